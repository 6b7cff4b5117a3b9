"""One run's layout, model, precision and batch, resolved and checked once: by cli.py in each process before anything
is built (GPTModule.use_run), or by a script's GPTModule from its Trainer at setup."""

from dataclasses import dataclass
from functools import cached_property

from gpt_tp.hardware import detect_device_memory_gib
from gpt_tp.model import GPTConfig
from gpt_tp.parallel.apply import check_ac_mode, check_compiled_ac
from gpt_tp.ranks import Layout
from gpt_tp.sizing import PRECISIONS, LayoutError, check_run, memory_per_device


@dataclass(frozen=True)
class Run:
    """What a run trains, validated (resolve_run makes one)."""

    model: GPTConfig  # the model GPTModule builds: model.model, or model.init_from's config.json
    layout: Layout  # DP x TP (FSDP2 x TP under ModelParallelStrategy; DP = every process under DDP)
    precision: str  # trainer.precision
    activation_checkpointing: str  # "none", "full" or "selective"
    compile: bool
    seq_len: int | None  # data.seq_len (None: predict, any prompt length up to block_size)
    batch_size: int | None  # data.batch_size, rows per DP rank per micro-batch (None: not a fit)
    accumulate: int  # trainer.accumulate_grad_batches
    total_batch_size: int | None  # model.total_batch_size: tokens per optimizer step (None: unchecked)

    dp = property(lambda self: self.layout.dp)
    tp = property(lambda self: self.layout.tp)
    world = property(lambda self: self.layout.world)

    @cached_property
    def sync_once(self) -> bool:
        """FSDP2 reduce-scatters once per optimizer step where the planner says the unsharded gradients fit."""
        return self.batch_size is not None and self.precision in PRECISIONS and memory_per_device(
            self.model, self.dp, self.tp, self.batch_size, self.seq_len, self.precision, ac=self.activation_checkpointing,
            accumulate=self.accumulate, device_memory_gib=detect_device_memory_gib()).sync_once


def resolve_run(model: GPTConfig, dp: int, tp: int, precision: str = "32-true", activation_checkpointing: str = "none",
                compile: bool = False, seq_len: int | None = None,
                batch_size: int | None = None, accumulate: int = 1, total_batch_size: int | None = None,
                world_size: int | None = None, devices_per_node: int | None = None,
                flags: dict[str, str] | None = None) -> Run:
    """The Run of these settings, or one UserError naming the setting at fault. world_size: the processes launched
    (dp x tp must equal it); devices_per_node: a TP group must fit in one node; flags: how each of
    LayoutError.quantities is named to the user, as flag=value (cli.config.run_of)."""
    check_ac_mode(activation_checkpointing)
    try:
        check_run(model, tp, dp, seq_len, batch_size, accumulate, total_batch_size, world_size=world_size,
                  devices_per_node=devices_per_node)
    except LayoutError as e:
        named = [flags[q] for q in e.quantities if q in (flags or {})]
        raise LayoutError(f"{', '.join(named)}: {e}" if named else str(e), e.quantities) from None
    check_compiled_ac(activation_checkpointing, compile, tp)
    return Run(model, Layout(dp, tp), precision, activation_checkpointing, compile, seq_len, batch_size,
               accumulate, total_batch_size)


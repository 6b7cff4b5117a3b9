"""Which (data-parallel, tensor-parallel) layouts a model can take, and the error that says why one cannot."""

from math import gcd

from gpt_tp.errors import UserError
from gpt_tp.model import GPTConfig
from gpt_tp.ranks import Layout


class LayoutError(UserError):
    """A layout that cannot work; ``quantities`` names what is at fault ("tp", "dp", "world_size", "devices", "n_head",
    "n_embd", "vocab_size", "seq_len") for a command to name its own flags."""

    def __init__(self, message: str, quantities: tuple[str, ...] = ()):
        super().__init__(message)
        self.quantities = quantities


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp_sizes(config: GPTConfig, seq_len: int | None = None) -> list[int]:
    """TP degrees this model can be split over: each must divide the heads, the width, the vocab and T."""
    return divisors(gcd(config.n_head, config.n_embd, config.vocab_size, seq_len or 0))  # gcd(x, 0) == x


def fitting_layouts(config: GPTConfig, world_size: int, seq_len: int | None = None) -> list[tuple[int, int]]:
    """(dp, tp) pairs with dp * tp == world_size and a valid tp, smallest TP first."""
    return [(world_size // tp, tp) for tp in valid_tp_sizes(config, seq_len) if world_size % tp == 0]


def _layouts_text(config: GPTConfig, world_size: int, seq_len: int | None) -> str:
    s = ", ".join(str(Layout(dp, tp)) for dp, tp in fitting_layouts(config, world_size, seq_len))
    return f"Layouts that fit {world_size} devices: {s}." if s else f"No DP x TP layout fits {world_size} devices."


def validate_layout(config: GPTConfig, tp: int, dp: int = 1, world_size: int | None = None,
                    seq_len: int | None = None) -> None:
    """Raise LayoutError, with the layouts that would fit, if this model cannot run as dp x tp on world_size devices."""
    world_size = dp * tp if world_size is None else world_size
    if tp < 1 or dp < 1:
        raise LayoutError(f"tensor-parallel size {tp} and data-parallel size {dp} must be >= 1", ("tp", "dp"))
    if dp * tp != world_size:
        raise LayoutError(
            f"data-parallel size {dp} x tensor-parallel size {tp} = {dp * tp}, but the run has {world_size} devices. "
            f"{_layouts_text(config, world_size, seq_len)}", ("dp", "tp", "world_size")
        )
    checks = [  # a tp that divides n_embd divides the MLP's 4 * n_embd too
        ("n_head", config.n_head, "every rank holds whole attention heads"),
        ("n_embd", config.n_embd, "row-parallel projections split the width"),
        ("vocab_size", config.vocab_size, "the embedding and lm_head are split over the vocabulary; pad it"),
    ]
    if seq_len is not None:
        checks.append(("seq_len", seq_len, "sequence parallelism splits the sequence"))
    for name, value, why in checks:
        if value % tp:
            raise LayoutError(
                f"tensor-parallel size {tp} must divide {name}={value} ({why}); it divides by "
                f"{', '.join(map(str, divisors(value)[:12]))}. Valid tensor-parallel sizes for this model: "
                f"{', '.join(map(str, valid_tp_sizes(config, seq_len)))}. {_layouts_text(config, world_size, seq_len)}",
                ("tp", name),
            )


def check_total_batch(total: int | None, B: int, T: int, dp: int, accum: int) -> None:
    """B x T x dp x accum must be the tokens per optimizer step the run asks for (None skips the check)."""
    if total is None or B * T * dp * accum == total:
        return
    per_step = B * T * dp
    if total % per_step == 0:
        hint = f"set trainer.accumulate_grad_batches={total // per_step}"
    elif total % dp == 0:
        hint = f"choose data.batch_size and data.seq_len so that {total} is a multiple of B x T x {dp}"
    else:  # no B or T helps
        hint = (f"{total} is not a multiple of the data-parallel size {dp}: set model.total_batch_size to a multiple "
                f"of B x T x {dp} (e.g. {per_step * max(1, round(total / per_step))}) or use another layout")
    raise UserError(
        f"model.total_batch_size={total} tokens, but data.batch_size={B} x data.seq_len={T} x data-parallel size "
        f"{dp} x trainer.accumulate_grad_batches={accum} = {per_step * accum}: {hint} "
        f"(or set model.total_batch_size=null to skip this check)"
    )


def check_run(config: GPTConfig, tp: int, dp: int, seq_len: int | None, batch_size: int | None = None,
              accum: int = 1, total_batch_size: int | None = None, world_size: int | None = None,
              devices_per_node: int | None = None) -> None:
    """The one check of a run's shapes, before anything is built (resolve_run); devices_per_node None: no node check."""
    if seq_len is not None and seq_len > config.block_size:
        raise UserError(f"data.seq_len={seq_len} exceeds the model's block_size={config.block_size}: lower data.seq_len")
    validate_layout(config, tp=tp, dp=dp, world_size=world_size, seq_len=seq_len)
    if devices_per_node is not None and devices_per_node % tp:
        inside = [t for t in valid_tp_sizes(config, seq_len) if devices_per_node % t == 0]
        raise LayoutError(f"tensor-parallel size {tp} does not divide the {devices_per_node} devices of a node, so a "
                          "TP group would span nodes (TP stays inside a node: docs/scale.md); tensor-parallel sizes "
                          f"inside a node for this model: {', '.join(map(str, inside))}", ("tp", "devices"))
    if batch_size is not None:
        check_total_batch(total_batch_size, batch_size, seq_len, dp, accum)

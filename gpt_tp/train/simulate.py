"""`python cli.py fit --config X --simulate`: one rank of the config's whole world (num_nodes x devices), run in this
process on PyTorch's fake process group with fake tensors, through gpt_tp's own parallelize (TP, activation
checkpointing, FSDP2), vocab-parallel loss, backward, clip and AdamW step; no GPU, no cluster, no real memory.
It reports that rank's peak memory by kind (FSDPMemTracker), the planner's estimate beside it, and the step's
collectives. torch.compile is skipped (the eager step's memory); what it cannot tell is in docs/scale.md.
"""

import math
import warnings
from dataclasses import dataclass, field
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from gpt_tp.model import GPT, GPTConfig
from gpt_tp.parallel import clip_grad_norm, grad_norm, parallelize
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.sizing.memory import GIB, Memory, fits, memory_per_device
from gpt_tp.train.optim import make_adamw

KINDS = ("params", "grads", "optimizer", "activations", "temporaries")
# FSDPMemTracker's kinds, by gpt_tp's names; unsharded parameters and the collectives' buffers are temporaries
# (MemTracker's where FSDP2 is not applied, at DP=1)
TRACKER_KINDS = {
    "params": ("SHARDED_PARAM", "PARAM", "BUFFER"), "grads": ("SHARDED_GRAD", "UNSHARDED_GRAD", "GRAD"),
    "optimizer": ("OPT",), "activations": ("ACT", "INP"),
    "temporaries": ("TEMP", "UNSHARDED_PARAM", "ALL_GATHER", "REDUCE_SCATTER"),
}


@dataclass
class Simulation:
    dp: int
    tp: int
    rank: int
    device: str
    peak: dict[str, int]  # bytes by KINDS at the step's peak, and "total"
    planned: dict[str, int]  # the planner's estimate without its fixed overhead, by KINDS, and "total"
    collectives: dict[str, int]  # op -> count in one step
    notes: list[str] = field(default_factory=list)

    def fits(self, memory_gib: float | None) -> bool:
        """The peak fits memory_gib by the planner's own rule (gpt_tp.sizing.memory.fits: 95% usable)."""
        p = self.peak
        return fits(Memory(p["params"], p["grads"], p["optimizer"], p["activations"], p["temporaries"], 0), memory_gib)


def simulate(config: GPTConfig, dp: int, tp: int, batch_size: int, seq_len: int, precision: str = "32-true",
             activation_checkpointing: str = "none", rank: int = 0) -> Simulation:
    """Rank `rank` of a dp x tp world: the model built on the meta device, parallelized, given fake storage, and two
    training steps taken: the first's collectives are counted, the second's peak memory measured (AdamW's moments
    exist by then)."""
    world = dp * tp
    notes = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        notes.append("this torch has no CUDA: fake tensors on 'cpu' at the config's precision (FSDP2 asks "
                     "torch.cuda.current_device() for 'cuda')")
    notes.append("torch.compile skipped: the eager step's memory")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
        with torch.device("meta"):
            model = GPT(config)
        parallelize(model, mesh, compile=False, param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
                    activation_checkpointing=activation_checkpointing)
        autocast = torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            # the token ids need no gradient, so torch notes that FSDP2's backward hooks see module outputs only
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            model.to_empty(device=device)
            if precision == "bf16-true":
                model.to(torch.bfloat16)
            opt = make_adamw(model, 6e-4, fused=False)

            def step() -> None:
                x = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)  # (B, T)
                with autocast:
                    loss = cross_entropy(model(x), x)
                loss.backward()
                clip_grad_norm(model, 1.0, grad_norm(model))
                opt.step()
                opt.zero_grad()

            with CommDebugMode() as comms:  # the first step: its collectives (and AdamW's moments come to exist)
                step()
            counts = dict(comms.get_comm_counts())
            if dp > 1:
                tracker = FSDPMemTracker(model, opt)
            else:
                tracker = MemTracker()
                tracker.track_external(model, opt)
            with tracker:  # the steady state's peak
                step()
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    by_kind = {str(k).split(".")[-1]: v for k, v in next(iter(snapshot.values())).items()}
    peak = {kind: sum(by_kind.get(k, 0) for k in keys) for kind, keys in TRACKER_KINDS.items()}
    peak["total"] = sum(peak.values())
    m = memory_per_device(config, dp, tp, batch_size, seq_len, precision, "flash", 0.0, activation_checkpointing)
    planned = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "activations": m.activations,
               "temporaries": m.transient}
    planned["total"] = sum(planned.values())
    # c10d_functional ops are DTensor's (the TP plan, the grad norm); c10d's own are FSDP2's and the loss's
    collectives = {str(op): n for op, n in counts.items()}
    if tp > 1 and config.vocab_size % tp == 0:
        notes.append(f"every rank holds its own 1/{tp} of wte/lm_head's vocabulary and of each block's heads; the "
                     "sizes are the same on every rank")
    return Simulation(dp, tp, rank, device, peak, planned, collectives, notes)


def format_simulation(s: Simulation, memory_gib: float | None) -> str:
    """The table `--simulate` prints."""
    gib = lambda b: f"{b / GIB:10.2f}"  # noqa: E731
    head = "".join(f"{k:>12}" for k in (*KINDS, "total GiB"))
    lines = [f"simulated rank {s.rank} of {s.dp * s.tp} (DP={s.dp} x TP={s.tp}) on fake '{s.device}' tensors",
             f"{'':<12}{head}",
             f"{'simulated':<12}" + "".join(f"{gib(s.peak[k]):>12}" for k in (*KINDS, "total")),
             f"{'planner':<12}" + "".join(f"{gib(s.planned[k]):>12}" for k in (*KINDS, "total"))]
    diff = s.peak["total"] / s.planned["total"] - 1 if s.planned["total"] else math.nan
    lines.append(f"simulated peak {s.peak['total'] / GIB:.2f} GiB, planner {s.planned['total'] / GIB:.2f} GiB "
                 f"({diff:+.1%}), both without the planner's fixed overhead (CUDA context, NCCL, allocator slack)")
    if memory_gib is not None:
        verdict = "fits" if s.fits(memory_gib) else "does not fit"
        lines.append(f"{verdict} {memory_gib:g} GiB per device (95% usable)")
    lines.append("collectives in one step (all process groups): "
                 + ", ".join(f"{op} {n}" for op, n in sorted(s.collectives.items())))
    lines += [f"note: {n}" for n in s.notes]
    return "\n".join(lines)

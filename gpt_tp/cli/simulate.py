"""`cli.py fit --simulate`: one rank of the whole world takes gpt_tp's eager training step on a fake process group with
fake tensors; its peak memory beside the planner's, its collectives by process group (limits: docs/scale.md)."""

import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gpt_tp.model import GPT
from gpt_tp.parallel import parallelize
from gpt_tp.ranks import Layout, build_mesh
from gpt_tp.sizing.memory import GIB, USABLE_FRACTION, Memory, fits, memory_per_device
from gpt_tp.torch_internals import FUNCTIONAL, FakeTensorMode, TorchDispatchMode, memory_tracker
from gpt_tp.train.optim import AdamW, Schedule
from gpt_tp.train.run import Run
from gpt_tp.train.step import TrainStep

KINDS = ("params", "grads", "optimizer", "activations", "temporaries")
# FSDPMemTracker's (MemTracker's at DP=1) kinds by gpt_tp's; unsharded parameters, collectives' buffers: temporaries
TRACKER_KINDS = {"params": ("SHARDED_PARAM", "PARAM", "BUFFER"), "grads": ("SHARDED_GRAD", "UNSHARDED_GRAD", "GRAD"),
                 "optimizer": ("OPT",), "activations": ("ACT", "INP"),
                 "temporaries": ("TEMP", "UNSHARDED_PARAM", "ALL_GATHER", "REDUCE_SCATTER")}
# c10d's ops (FSDP2's, the loss's) and functional collectives (DTensor's, sequence parallelism's) by a common name
COLLECTIVE_NAMES = {"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather", "allreduce_": "all_reduce",
                    "all_reduce": "all_reduce", "_reduce_scatter_base_": "reduce_scatter",
                    "reduce_scatter_tensor": "reduce_scatter", "alltoall_base_": "all_to_all"}


def _tensors(args):
    for a in args:  # c10d's ops take lists (of lists) of tensors
        yield from _tensors(a) if isinstance(a, (list, tuple)) else [a] if isinstance(a, torch.Tensor) else []


class CollectiveCounts(TorchDispatchMode):
    """Counts the collectives run under it by process group: (group's label, collective) -> count. On 'cuda' it
    refuses a collective on a tensor elsewhere, as NCCL does (a fake process group takes any)."""

    def __init__(self, labels: dict[str, str], device: str = "cpu"):
        super().__init__()
        self.labels, self.counts, self.device = labels, Counter(), device  # labels: group_name -> mesh dimension

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor first turns the op into local ops and its collectives
        collective = getattr(func, "namespace", None) in ("c10d", FUNCTIONAL.name)
        if collective and self.device == "cuda" and any(t.device.type != "cuda" for t in _tensors(args)):
            raise RuntimeError(f"{func} on a CPU tensor: NCCL takes tensors on the process group's CUDA device")
        out = func(*args, **(kwargs or {}))
        if collective:
            # the group: functional collectives name it last; c10d's take it boxed, as their first script object
            names = [a for a in args if isinstance(a, str)]
            boxed = [a for a in args if isinstance(a, torch.ScriptObject)]
            group = names[-1] if names else dist.ProcessGroup.unbox(boxed[0]).group_name if boxed else None
            if group is not None:  # (wait_tensor and the like name no group)
                op = func.overloadpacket.__name__
                self.counts[self.labels.get(group, group), COLLECTIVE_NAMES.get(op, op)] += 1
        return out


@dataclass
class Simulation:
    layout: Layout
    rank: int
    device: str
    peak: dict[str, int]  # bytes by KINDS at the step's peak, and "total"
    planned: dict[str, int]  # the planner's estimate without its fixed overhead, by KINDS, "total" and "staging"
    collectives: dict[tuple[str, str], int]  # (process group, collective) -> count in one micro-batch and step
    notes: list[str] = field(default_factory=list)

    def fits(self, memory_gib: float | None) -> bool:
        """The peak fits memory_gib by the planner's own rule (gpt_tp.sizing.memory.fits)."""
        return fits(Memory(*(self.peak[k] for k in KINDS), 0), memory_gib)


def simulate(run: Run, rank: int = 0, optimizer: AdamW = AdamW(), schedule: Schedule = Schedule()) -> Simulation:
    """Rank `rank` of the run's world takes two TrainSteps on fake storage: the first's collectives are counted, the
    second's peak memory measured (AdamW's moments exist by then). With accumulation that step takes two micro-batches,
    the second (like every later one) holding the first's gradients (FSDP2 reduces each backward's)."""
    config, dp, tp, precision = run.model, run.dp, run.tp, run.precision
    device = "cuda" if torch.cuda.is_available() else "cpu"
    notes = [] if device == "cuda" else ["this torch has no CUDA: fake tensors on 'cpu' at the config's precision "
                                         "(FSDP2 asks torch.cuda.current_device() for 'cuda')"]
    notes += ["torch.compile skipped: the eager step's memory"] if run.compile else []
    notes += ["FSDP2 holds the unsharded float32 gradients from one micro-batch to the next (Run.sync_once): the "
              "tracker counts them among the activations or temporaries"] if run.sync_once else []
    dist.init_process_group("fake", rank=rank, world_size=dp * tp)  # torch makes its fake store
    try:
        mesh = build_mesh(run.layout, device)
        with torch.device("meta"):
            model = GPT(config)
        parallelize(model, mesh, compile=False, param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
                    activation_checkpointing=run.activation_checkpointing)
        autocast = partial(torch.autocast, device, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            # the token ids need no gradient, so torch notes that FSDP2's backward hooks see module outputs only
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            # fake logits come back as a view; the loss never writes them in place (a real run does not warn)
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            model.to_empty(device=device)
            if precision == "bf16-true":
                model.to(torch.bfloat16)
            train_step = TrainStep(model, optimizer, schedule)

            def step(micro_batches: int, tracker=None) -> None:
                x = torch.randint(0, config.vocab_size, (run.batch_size, run.seq_len), device=device)  # (B, T)
                forwards = iter(range(micro_batches))

                def phase(name: str):
                    if name == "forward" and next(forwards) and tracker is not None:
                        tracker.reset_mod_stats()  # the tracker's peak stays; its per-module stats restart
                    return nullcontext()

                train_step([(x, x)] * micro_batches, 0, 1.0, autocast, phase, run.sync_once)
                train_step.optimizer.zero_grad()

            labels = {dist.group.WORLD.group_name: "world"}
            labels |= {mesh.get_group(d).group_name: d for d in mesh.mesh_dim_names}  # a dimension spanning the world
            with CollectiveCounts(labels, device) as comms:
                step(1)
            with memory_tracker(model, train_step.optimizer, fsdp=dp > 1) as tracker:
                step(min(run.accumulate, 2), tracker)
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    by_kind = {str(k).split(".")[-1]: v for k, v in next(iter(snapshot.values())).items()}
    peak = {kind: sum(by_kind.get(k, 0) for k in keys) for kind, keys in TRACKER_KINDS.items()}
    peak["total"] = sum(peak.values())
    m = memory_per_device(config, dp, tp, run.batch_size, run.seq_len, precision, 0.0, run.activation_checkpointing,
                          optimizer.kind, run.accumulate if run.sync_once else 1)
    planned = dict(zip(KINDS, (m.params, m.grads, m.optimizer, m.activations, m.transient)))
    planned["total"], planned["staging"] = sum(planned.values()), m.staging
    if tp > 1 and config.vocab_size % tp == 0:
        notes.append(f"every rank holds its own 1/{tp} of wte/lm_head's vocabulary and of each block's heads; the "
                     "sizes are the same on every rank")
    return Simulation(run.layout, rank, device, peak, planned, dict(comms.counts), notes)


def format_simulation(s: Simulation, memory_gib: float | None) -> str:
    lines = [f"simulated rank {s.rank} of {s.layout.world} ({s.layout}) on fake '{s.device}' tensors",
             f"{'':<12}" + "".join(f"{k:>12}" for k in (*KINDS, "total GiB"))]
    lines += [f"{name:<12}" + "".join(f"{row[k] / GIB:12.2f}" for k in (*KINDS, "total"))
              for name, row in (("simulated", s.peak), ("planner", s.planned))]
    diff = s.peak["total"] / s.planned["total"] - 1 if s.planned["total"] else math.nan
    lines.append(f"simulated peak {s.peak['total'] / GIB:.2f} GiB, planner {s.planned['total'] / GIB:.2f} GiB "
                 f"({diff:+.2%}), both without the planner's fixed overhead (CUDA context, NCCL, allocator slack)")
    lines.append(f"an asynchronous save (trainer.strategy.init_args.async_save) stages {s.planned['staging'] / GIB:.2f} "
                 "GiB per rank in host memory (pinned on CUDA), beside these")
    if memory_gib is not None:
        lines.append(f"{'fits' if s.fits(memory_gib) else 'does not fit'} {memory_gib:g} GiB per device "
                     f"({USABLE_FRACTION:.0%} usable)")
    lines.append("collectives in one micro-batch and the optimizer step: " + "; ".join(
        f"{group} " + ", ".join(f"{op} {n}" for (g, op), n in sorted(s.collectives.items()) if g == group)
        for group in sorted({group for group, _ in s.collectives})))
    lines += [f"note: {n}" for n in s.notes]
    return "\n".join(lines)

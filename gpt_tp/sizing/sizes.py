"""What a DP x TP layout puts on each rank: TP-local parameter shapes (as gpt_tp.parallel.TP_PLAN splits them) and
bytes per rank, for the planner (a step's collectives, derived from the same shapes: benchmarks/collectives.py)."""

import math
from typing import NamedTuple

from gpt_tp.model import BLOCK_MATRICES, GPTConfig

# trainer.precision -> bytes of (parameters / gradients / optimizer state, residual-stream activations, matmul
# activations, log-softmax, the autocast weight copies kept for backward): the one list of precisions gpt_tp sizes
PRECISIONS = {
    "32-true": (4, 4, 4, 4, 0), "32": (4, 4, 4, 4, 0),
    "bf16-mixed": (4, 2, 2, 4, 2), "16-mixed": (4, 4, 2, 4, 2),  # bf16-mixed: a bf16 residual stream (GPT.forward)
    "bf16-true": (2, 2, 2, 2, 0), "16-true": (2, 2, 2, 2, 0),
}

# model.activation_checkpointing: per block keep everything, only its input, or also its matmul and attention outputs
AC_MODES = ("none", "full", "selective")


class LocalParam(NamedTuple):
    name: str  # under transformer.h.<i> for a block's, transformer.<name> for the root's
    shape: tuple[int, ...]  # on one TP rank
    matmul: bool  # a matmul weight (autocast casts it to bf16)
    sequence_partial: bool  # its gradient is a per-rank partial sum over TP (LayerNorms, wpe: SequenceReplicated)


def padded_vocab(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """The smallest vocabulary >= vocab_size divisible by tp and by `multiple` (fast matmuls)."""
    step = math.lcm(tp, multiple)
    return -(-vocab_size // step) * step


def block_params(config: GPTConfig, tp: int) -> list[LocalParam]:
    """One block's parameters on one TP rank, in the module's order."""
    C, t = config.n_embd, tp
    return [
        LocalParam("ln_1.weight", (C,), False, True), LocalParam("ln_1.bias", (C,), False, True),
        LocalParam("attn.c_attn.weight", (3 * C // t, C), True, False),  # colwise
        LocalParam("attn.c_attn.bias", (3 * C // t,), False, False),
        LocalParam("attn.c_proj.weight", (C, C // t), True, False),  # rowwise, bias whole
        LocalParam("attn.c_proj.bias", (C,), False, False),
        LocalParam("ln_2.weight", (C,), False, True), LocalParam("ln_2.bias", (C,), False, True),
        LocalParam("mlp.c_fc.weight", (4 * C // t, C), True, False),  # colwise
        LocalParam("mlp.c_fc.bias", (4 * C // t,), False, False),
        LocalParam("mlp.c_proj.weight", (C, 4 * C // t), True, False),  # rowwise, bias whole
        LocalParam("mlp.c_proj.bias", (C,), False, False),
    ]


def root_params(config: GPTConfig, tp: int) -> list[LocalParam]:
    """The parameters outside the blocks (FSDP2's root unit) on one TP rank: wte once (lm_head is tied to it)."""
    C = config.n_embd
    return [
        LocalParam("wte.weight", (config.vocab_size // tp, C), True, False),  # vocab-parallel; lm_head's matmul casts it
        LocalParam("wpe.weight", (config.block_size, C), False, True),
        LocalParam("ln_f.weight", (C,), False, True), LocalParam("ln_f.bias", (C,), False, True),
    ]


def local_params(config: GPTConfig, tp: int) -> list[LocalParam]:
    return block_params(config, tp) * config.n_layer + root_params(config, tp)


def numel(params: list[LocalParam], dp: int = 1) -> int:
    """Elements one rank holds under FSDP2 over dp ranks: each tensor's dim 0 in dp chunks, padded to equal size."""
    return sum(math.ceil(p.shape[0] / dp) * math.prod(p.shape[1:]) for p in params)


def state_bytes(config: GPTConfig, dp: int, tp: int, param_bytes: int = 4, optimizer: str = "adamw") -> dict[str, int]:
    """Parameters, gradients (in the parameter dtype), optimizer state and their total, in bytes per rank: AdamW's
    two moments per parameter; under "muon" one momentum buffer per block matrix (BLOCK_MATRICES)."""
    params = local_params(config, tp)
    n = numel(params, dp)
    states = 2 * n - (numel([p for p in params if p.name in BLOCK_MATRICES], dp) if optimizer == "muon" else 0)
    out = {"params": n * param_bytes, "grads": n * param_bytes, "optimizer": states * param_bytes}
    return {**out, "total": sum(out.values())}


def checkpoint_bytes(config: GPTConfig) -> int:
    """A checkpoint folder's size, all ranks together: fp32 weights and AdamW's two moments, each tensor written once
    whatever the layout, plus lm_head's copy of the tied wte (DCP saves both names); the step counters, RNG states
    and data position add under 1 MiB (configs/cpu.yaml's model: 52.8 MB estimated, 53.2 MB written)."""
    s = state_bytes(config, 1, 1, 4)
    return s["params"] + s["optimizer"] + config.vocab_size * config.n_embd * 4


def fsdp_gather_bytes(precision: str) -> int:
    """Bytes per element FSDP2 all-gathers: 2 under bf16-mixed (parallelize's param_dtype), else the parameters'."""
    return 2 if str(precision) == "bf16-mixed" else PRECISIONS[str(precision)][0]


# Muon's schemes per matrix (gpt_tp.train.muon) are weighed by wire bytes + flops / FLOPS_PER_BYTE, per rank per step: an
# H100's dense bf16 peak (989e12 FLOP/s) over a 50 GB/s link, the time of one wire byte in flops
FLOPS_PER_BYTE = 2e4


def muon_costs(short: int, long: int, summed: int, gathered: int, ns_bytes: int = 2, ns_steps: int = 5) -> dict:
    """{scheme: (wire bytes, flops)} per rank per step of Newton-Schulz on a [short, long] matrix split by `summed` x
    `gathered` ranks along its long x short side. "owner": (p-1)/p^2 of it sent each way on average, 1/p of the work;
    "sharded": the short side all-gathered, the norm and ns_steps float32 Grams all-reduced, A A on every rank."""
    p, size, gram = summed * gathered, short * long * ns_bytes, 2 * short * short * long
    owner = (2 * (p - 1) / p**2 * size, ns_steps * (2 * gram + 2 * short**3) / p)
    sharded = ((gathered - 1) / gathered * size / summed + 2 * (summed - 1) / summed * 4 * (1 + ns_steps * short**2),
               ns_steps * (2 * gram / summed + 2 * short**3))
    return {"owner": owner, "sharded": sharded}


def muon_scheme(short: int, long: int, summed: int, gathered: int, ns_bytes: int = 2) -> str:
    """The scheme of muon_costs with the lower bytes + flops / FLOPS_PER_BYTE (owner-computes on a tie)."""
    costs = muon_costs(short, long, summed, gathered, ns_bytes)
    return min(costs, key=lambda k: costs[k][0] + costs[k][1] / FLOPS_PER_BYTE)


def muon_owners(numels: list[int], world: int) -> list[int]:
    """Each matrix's owner rank: the largest first, each to the least loaded rank (the lowest on a tie)."""
    load, out = [0] * world, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        out[i] = min(range(world), key=lambda r: load[r])
        load[out[i]] += numels[i]
    return out

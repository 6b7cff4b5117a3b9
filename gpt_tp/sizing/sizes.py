"""What a DP x TP layout puts on each rank and sends each step: TP-local parameter shapes (as gpt_tp.parallel.TP_PLAN
splits them), bytes per rank and a step's collectives, for the planner, the cost model, the benchmark and the audit."""

import math
from typing import NamedTuple

from gpt_tp.model import GPTConfig

TP, DP = "tensor_parallel", "data_parallel"

# trainer.precision -> bytes of (parameters / gradients / optimizer state, residual-stream activations, matmul
# activations, log-softmax, the autocast weight copies kept for backward): the one list of precisions gpt_tp sizes
PRECISIONS = {
    "32-true": (4, 4, 4, 4, 0), "32": (4, 4, 4, 4, 0),
    "bf16-mixed": (4, 4, 2, 4, 2), "16-mixed": (4, 4, 2, 4, 2),
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


# the weights model.optimizer=muon gives Muon (one momentum buffer each); AdamW keeps two moments of the rest
MUON_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def state_bytes(config: GPTConfig, dp: int, tp: int, param_bytes: int = 4, optimizer: str = "adamw") -> dict[str, int]:
    """Parameters, gradients (in the parameter dtype), optimizer state and their total, in bytes per rank: AdamW's
    two moments per parameter; under "muon" one momentum buffer per block matrix (MUON_WEIGHTS)."""
    params = local_params(config, tp)
    n = numel(params, dp)
    states = 2 * n - (numel([p for p in params if p.name in MUON_WEIGHTS], dp) if optimizer == "muon" else 0)
    out = {"params": n * param_bytes, "grads": n * param_bytes, "optimizer": states * param_bytes}
    return {**out, "total": sum(out.values())}


def checkpoint_bytes(config: GPTConfig) -> int:
    """A checkpoint folder's size, all ranks together: fp32 weights and AdamW's two moments, each tensor written once
    whatever the layout, plus lm_head's copy of the tied wte (DCP saves both names); the step counters, RNG states
    and data position add under 1 MiB (configs/cpu.yaml's model: 52.8 MB estimated, 53.2 MB written)."""
    s = state_bytes(config, 1, 1, 4)
    return s["params"] + s["optimizer"] + config.vocab_size * config.n_embd * 4


# ------------------------------------------ Collectives of one training step ------------------------------------------


def wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes each rank sends for a collective over a tensor of nbytes (the full, unsharded size), with the ring
    algorithm: all-gather and reduce-scatter (p-1)/p N, all-reduce twice that (reduce-scatter + all-gather)."""
    return (2.0 if kind == "all_reduce" else 1.0) * (group_size - 1) / group_size * nbytes if group_size > 1 else 0.0


def collective(dim: str, kind: str, group_size: int, count: int, nbytes: float) -> dict:
    """`count` collectives of `kind` on mesh dim `dim` moving `nbytes` full-tensor bytes in all."""
    return {"dim": dim, "kind": kind, "group_size": group_size, "count": count, "bytes": int(nbytes),
            "wire_bytes": wire_bytes(kind, nbytes, group_size) if count else 0.0}


def merge(rows: list[dict]) -> list[dict]:
    """Rows summed per (dim, kind), sorted; rows of no collective left out."""
    out: dict = {}
    for r in [r for r in rows if r["count"]]:
        m = out.setdefault((r["dim"], r["kind"]), {**r, "count": 0, "bytes": 0, "wire_bytes": 0.0})
        for k in ("count", "bytes", "wire_bytes"):
            m[k] += r[k]
    return sorted(out.values(), key=lambda r: (r["dim"], r["kind"]))


def counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """{dim: {kind: count}} of a collectives list."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        out.setdefault(r["dim"], {})[r["kind"]] = out.get(r["dim"], {}).get(r["kind"], 0) + r["count"]
    return out


def check_precision(precision: str) -> tuple[int, int, int, int, int]:
    """PRECISIONS' row for trainer.precision; a ValueError for any other."""
    if str(precision) not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[str(precision)]


def fsdp_gather_bytes(precision: str) -> int:
    """Bytes per element FSDP2 all-gathers: 2 under bf16-mixed (parallelize's param_dtype), else the parameters'."""
    return 2 if str(precision) == "bf16-mixed" else check_precision(precision)[0]


def tp_collectives(config: GPTConfig, batch_size: int, seq_len: int, dp: int, tp: int, precision: str) -> list[dict]:
    """The TP group's collectives of one step under TP_PLAN for L blocks (Korthikanti et al. 2022, section 4.2.2;
    docs/performance.md, "The layout"): all_gather 6L + 3, reduce_scatter 4L + 2, all_reduce 3. Under bf16 autocast
    the gathered LayerNorm and c_proj outputs move 2-byte elements; the embedding's, fp32 unless FSDP2 gathers bf16."""
    if tp <= 1:
        return []
    L, act = config.n_layer, batch_size * seq_len * config.n_embd
    mm = check_precision(precision)[2]  # matmul outputs, and LayerNorm outputs cast before their gather
    emb = mm if dp > 1 else 4
    partial = numel([p for p in local_params(config, tp) if p.sequence_partial], dp)
    return [
        collective(TP, "all_gather", tp, 2 * L + 1, (2 * L + 1) * act * mm),  # fwd: ln_1, ln_2 per block, ln_f
        collective(TP, "all_gather", tp, 4 * L + 2, (4 * L + 1) * act * mm + act * emb),  # bwd: again, c_proj's and wte's RS
        collective(TP, "reduce_scatter", tp, 2 * L + 1, 2 * L * act * mm + act * emb),  # fwd: c_proj x 2, wte
        collective(TP, "reduce_scatter", tp, 2 * L + 1, (2 * L + 1) * act * mm),  # bwd: of the gathers
        collective(TP, "all_reduce", tp, 1, partial * 4),
        collective(TP, "all_reduce", tp, 2, batch_size * seq_len * 12),  # cross-entropy
    ]


def fsdp_collectives(config: GPTConfig, dp: int, tp: int, precision: str) -> list[dict]:
    """The DP group's collectives of one step under FSDP2 (one unit per block, one root unit): all_gather 2L + 1
    (each unit before forward, each block again before backward), reduce_scatter L + 1 of float32 gradients."""
    if dp <= 1:
        return []
    L, g = config.n_layer, fsdp_gather_bytes(precision)
    block, root = (dp * numel(params(config, tp), dp) for params in (block_params, root_params))  # padded as FSDP2 does
    return [collective(DP, "all_gather", dp, 2 * L + 1, (2 * L * block + root) * g),
            collective(DP, "reduce_scatter", dp, L + 1, (L * block + root) * 4)]


def norm_collective(dp: int, tp: int) -> list[dict]:
    """The grad norm (gpt_tp.parallel.clip_grad_norm): one float32 all-reduced over the whole mesh."""
    if dp * tp <= 1:
        return []
    return [collective("world" if dp > 1 and tp > 1 else DP if dp > 1 else TP, "all_reduce", dp * tp, 1, 4)]


def muon_collectives(config: GPTConfig, dp: int, tp: int, ns_steps: int = 5, ns_bytes: int = 2) -> list[dict]:
    """Muon's optimizer step (gpt_tp.parallel.muon) on the 4L block matrices, each with short side C. c_attn and c_fc
    are split along their long side over TP and DP, the c_projs along their long side over TP and their short side
    (FSDP2's dim 0) over DP. Per group of ranks that split long sides: one all-reduce of each matrix's squared norm
    and ns_steps of its C x C Gram, float32; at DP > 1 each c_proj all-gathered over DP in Newton-Schulz's dtype."""
    L, C = config.n_layer, config.n_embd
    colwise = [d for d, n in ((DP, dp), (TP, tp)) if n > 1]
    groups: dict[tuple[str, int], int] = {}  # (label, size) -> matrices summed over it, in one flat all-reduce
    for dims in (colwise, [TP] if tp > 1 else []):
        if dims:
            group = ("world", dp * tp) if len(dims) == 2 else (dims[0], dp if dims == [DP] else tp)
            groups[group] = groups.get(group, 0) + 2 * L
    rows = [collective(label, "all_reduce", size, 1 + ns_steps, n * 4 * (1 + ns_steps * C * C))
            for (label, size), n in groups.items()]
    if dp > 1:
        rows.append(collective(DP, "all_gather", dp, 2 * L, L * (C * C + 4 * C * C) // tp * ns_bytes))
    return rows


def muon_gather_all_bytes(config: GPTConfig, dp: int, tp: int, ns_bytes: int = 2) -> float:
    """The baseline Muon's sharded scheme is measured against: every rank all-gathers each block matrix whole, in
    Newton-Schulz's dtype. Wire bytes per rank per step (ring all-gather)."""
    return wire_bytes("all_gather", config.n_layer * 12 * config.n_embd ** 2 * ns_bytes, dp * tp)


def step_collectives(config: GPTConfig, batch_size: int, seq_len: int, dp: int = 1, tp: int = 1,
                     precision: str = "32-true", optimizer: str = "adamw") -> list[dict]:
    """A step's collectives per (mesh dim, kind): count, full-tensor and per-rank wire bytes; batch_size per DP rank.
    AdamW's step communicates nothing; Muon's: muon_collectives."""
    check_precision(precision)
    return merge(tp_collectives(config, batch_size, seq_len, dp, tp, precision)
                 + fsdp_collectives(config, dp, tp, precision) + norm_collective(dp, tp)
                 + (muon_collectives(config, dp, tp) if optimizer == "muon" else []))

"""Layout planner: which data-parallel x tensor-parallel layouts can train this GPT on these devices, and how much
memory each needs per device.

    python -m gpt_tp.perf.planner --model gpt2-xl --devices-per-node 8 --memory-gib 24 --batch-size 4 --seq-len 1024
    python -m gpt_tp.perf.planner --config configs/tp2.yaml --memory-gib 24

Rules (the same as gpt_tp.parallel): TP stays inside a node (it talks every layer), so TP divides the devices per node
and is a valid TP size of the model (it divides heads, widths, vocabulary and T); DP = world size / TP runs FSDP2, which
shards parameters, gradients and AdamW state over DP as well. Among the layouts that fit, the smallest TP wins: TP costs
four collectives per layer on the critical path, DP costs one reduce-scatter/all-gather per block that overlaps compute.

Memory per device (bytes; t = TP, d = DP, B = micro-batch per DP rank, T = sequence, C = width, L = layers, V = vocab):
  params     sum over parameters of ceil(rows_tp / d) x cols_tp x param bytes: TP splits the matmuls, the vocab-
             parallel embedding (tied to lm_head) and the column-parallel biases; LayerNorms, wpe and the row-parallel
             biases stay whole under TP; FSDP2 then shards every tensor's first dim over d (padded to a multiple of d).
  grads      the same count, in the parameter dtype.
  optimizer  AdamW exp_avg + exp_avg_sq: 2 x params.
  activations, saved for backward in one forward, per layer, with sequence parallelism and no checkpointing:
             B T C [2 r / t  +  2 m  +  12 m / t]  +  B T (4 x 4 / t)  +  B (a / t) T x 4
               2 r / t:  the LayerNorm inputs (residual stream, sequence-sharded; r = residual bytes)
               2 m:      the inputs of c_attn and c_fc, all-gathered to the full sequence (torch's TP saves the gathered
                         tensor; Megatron saves the shard and gathers again in backward, hence its smaller 34/t term)
               12 m / t: qkv (3C), the attention output that c_proj reads (C, the same storage), the MLP hidden (4C)
                         before and after GELU (m = matmul activation bytes)
               LayerNorm mean/rstd (fp32), and the attention logsumexp (fp32) of flash / memory-efficient SDPA. The
               math SDPA kernel (sdpa="math") keeps the (a/t) T x T attention probabilities as well.
             Compare Korthikanti et al. 2022 (Reducing Activation Recomputation), s b h (34 + 5 a s / h) / t bytes with
             2-byte activations, dropout masks and the a s^2 scores; GPT-2 here trains without dropout and SDPA keeps no
             score matrix, so those terms vanish.
             Plus the head: ln_f input B T C r / t, lm_head input B T C m (gathered), the vocab-parallel log-softmax
             B T (V / t) x 4 (cross-entropy runs in fp32 under autocast) and the token ids / targets (int64).
             Under bf16-mixed at d = 1 autocast also keeps a bf16 copy of every TP-local matmul weight (2 bytes x
             TP-local matmul parameters, in every checkpointing mode). At d > 1 FSDP2 gathers the weights in bf16
             (param_dtype): no copies, and the residual stream, the block inputs included, is bf16 (r = 2).
             Activation checkpointing (ac, gpt_tp.parallel.apply_ac) changes the per-layer term: "full" keeps the
             block input, B T C r / t; "selective" keeps the input and the matmul and attention outputs,
             B T C [r / t + 8 m / t + 2 m] + B (a / t) T x 4 (qkv, attention output, c_fc / t; the two row-parallel
             matmul outputs are whole-sequence partial sums before their reduce-scatter).
  transient  alive at the peak beyond the saved activations, at the larger of two moments: the loss, with the
             logits B T (V / t) x m and, for 2-byte logits, the float32 copy the loss's subtraction makes (+ 4); or a
             block's backward, with the block's recomputed activations under checkpointing and, under FSDP2, two
             gathered blocks, one block's unsharded gradients and their float32 reduce-scatter copy, and the root's
             unsharded gradients (the head's activations are freed by then). Plus, at d > 1, the root unit (wte, wpe,
             ln_f), which FSDP2 keeps gathered through the step. Gathered weights cost 2 bytes under bf16-mixed.
  overhead   CUDA context, NCCL buffers and allocator slack: `overhead_gib` (default 1.5 GiB) is added, and a layout
             fits when the total is at most `usable_fraction` (default 0.95) of the device memory.
The saved-activation and state terms, and the total less the overhead (the peak of a micro-batch under gradient
accumulation), are checked against measurements on CPU in tests/test_planner.py: within 0.2 % on a 2-layer model at
DP1/DP2 x TP1/TP2, fp32 and bf16-mixed, every checkpointing mode. The block-backward moment (FSDP2's gathered
blocks, the recomputed block) is below the loss moment there, so it is not measured.
"""

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from math import gcd

from gpt_tp.errors import UserError
from gpt_tp.model import SIZES, GPTConfig
from gpt_tp.parallel import AC_MODES, LayoutError, valid_tp_sizes

GIB = 1024**3

# precision -> (parameter/grad/optimizer bytes, residual-stream activation bytes, matmul activation bytes,
#               log-softmax bytes, bytes of the autocast weight copies kept for backward)
PRECISIONS = {
    "32-true": (4, 4, 4, 4, 0),
    "32": (4, 4, 4, 4, 0),
    "bf16-mixed": (4, 4, 2, 4, 2),
    "16-mixed": (4, 4, 2, 4, 2),
    "bf16-true": (2, 2, 2, 2, 0),
    "16-true": (2, 2, 2, 2, 0),
}


class PlanError(UserError):
    """No layout can work (or an input is wrong); the message says why and what to change."""


@dataclass
class Memory:
    """Estimated bytes per device for one layout."""

    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward in one forward (incl. autocast weight copies)
    transient: int  # logits + their grad at the loss; FSDP2's gathered blocks
    overhead: int

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.states + self.activations + self.transient + self.overhead


@dataclass
class Layout:
    dp: int
    tp: int
    memory: Memory | None = None
    fits: bool = False
    reason: str = ""  # why the layout is invalid or does not fit; empty when it fits


@dataclass
class Plan:
    config: GPTConfig
    devices_per_node: int
    num_nodes: int
    batch_size: int
    seq_len: int
    device_memory_gib: float | None
    precision: str
    ac: str = "none"
    layouts: list[Layout] = field(default_factory=list)  # every TP size that divides the devices per node
    choice: Layout | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes


def _precision(precision: str) -> tuple[int, int, int, int, int]:
    p = str(precision)
    if p not in PRECISIONS:
        raise PlanError(f"precision={p!r} is not known to the planner; use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[p]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def param_shapes(config: GPTConfig, tp: int) -> list[tuple[tuple[int, ...], bool]]:
    """Each parameter's TP-local shape (the tied wte/lm_head once) and whether it is a matmul weight (cast to bf16
    by autocast). Mirrors gpt_tp.parallel.TP_PLAN: colwise splits rows, rowwise splits columns, LayerNorms, wpe and
    row-parallel biases stay whole."""
    C, V, t = config.n_embd, config.vocab_size, tp
    block = [
        ((C,), False), ((C,), False),  # ln_1
        ((3 * C // t, C), True), ((3 * C // t,), False),  # attn.c_attn (colwise)
        ((C, C // t), True), ((C,), False),  # attn.c_proj (rowwise; bias whole)
        ((C,), False), ((C,), False),  # ln_2
        ((4 * C // t, C), True), ((4 * C // t,), False),  # mlp.c_fc (colwise)
        ((C, 4 * C // t), True), ((C,), False),  # mlp.c_proj (rowwise)
    ]
    head = [
        ((V // t, C), True),  # wte, vocab-parallel; lm_head is the same tensor (the lm_head matmul casts it)
        ((config.block_size, C), False),  # wpe, replicated
        ((C,), False), ((C,), False),  # ln_f
    ]
    return block * config.n_layer + head


def _fsdp_local(shape: tuple[int, ...], dp: int) -> int:
    """Elements FSDP2 allocates per rank for one tensor: dim 0 split into dp chunks, padded to equal size."""
    rows = math.ceil(shape[0] / dp)
    return rows * math.prod(shape[1:])


def state_bytes(config: GPTConfig, dp: int, tp: int, precision: str = "bf16-mixed") -> dict[str, int]:
    """Parameters, gradients and AdamW state per device, in bytes (compare gpt_tp.perf.audit.state_bytes)."""
    pb = _precision(precision)[0]
    n = sum(_fsdp_local(shape, dp) for shape, _ in param_shapes(config, tp))
    return {"params": n * pb, "grads": n * pb, "optimizer": 2 * n * pb}


def _gather_bytes(precision: str, dp: int) -> int:
    """Bytes per element of the weights the forward uses: FSDP2 (dp > 1) under bf16-mixed all-gathers them in bf16
    (gpt_tp.parallel.parallelize's param_dtype), everywhere else they are the parameters themselves."""
    return 2 if dp > 1 and str(precision) == "bf16-mixed" else _precision(precision)[0]


def _layer_bytes(config: GPTConfig, batch_size: int, seq_len: int, tp: int, r: int, m: int, sdpa: str, ac: str) -> int:
    """Bytes one block saves for backward (module docstring): everything ("none"), its input ("full"), or its input
    with the outputs of its matmuls and of attention ("selective")."""
    B, T, C, t = batch_size, seq_len, config.n_embd, tp
    lse = B * (config.n_head // t) * T * 4  # the attention logsumexp, fp32
    if ac == "full":
        return B * T * C * r // t
    if ac == "selective":  # input; qkv, attention output, c_fc (/ t); both row-parallel matmul outputs (full T)
        return B * T * C * r // t + 8 * B * T * C * m // t + 2 * B * T * C * m + lse
    if sdpa == "math":
        lse += 2 * B * (config.n_head // t) * T * T * m  # softmax probabilities and their dropout/cast copy
    per_layer = 2 * B * T * C * r // t + 2 * B * T * C * m + 12 * B * T * C * m // t
    return per_layer + 2 * 2 * (B * T // t) * 4 + lse  # + LayerNorm mean and rstd, fp32, on the sequence slice


def activation_bytes(
    config: GPTConfig, batch_size: int, seq_len: int, tp: int, precision: str = "bf16-mixed", sdpa: str = "flash",
    dp: int = 1, ac: str = "none",
) -> dict[str, int]:
    """Bytes saved for backward by one forward on one device (see the module docstring for the terms).

    sdpa: "flash" (flash / memory-efficient / CPU flash kernels: a logsumexp per query) or "math" (also the
    (a/t) x T x T attention probabilities). ac: the activation checkpointing mode (gpt_tp.parallel.apply_ac).
    Under FSDP2 with bf16-mixed (dp > 1) the residual stream is bf16 (the gathered weights are) and autocast keeps
    no weight copies."""
    _, r, m, lsm, wcopy = _precision(precision)
    if sdpa not in ("flash", "math"):
        raise PlanError(f"sdpa={sdpa!r}: use 'flash' (GPU flash / memory-efficient kernels, CPU) or 'math'")
    if ac not in AC_MODES:
        raise PlanError(f"activation checkpointing {ac!r}: use one of {', '.join(AC_MODES)} (planner --ac)")
    if _gather_bytes(precision, dp) == 2 and r == 4:  # bf16-mixed under FSDP2: bf16 weights, bf16 residual stream
        r, wcopy = 2, 0
    B, T, C, t = batch_size, seq_len, config.n_embd, tp
    head = B * T * C * r // t + 2 * (B * T // t) * 4  # ln_f input + stats
    head += B * T * C * m  # lm_head input, gathered
    head += B * T * (config.vocab_size // t) * lsm  # log-softmax output
    head += 2 * B * T * 8 + 2 * (T // t) * 8  # token ids, targets (int64), position ids
    weights = sum(math.prod(s) for s, mm in param_shapes(config, tp) if mm) * wcopy  # in every AC mode (measured)
    return {"layers": config.n_layer * _layer_bytes(config, B, T, t, r, m, sdpa, ac), "head": head, "weight_copies": weights}


def transient_bytes(
    config: GPTConfig, dp: int, tp: int, batch_size: int, seq_len: int, precision: str = "bf16-mixed",
    sdpa: str = "flash", ac: str = "none",
) -> int:
    """Memory alive at the peak beyond the saved activations, at the larger of two moments:
    - the loss: the logits B T (V/t) x m and, when they are not float32, the float32 copy the loss's subtraction
      makes (+ 4);
    - a block's backward: under AC the block's recomputed activations, under FSDP2 (dp > 1) two gathered blocks
      and one block's unsharded gradients with their float32 reduce-scatter copy, and the root's unsharded
      gradients; by then the head's activations are freed.
    Plus, under FSDP2, the root unit (wte, wpe, ln_f), which stays gathered through the step.
    Weights are gathered in 2 bytes under bf16-mixed (_gather_bytes)."""
    _, r, m, _, _ = _precision(precision)
    g = _gather_bytes(precision, dp)
    r = 2 if g == 2 and r == 4 else r
    at_loss = batch_size * seq_len * (config.vocab_size // tp) * (m + (4 if m < 4 else 0))
    backward = 0
    if ac != "none":
        backward += _layer_bytes(config, batch_size, seq_len, tp, r, m, sdpa, "none")
        backward -= _layer_bytes(config, batch_size, seq_len, tp, r, m, sdpa, ac)
    root = 0
    if dp > 1:
        shapes = param_shapes(config, tp)
        block = sum(math.prod(s) for s, _ in shapes[:12])
        root = sum(math.prod(s) for s, _ in shapes[12 * config.n_layer :]) * g
        backward += block * (2 * g + g + 4) + root
    backward -= activation_bytes(config, batch_size, seq_len, tp, precision, sdpa, dp, ac)["head"]
    return root + max(at_loss, backward)


def estimate(
    config: GPTConfig, dp: int, tp: int, batch_size: int, seq_len: int, precision: str = "bf16-mixed",
    sdpa: str = "flash", overhead_gib: float = 1.5, ac: str = "none",
) -> Memory:
    """The memory estimate of one layout, per device."""
    s = state_bytes(config, dp, tp, precision)
    a = activation_bytes(config, batch_size, seq_len, tp, precision, sdpa, dp, ac)
    return Memory(
        params=s["params"], grads=s["grads"], optimizer=s["optimizer"], activations=sum(a.values()),
        transient=transient_bytes(config, dp, tp, batch_size, seq_len, precision, sdpa, ac), overhead=int(overhead_gib * GIB),
    )


def padded_vocab(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """The smallest vocabulary >= vocab_size divisible by tp and by `multiple` (fast matmuls)."""
    step = tp * multiple // gcd(tp, multiple)
    return -(-vocab_size // step) * step


def _invalid_reason(config: GPTConfig, tp: int, seq_len: int) -> str:
    checks = [("n_head", config.n_head), ("n_embd", config.n_embd), ("vocab_size", config.vocab_size), ("seq_len", seq_len)]
    bad = [f"{name}={v}" for name, v in checks if v % tp]
    return f"TP={tp} does not divide {', '.join(bad)}"


def _check_inputs(config: GPTConfig, devices_per_node, num_nodes, batch_size, seq_len, device_memory_gib,
                  overhead_gib, usable_fraction) -> None:
    for name, v in [("devices_per_node", devices_per_node), ("num_nodes", num_nodes), ("batch_size", batch_size),
                    ("seq_len", seq_len), ("vocab_size", config.vocab_size)]:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{name}={v!r} must be a positive integer")
    if seq_len > config.block_size:
        raise PlanError(f"seq_len={seq_len} exceeds the model's block_size={config.block_size}: lower data.seq_len "
                        "(planner: --seq-len)")
    if device_memory_gib is not None and not device_memory_gib > 0:
        raise PlanError(f"device memory {device_memory_gib!r} GiB must be > 0 (planner --memory-gib)")
    if not overhead_gib >= 0:
        raise PlanError(f"overhead_gib={overhead_gib!r} must be >= 0 (planner --overhead-gib)")
    if not 0 < usable_fraction <= 1:
        raise PlanError(f"usable_fraction={usable_fraction!r} must be in (0, 1]")
    if device_memory_gib is not None and device_memory_gib * usable_fraction <= overhead_gib:
        raise PlanError(
            f"{usable_fraction:.0%} of {device_memory_gib:g} GiB per device leaves nothing after the {overhead_gib:g} "
            "GiB of CUDA context, NCCL buffers and allocator slack: no layout can fit; give the device's real memory "
            "(--memory-gib) or a smaller --overhead-gib")


def plan(
    config: GPTConfig, devices_per_node: int, num_nodes: int = 1, batch_size: int = 16, seq_len: int = 1024,
    device_memory_gib: float | None = None, precision: str = "bf16-mixed", sdpa: str = "flash",
    overhead_gib: float = 1.5, usable_fraction: float = 0.95, ac: str = "none",
) -> Plan:
    """Every TP size that divides the devices per node, with its memory estimate, validity and fit; and the choice:
    the valid layout with the smallest TP that fits (all fit when device_memory_gib is None)."""
    _check_inputs(config, devices_per_node, num_nodes, batch_size, seq_len, device_memory_gib, overhead_gib, usable_fraction)
    _precision(precision)
    out = Plan(config, devices_per_node, num_nodes, batch_size, seq_len, device_memory_gib, str(precision), ac)
    world = devices_per_node * num_nodes
    budget = None if device_memory_gib is None else device_memory_gib * GIB * usable_fraction
    valid = set(valid_tp_sizes(config, seq_len))

    def fits(dp: int, tp: int) -> tuple[Memory, bool]:
        m = estimate(config, dp, tp, batch_size, seq_len, precision, sdpa, overhead_gib, ac)
        return m, budget is None or m.total <= budget

    for tp in _divisors(devices_per_node):
        lay = Layout(dp=world // tp, tp=tp)
        if tp not in valid:
            lay.reason = _invalid_reason(config, tp, seq_len)
        else:
            lay.memory, lay.fits = fits(lay.dp, tp)
            if not lay.fits:
                lay.reason = f"needs {lay.memory.total / GIB:.1f} GiB > {usable_fraction:.0%} of {device_memory_gib:g} GiB"
        out.layouts.append(lay)
    out.choice = next((lay for lay in out.layouts if lay.fits), None)

    bad = [lay for lay in out.layouts if lay.memory is None]
    if bad:
        out.notes.append(
            f"valid TP sizes for this model (n_head={config.n_head}, n_embd={config.n_embd}, vocab_size="
            f"{config.vocab_size}, seq_len={seq_len}): {', '.join(map(str, sorted(valid)))}; "
            + "; ".join(lay.reason for lay in bad)
        )
        for tp in _divisors(config.n_head):  # TP sizes a node of this size allows with whole heads, other V or T
            if 1 < tp <= devices_per_node and tp not in valid and config.n_embd % tp == 0:
                needs = []
                if config.vocab_size % tp:
                    needs.append(f"vocab_size={padded_vocab(config.vocab_size, tp)} (padded; model.vocab_size, planner: --vocab-size)")
                if seq_len % tp:
                    needs.append(f"a sequence length that is a multiple of {tp} (sequence parallelism splits T), e.g. "
                                 f"{seq_len // tp * tp} (data.seq_len, planner: --seq-len)")
                if devices_per_node % tp:
                    needs.append(f"{tp} or a multiple of {tp} devices per node")
                out.notes.append(f"TP={tp} would split whole heads with " + ", ".join(needs))
    if out.choice is None:
        hint = ("lower data.batch_size (planner: --batch-size) and raise trainer.accumulate_grad_batches to keep the "
                "tokens per step")
        bigger = [tp for tp in sorted(valid) if tp > devices_per_node and fits(num_nodes, tp)[1]]
        if bigger:  # a node of `tp` devices, one TP group per node
            hint += f", or use nodes of {bigger[0]} devices (TP={bigger[0]})"
        out.notes.append(f"no layout fits {device_memory_gib:g} GiB per device: {hint}")
    return out


def format_plan(p: Plan) -> str:
    """A human-readable table of the plan."""
    c = p.config
    mem = "unlimited" if p.device_memory_gib is None else f"{p.device_memory_gib:g} GiB"
    lines = [
        f"model: {c.n_layer} layers, {c.n_head} heads, n_embd={c.n_embd}, vocab={c.vocab_size}, "
        f"{c.num_params(non_embedding=False) / 1e6:.0f}M parameters",
        f"devices: {p.num_nodes} node(s) x {p.devices_per_node} = {p.world_size}, {mem} each; micro-batch "
        f"B={p.batch_size} x T={p.seq_len} per DP rank; precision {p.precision}; activation checkpointing {p.ac}",
        f"{'layout':<14}{'params':>8}{'grads':>8}{'adamw':>8}{'activ.':>8}{'transient':>10}{'overhead':>9}{'total GiB':>11}  status",
    ]
    for lay in p.layouts:
        name = f"DP={lay.dp} x TP={lay.tp}"
        if lay.memory is None:
            lines.append(f"{name:<14}{'-':>62}  invalid: {lay.reason}")
            continue
        m = lay.memory
        g = [x / GIB for x in (m.params, m.grads, m.optimizer, m.activations, m.transient, m.overhead, m.total)]
        status = "fits" if lay.fits else lay.reason
        if lay is p.choice:
            status += "  <- chosen"
        lines.append(f"{name:<14}{g[0]:8.2f}{g[1]:8.2f}{g[2]:8.2f}{g[3]:8.2f}{g[4]:10.2f}{g[5]:9.2f}{g[6]:11.2f}  {status}")
    lines += [f"note: {n}" for n in p.notes]
    if p.choice is not None:
        lines.append(f"choice: data_parallel_size={p.choice.dp}, tensor_parallel_size={p.choice.tp}")
    return "\n".join(lines)


def resolve_layout(
    config: GPTConfig, world_size: int, devices_per_node: int, num_nodes: int, batch_size: int, seq_len: int,
    device_memory_gib: float | None = None, precision: str = "bf16-mixed", dp: int | str = "auto", tp: int | str = "auto",
    ac: str = "none",
) -> tuple[int, int]:
    """(dp, tp) for ModelParallelStrategy when either size is "auto": the planner's choice (smallest TP that fits;
    without a memory size, the smallest valid TP). A size given as a number is kept and the other one derived.
    Raises LayoutError (with the valid layouts) when nothing works, before any process group exists."""
    if world_size != devices_per_node * num_nodes:
        raise LayoutError(f"world_size={world_size} != devices_per_node={devices_per_node} x num_nodes={num_nodes}")
    if dp != "auto" and tp != "auto":
        return int(dp), int(tp)
    p = plan(config, devices_per_node, num_nodes, batch_size, seq_len, device_memory_gib, precision, ac=ac)
    candidates = [lay for lay in p.layouts if lay.memory is not None]
    if tp != "auto":
        candidates = [lay for lay in candidates if lay.tp == int(tp)]
    if dp != "auto":
        candidates = [lay for lay in candidates if lay.dp == int(dp)]
    fits = [lay for lay in candidates if lay.fits]
    if fits:
        return fits[0].dp, fits[0].tp
    raise LayoutError(
        f"no data_parallel_size x tensor_parallel_size layout for {world_size} devices "
        f"(given dp={dp}, tp={tp}) works for this model:\n{format_plan(p)}"
    )


def detect_device_memory_gib() -> float | None:
    """Memory of CUDA device 0 in GiB, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB


def _config_from_yaml(path: str) -> dict:
    """Model, batch and device settings from a `python cli.py fit --config` YAML file."""
    import yaml

    try:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise PlanError("no such file") from None
    except yaml.YAMLError as e:
        raise PlanError(f"not valid YAML ({' '.join(str(e).split())})") from None
    trainer, model, data = cfg.get("trainer", {}), cfg.get("model", {}), cfg.get("data", {})
    m = model.get("model", "gpt2")
    out = {
        "config": GPTConfig.from_name(m) if isinstance(m, str) else GPTConfig(**m),
        "devices_per_node": trainer.get("devices") if isinstance(trainer.get("devices"), int) else None,
        "num_nodes": trainer.get("num_nodes", 1),
        "batch_size": data.get("batch_size", 16),
        "seq_len": data.get("seq_len"),  # None: the model's block_size, at most 1024
        "precision": str(trainer.get("precision", "32-true")),
        "ac": model.get("activation_checkpointing", "none"),
    }
    if out["seq_len"] is None:
        out["seq_len"] = min(1024, out["config"].block_size)
    return out


def main(argv: list[str] | None = None) -> Plan:
    ap = argparse.ArgumentParser(
        prog="python -m gpt_tp.perf.planner",
        description="List the DP x TP layouts of a GPT-2 on a cluster, with estimated memory per device, and pick "
        "the one with the smallest tensor-parallel size that fits.",
    )
    ap.add_argument("--config", help="read model, devices, num_nodes, batch size, seq_len and precision from a cli.py YAML")
    ap.add_argument("--model", choices=list(SIZES), help="named model size (default gpt2)")
    ap.add_argument("--vocab-size", type=int, help="override the vocabulary (e.g. padded for a TP size)")
    ap.add_argument("--devices-per-node", type=int, help="GPUs per node (TP stays within a node)")
    ap.add_argument("--nodes", type=int, help="number of nodes (default 1)")
    ap.add_argument("--memory-gib", type=float, help="memory per device in GiB (default: CUDA device 0's, else no limit)")
    ap.add_argument("--batch-size", type=int, help="micro-batch per data-parallel rank (data.batch_size; default 16)")
    ap.add_argument("--seq-len", type=int, help="sequence length T (data.seq_len; default the model's block_size, at most 1024)")
    ap.add_argument("--precision", choices=list(PRECISIONS), help="trainer.precision (default bf16-mixed)")
    ap.add_argument("--sdpa", choices=["flash", "math"], default="flash", help="attention kernel (math keeps T x T scores)")
    ap.add_argument("--ac", choices=AC_MODES, help="activation checkpointing per block (model.activation_checkpointing; default none)")
    ap.add_argument("--overhead-gib", type=float, default=1.5, help="CUDA context + NCCL + allocator slack per device")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)

    settings = {
        "config": GPTConfig.from_name("gpt2"), "devices_per_node": None, "num_nodes": 1, "batch_size": 16,
        "seq_len": None, "precision": "bf16-mixed", "ac": "none",
    }
    if args.config:
        try:
            settings = _config_from_yaml(args.config)
        except (ValueError, TypeError) as e:  # PlanError included
            raise PlanError(f"--config {args.config}: {e}") from None
    if args.model:
        settings["config"] = GPTConfig.from_name(args.model)
    if args.vocab_size is not None:
        settings["config"].vocab_size = args.vocab_size
    for key, val in [("devices_per_node", args.devices_per_node), ("num_nodes", args.nodes), ("batch_size", args.batch_size),
                     ("seq_len", args.seq_len), ("precision", args.precision), ("ac", args.ac)]:
        if val is not None:
            settings[key] = val
    if settings["devices_per_node"] is None:
        raise PlanError("give --devices-per-node (or --config with a number in trainer.devices)")
    if settings["seq_len"] is None:
        settings["seq_len"] = min(1024, settings["config"].block_size)
    memory = args.memory_gib if args.memory_gib is not None else detect_device_memory_gib()
    p = plan(settings.pop("config"), **settings, device_memory_gib=memory, sdpa=args.sdpa, overhead_gib=args.overhead_gib)
    if args.json:
        rows = [
            {"dp": lay.dp, "tp": lay.tp, "fits": lay.fits, "reason": lay.reason,
             "memory": None if lay.memory is None else {**asdict(lay.memory), "total": lay.memory.total}}
            for lay in p.layouts
        ]
        choice = None if p.choice is None else {"dp": p.choice.dp, "tp": p.choice.tp}
        print(json.dumps({"layouts": rows, "choice": choice, "notes": p.notes}, indent=1))
    else:
        print(format_plan(p))
    return p


if __name__ == "__main__":
    from gpt_tp.entry import run

    run(main)

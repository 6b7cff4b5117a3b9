"""The planner's memory model: bytes per device of one data-parallel x tensor-parallel layout, checked against
measurements in tests/test_planner.py. Parameter shapes and state bytes per rank come from gpt_tp.sizing.sizes.

Memory per device (bytes; t = TP, d = DP, B = micro-batch per DP rank, T = sequence, C = width, L = layers, V = vocab):
  params     sum over parameters of ceil(rows_tp / d) x cols_tp x param bytes: TP splits the matmuls, the vocab-
             parallel embedding (tied to lm_head) and the column-parallel biases; LayerNorms, wpe and the row-parallel
             biases stay whole under TP; FSDP2 then shards every tensor's first dim over d (padded to a multiple of d).
  grads      the same count, in the parameter dtype.
  optimizer  AdamW exp_avg + exp_avg_sq: 2 x params.
  activations, saved for backward in one forward, per layer, with sequence parallelism and no checkpointing:
             B T C [2 r / t  +  14 m / t]  +  B T (4 x 4 / t)  +  B (a / t) T x 4
               2 r / t:  the LayerNorm inputs (residual stream, sequence-sharded; r = residual bytes)
               14 m / t: the inputs of c_attn and c_fc, each rank's sequence slice (at t > 1 they are all-gathered
                         again in backward, as Megatron does: gpt_tp.parallel.sp._ColParallel); qkv (3C), the
                         attention output (C), the MLP hidden (4C) before and after GELU (m = matmul activation
                         bytes); c_proj keeps the attention output's own storage (at t > 1 gpt_tp's plan makes its
                         token-major copy again in backward, gpt_tp.parallel.sp._RowParallel)
               LayerNorm mean/rstd (fp32), and the attention logsumexp (fp32) of flash / memory-efficient SDPA. The
               math SDPA kernel (sdpa="math") keeps the (a/t) T x T attention probabilities as well.
             Compare Korthikanti et al. 2022 (Reducing Activation Recomputation), s b h (34 + 5 a s / h) / t bytes with
             2-byte activations, dropout masks and the a s^2 scores; GPT-2 here trains without dropout and SDPA keeps no
             score matrix, so those terms vanish.
             Plus the head: ln_f input B T C r / t, lm_head input B T C m / t, the vocab-parallel log-softmax
             B T (V / t) x 4 (cross-entropy runs in fp32 under autocast), the token ids and targets (int64), the
             position ids (T, int64) and, at t > 1, the vocab-parallel loss's per-token sums (2 B T x 4) and the
             embedding's and the loss's masks of the ids this rank holds (2 B T bools).
             Under bf16-mixed at d = 1 and t = 1 autocast also keeps a bf16 copy of every matmul weight (2 bytes x
             matmul parameters; at t > 1 the parallel layers keep their float32 shards and cast them again in
             backward). At d > 1 FSDP2 gathers the weights in bf16
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

from dataclasses import dataclass

from gpt_tp.errors import UserError
from gpt_tp.hardware import GIB
from gpt_tp.model import GPTConfig
from gpt_tp.sizing import sizes
from gpt_tp.sizing.sizes import AC_MODES, PRECISIONS



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


def precision_bytes(precision: str) -> tuple[int, int, int, int, int]:
    """The bytes of sizes.PRECISIONS for trainer.precision; a PlanError naming the known ones for any other."""
    p = str(precision)
    if p not in PRECISIONS:
        raise PlanError(f"precision={p!r} is not known to the planner; use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[p]


def _gather_bytes(precision: str, dp: int) -> int:
    """Bytes per element of the weights the forward uses: FSDP2 (dp > 1) under bf16-mixed all-gathers them in bf16
    (gpt_tp.parallel.parallelize's param_dtype), everywhere else they are the parameters themselves."""
    return sizes.fsdp_gather_bytes(precision) if dp > 1 else precision_bytes(precision)[0]


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
    per_layer = 2 * B * T * C * r // t + 14 * B * T * C * m // t
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
    _, r, m, lsm, wcopy = precision_bytes(precision)
    if sdpa not in ("flash", "math"):
        raise PlanError(f"sdpa={sdpa!r}: use 'flash' (GPU flash / memory-efficient kernels, CPU) or 'math'")
    if ac not in AC_MODES:
        raise PlanError(f"activation checkpointing {ac!r}: use one of {', '.join(AC_MODES)} (planner --ac)")
    if _gather_bytes(precision, dp) == 2 and r == 4:  # bf16-mixed under FSDP2: bf16 weights, bf16 residual stream
        r, wcopy = 2, 0
    B, T, C, t = batch_size, seq_len, config.n_embd, tp
    head = B * T * C * r // t + 2 * (B * T // t) * 4  # ln_f input + stats
    head += B * T * C * m // t  # lm_head input, this rank's slice (gathered again in backward)
    head += B * T * (config.vocab_size // t) * lsm  # log-softmax output
    head += 2 * B * T * 8 + T * 8  # token ids, targets (int64), position ids (each rank saves a slice of all T)
    if t > 1:  # the vocab-parallel loss's per-token sums (fp32); the ids this rank holds (bools, embedding and loss)
        head += 2 * B * T * 4 + 2 * B * T
    # autocast keeps its casts of the parameters themselves (t = 1) through the forward, in every AC mode; at t > 1
    # gpt_tp's column- and row-parallel layers keep the float32 shards and cast them again in backward
    # (gpt_tp.parallel.sp._ColParallel, _RowParallel)
    copied = [] if tp > 1 else sizes.root_params(config, tp) + sizes.block_params(config, tp) * config.n_layer
    weights = sizes.numel([p for p in copied if p.matmul]) * wcopy
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
    _, r, m, _, _ = precision_bytes(precision)
    g = _gather_bytes(precision, dp)
    r = 2 if g == 2 and r == 4 else r
    at_loss = batch_size * seq_len * (config.vocab_size // tp) * (m + (4 if m < 4 else 0))
    backward = 0
    if ac != "none":
        backward += _layer_bytes(config, batch_size, seq_len, tp, r, m, sdpa, "none")
        backward -= _layer_bytes(config, batch_size, seq_len, tp, r, m, sdpa, ac)
    root = 0
    if dp > 1:
        block = sizes.numel(sizes.block_params(config, tp))
        root = sizes.numel(sizes.root_params(config, tp)) * g
        backward += block * (2 * g + g + 4) + root
    backward -= activation_bytes(config, batch_size, seq_len, tp, precision, sdpa, dp, ac)["head"]
    return root + max(at_loss, backward)


def memory_per_device(
    config: GPTConfig, dp: int, tp: int, batch_size: int, seq_len: int, precision: str = "bf16-mixed",
    sdpa: str = "flash", overhead_gib: float = 1.5, ac: str = "none",
) -> Memory:
    """The memory estimate of one layout, per device."""
    s = sizes.state_bytes(config, dp, tp, precision_bytes(precision)[0])
    a = activation_bytes(config, batch_size, seq_len, tp, precision, sdpa, dp, ac)
    return Memory(
        params=s["params"], grads=s["grads"], optimizer=s["optimizer"], activations=sum(a.values()),
        transient=transient_bytes(config, dp, tp, batch_size, seq_len, precision, sdpa, ac), overhead=int(overhead_gib * GIB),
    )


def fits(memory: Memory, device_memory_gib: float | None, usable_fraction: float = 0.95) -> bool:
    """A layout fits when its total is at most `usable_fraction` of the device memory (always, when unknown)."""
    return device_memory_gib is None or memory.total <= device_memory_gib * GIB * usable_fraction

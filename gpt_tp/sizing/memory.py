"""The planner's memory model: bytes per device of one data-parallel x tensor-parallel layout, checked against
measurements in tests/test_planner.py. The terms are in docs/scale.md, "The memory model (per device)"."""

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
    """Bytes one block saves for backward (docs/scale.md): everything ("none"), its input ("full"), or its input
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
    """Bytes saved for backward by one forward on one device (docs/scale.md, "The memory model"). sdpa: "flash" (a
    logsumexp per query) or "math" (also the (a/t) x T x T attention probabilities); ac: gpt_tp.parallel.apply_ac's mode."""
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
    """Memory alive at the peak beyond the saved activations: the larger of the loss moment and a block's backward,
    plus the root unit FSDP2 keeps gathered (docs/scale.md, "The memory model", transient)."""
    _, r, m, _, _ = precision_bytes(precision)
    g = _gather_bytes(precision, dp)
    r = 2 if g == 2 and r == 4 else r
    at_loss = batch_size * seq_len * (config.vocab_size // tp) * m  # the logits; their float32 shift is saved
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

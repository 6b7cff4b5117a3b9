"""The planner's memory model: bytes per device of one data-parallel x tensor-parallel layout, checked against
measurements in tests/test_planner.py. The terms are in docs/scale.md, "The memory model (per device)"."""

from dataclasses import dataclass, replace

from gpt_tp.errors import UserError
from gpt_tp.hardware import GIB
from gpt_tp.model import GPTConfig
from gpt_tp.sizing import sizes


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
    sync_once: bool = False  # accumulating at DP > 1, the unsharded gradients (in grads) fit: one reduce-scatter a step
    staging: int = 0  # host memory (pinned on CUDA; not in total) of an asynchronous save's copy: params + optimizer

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.states + self.activations + self.transient + self.overhead


def precision_bytes(precision: str) -> tuple[int, int, int, int, int]:
    """The bytes of sizes.PRECISIONS for trainer.precision; a PlanError naming the known ones for any other."""
    p = str(precision)
    if p not in sizes.PRECISIONS:
        raise PlanError(f"precision={p!r} is not known to the planner; use one of {', '.join(sizes.PRECISIONS)}")
    return sizes.PRECISIONS[p]


def _activation_bytes_per_element(precision: str, dp: int) -> tuple[int, int, int, int, int]:
    """(residual, matmul, log-softmax, autocast weight copy, gathered weight) bytes per element; FSDP2 (dp > 1) under
    bf16-mixed gathers bf16 weights (parallelize's param_dtype): no autocast copies."""
    param, r, m, lsm, wcopy = precision_bytes(precision)
    g = sizes.fsdp_gather_bytes(precision) if dp > 1 else param
    return r, m, lsm, 0 if g == 2 else wcopy, g


def _layer_bytes(config: GPTConfig, batch_size: int, seq_len: int, tp: int, r: int, m: int, ac: str) -> int:
    """Bytes one block saves for backward under activation checkpointing mode `ac` (docs/scale.md)."""
    B, T, C, t = batch_size, seq_len, config.n_embd, tp
    lse = B * (config.n_head // t) * T * 4  # the attention logsumexp, fp32
    if ac == "full":
        return B * T * C * r // t
    if ac == "selective":  # input; qkv, attention output, c_fc (/ t); both row-parallel matmul outputs (full T)
        return B * T * C * r // t + 8 * B * T * C * m // t + 2 * B * T * C * m + lse
    per_layer = 2 * B * T * C * r // t + 14 * B * T * C * m // t
    return per_layer + 2 * 2 * (B * T // t) * 4 + lse  # + LayerNorm mean and rstd, fp32, on the sequence slice


def activation_bytes(config: GPTConfig, batch_size: int, seq_len: int, tp: int, precision: str = "bf16-mixed",
                     dp: int = 1, ac: str = "none") -> dict[str, int]:
    """Bytes saved for backward by one forward on one device, SDPA keeping a logsumexp per query (its flash and
    memory-efficient kernels, the only ones GPT.forward meets); ac: gpt_tp.parallel.apply_ac's mode."""
    r, m, lsm, wcopy, _ = _activation_bytes_per_element(precision, dp)
    if ac not in sizes.AC_MODES:
        raise PlanError(f"activation checkpointing {ac!r}: use one of {', '.join(sizes.AC_MODES)} (planner --ac)")
    B, T, C, t = batch_size, seq_len, config.n_embd, tp
    head = B * T * C * r // t + 2 * (B * T // t) * 4  # ln_f input + stats
    head += B * T * C * m // t  # lm_head input, this rank's slice (gathered again in backward)
    head += B * T * (config.vocab_size // t) * lsm  # log-softmax output
    head += 2 * B * T * 8 + T * 8  # token ids, targets (int64), position ids (each rank saves a slice of all T)
    if t > 1:  # the vocab-parallel loss's per-token sums (fp32); the ids this rank holds (bools, embedding and loss)
        head += 2 * B * T * 4 + 2 * B * T
    # autocast keeps its casts of the matmul weights (t = 1) through the forward, in every AC mode; at t > 1 the
    # column- and row-parallel layers keep the float32 shards and cast them again in backward (gpt_tp.parallel.sp)
    weights = 0 if tp > 1 else sizes.numel([p for p in sizes.local_params(config, tp) if p.matmul]) * wcopy
    return {"layers": config.n_layer * _layer_bytes(config, B, T, t, r, m, ac), "head": head, "weight_copies": weights}


def transient_bytes(config: GPTConfig, dp: int, tp: int, batch_size: int, seq_len: int, precision: str = "bf16-mixed",
                    ac: str = "none") -> int:
    """Memory alive at the peak beyond the saved activations: the larger of the loss moment and a block's backward
    (with checkpointing, the block recomputed), plus the root unit FSDP2 keeps gathered (docs/scale.md)."""
    r, m, _, _, g = _activation_bytes_per_element(precision, dp)
    at_loss = batch_size * seq_len * (config.vocab_size // tp) * m  # the logits; their float32 shift is saved
    backward = (_layer_bytes(config, batch_size, seq_len, tp, r, m, "none")
                - _layer_bytes(config, batch_size, seq_len, tp, r, m, ac))
    root = 0
    if dp > 1:  # two gathered blocks, one block's gradients and their fp32 reduce-scatter copy, the root's gradients
        root = sizes.numel(sizes.root_params(config, tp)) * g
        backward += sizes.numel(sizes.block_params(config, tp)) * (2 * g + g + 4) + root
    backward -= activation_bytes(config, batch_size, seq_len, tp, precision, dp, ac)["head"]  # freed by then
    return root + max(at_loss, backward)


def memory_per_device(config: GPTConfig, dp: int, tp: int, batch_size: int, seq_len: int, precision: str = "bf16-mixed",
                      overhead_gib: float = 1.5, ac: str = "none", optimizer: str = "adamw", accumulate: int = 1,
                      device_memory_gib: float | None = None) -> Memory:
    s = sizes.state_bytes(config, dp, tp, precision_bytes(precision)[0], optimizer)
    a = activation_bytes(config, batch_size, seq_len, tp, precision, dp, ac)
    transient = transient_bytes(config, dp, tp, batch_size, seq_len, precision, ac)
    m = Memory(s["params"], s["grads"], s["optimizer"], sum(a.values()), transient, int(overhead_gib * GIB),
               staging=s["params"] + s["optimizer"])
    held = replace(m, grads=sizes.numel(sizes.local_params(config, tp)) * precision_bytes(precision)[0], sync_once=True)
    return held if dp > 1 and accumulate > 1 and fits(held, device_memory_gib) else m


USABLE_FRACTION = 0.95  # of a device's memory a layout may fill


def fits(memory: Memory, device_memory_gib: float | None) -> bool:
    """A layout fits when its total is at most USABLE_FRACTION of the device memory (always, when unknown)."""
    return device_memory_gib is None or memory.total <= device_memory_gib * GIB * USABLE_FRACTION

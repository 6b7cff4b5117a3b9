"""Which (data-parallel, tensor-parallel) layouts a model can take, and the error that says why one cannot."""

from math import gcd


from gpt_tp.errors import UserError
from gpt_tp.model import GPTConfig


class LayoutError(UserError):
    """A model / device layout that cannot work; the message says what to change."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp_sizes(config: GPTConfig, seq_len: int | None = None) -> list[int]:
    """TP degrees this model can be split over: each must divide the heads, the widths, the vocab and T."""
    g = gcd(config.n_head, config.n_embd, 4 * config.n_embd, config.vocab_size)
    if seq_len is not None:
        g = gcd(g, seq_len)
    return _divisors(g)


def fitting_layouts(config: GPTConfig, world_size: int, seq_len: int | None = None) -> list[tuple[int, int]]:
    """(dp, tp) pairs with dp * tp == world_size and a valid tp, smallest TP first."""
    return [(world_size // tp, tp) for tp in valid_tp_sizes(config, seq_len) if world_size % tp == 0]


def _layouts_text(config: GPTConfig, world_size: int, seq_len: int | None) -> str:
    fits = fitting_layouts(config, world_size, seq_len)
    s = ", ".join(f"DP={dp} x TP={tp}" for dp, tp in fits)
    return f"Layouts that fit {world_size} devices: {s}." if fits else f"No DP x TP layout fits {world_size} devices."


def validate_layout(
    config: GPTConfig, tp: int, dp: int = 1, world_size: int | None = None, seq_len: int | None = None
) -> None:
    """Raise LayoutError naming the flag to change if this model cannot run as dp x tp on world_size devices."""
    world_size = dp * tp if world_size is None else world_size
    if tp < 1 or dp < 1:
        raise LayoutError(f"tensor_parallel_size={tp} and data_parallel_size={dp} must be >= 1")
    if dp * tp != world_size:
        raise LayoutError(
            f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp}, but the run has {world_size} devices "
            f"(trainer.devices x trainer.num_nodes). {_layouts_text(config, world_size, seq_len)}"
        )
    checks = [
        ("model.n_head", config.n_head, "every rank holds whole attention heads"),
        ("model.n_embd", config.n_embd, "row-parallel projections split the width"),
        ("4 * model.n_embd", 4 * config.n_embd, "the MLP's hidden units are split"),
        ("model.vocab_size", config.vocab_size, "the embedding and lm_head are split over the vocabulary; pad it"),
    ]
    if seq_len is not None:
        checks.append(("the sequence length (data.seq_len)", seq_len, "sequence parallelism splits T"))
    for name, value, why in checks:
        if value % tp:
            raise LayoutError(
                f"tensor_parallel_size={tp} must divide {name}={value} ({why}); it divides by "
                f"{', '.join(map(str, _divisors(value)[:12]))}. Valid TP sizes for this model: "
                f"{', '.join(map(str, valid_tp_sizes(config, seq_len)))}. {_layouts_text(config, world_size, seq_len)}"
            )

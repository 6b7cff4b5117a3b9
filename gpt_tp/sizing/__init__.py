"""The sizing room: what a DP x TP layout puts on each rank, before anything is built (docs/structure.md)."""

from gpt_tp.sizing.layout import (  # noqa: F401
    LayoutError, check_run, check_total_batch, divisors, fitting_layouts, valid_tp_sizes, validate_layout,
)
from gpt_tp.sizing.memory import Memory, PlanError, fits, memory_per_device  # noqa: F401
from gpt_tp.sizing.sizes import AC_MODES, PRECISIONS, padded_vocab  # noqa: F401


def __getattr__(name: str):
    """The planner's names, imported on first use: `python -m gpt_tp.sizing.planner` then runs without runpy's
    warning about a module imported before it runs."""
    if name in ("Candidate", "Plan", "format_plan", "plan", "resolve_layout"):
        from gpt_tp.sizing import planner
        return getattr(planner, name)
    raise AttributeError(f"module 'gpt_tp.sizing' has no attribute {name!r}")

"""The sizing room: what a DP x TP layout puts on each rank, before anything is built (docs/structure.md)."""

from gpt_tp.sizing.layout import (  # noqa: F401
    LayoutError, check_run, check_total_batch, divisors, fitting_layouts, valid_tp_sizes, validate_layout,
)
from gpt_tp.sizing.memory import Memory, PlanError, fits, memory_per_device  # noqa: F401
from gpt_tp.sizing.sizes import AC_MODES, PRECISIONS, padded_vocab  # noqa: F401

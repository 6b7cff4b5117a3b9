"""The sizing room: what a data-parallel x tensor-parallel layout puts on each rank, before anything is built.
layout.py: which TP sizes a model takes (validate_layout); sizes.py: TP-local shapes, state bytes and a step's
collectives; memory.py: the planner's memory model; planner.py: which layout to pick (and `auto` sizes)."""

from gpt_tp.sizing.layout import (  # noqa: F401
    LayoutError, check_run, check_total_batch, divisors, fitting_layouts, valid_tp_sizes, validate_layout,
)
from gpt_tp.sizing.memory import Memory, PlanError, fits, memory_per_device  # noqa: F401
from gpt_tp.sizing.planner import Layout, Plan, format_plan, plan, resolve_layout  # noqa: F401
from gpt_tp.sizing.sizes import AC_MODES, PRECISIONS, padded_vocab  # noqa: F401

"""The parallel room: the tensor-parallel plan (plan.py), which layouts fit (layout.py), applying it in a fixed order
(apply.py), the step's gradient sync (grads.py) and the vocab-parallel cross-entropy (loss.py)."""

from gpt_tp.parallel.apply import AC_MODES, apply_ac, check_ac_mode, is_parallelized, materialize, parallelize  # noqa: F401
from gpt_tp.parallel.grads import clip_grad_norm, reduce_partial_grads  # noqa: F401
from gpt_tp.parallel.layout import LayoutError, fitting_layouts, valid_tp_sizes, validate_layout  # noqa: F401
from gpt_tp.parallel.plan import (  # noqa: F401
    PLANS, TP_PLAN, SequenceReplicated, check_plan, enable_async_tp, is_sequence_partial, make_plan,
)

"""The parallel room: the tensor-parallel plan, applying it, the gradient sync and the loss (docs/structure.md)."""

from gpt_tp.parallel.apply import apply_ac, check_ac_mode, is_parallelized, materialize, parallelize  # noqa: F401
from gpt_tp.parallel.grads import clip_grad_norm, grad_norm, sync_grads  # noqa: F401
from gpt_tp.parallel.plan import TP_PLAN, SequenceReplicated  # noqa: F401

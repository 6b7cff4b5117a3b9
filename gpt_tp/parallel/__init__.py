"""The parallel room: the tensor-parallel plan (plan.py) and its styles, sequence parallelism on local tensors
(sp.py); applying it in a fixed order (apply.py); the step's gradient sync (grads.py); the vocab-parallel
cross-entropy (loss.py) and the padded vocabulary's mask (vocab.py). Which layouts fit: gpt_tp.sizing."""

from gpt_tp.parallel.apply import apply_ac, check_ac_mode, is_parallelized, materialize, parallelize  # noqa: F401
from gpt_tp.parallel.grads import clip_grad_norm, grad_norm, reduce_partial_grads  # noqa: F401
from gpt_tp.parallel.plan import TP_PLAN, SequenceReplicated, enable_async_tp, is_sequence_partial  # noqa: F401

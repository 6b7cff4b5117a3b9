"""Plans for tests/test_paritycheck.py, loaded with --plan tests.workers.paritycheck_plans:<name>.

naive_qkv: gpt_tp's plan, except that c_attn is sharded as if its rows were [q | k | v] (the layout of
  nanoGPT's and Hugging Face's fused projection) instead of grouped per head: rank 0 then holds every head's q
  and half of the k's. This is the classic fused-qkv mistake. It runs, and the loss is wrong.
swapped_mlp: Colwise and Rowwise exchanged on the MLP: the shapes no longer fit.
"""

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from gpt_tp.model import qkv_from_per_head
from gpt_tp.parallel import TP_PLAN


class NaiveQKVColwise(ParallelStyle):
    """gpt_tp's column-parallel c_attn (it gathers its own sequence slice) over rows taken in [q | k | v] order."""

    def __init__(self, n_head: int):
        super().__init__()
        self.n_head = n_head

    def _apply(self, module, device_mesh):
        with torch.no_grad():
            module.weight.copy_(qkv_from_per_head(module.weight, self.n_head))
            module.bias.copy_(qkv_from_per_head(module.bias, self.n_head))
        return TP_PLAN["transformer.h.*.attn.c_attn"]._apply(module, device_mesh)


def naive_qkv(config):
    return {**TP_PLAN, "transformer.h.*.attn.c_attn": NaiveQKVColwise(config.n_head)}


swapped_mlp = {**TP_PLAN, "transformer.h.*.mlp.c_fc": RowwiseParallel(), "transformer.h.*.mlp.c_proj": ColwiseParallel()}

not_a_plan = ["transformer.wte"]

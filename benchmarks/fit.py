"""`python cli.py` with another tensor-parallel plan: the scaling benchmark's door for the reference plans.

    python -m benchmarks.fit --plan benchmarks.plans:ordered fit --config configs/cpu.yaml
    python -m benchmarks.fit --plan my_plans:PLAN fit --config configs/cpu.yaml --trainer.max_steps 20

--plan module:attribute names a plan dict (module path -> ParallelStyle) or a GPTModule subclass
(benchmarks.fit:TorchRecipe: the plain torch recipe, with torch's loss_parallel); the rest is cli.py's command line. The same argv reaches every process Lightning
starts, so each builds the same plan.
"""

import sys

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from benchmarks.plans import import_attribute, reduce_dtensor_partial_grads, torch_recipe
from gpt_tp.entry import run
from gpt_tp.errors import UserError
from gpt_tp.cli.main import main as cli_main
from gpt_tp.train.module import GPTModule


class TorchRecipe(GPTModule):
    """GPTModule on torch_recipe, trained as torch's recipe trains: torch's loss_parallel around the loss and its
    backward, and the Partial gradients reduced per parameter before the clip."""

    tp_plan = torch_recipe

    def _tp(self) -> bool:
        return self.device_mesh is not None and self.device_mesh["tensor_parallel"].size() > 1

    def compute_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self._tp():
            return super().compute_loss(logits, y)
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), y.flatten()).full_tensor()  # (B T, V) vocab-sharded, (B T,)

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        if not self._tp():
            return super().backward(loss, *args, **kwargs)
        with loss_parallel():
            super().backward(loss, *args, **kwargs)

    def on_before_optimizer_step(self, optimizer) -> None:
        reduce_dtensor_partial_grads(self.model)  # before GPTModule takes the grad norm
        super().on_before_optimizer_step(optimizer)


def load(spec: str) -> type[GPTModule]:
    """--plan module:attribute -> the GPTModule class that trains with it: a plan dict in a subclass of its own, or a
    GPTModule subclass as it is."""
    obj = import_attribute(spec, "--plan", "benchmarks.plans:ordered")
    if isinstance(obj, type) and issubclass(obj, GPTModule):
        return obj
    if not isinstance(obj, dict):
        raise UserError(f"--plan={spec!r} is neither a plan dict nor a GPTModule subclass")
    return type("PlanModule", (GPTModule,), {"tp_plan": obj})


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] != "--plan":
        raise UserError("usage: python -m benchmarks.fit --plan module:attribute fit --config ... (cli.py's arguments)")
    return cli_main(argv[2:], model_class=load(argv[1]))


if __name__ == "__main__":
    run(main)

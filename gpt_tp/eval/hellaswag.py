"""HellaSwag val accuracy during training and in `cli.py validate` (HellaSwagCallback; docs/eval.md)."""

import torch

from gpt_tp.collective import one_does
from gpt_tp.eval.hellaswag_data import DEFAULT_CACHE_DIR, HellaSwagError, read_examples, resolve_path
from gpt_tp.eval.hellaswag_score import evaluate
from gpt_tp.infer.sampling import StepCallback
from gpt_tp.ranks import layout_of, model_config


class HellaSwagCallback(StepCallback):
    """Logs hellaswag/acc_norm and hellaswag/acc every `every_n_steps` optimizer steps and at the end of fit.

    Args:
        path: a local hellaswag_val.jsonl; None downloads the official file once into cache_dir.
        cache_dir: where the download is kept.
        every_n_steps: evaluate when trainer.global_step is a multiple of this (0: only at the end of fit).
        limit: score only the first `limit` examples (None: all 10,042).
        batch_size: examples per forward (4 rows each).
        pad_to: round row lengths up to a multiple of this (with the TP degree), fewer shapes for torch.compile.
    """

    def __init__(self, path: str | None = None, cache_dir: str = DEFAULT_CACHE_DIR, every_n_steps: int = 250,
                 limit: int | None = None, batch_size: int = 4, pad_to: int = 32):
        super().__init__(every_n_steps)
        if limit is not None and limit < 1:
            raise HellaSwagError(f"HellaSwagCallback limit={limit} must be >= 1, or null for every example")
        if batch_size < 1 or pad_to < 1:
            raise HellaSwagError(f"HellaSwagCallback batch_size={batch_size} and pad_to={pad_to} must be >= 1")
        if path is not None:  # named before any rank starts (a compute node may have no internet to fetch it)
            resolve_path(path)
        self.path, self.cache_dir, self.limit, self.batch_size, self.pad_to = path, cache_dir, limit, batch_size, pad_to
        self.examples: list[dict] | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage not in ("fit", "validate") or self.examples is not None:
            return
        # one process per node downloads (the cache dir may be node-local); a failure ends every rank with it
        one_does(lambda: resolve_path(self.path, self.cache_dir), doer=trainer.local_rank == 0)
        self.examples = read_examples(resolve_path(self.path, self.cache_dir), self.limit)

    def compute(self, trainer, pl_module) -> dict:
        return evaluate(pl_module, self.examples, block_size=model_config(pl_module).block_size, batch_size=self.batch_size,
                        layout=layout_of(trainer, pl_module), device=pl_module.device,
                        forward_context=trainer.precision_plugin.forward_context, pad_to=self.pad_to)

    def run(self, trainer, pl_module) -> dict:
        res = super().run(trainer, pl_module)  # on every rank; rank 0 logs
        step = trainer.global_step
        metrics = {"hellaswag/acc_norm": res["acc_norm"], "hellaswag/acc": res["acc"]}

        def write():  # straight to the loggers: works in hooks where self.log cannot, whatever log_every_n_steps is
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
                logger.save()
            print(f"step {step}: HellaSwag acc_norm {res['correct_norm']}/{res['total']} = {res['acc_norm']:.4f}, "
                  f"acc {res['acc']:.4f}" + (f" ({res['truncated']} truncated to block_size)" if res["truncated"] else ""), flush=True)

        one_does(write, doer=trainer.global_rank == 0)  # rank 0 writes and prints; its failure ends every rank with it
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        return res

    def on_validation_end(self, trainer, pl_module) -> None:
        """`python cli.py validate` evaluates HellaSwag beside the val loss (fit's validations leave it to every_n_steps)."""
        if trainer.state.fn == "validate":
            self.run(trainer, pl_module)


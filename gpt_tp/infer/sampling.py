"""Text samples during training, as build-nanogpt prints them (generation: gpt_tp.infer.generate)."""

from pathlib import Path

from lightning.pytorch.callbacks import Callback

from gpt_tp.collective import one_does
from gpt_tp.data.tokenizer import get_encoding
from gpt_tp.errors import UserError
from gpt_tp.infer.generate import PROMPT, sample_texts


class StepCallback(Callback):
    """`run`: `compute` in eval mode, every `every_n_steps` optimizer steps and, with `at_end`, at the end of fit."""

    def __init__(self, every_n_steps: int, at_end: bool = True):
        if every_n_steps < 0:
            raise UserError(f"{type(self).__name__} every_n_steps={every_n_steps} must be >= 0 "
                            "(0: only at the end of fit)")
        self.every_n_steps, self.at_end = every_n_steps, at_end
        self._last_step = -1

    def compute(self, trainer, pl_module):
        raise NotImplementedError

    def run(self, trainer, pl_module):
        was_training = pl_module.training
        pl_module.eval()
        try:
            result = self.compute(trainer, pl_module)
        finally:
            pl_module.train(was_training)
        self._last_step = trainer.global_step
        return result

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.at_end and trainer.global_step != self._last_step:
            self.run(trainer, pl_module)


class TextSampleCallback(StepCallback):
    """`num_samples` seeded top-k continuations of `prompt`, as StepCallback runs; rank 0 prints and logs them."""

    def __init__(self, prompt: str = PROMPT, every_n_steps: int = 250, num_samples: int = 4, max_length: int = 32,
                 top_k: int = 50, seed: int = 42, at_end: bool = True):
        super().__init__(every_n_steps, at_end)
        if num_samples < 1 or top_k < 1:
            raise UserError(f"TextSampleCallback num_samples={num_samples} and top_k={top_k} must be >= 1")
        self.prompt, self.num_samples, self.max_length = prompt, num_samples, max_length
        self.top_k, self.seed = top_k, seed
        self._enc = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._enc = self._enc or get_encoding()
        if len(self._enc.encode(self.prompt)) >= self.max_length:
            raise UserError(f"TextSampleCallback max_length={self.max_length} must exceed the prompt's token count: "
                            "raise max_length or shorten the prompt")

    def compute(self, trainer, pl_module) -> list[str]:
        return sample_texts(pl_module, self._enc, self.prompt, trainer=trainer, num_samples=self.num_samples,
                            max_length=self.max_length, top_k=self.top_k, seed=self.seed)

    def run(self, trainer, pl_module) -> list[str]:
        texts = super().run(trainer, pl_module)
        step = trainer.global_step
        log_dir = trainer.log_dir  # a broadcast inside: every rank must ask

        def write():
            lines = [f"step {step} sample {i}: {t}" for i, t in enumerate(texts)]
            print("\n".join(lines), flush=True)
            if log_dir:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                with open(Path(log_dir) / "samples.txt", "a", encoding="utf-8") as f:
                    f.write("\n".join(lines) + "\n")
            for logger in trainer.loggers:
                if hasattr(getattr(logger, "experiment", None), "add_text"):  # TensorBoard
                    logger.experiment.add_text("samples", "\n\n".join(texts), global_step=step)

        one_does(write, doer=trainer.global_rank == 0)  # rank 0 writes; its failure ends every rank with it
        return texts

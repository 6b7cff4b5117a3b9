"""build-nanogpt's top-k sampling, for predict and the text samples of training (docs/eval.md): under TP every rank
runs the same forwards and draws the same tokens from one seeded generator; sequences are right-padded to a multiple
of the TP degree (sequence parallelism), unseen by a causal model's last real position."""

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor, Shard

from gpt_tp.collective import one_does
from gpt_tp.data.shards import check_token_ids
from gpt_tp.data.tokenizer import get_encoding
from gpt_tp.errors import UserError
from gpt_tp.parallel.loss import mask_padded_vocab
from gpt_tp.ranks import layout_of, model_config, model_vocab

PROMPT = "Hello, I'm a language model,"


def last_logits(logits: torch.Tensor, pos: int) -> torch.Tensor:
    """(B, V) logits at `pos` of (B, T, V) logits; of a vocab-sharded DTensor only that slice is gathered."""
    if not isinstance(logits, DTensor):
        return logits[:, pos, :]
    local = logits.to_local()[:, pos, :]  # (B, V / tp)
    placements = [Shard(1) if p.is_shard() else p for p in logits.placements]
    return DTensor.from_local(local, logits.device_mesh, placements, run_check=False).full_tensor()


@torch.no_grad()
def generate(model, prompt: list[int], *, num_samples: int = 4, max_length: int = 32, top_k: int = 50, seed: int = 42,
             block_size: int = 1024, tp: int = 1, vocab_limit: int | None = None, device: torch.device | str = "cpu",
             forward_context=nullcontext) -> torch.Tensor:
    """`prompt` (token ids) extended to max_length tokens, num_samples times, by build-nanogpt's loop: (num_samples,
    max_length) ids. Ids >= vocab_limit (padded vocabulary rows) are never drawn; each prompt id must be below
    vocab_limit and the model's vocabulary. Call on every rank of the job."""
    if not prompt:
        raise UserError("the prompt encodes to no tokens: give a non-empty prompt")
    limits = [v for v in (model_vocab(model), vocab_limit) if v is not None]
    if limits:
        check_token_ids(prompt, min(limits), "the sampling prompt")
    if max_length <= len(prompt):
        raise UserError(f"max_length={max_length} must exceed the prompt's {len(prompt)} tokens")
    max_ctx = block_size - block_size % tp  # longest window the model (and sequence parallelism) takes
    gen = torch.Generator(device=device).manual_seed(seed)  # the same stream on every rank
    x = torch.tensor(prompt, dtype=torch.long, device=device).unsqueeze(0).repeat(num_samples, 1)
    with torch.compiler.set_stance("force_eager"):  # every new length would be a new shape to compile
        while x.size(1) < max_length:
            ctx = x[:, -max_ctx:]
            T = ctx.size(1)
            with forward_context():
                logits = model(F.pad(ctx, (0, -T % tp)))  # right-padded with token 0 to a multiple of tp
            logits = mask_padded_vocab(last_logits(logits, T - 1).float(), vocab_limit)  # (B, V): never the padding
            probs = F.softmax(logits, dim=-1)
            topk_probs, topk_idx = torch.topk(probs, min(top_k, probs.size(-1)), dim=-1)  # (B, k)
            ix = torch.multinomial(topk_probs, 1, generator=gen)  # (B, 1)
            x = torch.cat([x, torch.gather(topk_idx, -1, ix)], dim=1)
    return x


def sample_texts(model, enc, prompt: str = PROMPT, trainer=None, **kwargs) -> list[str]:
    """generate() decoded with `enc`; vocab_limit defaults to enc's size, the rest to `trainer`'s (if given)."""
    if trainer is not None:
        kwargs = {"block_size": model_config(model).block_size, "tp": layout_of(trainer, model).tp, "device": model.device,
                  "forward_context": trainer.precision_plugin.forward_context, **kwargs}
    kwargs.setdefault("vocab_limit", enc.n_vocab)
    return [enc.decode(r) for r in generate(model, enc.encode(prompt), **kwargs).tolist()]


class StepCallback(Callback):
    """`run`: `compute` in eval mode, every `every_n_steps` optimizer steps and, with `at_end`, at the end of fit."""

    def __init__(self, every_n_steps: int, at_end: bool = True):
        if every_n_steps < 0:
            raise UserError(f"{type(self).__name__} every_n_steps={every_n_steps} must be >= 0 "
                            "(0: only at the end of fit)")
        self.every_n_steps, self.at_end, self._last_step = every_n_steps, at_end, -1

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

    def setup(self, trainer, pl_module, stage: str) -> None:
        if len(get_encoding().encode(self.prompt)) >= self.max_length:
            raise UserError(f"TextSampleCallback max_length={self.max_length} must exceed the prompt's token count: "
                            "raise max_length or shorten the prompt")

    def compute(self, trainer, pl_module) -> list[str]:
        return sample_texts(pl_module, get_encoding(), self.prompt, trainer=trainer, num_samples=self.num_samples,
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

"""Text samples during training, as build-nanogpt prints them: top-k 50 continuations of a prompt.

Under tensor parallelism every rank of a TP group runs the same forwards (they share the collectives), so every
rank samples, from the same seeded torch.Generator, on the same numbers: only the last position's logits are
gathered over the vocabulary shards, (B, vocab) rather than (B, T, vocab), and all ranks then draw identical
tokens. Sequences are right-padded to a multiple of the TP degree (sequence parallelism); a causal model's
logits at the last real position do not see the padding. torch.compile is bypassed while sampling (every new
length would be a new shape to compile).
"""

import math
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
from gpt_tp.eval.vocab import mask_padded_vocab
from gpt_tp.train.ranks import block_size_of, model_vocab, parallel_layout

PROMPT = "Hello, I'm a language model,"


def last_logits(logits: torch.Tensor, pos: int) -> torch.Tensor:
    """Full-vocabulary logits at position `pos`, (B, V), from (B, T, V) logits; a vocab-sharded DTensor has only
    that slice gathered."""
    if not isinstance(logits, DTensor):
        return logits[:, pos, :]
    local = logits.to_local()[:, pos, :]  # (B, V / tp)
    placements = [Shard(1) if p.is_shard() else p for p in logits.placements]
    return DTensor.from_local(local, logits.device_mesh, placements, run_check=False).full_tensor()


@torch.no_grad()
def generate(
    model,
    prompt: list[int],
    *,
    num_samples: int = 4,
    max_length: int = 32,
    top_k: int = 50,
    seed: int = 42,
    block_size: int = 1024,
    tp: int = 1,
    vocab_limit: int | None = None,
    device: torch.device | str = "cpu",
    forward_context=nullcontext,
) -> torch.Tensor:
    """Extend `prompt` (token ids) to max_length tokens, num_samples times: softmax, top-k, multinomial with a
    generator seeded with `seed` (build-nanogpt's loop). Token ids >= vocab_limit (the padded vocabulary rows)
    are never drawn. Every prompt id must be below the model's vocabulary (where it has a config) and vocab_limit
    (gpt_tp.data.shards.check_token_ids). Returns (num_samples, max_length) token ids. Call on every rank of the job."""
    if not prompt:
        raise UserError("the prompt encodes to no tokens: give a non-empty prompt")
    limits = [v for v in (model_vocab(model), vocab_limit) if v is not None]
    if limits:
        check_token_ids(torch.tensor(prompt), min(limits), "the sampling prompt")
    if max_length <= len(prompt):
        raise UserError(f"max_length={max_length} must exceed the prompt's {len(prompt)} tokens")
    device = torch.device(device)
    max_ctx = block_size - block_size % tp  # longest window the model (and sequence parallelism) takes
    gen = torch.Generator(device=device).manual_seed(seed)  # the same stream on every rank
    x = torch.tensor(prompt, dtype=torch.long, device=device).unsqueeze(0).repeat(num_samples, 1)
    with torch.compiler.set_stance("force_eager"):
        while x.size(1) < max_length:
            ctx = x[:, -max_ctx:]
            T = ctx.size(1)
            padded = F.pad(ctx, (0, math.ceil(T / tp) * tp - T))  # right-pad with token 0
            with forward_context():
                logits = model(padded)
            logits = mask_padded_vocab(last_logits(logits, T - 1).float(), vocab_limit)  # (B, V): never the padding
            probs = F.softmax(logits, dim=-1)
            topk_probs, topk_idx = torch.topk(probs, min(top_k, probs.size(-1)), dim=-1)  # (B, k)
            ix = torch.multinomial(topk_probs, 1, generator=gen)  # (B, 1)
            x = torch.cat([x, torch.gather(topk_idx, -1, ix)], dim=1)
    return x


def sample_texts(model, enc, prompt: str = PROMPT, **kwargs) -> list[str]:
    """generate() decoded with `enc` (tiktoken); vocab_limit defaults to the tokenizer's size."""
    kwargs.setdefault("vocab_limit", enc.n_vocab)
    rows = generate(model, enc.encode(prompt), **kwargs)
    return [enc.decode(r) for r in rows.tolist()]


class TextSampleCallback(Callback):
    """Every `every_n_steps` optimizer steps (and at the end of fit), sample `num_samples` continuations of
    `prompt` up to `max_length` tokens with top-k sampling; rank 0 prints them, appends them to
    <log_dir>/samples.txt and adds them to TensorBoard where a TensorBoardLogger is attached.
    The generator is seeded with `seed` at every call: the same seed gives the same text for the same weights,
    whatever the TP layout."""

    def __init__(self, prompt: str = PROMPT, every_n_steps: int = 250, num_samples: int = 4, max_length: int = 32,
                 top_k: int = 50, seed: int = 42, at_end: bool = True):
        if every_n_steps < 0:
            raise UserError(f"TextSampleCallback every_n_steps={every_n_steps} must be >= 0 (0: only at the end of fit)")
        if num_samples < 1 or top_k < 1:
            raise UserError(f"TextSampleCallback num_samples={num_samples} and top_k={top_k} must be >= 1")
        self.prompt, self.every_n_steps, self.num_samples, self.max_length = prompt, every_n_steps, num_samples, max_length
        self.top_k, self.seed, self.at_end = top_k, seed, at_end
        self.history: list[tuple[int, list[str]]] = []  # (step, samples) on this rank
        self._last_step = -1
        self._enc = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._enc = self._enc or get_encoding()
        if len(self._enc.encode(self.prompt)) >= self.max_length:
            raise UserError(f"TextSampleCallback max_length={self.max_length} must exceed the prompt's token count: "
                            "raise max_length or shorten the prompt")

    def run(self, trainer, pl_module) -> list[str]:
        tp = parallel_layout(trainer, pl_module)[0]
        was_training = pl_module.training
        pl_module.eval()
        try:
            texts = sample_texts(pl_module, self._enc, self.prompt, num_samples=self.num_samples,
                                 max_length=self.max_length, top_k=self.top_k, seed=self.seed,
                                 block_size=block_size_of(pl_module), tp=tp, device=pl_module.device,
                                 forward_context=trainer.precision_plugin.forward_context)
        finally:
            pl_module.train(was_training)
        step = trainer.global_step
        self.history.append((step, texts))
        self._last_step = step
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

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.at_end and trainer.global_step != self._last_step:
            self.run(trainer, pl_module)

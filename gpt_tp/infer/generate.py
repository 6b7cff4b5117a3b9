"""build-nanogpt's top-k sampling of a prompt's continuations, for the sampling callback and predict (docs/eval.md).
Under TP every rank runs the same forwards and draws the same tokens from the same seeded generator; sequences are
right-padded to a multiple of the TP degree (sequence parallelism), unseen by a causal model's last real position."""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from gpt_tp.data.shards import check_token_ids
from gpt_tp.errors import UserError
from gpt_tp.parallel.loss import mask_padded_vocab
from gpt_tp.ranks import block_size_of, layout_of, model_vocab

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
        check_token_ids(torch.tensor(prompt), min(limits), "the sampling prompt")
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
        kwargs = {"block_size": block_size_of(model), "tp": layout_of(trainer, model).tp, "device": model.device,
                  "forward_context": trainer.precision_plugin.forward_context, **kwargs}
    kwargs.setdefault("vocab_limit", enc.n_vocab)
    return [enc.decode(r) for r in generate(model, enc.encode(prompt), **kwargs).tolist()]

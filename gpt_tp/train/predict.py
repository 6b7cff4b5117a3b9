"""`python cli.py predict`: continue prompts with a trained model (a checkpoint, init_from weights, or the init).

Prompts come from `--prompt` (one, or a JSON list) and `--prompts_file` (one prompt a line), else the text sampler's default.
Every rank runs every prompt (TP ranks share the forwards; DP replicas repeat them), drawing from a generator seeded
per prompt, so every rank produces the same text, and the same text as the single-device run. Rank 0 prints the
continuations and, with `--output FILE`, writes them as JSON lines {"prompt", "sample", "text"}.
"""

import json
from pathlib import Path

from lightning.pytorch import Trainer

from gpt_tp.collective import one_does
from gpt_tp.errors import UserError
from gpt_tp.train.generate import PROMPT, sample_texts


def read_prompts(prompt: list[str] | None = None, prompts_file: str | None = None) -> list[str]:
    """The prompts of a predict run: --prompt values, then the non-empty lines of --prompts_file; the default prompt if neither."""
    prompts = list(prompt or [])
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise UserError(f"--prompts_file {prompts_file}: no such file (give a text file with one prompt a line)")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not prompts:
            raise UserError(f"--prompts_file {prompts_file}: holds no prompt (one prompt a line)")
    if any(not p.strip() for p in prompts):
        raise UserError("--prompt: an empty prompt; give text to continue")
    return prompts or [PROMPT]


def prompt_tokens(enc, prompt: str, block_size: int) -> int:
    """The prompt's token count; UserError where it leaves no room for a new token within the model's block_size."""
    n = len(enc.encode(prompt))
    if n >= block_size:
        raise UserError(f"--prompt {prompt[:40]!r}...: {n} tokens, but the model's block_size is {block_size}; "
                        f"shorten it to under {block_size} tokens")
    return n


def check_prompts(prompts: list[str], block_size: int, output: str | None) -> None:
    """Before any rank starts: every prompt fits the model (prompt_tokens) and --output names a file, not a folder."""
    from gpt_tp.data.tokenizer import get_encoding

    enc = get_encoding()
    for prompt in prompts:
        prompt_tokens(enc, prompt, block_size)
    if output is not None and Path(output).is_dir():
        raise UserError(f"--output {output} is a folder; give the name of a file for the JSON lines")


class PromptBatches:
    """One batch a prompt. A plain iterable, not a DataLoader: Lightning adds no distributed sampler, so every rank
    sees every prompt (and not a list, which Lightning would take as one loader per element)."""

    def __init__(self, prompts: list[str], **settings):
        self.batches = [{"prompt": p, **settings} for p in prompts]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def continue_prompt(pl_module, batch: dict) -> list[dict]:
    """predict_step's work: `num_samples` top-k continuations of batch["prompt"], `max_new_tokens` tokens each."""
    from gpt_tp.data.tokenizer import get_encoding
    from gpt_tp.train.ranks import block_size_of, parallel_layout

    enc = get_encoding()
    trainer = pl_module.trainer
    prompt = batch["prompt"]
    block = block_size_of(pl_module)
    n_prompt = prompt_tokens(enc, prompt, block)
    texts = sample_texts(
        pl_module, enc, prompt, num_samples=batch["num_samples"], max_length=min(block, n_prompt + batch["max_new_tokens"]),
        top_k=batch["top_k"], seed=batch["seed"], block_size=block, tp=parallel_layout(trainer, pl_module)[0],
        device=pl_module.device, forward_context=trainer.precision_plugin.forward_context,
    )
    return [{"prompt": prompt, "sample": i, "text": t} for i, t in enumerate(texts)]


def write_predictions(rows: list[dict], output: str | None) -> None:
    """Rank 0: print each continuation; with `output`, also write them as JSON lines."""
    for r in rows:
        print(f"prompt {r['prompt']!r} sample {r['sample']}: {r['text']}", flush=True)
    if output is not None:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(path)


class GPTTrainer(Trainer):
    """Lightning's Trainer whose predict, without dataloaders, continues prompts (the `predict` subcommand's flags)."""

    def predict(self, model=None, dataloaders=None, datamodule=None, return_predictions=None, ckpt_path=None, *,
                prompt: list[str] | str | None = None, prompts_file: str | None = None, output: str | None = None,
                max_new_tokens: int = 32, num_samples: int = 1, top_k: int = 50, seed: int = 42):
        """Continue prompts with the model and print them (rank 0); --output FILE also writes them as JSON lines.

        Args:
            prompt: a prompt to continue, or a JSON list of them ('["To be", "ROMEO:"]'); default: the text sampler's prompt.
            prompts_file: a text file with one prompt a line, after any --prompt.
            output: also write {"prompt", "sample", "text"} JSON lines to this file (rank 0).
            max_new_tokens: tokens to add to each prompt (fewer where the model's block_size ends first).
            num_samples: continuations per prompt.
            top_k: sample from the k most likely tokens (1: greedy).
            seed: the sampling generator's seed, per prompt: the same seed and weights give the same text on any layout.
        """
        if dataloaders is None:
            if max_new_tokens < 1 or num_samples < 1 or top_k < 1:
                raise UserError(f"--max_new_tokens={max_new_tokens}, --num_samples={num_samples} and --top_k={top_k} must be >= 1")
            settings = {"max_new_tokens": max_new_tokens, "num_samples": num_samples, "top_k": top_k, "seed": seed}
            prompts = read_prompts([prompt] if isinstance(prompt, str) else prompt, prompts_file)
            if model is not None:
                check_prompts(prompts, model.config.block_size, output)
            dataloaders = PromptBatches(prompts, **settings)
        out = super().predict(model, dataloaders, None, True if return_predictions is None else return_predictions, ckpt_path)
        if out is not None:  # rank 0 writes; a failure there ends every rank with it
            one_does(lambda: write_predictions([row for batch in out for row in batch], output))
        return out

"""`python cli.py predict`: continue prompts with a trained model. Its flags are linked into the data module's `prompts`
(a `Prompts`), --output into `PromptWriter`. Every rank runs every prompt, seeded per prompt: one text on any layout."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning.pytorch.callbacks import BasePredictionWriter

from gpt_tp.collective import one_does
from gpt_tp.data.shards import atomic_file, make_writable
from gpt_tp.data.tokenizer import get_encoding
from gpt_tp.errors import UserError
from gpt_tp.infer.sampling import PROMPT, sample_texts


@dataclass
class Prompts:
    """What `cli.py predict` continues, and how.

    Args:
        prompt: a prompt to continue, or a JSON list of them ('["To be", "ROMEO:"]'); default: the text sampler's prompt.
        prompts_file: a UTF-8 text file (a byte-order mark is dropped) with one prompt a line, after any --prompt.
        max_new_tokens: tokens to add to each prompt; past block_size the context slides, as nanoGPT's generate does.
        num_samples: continuations per prompt.
        top_k: sample from the k most likely tokens (1: greedy).
        seed: the sampling generator's seed, per prompt: the same seed and weights give the same text on any layout.
    """

    prompt: list[str] | str | None = None
    prompts_file: str | None = None
    max_new_tokens: int = 32
    num_samples: int = 1
    top_k: int = 50
    seed: int = 42

    def read(self) -> list[str]:
        """The prompts: --prompt values, then the non-empty lines of --prompts_file; the default prompt if neither."""
        if self.max_new_tokens < 1 or self.num_samples < 1 or self.top_k < 1:
            raise UserError(f"--max_new_tokens={self.max_new_tokens}, --num_samples={self.num_samples} and "
                            f"--top_k={self.top_k} must be >= 1")
        prompts = [self.prompt] if isinstance(self.prompt, str) else list(self.prompt or [])
        if self.prompts_file is not None:
            path = Path(self.prompts_file)
            if not path.is_file():
                raise UserError(f"--prompts_file {path}: no such file (give a text file with one prompt a line)")
            try:
                prompts += [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
            except UnicodeDecodeError as e:
                raise UserError(f"--prompts_file {path}: not UTF-8 text ({e.reason} at byte {e.start}); give a text "
                                "file with one prompt a line") from e
            if not prompts:
                raise UserError(f"--prompts_file {path}: holds no prompt (one prompt a line)")
        if any(not p.strip() for p in prompts):
            raise UserError("--prompt: an empty prompt; give text to continue")
        return prompts or [PROMPT]


# the predict subcommand's flags linked into GPTDataModule(prompts=Prompts(...)), in Prompts' field order
PROMPT_FLAGS = tuple(Prompts.__dataclass_fields__)


class PromptBatches:
    """One batch a prompt. A plain iterable, not a DataLoader: Lightning adds no distributed sampler, so every rank
    sees every prompt (and not a list, which Lightning would take as one loader per element)."""

    def __init__(self, prompts: Prompts):
        settings = {k: v for k, v in asdict(prompts).items() if k not in ("prompt", "prompts_file")}
        self.batches = [{"prompt": p, **settings} for p in prompts.read()]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def continue_prompt(pl_module, batch: dict) -> list[dict]:
    """predict_step's work: `num_samples` top-k continuations of batch["prompt"], `max_new_tokens` tokens each."""
    enc, prompt = get_encoding(), batch["prompt"]
    texts = sample_texts(pl_module, enc, prompt, trainer=pl_module.trainer, num_samples=batch["num_samples"],
                         max_length=len(enc.encode(prompt)) + batch["max_new_tokens"], top_k=batch["top_k"],
                         seed=batch["seed"])
    return [{"prompt": prompt, "sample": i, "text": t} for i, t in enumerate(texts)]


class PromptWriter(BasePredictionWriter):
    """Rank 0 prints each continuation as its prompt finishes and, with `output`, writes them all as JSON lines at the
    end (gpt_tp.data.shards.atomic_file: whole or not at all). A failed write ends every rank with the same line.

    Args:
        output: also write {"prompt", "sample", "text"} JSON lines to this file (cli.py predict's --output).
        overwrite: replace an existing `output` (cli.py predict's --overwrite_output); without it one is refused.
    """

    def __init__(self, output: str | None = None, overwrite: bool = False):
        super().__init__(write_interval="batch")
        if output is not None:  # found now, not after every prompt has been continued
            if Path(output).is_dir():
                raise UserError(f"--output {output} is a folder; give the name of a file for the JSON lines")
            if Path(output).exists() and not overwrite:
                raise UserError(f"--output {output} exists; give a new file, or pass --overwrite_output to replace it")
            make_writable(Path(output).absolute().parent, "its folder", f"--output {output}",
                          "give a file in a writable folder")
        self.output, self.rows = output, []

    def on_predict_start(self, trainer, pl_module) -> None:
        self.rows = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.rows += prediction
        if trainer.is_global_zero:
            for r in prediction:
                print(f"prompt {r['prompt']!r} sample {r['sample']}: {r['text']}", flush=True)

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        if self.output is not None:
            one_does(self._write)

    def _write(self) -> None:
        with atomic_file(self.output) as f:
            f.write("".join(json.dumps(r) + "\n" for r in self.rows).encode())

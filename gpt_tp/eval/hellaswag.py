"""HellaSwag (val) accuracy the build-nanogpt way, correct under tensor and data parallelism.

Each example is a context and four endings. Row i = context tokens + tokens of " " + ending i; the model's
cross-entropy is taken over the ending tokens only. `acc` picks the ending with the lowest summed loss,
`acc_norm` the one with the lowest mean loss per token (build-nanogpt's hellaswag.py reports both; its
training loop logs acc_norm). GPT-2 124M scores acc 0.2859 / acc_norm 0.2955 on the 10,042 val examples.

Parallelism:
- TP: the logits are a DTensor sharded over the vocabulary. Per-token losses come from F.cross_entropy(...,
  reduction="none") under loss_parallel(): a max, a sum of exponentials and the target logit are all-reduced
  over the TP group, never the (rows, T, vocab) logits. Rows are padded (right, causal model: padding cannot
  change earlier positions) to a multiple of the TP degree, which sequence parallelism requires.
- DP: example i goes to data-parallel rank i % dp; the ranks of one TP group score the same examples. Counts are
  summed over the data-parallel group only (a sum over all ranks would count every example tp times), so the
  total is exactly the number of examples. Every DP rank runs the same number of forwards (a rank with fewer
  examples repeats a batch with weight 0), since FSDP2 all-gathers parameters in each forward.

Command line (one process, or torchrun for TP/DP), see docs/eval.md:
    python -m gpt_tp.eval.hellaswag --hf-dir gpt2_hf           # a Hugging Face GPT-2 directory
    python -m gpt_tp.eval.hellaswag --ckpt_path checkpoints/last.ckpt   # a Lightning checkpoint (DCP folder or file)
    torchrun --nproc_per_node 2 -m gpt_tp.eval.hellaswag --hf-dir gpt2_hf --tp 2
"""

import argparse
import json
import math
import os
import tempfile
import urllib.request
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from gpt_tp.collective import one_does
from gpt_tp.data.shards import check_token_ids, resolve_data_dir
from gpt_tp.errors import UserError
from gpt_tp.data.tokenizer import get_encoding

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
FILENAME = "hellaswag_val.jsonl"
DEFAULT_CACHE_DIR = "data/hellaswag"
N_VAL = 10042  # examples in the official val split
MAX_REPORTED = 20  # malformed lines listed in one error


class HellaSwagError(UserError):
    """A missing, unreadable or malformed HellaSwag file; the message names the line(s) and the fix."""


# ---------------------------------------------------------------------------------------------------------
# the file: reading, checking, downloading


def check_record(rec) -> str | None:
    """What is wrong with one parsed record (None if it is usable): a dict with a string `ctx`, a list of four
    string `endings` and an integer `label` in 0-3."""
    if not isinstance(rec, dict):
        return f"expected a JSON object, got {type(rec).__name__}"
    missing = [k for k in ("ctx", "endings", "label") if k not in rec]
    if missing:
        return f"missing key(s) {', '.join(map(repr, missing))}"
    if not isinstance(rec["ctx"], str):
        return f"'ctx' must be a string, got {type(rec['ctx']).__name__}"
    endings = rec["endings"]
    if not isinstance(endings, list) or len(endings) != 4:
        n = len(endings) if isinstance(endings, list) else type(endings).__name__
        return f"'endings' must be a list of 4 strings, got {n}" + (" endings" if isinstance(endings, list) else "")
    if not all(isinstance(e, str) and e.strip() for e in endings):
        return "'endings' must hold 4 non-empty strings"
    label = rec["label"]
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label <= 3:
        return f"'label' must be an integer 0-3, got {label!r}"
    return None


def read_examples(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """The records of a HellaSwag .jsonl file (the first `limit` if given), each checked. Blank lines are skipped.
    Raises HellaSwagError listing every malformed line as path:line: problem."""
    path = Path(path)
    if not path.is_file():
        raise HellaSwagError(f"HellaSwag file {path} not found: pass an existing hellaswag_val.jsonl, or path=None to download it")
    if limit is not None and limit < 1:
        raise HellaSwagError(f"limit={limit} must be >= 1 (or None for every example)")
    examples, errors = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(examples) + len(errors) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})")
                continue
            problem = check_record(rec)
            if problem:
                errors.append(f"{path}:{lineno}: {problem}")
            else:
                examples.append(rec)
    if errors:
        shown = "\n  ".join(errors[:MAX_REPORTED])
        more = f"\n  ... and {len(errors) - MAX_REPORTED} more" if len(errors) > MAX_REPORTED else ""
        raise HellaSwagError(
            f"{len(errors)} malformed HellaSwag record(s) in {path} (each needs 'ctx', 4 'endings', 'label' 0-3):"
            f"\n  {shown}{more}\nFix or delete these lines, or re-download the file (delete it from the cache dir)."
        )
    if not examples:
        raise HellaSwagError(f"{path} holds no HellaSwag records")
    return examples


def fetch_url(url: str, timeout: float = 60.0) -> bytes:
    """The bytes at url (the one network call; tests replace it)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def download(dest: str | os.PathLike, url: str = HELLASWAG_URL) -> Path:
    """Fetch url into dest atomically: written to a temporary file beside dest, then renamed, so a crash or a
    concurrent reader never sees a half-written file."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = fetch_url(url)
    except Exception as e:
        raise HellaSwagError(
            f"could not download HellaSwag from {url} ({type(e).__name__}: {e}). Offline, fetch the file elsewhere "
            f"and copy it to {dest}, or pass its location as path=/--path."
        ) from e
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def resolve_path(path: str | os.PathLike | None = None, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> Path:
    """The file to read: `path` if given (it must exist; a relative one missing from the working directory is
    taken from the repository root, like data.data_dir), else cache_dir/hellaswag_val.jsonl, downloaded once."""
    if path is not None:
        p = resolve_data_dir(path)  # a relative path missing here is looked up under the repository root
        if not p.is_file():
            raise HellaSwagError(f"HellaSwag file {p} not found: give an existing hellaswag_val.jsonl, or no path to download it into the cache dir")
        return p
    dest = Path(cache_dir).expanduser() / FILENAME
    return dest if dest.is_file() else download(dest)


# ---------------------------------------------------------------------------------------------------------
# rendering and scoring


def render_example(example: dict, enc) -> tuple[list[list[int]], list[list[int]], int]:
    """build-nanogpt's render_example, unpadded: 4 token rows (context + " " + ending), 4 mask rows (1 on the
    ending tokens), and the label."""
    ctx_tokens = enc.encode(example["ctx"])
    rows, masks = [], []
    for end in example["endings"]:
        end_tokens = enc.encode(" " + end)  # GPT-2's tokenizer: the space belongs to the ending's first token
        rows.append(ctx_tokens + end_tokens)
        masks.append([0] * len(ctx_tokens) + [1] * len(end_tokens))
    return rows, masks, example["label"]


def fit_rows(rows: list[list[int]], masks: list[list[int]], max_len: int) -> tuple[list[list[int]], list[list[int]], bool]:
    """Left-truncate rows longer than max_len (drop the oldest context tokens), as the model sees at most
    block_size positions. Returns the rows, the masks and whether anything was cut. An ending that alone does not
    fit loses its first tokens (their loss would need context the model cannot see)."""
    cut = any(len(r) > max_len for r in rows)
    if cut:
        rows = [r[-max_len:] for r in rows]
        masks = [m[-max_len:] for m in masks]
    return rows, masks, cut


def pad_batch(rows: list[list[int]], masks: list[list[int]], multiple: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to one length, rounded up to `multiple` (sequence parallelism needs T % tp == 0) and at most
    max_len. Padding is token 0 with mask 0: a causal model's earlier positions cannot see it."""
    T = min(math.ceil(max(len(r) for r in rows) / multiple) * multiple, max_len)
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m)
    return tokens, mask


def mask_vocab(logits: torch.Tensor, limit: int | None) -> torch.Tensor:
    """Logits of token ids >= limit set to -inf: the rows padding the vocabulary (50257 -> 50304) are not
    GPT-2 tokens. It matters for imported Hugging Face weights, whose padded rows are zero, giving logit 0 where
    GPT-2's real logits are far below (the softmax would put most of its mass there). A vocab-sharded DTensor is
    masked shard by shard, without communication."""
    V = logits.shape[-1]
    if limit is None or limit >= V:
        return logits
    if not isinstance(logits, DTensor):
        return logits.masked_fill(torch.arange(V, device=logits.device) >= limit, float("-inf"))
    mesh, placements = logits.device_mesh, logits.placements
    dims = [i for i, p in enumerate(placements) if p.is_shard() and p.dim % logits.ndim == logits.ndim - 1]
    local = logits.to_local()
    n = local.shape[-1]
    if len(dims) != 1 or n * mesh.size(dims[0]) != V:
        raise ValueError(f"expected logits evenly sharded over the vocabulary on one mesh dim, got {placements} for {V} classes")
    offset = mesh.get_local_rank(dims[0]) * n
    local = local.masked_fill(torch.arange(offset, offset + n, device=local.device) >= limit, float("-inf"))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=logits.shape, stride=logits.stride())


def ending_losses(
    logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, vocab_limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean cross-entropy over each row's masked (ending) tokens.

    logits (R, T, V) may be a plain tensor or a DTensor sharded on the vocabulary (Shard(-1)); position t predicts
    token t + 1. Targets outside the ending are ignore_index, and under loss_parallel() each rank all-reduces only
    (R * T)-sized max / sum-exp / target-logit values, never the vocabulary. Ids >= vocab_limit are left out of the
    softmax (mask_vocab). Returns (sum_loss (R,), mean_loss (R,)) as plain float tensors.
    """
    target = torch.full_like(tokens, -100)  # (R, T): -100 = ignored
    target[:, :-1] = torch.where(mask[:, 1:].bool(), tokens[:, 1:], -100)
    logits = mask_vocab(logits.float(), vocab_limit)
    with loss_parallel() if isinstance(logits, DTensor) else nullcontext():
        losses = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")  # (R * T,)
    if isinstance(losses, DTensor):
        losses = losses.full_tensor()  # replicated over TP: no communication
    losses = losses.view(tokens.shape)
    n = (target != -100).sum(dim=1)
    sum_loss = losses.sum(dim=1)
    return sum_loss, sum_loss / n.clamp_min(1)


def predict(sum_loss: torch.Tensor, mean_loss: torch.Tensor) -> tuple[int, int]:
    """(pred, pred_norm): the ending with the lowest summed loss (acc) and the lowest mean loss (acc_norm)."""
    return int(sum_loss.argmin()), int(mean_loss.argmin())


@torch.no_grad()
def evaluate(
    model,
    examples: list[dict],
    *,
    block_size: int,
    batch_size: int = 4,
    tp: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
    dp_group=None,
    device: torch.device | str = "cpu",
    forward_context=nullcontext,
    pad_to: int = 1,
    details: bool = False,
    enc=None,
    vocab_limit: int | None = -1,
) -> dict:
    """Score `examples` with model(idx (B, T)) -> logits (B, T, V) (plain or vocab-sharded DTensor).

    This DP rank scores examples dp_rank, dp_rank + dp, ... in batches of `batch_size` examples (4 rows each);
    counts are summed over dp_group (None: the default group) when dp_size > 1. Rows are padded to a multiple of
    lcm(tp, pad_to). Logits of ids >= vocab_limit are masked (-1: the tokenizer's size, 50257; None: keep all).
    Every token id must have an embedding row (gpt_tp.data.check_token_ids against the model's vocab_size, where
    it has a config). Call it on every rank of the job: all take part in every forward's collectives.
    Returns {"acc", "acc_norm", "correct", "correct_norm", "total", "truncated"} (the totals are global), plus
    "examples" (this rank's per-example index, label, sum/mean losses, pred, pred_norm) with details=True.
    """
    if batch_size < 1:
        raise HellaSwagError(f"batch_size={batch_size} must be >= 1")
    enc = enc or get_encoding()
    vocab_limit = enc.n_vocab if vocab_limit == -1 else vocab_limit
    vocab_size = getattr(config_of(model), "vocab_size", enc.n_vocab)
    multiple = math.lcm(tp, pad_to)
    max_len = block_size - block_size % tp  # sequence parallelism: T % tp == 0
    mine = list(range(dp_rank, len(examples), dp_size))
    n_batches = math.ceil(math.ceil(len(examples) / dp_size) / batch_size)  # the same on every DP rank
    counts = torch.zeros(4, dtype=torch.long)  # correct, correct_norm, total, truncated
    out = []
    for b in range(n_batches):
        idx = mine[b * batch_size : (b + 1) * batch_size]
        weight = 1
        if not idx:  # this rank ran out: repeat a batch for the collectives, count nothing
            idx, weight = [mine[0] if mine else 0], 0
        rows, masks, labels, cuts = [], [], [], []
        for i in idx:
            r, m, label = render_example(examples[i], enc)
            for k, row in enumerate(r):
                check_token_ids(row, vocab_size, f"HellaSwag example {i}, ending {k}")
            r, m, cut = fit_rows(r, m, max_len)
            rows += r
            masks += m
            labels.append(label)
            cuts.append(cut)
        tokens, mask = pad_batch(rows, masks, multiple, max_len)
        tokens, mask = tokens.to(device), mask.to(device)
        with forward_context():
            logits = model(tokens)
        sum_loss, mean_loss = ending_losses(logits, tokens, mask, vocab_limit)
        sum_loss, mean_loss = sum_loss.view(-1, 4).cpu(), mean_loss.view(-1, 4).cpu()
        for j, i in enumerate(idx):
            pred, pred_norm = predict(sum_loss[j], mean_loss[j])
            counts += weight * torch.tensor([pred == labels[j], pred_norm == labels[j], 1, cuts[j]])
            if details and weight:
                out.append({"index": i, "label": labels[j], "pred": pred, "pred_norm": pred_norm,
                            "sum_loss": sum_loss[j].tolist(), "mean_loss": mean_loss[j].tolist()})
    if dp_size > 1:
        counts = counts.to(device)
        dist.all_reduce(counts, group=dp_group)  # DP group only: a TP group scored the same examples
        counts = counts.cpu()
    correct, correct_norm, total, truncated = counts.tolist()
    if total != len(examples):
        raise RuntimeError(f"HellaSwag counted {total} examples, expected {len(examples)}: the DP rank/size passed do not match the job")
    res = {"acc": correct / total, "acc_norm": correct_norm / total, "correct": correct,
           "correct_norm": correct_norm, "total": total, "truncated": truncated}
    if details:
        res["examples"] = out
    return res


# ---------------------------------------------------------------------------------------------------------
# Lightning


def parallel_layout(trainer, pl_module) -> tuple[int, int, int, object]:
    """(tp, dp_rank, dp_size, dp_group) of this process: ModelParallelStrategy's mesh, else every process is a
    data-parallel replica (DDP-like strategies), else one process."""
    from gpt_tp.train.ranks import data_parallel_rank_size

    mesh = getattr(pl_module, "device_mesh", None)
    if mesh is not None:
        dp_mesh = mesh["data_parallel"]
        return mesh["tensor_parallel"].size(), dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group()
    rank, size = data_parallel_rank_size(trainer)
    return 1, rank, size, None


def config_of(model):
    """The GPTConfig of a GPT, of a GPTModule (its .model) or of anything with a .config; None without one."""
    return getattr(getattr(model, "model", model), "config", None) or getattr(model, "config", None)


def block_size_of(pl_module) -> int:
    cfg = config_of(pl_module)
    if cfg is None:
        raise ValueError("HellaSwagCallback needs the model's block_size: pl_module.model.config.block_size or pl_module.config.block_size")
    return cfg.block_size


def log_to_loggers(trainer, metrics: dict[str, float], step: int) -> None:
    """Write metrics straight to the trainer's loggers at `step` (rank 0, its failure raised on every rank; works in
    hooks where self.log cannot, and whatever log_every_n_steps is). Call on every rank."""

    def write():
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            logger.save()

    one_does(write, doer=trainer.global_rank == 0)


class HellaSwagCallback(Callback):
    """HellaSwag acc_norm / acc every `every_n_steps` optimizer steps and at the end of fit, logged as
    hellaswag/acc_norm and hellaswag/acc (and put in trainer.callback_metrics).

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
        if every_n_steps < 0:
            raise HellaSwagError(f"HellaSwagCallback every_n_steps={every_n_steps} must be >= 0 (0: only at the end of fit)")
        if limit is not None and limit < 1:
            raise HellaSwagError(f"HellaSwagCallback limit={limit} must be >= 1, or null for every example")
        if batch_size < 1 or pad_to < 1:
            raise HellaSwagError(f"HellaSwagCallback batch_size={batch_size} and pad_to={pad_to} must be >= 1")
        self.path, self.cache_dir, self.every_n_steps, self.limit = path, cache_dir, every_n_steps, limit
        self.batch_size, self.pad_to = batch_size, pad_to
        self.examples: list[dict] | None = None
        self.history: list[tuple[int, dict]] = []  # (step, result) of every evaluation on this rank
        self._last_step = -1

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage not in ("fit", "validate") or self.examples is not None:
            return
        # one process per node downloads (the cache dir may be node-local); a failure ends every rank with it
        one_does(lambda: resolve_path(self.path, self.cache_dir), doer=trainer.local_rank == 0)
        self.examples = read_examples(resolve_path(self.path, self.cache_dir), self.limit)

    def run(self, trainer, pl_module) -> dict:
        """Evaluate now (on every rank), log on rank 0, return the result."""
        tp, dp_rank, dp_size, dp_group = parallel_layout(trainer, pl_module)
        was_training = pl_module.training
        pl_module.eval()
        try:
            res = evaluate(pl_module, self.examples, block_size=block_size_of(pl_module), batch_size=self.batch_size,
                           tp=tp, dp_rank=dp_rank, dp_size=dp_size, dp_group=dp_group, device=pl_module.device,
                           forward_context=trainer.precision_plugin.forward_context, pad_to=self.pad_to)
        finally:
            pl_module.train(was_training)
        step = trainer.global_step
        metrics = {"hellaswag/acc_norm": res["acc_norm"], "hellaswag/acc": res["acc"]}
        log_to_loggers(trainer, metrics, step)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        self.history.append((step, res))
        self._last_step = step
        if trainer.global_rank == 0:
            print(f"step {step}: HellaSwag acc_norm {res['correct_norm']}/{res['total']} = {res['acc_norm']:.4f}, "
                  f"acc {res['acc']:.4f}" + (f" ({res['truncated']} truncated to block_size)" if res["truncated"] else ""), flush=True)
        return res

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._last_step:
            self.run(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        """`python cli.py validate` evaluates HellaSwag beside the val loss (fit's validations leave it to every_n_steps)."""
        if trainer.state.fn == "validate":
            self.run(trainer, pl_module)


# ---------------------------------------------------------------------------------------------------------
# command line: evaluate weights alone


def load_model(args):
    """A GPT from --hf-dir, --ckpt_path (a Lightning checkpoint of GPTModule: a distributed checkpoint folder, as
    ModelParallelStrategy saves, or a single .ckpt file) or --model (random init)."""
    from gpt_tp.model import GPT, GPTConfig, load_hf_dir

    torch.manual_seed(args.seed)
    if args.hf_dir:
        config, sd = load_hf_dir(args.hf_dir)
    elif args.ckpt_path:
        p = Path(args.ckpt_path)
        if p.is_dir():  # a distributed checkpoint (ModelParallelStrategy): consolidated in this one process
            from gpt_tp.train.checkpoint import CheckpointError, load_consolidated

            try:
                config, sd = load_consolidated(p)
            except CheckpointError as e:
                raise HellaSwagError(str(e)) from e
            model = GPT(config)
            model.load_state_dict(sd)
            model.tie_weights()
            return model
        if not p.is_file():
            raise HellaSwagError(f"--ckpt_path {p} not found: give a Lightning checkpoint (.ckpt file or distributed checkpoint folder)")
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same mistake
            raise HellaSwagError(f"--ckpt_path {p} is not a readable checkpoint ({type(e).__name__}: {e})") from e
        if "state_dict" not in ckpt:
            raise HellaSwagError(f"{p} has no 'state_dict': not a Lightning checkpoint of GPTModule")
        config = GPTConfig.resolve(ckpt.get("hyper_parameters", {}).get("model", "gpt2"))
        sd = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    else:
        config, sd = GPTConfig.from_name(args.model), None
    model = GPT(config)
    if sd is not None:
        model.load_state_dict(sd)
        model.tie_weights()
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m gpt_tp.eval.hellaswag", description="HellaSwag val accuracy of GPT-2 weights (build-nanogpt's scoring).")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--hf-dir", help="Hugging Face GPT-2 directory (config.json + model.safetensors)")
    src.add_argument("--ckpt_path", help="Lightning checkpoint of GPTModule: distributed checkpoint folder (any TP/DP layout) or .ckpt file")
    src.add_argument("--model", default="tiny", help="random init of a named size (smoke test), default tiny")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--path", help="local hellaswag_val.jsonl (default: download into --cache-dir)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--limit", type=int, help="score only the first N examples")
    ap.add_argument("--batch-size", type=int, default=4, help="examples per forward")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel degree under torchrun (default: all processes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="autocast dtype on CUDA")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        raise HellaSwagError(f"--batch-size={args.batch_size} must be >= 1")
    if args.out and Path(args.out).is_dir():
        raise HellaSwagError(f"--out {args.out} is a folder; give the name of a file for the JSON result")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, dp_rank, dp_size, dp_group, mesh = 1, 0, 1, None, None
    device = torch.device(args.device)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        tp = args.tp or world
        if world % tp:
            raise HellaSwagError(f"--tp {tp} must divide the number of processes {world}: pass a divisor of {world}")
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
        dp_rank, dp_size, dp_group = mesh["data_parallel"].get_local_rank(), world // tp, mesh["data_parallel"].get_group()
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    # one process per node downloads, before the other ranks read; a failure ends every rank with it
    one_does(lambda: resolve_path(args.path, args.cache_dir), doer=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    examples = read_examples(resolve_path(args.path, args.cache_dir), args.limit)
    model = load_model(args).to(device).eval()
    if mesh is not None:
        from gpt_tp.parallel import parallelize

        parallelize(model, mesh)
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.dtype == "bfloat16" else nullcontext
    res = evaluate(model, examples, block_size=model.config.block_size, batch_size=args.batch_size, tp=tp,
                   dp_rank=dp_rank, dp_size=dp_size, dp_group=dp_group, device=device, forward_context=ctx)

    def report():
        print(f"HellaSwag: acc_norm {res['correct_norm']}/{res['total']} = {res['acc_norm']:.4f}, "
              f"acc {res['correct']}/{res['total']} = {res['acc']:.4f}"
              + (f" ({res['truncated']} examples truncated to block_size={model.config.block_size})" if res["truncated"] else ""))
        if args.out:
            Path(args.out).write_text(json.dumps(res))

    one_does(report, doer=rank0)  # a failed write of --out ends every rank with its error
    return res


if __name__ == "__main__":
    from gpt_tp.entry import run

    run(main)

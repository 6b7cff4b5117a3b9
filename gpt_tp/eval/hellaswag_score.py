"""HellaSwag (val) accuracy the build-nanogpt way (acc: lowest summed ending loss; acc_norm: lowest mean), correct
under tensor and data parallelism. Scoring, padding and the counts' sync: docs/eval.md, "HellaSwag"."""

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torchmetrics import Metric

from gpt_tp.data.shards import check_token_ids
from gpt_tp.data.tokenizer import get_encoding
from gpt_tp.eval.hellaswag_data import render_example
from gpt_tp.parallel.loss import mask_padded_vocab, vocab_shard_offset
from gpt_tp.ranks import Layout, model_vocab


def fit_rows(rows: list[list[int]], masks: list[list[int]], max_len: int) -> tuple[list[list[int]], list[list[int]], bool]:
    """Rows and masks left-truncated to max_len (an ending too long loses its first tokens), and whether any was."""
    return [r[-max_len:] for r in rows], [m[-max_len:] for m in masks], any(len(r) > max_len for r in rows)


def pad_batch(rows: list[list[int]], masks: list[list[int]], multiple: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to one length, rounded up to `multiple` (sequence parallelism needs T % tp == 0) and at most
    max_len. Padding is token 0 with mask 0: a causal model's earlier positions cannot see it."""
    T = min(math.ceil(max(len(r) for r in rows) / multiple) * multiple, max_len)
    return tuple(torch.tensor([[*x] + [0] * (T - len(x)) for x in xs], dtype=torch.long)  # (R, T) each
                 for xs in (rows, masks))


def ending_losses(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                  vocab_limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean cross-entropy over each row's masked (ending) tokens, (R,) each. logits (R, T, V) may be a
    DTensor sharded on the vocabulary; position t predicts token t + 1; ids >= vocab_limit are left out."""
    target = torch.full_like(tokens, -100)  # (R, T): -100 = ignored
    target[:, :-1] = torch.where(mask[:, 1:].bool(), tokens[:, 1:], -100)
    logits, flat = logits.float(), target.flatten()  # flat: (R * T,)
    if isinstance(logits, DTensor):
        local = mask_padded_vocab(logits.to_local(), vocab_limit, vocab_shard_offset(logits))  # (R, T, V / tp)
        logits = DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False,
                                    shape=logits.shape, stride=logits.stride())
        with loss_parallel():
            losses = F.cross_entropy(logits.flatten(0, 1), flat, reduction="none")  # (R * T,)
        losses = losses.full_tensor()  # replicated over TP: no communication
    else:
        losses = F.cross_entropy(mask_padded_vocab(logits, vocab_limit).flatten(0, 1), flat, reduction="none")  # (R*T,)
    sum_loss = losses.view(tokens.shape).sum(dim=1)
    return sum_loss, sum_loss / (target != -100).sum(dim=1).clamp_min(1)


class HellaSwagCounts(Metric):
    """Examples scored, right by acc and acc_norm, and truncated: sums synced over the data-parallel process_group."""

    full_state_update = False
    NAMES = ("correct", "correct_norm", "total", "truncated")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for name in self.NAMES:
            self.add_state(name, default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, pred: torch.Tensor, pred_norm: torch.Tensor, label: torch.Tensor, truncated: torch.Tensor) -> None:
        """One entry per example (each (N,)): the acc and acc_norm picks, the label, whether its rows were cut."""
        self.correct += (pred == label).sum().to(self.device)
        self.correct_norm += (pred_norm == label).sum().to(self.device)
        self.total += label.numel()
        self.truncated += truncated.sum().to(self.device)

    def compute(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in self.NAMES}


@torch.no_grad()
def evaluate(model, examples: list[dict], *, block_size: int, batch_size: int = 4, layout: Layout = Layout(1, 1),
             device: torch.device | str = "cpu", forward_context=nullcontext, pad_to: int = 1, details: bool = False,
             enc=None) -> dict:
    """Score `examples` with model(idx (B, T)) -> logits (B, T, V), plain or a vocab-sharded DTensor. Call it on every
    rank of the job (every forward is collective). This DP rank scores examples dp_rank, dp_rank + dp, ... of `layout`;
    counts are summed over its dp_group (None: the default group). Rows are padded to a multiple of lcm(tp, pad_to);
    ids the tokenizer lacks are masked. Returns acc, acc_norm and HellaSwagCounts' global sums; "examples" if details."""
    enc = enc or get_encoding()
    vocab_size = model_vocab(model) or enc.n_vocab
    multiple = math.lcm(layout.tp, pad_to)
    max_len = block_size - block_size % layout.tp  # sequence parallelism: T % tp == 0
    mine = list(range(layout.dp_rank, len(examples), layout.dp))
    n_batches = math.ceil(math.ceil(len(examples) / layout.dp) / batch_size)  # the same on every DP rank
    counts = HellaSwagCounts(process_group=layout.dp_group, sync_on_compute=layout.dp > 1).to(device)
    out = []
    for b in range(n_batches):
        idx = mine[b * batch_size : (b + 1) * batch_size]
        n = len(idx)  # examples this batch counts; none: this rank ran out, so it repeats one for the collectives
        idx = idx or [mine[0] if mine else 0]
        rows, masks, labels, cuts = [], [], [], []
        for i in idx:
            r, m, label = render_example(examples[i], enc)
            for k, row in enumerate(r):
                check_token_ids(row, vocab_size, f"HellaSwag example {i}, ending {k}")
            r, m, cut = fit_rows(r, m, max_len)
            rows, masks, labels, cuts = rows + r, masks + m, labels + [label], cuts + [cut]
        tokens, mask = (t.to(device) for t in pad_batch(rows, masks, multiple, max_len))
        with forward_context():
            logits = model(tokens)
        sum_loss, mean_loss = (x.view(-1, 4).cpu() for x in ending_losses(logits, tokens, mask, enc.n_vocab))  # (ex, 4)
        # (n,) each: acc's pick is the ending with the lowest summed loss, acc_norm's the lowest mean loss
        pred, pred_norm = sum_loss[:n].argmin(dim=1), mean_loss[:n].argmin(dim=1)
        counts.update(pred, pred_norm, torch.tensor(labels[:n], dtype=torch.long), torch.tensor(cuts[:n], dtype=torch.long))
        if details:
            out += [{"index": i, "label": labels[j], "pred": int(pred[j]), "pred_norm": int(pred_norm[j]),
                     "sum_loss": sum_loss[j].tolist(), "mean_loss": mean_loss[j].tolist()} for j, i in enumerate(idx[:n])]
    res = counts.compute()
    if res["total"] != len(examples):
        raise RuntimeError(f"HellaSwag counted {res['total']} examples, expected {len(examples)}: the DP rank/size passed do not match the job")
    res = {"acc": res["correct"] / res["total"], "acc_norm": res["correct_norm"] / res["total"], **res}
    return {**res, "examples": out} if details else res

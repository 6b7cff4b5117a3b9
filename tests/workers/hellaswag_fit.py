"""Under torchrun: a tiny Lightning fit (ModelParallelStrategy, TP=2 or DP x TP) with HellaSwagCallback and
TextSampleCallback attached, then a single-device check of the final weights on rank 0.

Writes <out>.json on rank 0: each rank's callback history (gathered), the logged callback_metrics, the CSV logger's
metrics.csv path, and the single-device HellaSwag result and text samples of the gathered final weights.
Failure injection (tests/test_rank_failures.py): --hellaswag-cache DIR downloads HellaSwag into DIR instead of using
the fixture; --break NAME puts a folder where rank 0 writes the log dir's file NAME (e.g. samples.txt).
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

from gpt_tp.data.tokenizer import get_encoding
from gpt_tp.entry import run
from gpt_tp.eval.hellaswag import HellaSwagCallback
from gpt_tp.eval.hellaswag_data import read_examples
from gpt_tp.eval.hellaswag_score import evaluate
from gpt_tp.infer.sampling import TextSampleCallback
from gpt_tp.infer.sampling import sample_texts
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.train.module import GPTModule
from synthetic_data import SyntheticDataModule

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hellaswag_small.jsonl"


def recorded(cb):
    """cb, keeping (step, result) of each of its runs on this rank in cb.history."""
    cb.history, run_once = [], cb.run

    def run_and_keep(trainer, pl_module):
        result = run_once(trainer, pl_module)
        cb.history.append((trainer.global_step, result))
        return result

    cb.run = run_and_keep
    return cb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hellaswag-cache", help="download HellaSwag into this folder (no --path)")
    ap.add_argument("--break", dest="broken", help="a folder of this name in the log dir, where a file belongs")
    args = ap.parse_args()
    if args.broken:  # the CSV logger's version_0 folder, as below
        (Path(args.out + "_logs") / "run" / "version_0" / args.broken).mkdir(parents=True, exist_ok=True)
    source = dict(path=None, cache_dir=args.hellaswag_cache) if args.hellaswag_cache else dict(path=str(FIXTURE))
    hs = recorded(HellaSwagCallback(every_n_steps=2, batch_size=4, **source))
    ts = recorded(TextSampleCallback(every_n_steps=2, num_samples=2, max_length=16, seed=3))
    trainer = L.Trainer(
        accelerator="cpu", devices=args.tp * args.dp, max_steps=args.steps, gradient_clip_val=1.0,
        strategy=ModelParallelStrategy(data_parallel_size=args.dp, tensor_parallel_size=args.tp), inference_mode=False,
        logger=CSVLogger(args.out + "_logs", name="run", version=0), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, val_check_interval=2, limit_val_batches=1, log_every_n_steps=1, callbacks=[hs, ts],
    )
    L.seed_everything(1234, verbose=False)
    B, T = 4 // args.dp, 32
    model = GPTModule("tiny", max_lr=3e-3, min_lr=3e-4, warmup_steps=2, max_steps=args.steps, total_batch_size=4 * T)
    trainer.fit(model, SyntheticDataModule(batch_size=B, seq_len=T, vocab=1024, seed=7))

    trainer.save_checkpoint(args.out + "_ckpt")  # a distributed checkpoint folder, for the command line
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.model.state_dict().items()}
    histories = [None] * dist.get_world_size()
    dist.all_gather_object(histories, {"hs": hs.history, "ts": ts.history})
    log_dir = trainer.log_dir  # a broadcast inside: every rank asks
    if trainer.global_rank != 0:
        return
    ref = GPT(GPTConfig.from_name("tiny"))
    ref.load_state_dict(full)
    ref.tie_weights()
    ref.eval()
    enc = get_encoding()
    single = evaluate(ref, read_examples(FIXTURE), block_size=128, batch_size=3, details=True, enc=enc)
    samples = sample_texts(ref, enc, ts.prompt, num_samples=2, max_length=16, seed=3, block_size=128)
    res = {
        "histories": histories,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("hellaswag/")},
        "metrics_csv": str(Path(log_dir) / "metrics.csv"),
        "samples_txt": str(Path(log_dir) / "samples.txt"),
        "single": single,
        "single_samples": samples,
        "global_step": trainer.global_step,
        "ckpt": args.out + "_ckpt",
    }
    with open(args.out + ".json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)

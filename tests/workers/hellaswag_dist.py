"""Run under torchrun (gloo, CPU): HellaSwag scoring and text sampling on a (dp, tp) mesh vs a single-device copy.

Every rank builds the tiny GPT from one seed, parallelizes a deep copy on the mesh, and evaluates the fixture
both ways: the parallel model on this rank's DP share (batch_size 5 on 11 examples makes DP rank 1 run a padding
forward), the reference on everything. A second pass with limit 1 leaves DP rank 1 with no example at all.
With --sample it also samples (--sample-only: nothing else) from both models with the same seed. Writes <out>.<rank>.json.
"""

import argparse
import copy
import json
import os
from pathlib import Path

import torch
from torch.distributed.tensor.debug import CommDebugMode

from gpt_tp.data.tokenizer import get_encoding
from gpt_tp.entry import run, torchrun_mesh
from gpt_tp.eval.hellaswag_data import read_examples, render_example
from gpt_tp.eval.hellaswag_score import ending_losses, evaluate, pad_batch
from gpt_tp.infer.sampling import sample_texts
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.parallel import parallelize
from gpt_tp.ranks import layout_of

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hellaswag_small.jsonl"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--sample", action="store_true", help="also sample text from both models")
    ap.add_argument("--sample-only", action="store_true", help="only sample text (no HellaSwag)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dp, tp = args.dp, int(os.environ["WORLD_SIZE"]) // args.dp
    mesh, _ = torchrun_mesh(dp, tp, "cpu")
    rank = mesh.get_rank()
    layout = layout_of(mesh=mesh)

    torch.manual_seed(1234)
    config = GPTConfig.from_name("tiny")
    ref = GPT(config).eval()
    model = parallelize(copy.deepcopy(ref), mesh).eval()
    enc = get_encoding()
    examples = read_examples(FIXTURE)
    res = {"rank": rank, "dp_rank": layout.dp_rank, "tp_rank": mesh["tensor_parallel"].get_local_rank(), "n": len(examples)}

    if not args.sample_only:
        res.update(score(model, ref, examples, enc, config, tp, layout))
    if args.sample or args.sample_only:
        kw = dict(num_samples=3, max_length=20, seed=7, block_size=config.block_size)
        res["samples"] = sample_texts(model, enc, tp=tp, **kw)
        res["ref_samples"] = sample_texts(ref, enc, **kw)
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump(res, f)


def score(model, ref, examples, enc, config, tp, layout) -> dict:
    res = {}
    res["par"] = evaluate(model, examples, block_size=config.block_size, batch_size=5, details=True, enc=enc, layout=layout)
    res["ref"] = evaluate(ref, examples, block_size=config.block_size, batch_size=5, details=True, enc=enc)
    res["par_one"] = evaluate(model, examples[:1], block_size=config.block_size, batch_size=5, details=True, enc=enc, layout=layout)
    # the collectives of the per-token losses on vocab-sharded logits: all-reduces of (rows, T), no all-gather
    rows, masks, _ = render_example(examples[0], enc)
    tokens, mask = pad_batch(rows, masks, tp, config.block_size)
    with torch.no_grad():
        logits = model(tokens)
        res["logits_type"] = type(logits).__name__
        with CommDebugMode() as comm:
            ending_losses(logits, tokens, mask, enc.n_vocab)
    res["loss_comms"] = {str(k): v for k, v in comm.get_comm_counts().items()}
    return res


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)

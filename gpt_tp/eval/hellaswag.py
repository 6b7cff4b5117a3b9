"""HellaSwag val accuracy during training (HellaSwagCallback) and of saved weights (the command; docs/eval.md)."""

import json
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from gpt_tp.checkpoint import load_model
from gpt_tp.collective import one_does
from gpt_tp.entry import ArgumentParser, pick_device, run, torchrun_mesh
from gpt_tp.eval.hellaswag_data import DEFAULT_CACHE_DIR, HellaSwagError, read_examples, resolve_path
from gpt_tp.eval.hellaswag_score import evaluate
from gpt_tp.infer.sampling import StepCallback
from gpt_tp.model import GPT, GPTConfig, load_hf_dir
from gpt_tp.parallel import parallelize
from gpt_tp.ranks import layout_of, model_config


class HellaSwagCallback(StepCallback):
    """Logs hellaswag/acc_norm and hellaswag/acc every `every_n_steps` optimizer steps and at the end of fit.

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
        super().__init__(every_n_steps)
        if limit is not None and limit < 1:
            raise HellaSwagError(f"HellaSwagCallback limit={limit} must be >= 1, or null for every example")
        if batch_size < 1 or pad_to < 1:
            raise HellaSwagError(f"HellaSwagCallback batch_size={batch_size} and pad_to={pad_to} must be >= 1")
        if path is not None:  # named before any rank starts (a compute node may have no internet to fetch it)
            resolve_path(path)
        self.path, self.cache_dir, self.limit, self.batch_size, self.pad_to = path, cache_dir, limit, batch_size, pad_to
        self.examples: list[dict] | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage not in ("fit", "validate") or self.examples is not None:
            return
        # one process per node downloads (the cache dir may be node-local); a failure ends every rank with it
        one_does(lambda: resolve_path(self.path, self.cache_dir), doer=trainer.local_rank == 0)
        self.examples = read_examples(resolve_path(self.path, self.cache_dir), self.limit)

    def compute(self, trainer, pl_module) -> dict:
        return evaluate(pl_module, self.examples, block_size=model_config(pl_module).block_size, batch_size=self.batch_size,
                        layout=layout_of(trainer, pl_module), device=pl_module.device,
                        forward_context=trainer.precision_plugin.forward_context, pad_to=self.pad_to)

    def run(self, trainer, pl_module) -> dict:
        res = super().run(trainer, pl_module)  # on every rank; rank 0 logs
        step = trainer.global_step
        metrics = {"hellaswag/acc_norm": res["acc_norm"], "hellaswag/acc": res["acc"]}

        def write():  # straight to the loggers: works in hooks where self.log cannot, whatever log_every_n_steps is
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
                logger.save()

        one_does(write, doer=trainer.global_rank == 0)  # rank 0 writes; its failure ends every rank with it
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        if trainer.global_rank == 0:
            print(f"step {step}: HellaSwag acc_norm {res['correct_norm']}/{res['total']} = {res['acc_norm']:.4f}, "
                  f"acc {res['acc']:.4f}" + (f" ({res['truncated']} truncated to block_size)" if res["truncated"] else ""), flush=True)
        return res

    def on_validation_end(self, trainer, pl_module) -> None:
        """`python cli.py validate` evaluates HellaSwag beside the val loss (fit's validations leave it to every_n_steps)."""
        if trainer.state.fn == "validate":
            self.run(trainer, pl_module)


def build_model(args) -> GPT:
    """A GPT from --hf-dir, --ckpt_path (a checkpoint folder, a .ckpt file or an exported model.pt) or --model."""
    torch.manual_seed(1337)  # --model's random init: the same weights every run
    if args.hf_dir:
        config, sd = load_hf_dir(args.hf_dir)
    elif args.ckpt_path:  # a bad one: load_model's CheckpointError names it
        config, sd = load_model(args.ckpt_path)
    else:
        config, sd = GPTConfig.from_name(args.model), None
    model = GPT(config)
    if sd is not None:
        model.load_state_dict(sd)
        model.tie_weights()
    return model


def main(argv=None) -> dict:
    ap = ArgumentParser("python -m gpt_tp.eval.hellaswag", "HellaSwag val accuracy of GPT-2 weights (build-nanogpt's scoring).")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--hf-dir", help="Hugging Face GPT-2 directory (config.json + model.safetensors)")
    src.add_argument("--ckpt_path", help="Lightning checkpoint of GPTModule: distributed checkpoint folder (any TP/DP "
                     "layout) or .ckpt file; or an exported model.pt")
    src.add_argument("--model", default="tiny", help="random init of a named size (smoke test), default tiny")
    ap.add_argument("--path", help="local hellaswag_val.jsonl (default: download into --cache-dir)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--limit", type=int, help="score only the first N examples")
    ap.add_argument("--batch-size", type=int, default=4, help="examples per forward")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel degree under torchrun (default: all processes)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto (default): CUDA when present")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="autocast dtype on CUDA")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        raise HellaSwagError(f"--batch-size={args.batch_size} must be >= 1")
    if args.out and Path(args.out).is_dir():
        raise HellaSwagError(f"--out {args.out} is a folder; give the name of a file for the JSON result")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = args.tp or world
    if tp < 1:
        raise HellaSwagError(f"--tp {tp} must be >= 1")
    mesh = None
    if world > 1 or tp > 1:  # under torchrun: a (data_parallel, tensor_parallel) mesh of world // tp x tp
        mesh, device = torchrun_mesh(max(world // tp, 1), tp, args.device)
    else:
        device = pick_device(args.device)
    model = build_model(args).to(device).eval()  # a wrong weights path is named before any download is tried
    # one process per node downloads, before the other ranks read; a failure ends every rank with it
    one_does(lambda: resolve_path(args.path, args.cache_dir), doer=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    examples = read_examples(resolve_path(args.path, args.cache_dir), args.limit)
    if mesh is not None:
        parallelize(model, mesh)
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.dtype == "bfloat16" else nullcontext
    res = evaluate(model, examples, block_size=model.config.block_size, batch_size=args.batch_size,
                   layout=layout_of(mesh=mesh), device=device, forward_context=ctx)

    def report():
        print(f"HellaSwag: acc_norm {res['correct_norm']}/{res['total']} = {res['acc_norm']:.4f}, "
              f"acc {res['correct']}/{res['total']} = {res['acc']:.4f}"
              + (f" ({res['truncated']} examples truncated to block_size={model.config.block_size})" if res["truncated"] else ""))
        if args.out:
            Path(args.out).write_text(json.dumps(res))

    one_does(report, doer=mesh is None or mesh.get_rank() == 0)  # a failed write of --out ends every rank with its error
    return res


if __name__ == "__main__":
    run(main)

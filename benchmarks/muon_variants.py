"""Do the speedrun's newer Newton-Schulz coefficients (Polar Express) or NorMuon's per-neuron normalisation lower the
val loss at a fixed number of tokens, against torch.optim.Muon's iteration? An experiment, through cli.py, on CPU.

    python -m benchmarks.muon_variants --steps 60 --val-every 20 --out muon_variants

`python cli.py fit` at TP=2 as benchmarks.muon_sweep runs Muon (4 layers, n_embd 256, T 256, micro-batch 4, AdamW's
part at 3e-3), with --model.optimizer benchmarks.muon_variants.Variant: gpt_tp's Muon (momentum, Nesterov, the
rows/cols lr scale, decoupled weight decay, each split matrix owner-computed) whose Newton-Schulz is one of
  torch    torch.optim.Muon's: 5 iterations of (3.4445, -4.7750, 2.0315) after X / ||X||;
  polar    Polar Express (arXiv 2505.16932; modded-nanogpt's 5-iteration schedule), after X / (1.02 ||X||);
  normuon  polar, then NorMuon's normalisation: each neuron's (row's, of a matrix with rows >= cols; else column's)
           update divided by the root of an EMA (beta2 0.95) of its mean square, the matrix's norm kept.
All three run in float32 here, so they differ only in the algorithm. Each variant runs at each --lrs value; the runs
go lr by lr, the variants in turn. Reported: each run's val losses and median step time, and each variant's best.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from benchmarks.muon_sweep import checked, fit_once, run_arguments
from gpt_tp.entry import ArgumentParser, run
from gpt_tp.errors import UserError
from gpt_tp.train.muon import ShardedMuon
from gpt_tp.train.optim import Muon

COEFFICIENTS = {
    "torch": ((3.4445, -4.7750, 2.0315),) * 5,
    "polar": ((8.156554524902461, -22.48329292557795, 15.878769915207462),
              (4.042929935166739, -2.808917465908714, 0.5000178451051316),
              (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
              (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
              (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)),
}
SAFETY = {"torch": 0.0, "polar": 0.02}  # X / (||X|| (1 + safety)) before the first iteration
VARIANTS = ("torch", "polar", "normuon")


def orthogonalize(g: torch.Tensor, coefficients: tuple, safety: float) -> torch.Tensor:
    """The Newton-Schulz iteration on one whole matrix g [rows, cols], in float32."""
    flip = g.shape[0] > g.shape[1]
    x = (g.T if flip else g).float()  # [short, long]
    x = x / (x.norm() * (1 + safety)).clamp(min=1e-7)
    for a, b, c in coefficients:
        gram = x @ x.T  # [short, short]
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if flip else x  # [rows, cols]


def normalize_neurons(v: torch.Tensor, second: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon: v [rows, cols] with each neuron scaled by 1 / sqrt(EMA of its mean square) (`second`, updated in
    place: [rows, 1] or [1, cols]), then rescaled to v's Frobenius norm."""
    dim = -1 if v.shape[0] >= v.shape[1] else -2
    second.lerp_(v.square().mean(dim=dim, keepdim=True), 1 - beta2)
    scaled = v * second.clamp(min=1e-10).rsqrt()
    return scaled * (v.norm() / scaled.norm().clamp(min=1e-10))


class VariantMuon(ShardedMuon):
    """ShardedMuon whose Newton-Schulz is `variant`'s; every split matrix is owner-computed, so each call sees whole
    matrices. NorMuon's second moments live on each matrix's owner (not saved: the experiment saves no checkpoint)."""

    def __init__(self, params, variant: str, **kwargs):
        super().__init__(params, ns_dtype=torch.float32, scheme="owner", **kwargs)
        self.variant, self.second = variant, {}

    def _newton_schulz(self, ps: list, xs: list) -> list:
        if any(p not in self.owners and self.layouts[p].scheme != "local" for p in ps):
            raise UserError("benchmarks.muon_variants: a matrix is not owner-computed")
        name = "polar" if self.variant == "normuon" else self.variant
        out = [orthogonalize(x, COEFFICIENTS[name], SAFETY[name]) for x in xs]
        if self.variant == "normuon":
            for i, (p, v) in enumerate(zip(ps, out)):
                shape = (v.shape[0], 1) if v.shape[0] >= v.shape[1] else (1, v.shape[1])
                out[i] = normalize_neurons(v, self.second.setdefault(p, v.new_zeros(shape)), 0.95)
        return out


@dataclass(frozen=True)
class Variant(Muon):
    """gpt_tp's Muon with another Newton-Schulz (VARIANTS): --model.optimizer benchmarks.muon_variants.Variant."""

    variant: str = "torch"

    @property
    def kind(self) -> str:  # its state is Muon's, for gpt_tp.sizing
        return "muon"

    def build(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        if self.variant not in VARIANTS:
            raise UserError(f"model.optimizer.variant={self.variant!r}: use one of {', '.join(VARIANTS)}")
        muon = super().build(model, lr)
        return VariantMuon(muon.param_groups, self.variant, lr=lr)


def measure(args) -> list[dict]:
    runs = []
    for lr in args.lrs:
        for variant in VARIANTS:
            spec = {"class_path": "benchmarks.muon_variants.Variant", "init_args": {"lr": lr, "variant": variant}}
            r = fit_once(args, "muon", lr, Path(args.out) / f"{variant}_{lr:g}", spec=spec) | {"variant": variant}
            runs.append(r)
            print(f"{variant} lr {lr:g}: val {r['val']}, median step {r['median_step_s']:.3f} s", file=sys.stderr,
                  flush=True)
    return runs


def markdown(runs: list[dict]) -> str:
    steps = sorted(runs[0]["val"])
    best = {v: min((r for r in runs if r["variant"] == v), key=lambda r: r["val"][steps[-1]]) for v in VARIANTS}
    lines = ["| variant | lr | " + " | ".join(f"val @ {s}" for s in steps) + " | median step s |",
             "|---|---|" + "---|" * (len(steps) + 1)]
    for r in runs:
        mark = " (best)" if r is best[r["variant"]] else ""
        lines.append(f"| {r['variant']}{mark} | {r['lr']:g} | " + " | ".join(f"{r['val'][s]:.3f}" for s in steps)
                     + f" | {r['median_step_s']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser("python -m benchmarks.muon_variants", __doc__)
    run_arguments(ap, steps=60, val_every=20)
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.02, 0.05], help="Muon's lr sweep")
    ap.add_argument("--out", default="muon_variants", help="folder for the runs' configs, logs and muon_variants.json")
    args = checked(ap.parse_args(argv))
    runs = measure(args)
    Path(args.out, "muon_variants.json").write_text(json.dumps(runs, indent=1))
    print(markdown(runs))
    return 0


if __name__ == "__main__":
    run(main)

r"""Benchmark: what a training step costs per layout (DP x TP), plan, precision and compile setting, and why.

    python -m benchmarks.bench --model gpt2 --layouts 1x1,1x2,2x2 --precision bf16-mixed --compile off,on \
        --batch-size 16 --seq-len 1024 --out bench_out
    python -m benchmarks.bench --model gpt2 --layouts 1x2 --compile off \
        --plan gpt_tp.parallel:TP_PLAN,benchmarks.plans:overlap2 --out bench_out/overlap

Every run is one torchrun job of dp x tp processes (benchmarks.bench_worker) training on generated tokens:
`--warmup` steps, then `--steps` timed ones. Each step is the training step without Lightning
(benchmarks.step.train_step: forward, vocab-parallel cross-entropy, backward, the flat sequence-partial gradient
all-reduce, grad-norm clipping at 1.0, fused AdamW) with no host sync inside; the step time is the slowest rank's.
One more step runs under a benchmarks.collectives.CollectiveRecorder, which records every collective with its
size. Reported per run: tokens/s (global batch / median step time), step time min/median/max, MFU
(GPTConfig.flops_per_token over the device's peak, gpt_tp.hardware), peak memory per rank (CUDA
max_memory_allocated on GPU, max RSS on CPU) and the collectives per step by mesh dim and kind with bytes (the
rows benchmarks.collectives.step_collectives models for gpt_tp's plan). Written to <out>/bench.md, <out>/bench.json
and <out>/bench.png.

Layouts are DPxTP: "1x2" is TP=2, "2x1" is DP=2 (FSDP2), "2x2" both. --batch-size is the micro-batch per
data-parallel rank, so every layout gives each TP group the same work. --plan takes module:attribute plans (a dict
of module path -> ParallelStyle, as for python -m benchmarks.paritycheck --plan), default gpt_tp's TP_PLAN;
the plans of benchmarks/plans.py that overlap their collectives (overlap2, overlap3) run eager only.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.step import runs
from gpt_tp.entry import ArgumentParser
from gpt_tp.entry import run as run_command
from gpt_tp.errors import UserError
from benchmarks.paritycheck import load_plan
from gpt_tp.hardware import PEAK_FLOPS, detect_peak_flops
from gpt_tp.model import SIZES, GPTConfig
from gpt_tp.sizing import LayoutError, validate_layout
from gpt_tp.sizing.sizes import PRECISIONS

ROOT = Path(__file__).resolve().parents[1]  # the repository, on the workers' PYTHONPATH
GPT_TP_PLAN = "gpt_tp.parallel:TP_PLAN"


class BenchError(UserError):
    """A bad flag; the message says what to change."""


def resolve_peak_flops(peak_flops: float | None, gpu: str | None, device: torch.device) -> float | None:
    """Peak FLOP/s per device for MFU: --peak-flops, else PEAK_FLOPS[--gpu], else detected (None on CPU)."""
    if peak_flops is not None and not peak_flops > 0:
        raise UserError(f"--peak-flops={peak_flops} must be > 0 (FLOP/s per device, e.g. 989e12 for an H100)")
    if peak_flops is None and gpu is not None and gpu not in PEAK_FLOPS:
        raise UserError(f"--gpu={gpu!r} is not known; choose one of {', '.join(PEAK_FLOPS)} or give --peak-flops")
    return peak_flops or PEAK_FLOPS.get(gpu) or detect_peak_flops(device)


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        parts = item.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise BenchError(f"--layouts: {item!r} is not DPxTP (e.g. 1x1 for one device, 1x2 for TP=2, 2x2 for DP=2 x TP=2)")
        out.append((int(parts[0]), int(parts[1])))
    return out


def parse_onoff(text: str, flag: str) -> list[bool]:
    vals = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}
    out = []
    for item in text.split(","):
        if item.strip().lower() not in vals:
            raise BenchError(f"{flag}: {item!r} is not on/off (give e.g. 'off' or 'off,on')")
        out.append(vals[item.strip().lower()])
    return out


def config_from_args(args) -> GPTConfig:
    if args.model not in SIZES:
        raise BenchError(f"--model={args.model!r} is unknown; choose one of {', '.join(SIZES)}")
    overrides = {k: v for k, v in (("n_layer", args.layers), ("block_size", args.block_size)) if v is not None}
    config = GPTConfig.from_name(args.model, **overrides)
    if args.seq_len is None:
        args.seq_len = min(256, config.block_size)
    if args.seq_len > config.block_size:
        raise BenchError(f"--seq-len={args.seq_len} exceeds the model's block_size={config.block_size}; lower --seq-len")
    return config


def specs_from_args(args) -> list[dict]:
    """Validate every flag and return one spec per run (layout x plan x precision x compile)."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device=cuda but torch sees no CUDA GPU; use --device cpu")
    config = config_from_args(args)
    layouts = parse_layouts(args.layouts)
    precisions = [p.strip() for p in args.precision.split(",")]
    for p in precisions:
        if not runs(p):
            raise BenchError(f"--precision: {p!r} is not one the benchmark step runs: "
                             f"{', '.join(q for q in PRECISIONS if runs(q))}")
    plans = [p.strip() for p in args.plan.split(",")]
    for p in plans:
        load_plan(p, config)  # one error line for a plan that does not load
    compiles = parse_onoff(args.compile, "--compile")
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1 or args.seq_len < 1 or args.threads < 1:
        raise BenchError("--steps, --batch-size, --seq-len and --threads must be >= 1 and --warmup >= 0")
    peak = resolve_peak_flops(args.peak_flops, args.gpu, torch.device(device))
    for dp, tp in layouts:
        try:
            validate_layout(config, tp=tp, dp=dp, seq_len=args.seq_len)
        except LayoutError as e:
            raise BenchError(f"--layouts {dp}x{tp}: {e}") from None
        if device == "cuda" and dp * tp > torch.cuda.device_count():
            raise BenchError(f"--layouts {dp}x{tp} needs {dp * tp} GPUs, this machine has {torch.cuda.device_count()}")
    specs = []
    for dp, tp in layouts:
        for plan in plans:
            for precision in precisions:
                for comp in compiles:
                    name = (f"dp{dp}xtp{tp}{'' if plan == GPT_TP_PLAN else ' ' + plan} {precision}"
                            f"{' compile' if comp else ''}{' muon' if args.optimizer == 'muon' else ''}")
                    specs.append(dict(
                        name=name, dp=dp, tp=tp, plan=plan, precision=precision, compile=comp,
                        device=device, threads=args.threads, model=args.model,
                        config=asdict(config), batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                        warmup=args.warmup, seed=args.seed, peak_flops=peak, optimizer=args.optimizer,
                    ))
    return specs


def launch(spec: dict, workdir: Path, timeout: float) -> dict:
    """Run one spec as a torchrun job of dp x tp processes; return its result or {'error': ...}.

    The result file rank 0 writes is the result, whatever torchrun's exit status: a process that aborts while
    exiting after it was written (see gpt_tp.entry) loses no measurement; the status is kept in 'exit_note'.
    Without a result, the error is the one each failed worker wrote (benchmarks.bench_worker), else torchrun's."""
    nproc = spec["dp"] * spec["tp"]
    safe = spec["name"].replace(" ", "_").replace(":", "_")
    workdir = workdir.resolve()
    spec = {**spec, "result": str(workdir / f"{safe}.json")}
    result = Path(spec["result"])
    for stale in [result, *_error_files(result)]:  # left by an earlier bench into the same --out
        stale.unlink(missing_ok=True)
    spec_file = workdir / f"{safe}.spec.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "benchmarks.bench_worker", str(spec_file)]
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    # a session of its own, so that a timeout (or Ctrl-C) stops torchrun and all its workers
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as e:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            return {**spec, "error": f"timed out after {timeout:.0f}s (raise --timeout or lower --steps)"}
        raise
    if result.exists():
        out = json.loads(result.read_text())
        if proc.returncode != 0:
            out["exit_note"] = f"torchrun exited {proc.returncode} after the result was written: {_torchrun_reason(stderr)}"
        return out
    errors = list(dict.fromkeys(f.read_text().strip() for f in _error_files(result)))
    if errors:
        return {**spec, "error": "; ".join(errors)[:500]}
    return {**spec, "error": f"no result, torchrun exited {proc.returncode}: {_torchrun_reason(stderr or stdout)}"[:500]}


def _error_files(result: Path) -> list[Path]:
    """The error each failed worker wrote (benchmarks.bench_worker), by rank."""
    files = result.parent.glob(f"{result.name}.rank*.error")
    return sorted(files, key=lambda f: int(f.name.rsplit(".rank", 1)[1].split(".")[0]))


def _torchrun_reason(text: str) -> str:
    """What torchrun's failure report says about the first failed worker ('traceback : Signal 6 (SIGABRT) ...'),
    or the last line of the output."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    reasons = [l.split(":", 1)[1].strip() for l in lines if l.startswith(("traceback :", "exitcode  :"))]
    useful = [r for r in reasons if not r.startswith("To enable traceback")]
    return ", ".join(useful[:2]) if useful else (lines[-1] if lines else "no output")


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def collectives_text(colls) -> str:
    if isinstance(colls, dict):
        return colls.get("error", "?")
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A", "broadcast": "BC"}
    dims = {"tensor_parallel": "TP", "data_parallel": "DP"}
    return "; ".join(f"{dims.get(c['dim'], c['dim'])} {short.get(c['kind'], c['kind'])} {c['count']}x {_mb(c['bytes'])}"
                     for c in colls) or "none"


def markdown(results: list[dict]) -> str:
    head = ("| run | tokens/s | step ms min / median / max | MFU | peak mem/rank (max) | collectives per step "
            "(count, full-tensor bytes) |\n|---|---:|---|---:|---:|---|\n")
    rows = []
    for r in results:
        if "error" in r:
            rows.append(f"| {r['name']} | failed: {r['error']} | | | | |")
            continue
        s = r["step_time_s"]
        m = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        rows.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {1e3 * s['min']:.1f} / {1e3 * s['median']:.1f} / "
                    f"{1e3 * s['max']:.1f} | {m} | {_mb(max(r['peak_memory_bytes']))} | {collectives_text(r['collectives'])} |")
    return head + "\n".join(rows) + "\n"


def chart(results: list[dict], path: Path, title: str) -> None:
    """Bars of tokens/s per run with the step-time spread as error bars, MFU written on the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(ok) + 2), 4))
    names = [r["name"].replace(" ", "\n") for r in ok]
    tok = [r["tokens_per_s"] for r in ok]
    # tokens/s at the fastest and slowest step around the median
    lo = [t - r["tokens_per_step"] / r["step_time_s"]["max"] for t, r in zip(tok, ok)]
    hi = [r["tokens_per_step"] / r["step_time_s"]["min"] - t for t, r in zip(tok, ok)]
    bars = ax.bar(range(len(ok)), tok, yerr=[lo, hi], capsize=4, color="tab:blue")
    for b, r in zip(bars, ok):
        if r["mfu"] is not None:
            ax.annotate(f"MFU {100 * r['mfu']:.0f}%", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(ok)), names, fontsize=8)
    ax.set_ylabel("tokens / s (median step; bars: fastest / slowest step)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_all(args) -> list[dict]:
    specs = specs_from_args(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out={out} is a file; give a directory")
    work = out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in specs:
        print(f"[bench] {spec['name']}: {spec['dp'] * spec['tp']} process(es) ...", flush=True)
        r = launch(spec, work, args.timeout)
        print(f"[bench] {spec['name']}: " + (f"failed: {r['error']}" if "error" in r else
              f"{r['tokens_per_s']:,.0f} tok/s, median step {1e3 * r['step_time_s']['median']:.1f} ms"
              + (f" ({r['exit_note']})" if "exit_note" in r else "")), flush=True)
        results.append(r)
    first = specs[0]
    title = (f"{first['model']} B={first['batch_size']} T={first['seq_len']} on {first['device']}"
             + (f" ({first['threads']} thread/process)" if first["device"] == "cpu" else ""))
    md = f"### {title}\n\n" + markdown(results)
    (out / "bench.md").write_text(md)
    (out / "bench.json").write_text(json.dumps({"title": title, "runs": results}, indent=1))
    chart(results, out / "bench.png", title)
    print(md)
    print(f"[bench] wrote {out / 'bench.md'}, {out / 'bench.json'}, {out / 'bench.png'}")
    return results


def parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m benchmarks.bench", description=__doc__)
    ap.add_argument("--model", default="gpt2", help=f"model size: {', '.join(SIZES)} (default gpt2, 124M)")
    ap.add_argument("--layers", type=int, help="override the number of blocks (quick runs)")
    ap.add_argument("--block-size", type=int, help="override block_size")
    ap.add_argument("--layouts", default="1x1,1x2", help="comma-separated DPxTP layouts (default 1x1,1x2)")
    ap.add_argument("--plan", default=GPT_TP_PLAN, help="comma-separated module:attribute plans (default "
                    f"{GPT_TP_PLAN}; e.g. benchmarks.plans:overlap2, eager only)")
    ap.add_argument("--precision", default=None, help="comma-separated, from "
                    f"{', '.join(p for p in PRECISIONS if runs(p))} (default bf16-mixed on GPU, 32-true on CPU)")
    ap.add_argument("--compile", default="off", help="torch.compile per block: off, on or off,on (default off)")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"), help="adamw (default) or muon: model.optimizer AdamW or Muon; "
                    "muon also reports the Newton-Schulz share of the step")
    ap.add_argument("--batch-size", type=int, default=4, help="micro-batch rows per data-parallel rank (default 4)")
    ap.add_argument("--seq-len", type=int, help="tokens per row (default 256, or the model's block_size if smaller)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10); the median is reported")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3; more with compile)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per process (default 1)")
    ap.add_argument("--peak-flops", type=float, help="peak FLOP/s per device for MFU (overrides --gpu)")
    ap.add_argument("--gpu", help=f"take the peak from a known GPU: {', '.join(PEAK_FLOPS)} (default: detect on CUDA)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is stopped (default 1800)")
    ap.add_argument("--out", default="bench_out", help="directory for bench.md, bench.json, bench.png")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "32-true"
    results = run_all(args)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    run_command(main)

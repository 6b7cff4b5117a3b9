"""A first-order cost model: when does tensor parallelism pay?

    python -m benchmarks.costmodel                       # anchor check + the table for GPT-2 sizes and links
    python -m benchmarks.costmodel --bench bench_out/bench.json --link nvlink-h100   # measured bytes, other links

It prices gpt_tp's own step (sequence-parallel TP, FSDP2) on a dp x tp layout: its collectives are
benchmarks.collectives.step_collectives, the list the benchmark and the audit measure byte for byte.
Step time = compute + exposed communication.
- compute: flops_per_token(T) x tokens on this rank's TP group / (peak x MFU), divided by tp (each rank does
  1/tp of every matmul). MFU at TP=1 is calibrated from a measured single-device figure; `tp_efficiency` < 1
  models smaller matmuls and duplicated work at tp > 1.
- tensor-parallel collectives sit on the critical path (each block waits for its all-gather): fully exposed,
  the backward all-gathers of the column-parallel inputs too, which the code issues before a matmul (an upper
  bound on their cost).
- data-parallel collectives (FSDP2's all-gathers and reduce-scatters) overlap with compute; only what exceeds
  the overlappable compute is exposed.
- a collective over a tensor of N bytes on p ranks sends (p-1)/p N per rank (ring all-gather / reduce-scatter),
  twice that for an all-reduce (benchmarks.collectives.wire_bytes); at a link's bus bandwidth (LINKS)
  plus a fixed latency per collective.
- memory per GPU: the planner's memory model (gpt_tp.sizing.memory), with its overhead and fit rule.
"""

import json
from dataclasses import dataclass

from benchmarks.collectives import DP, TP, step_collectives
from gpt_tp.entry import ArgumentParser, run
from gpt_tp.errors import UserError
from gpt_tp.hardware import GIB, PEAK_FLOPS
from gpt_tp.model import GPTConfig
from gpt_tp.sizing import fits, memory_per_device
from gpt_tp.sizing.memory import USABLE_FRACTION


class CostModelError(UserError):
    """A bad flag or bench file; the message says what to change."""


@dataclass(frozen=True)
class Link:
    """An interconnect: bus bandwidth per direction per GPU (nccl-tests' busbw) and a per-collective latency."""

    name: str
    bandwidth: float  # bytes/s
    latency: float = 10e-6  # s per collective


# Nominal per-direction bandwidth x 0.8, the fraction NCCL typically reaches (nccl-tests busbw).
LINKS = {
    "nvlink-h100": Link("NVLink 4, H100/H200 SXM (450 GB/s nominal)", 0.8 * 450e9),
    "nvlink-a100": Link("NVLink 3, A100 SXM (300 GB/s nominal)", 0.8 * 300e9),
    "nvlink-3090": Link("NVLink bridge, RTX 3090 (4 x 14 GB/s = 56 GB/s nominal)", 0.8 * 56.25e9),
    "pcie5": Link("PCIe 5.0 x16 (64 GB/s nominal)", 0.8 * 64e9, 20e-6),
    "pcie4": Link("PCIe 4.0 x16 (32 GB/s nominal)", 0.8 * 32e9, 20e-6),
    "pcie3": Link("PCIe 3.0 x16 (16 GB/s nominal)", 0.8 * 16e9, 20e-6),
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s (50 GB/s nominal)", 0.8 * 50e9, 30e-6),
    "ib-hdr": Link("InfiniBand HDR 200 Gb/s (25 GB/s nominal)", 0.8 * 25e9, 30e-6),
}


# Measured anchor: build-nanogpt's GPT-2 124M, B=16, T=1024, bf16, on NVLinked RTX 3090s. Its DP x2 is DDP (the
# gradients all-reduced, overlapped with backward as FSDP2's collectives are); its TP x2 is Megatron TP without
# sequence parallelism, with the logits gathered to every rank. The model prices gpt_tp's step at the same layouts,
# so the TP efficiency the measured TP x2 implies (anchor_check) also absorbs the bytes that plan moves beyond it.
ANCHOR = dict(gpu="3090", link="nvlink-3090", batch_size=16, seq_len=1024,
              tokens_per_s={"1 GPU": 66.5e3, "DP x2": 132e3, "TP x2": 70.5e3})


def comm_seconds(collectives: list[dict], link: Link, dim: str | None = None) -> float:
    """Time of the listed collectives (optionally one mesh dim's) on a link: wire bytes / bandwidth + latency."""
    rows = [c for c in collectives if dim is None or c["dim"] == dim]
    return sum(c["wire_bytes"] / link.bandwidth + c["count"] * link.latency for c in rows)


def step_time(config: GPTConfig, batch_size: int, seq_len: int, dp: int, tp: int, link: Link, peak_flops: float,
              mfu: float, precision: str = "bf16-mixed", tp_efficiency: float = 1.0, dp_overlap: float = 1.0) -> dict:
    """Predicted step time and tokens/s of gpt_tp's step on a dp x tp layout, with the collectives it prices
    (benchmarks.collectives.step_collectives). batch_size is per data-parallel rank."""
    colls = step_collectives(config, batch_size, seq_len, dp, tp, precision)
    tokens = batch_size * seq_len  # per TP group
    compute = config.flops_per_token(seq_len) * tokens / (peak_flops * mfu) / tp
    if tp > 1:
        compute /= tp_efficiency
    tp_comm = comm_seconds(colls, link, TP)
    dp_comm = comm_seconds(colls, link, DP)
    exposed_dp = max(0.0, dp_comm - dp_overlap * compute)
    step = compute + tp_comm + exposed_dp
    return {
        "dp": dp, "tp": tp, "collectives": colls, "compute_s": compute, "tp_comm_s": tp_comm, "dp_comm_s": dp_comm,
        "exposed_comm_s": tp_comm + exposed_dp, "step_s": step, "tokens_per_s": tokens * dp / step,
        "tp_wire_bytes": sum(c["wire_bytes"] for c in colls if c["dim"] == TP),
    }


# ---------------------------------------------------------------------------------------------------------------
# The anchor check and the tables


def anchor_check(tp_efficiency: float = 1.0) -> dict:
    """Calibrate MFU on the 1-GPU anchor, then predict DP x2 and TP x2 on the 3090 NVLink bridge and over PCIe 4.
    Also: the tp_efficiency at which TP x2 is as slow as the anchor's measured TP x2, and TP x2 over PCIe at it."""
    a = ANCHOR
    config, B, T = GPTConfig.from_name("gpt2"), a["batch_size"], a["seq_len"]
    peak, link, pcie = PEAK_FLOPS[a["gpu"]], LINKS[a["link"]], LINKS["pcie4"]
    mfu1 = a["tokens_per_s"]["1 GPU"] * config.flops_per_token(T) / peak
    kw = dict(config=config, batch_size=B, seq_len=T, peak_flops=peak, mfu=mfu1)
    pred = {
        "1 GPU": step_time(dp=1, tp=1, link=link, **kw),
        "DP x2": step_time(dp=2, tp=1, link=link, **kw),
        "TP x2": step_time(dp=1, tp=2, link=link, tp_efficiency=tp_efficiency, **kw),
        "TP x2 over PCIe 4": step_time(dp=1, tp=2, link=pcie, tp_efficiency=tp_efficiency, **kw),
        "DP x2 over PCIe 4": step_time(dp=2, tp=1, link=pcie, **kw),
    }
    # the tp_efficiency at which the TP x2 prediction meets the measured figure
    tp2 = pred["TP x2"]
    target_step = B * T / a["tokens_per_s"]["TP x2"]
    implied = (tp2["compute_s"] * tp_efficiency) / max(1e-9, target_step - tp2["tp_comm_s"])
    pred["TP x2 over PCIe 4, at that efficiency"] = step_time(
        dp=1, tp=2, link=pcie, tp_efficiency=implied * tp_efficiency, **kw)
    return {"mfu_1gpu": mfu1, "predicted": pred, "measured": a["tokens_per_s"], "implied_tp_efficiency": implied}


# (label, gpu, link, single-device MFU, memory per GPU in GiB)
SYSTEMS = [
    ("H100 SXM, NVLink", "H100", "nvlink-h100", 0.5, 80),
    ("H100 PCIe", "H100 PCIe", "pcie5", 0.5, 80),
    ("RTX 3090, NVLink bridge", "3090", "nvlink-3090", 0.8, 24),
    ("RTX 3090, PCIe 4", "3090", "pcie4", 0.8, 24),
]


def sizes_table(systems=SYSTEMS, batch_size: int = 16, seq_len: int = 1024) -> list[dict]:
    """Per GPT-2 size and system, 2 GPUs as DP=2 (FSDP2) or as TP=2: tokens/s, TP's share of the step, and memory
    per GPU (the planner's, bf16-mixed) against the device's. MFU 0.8 on the 3090 is the anchor's; 0.5 on H100 is a
    typical figure."""
    rows = []
    for size in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        config = GPTConfig.from_name(size)
        dp2_mem = memory_per_device(config, 2, 1, batch_size, seq_len, "bf16-mixed")
        tp2_mem = memory_per_device(config, 1, 2, batch_size, seq_len, "bf16-mixed")
        for label, gpu, ln, mfu, gib in systems:
            kw = dict(config=config, batch_size=batch_size, seq_len=seq_len, link=LINKS[ln], peak_flops=PEAK_FLOPS[gpu], mfu=mfu)
            one, dp2, tp2 = step_time(dp=1, tp=1, **kw), step_time(dp=2, tp=1, **kw), step_time(dp=1, tp=2, **kw)
            rows.append({
                "model": size, "system": label, "1gpu_tok_s": one["tokens_per_s"], "dp2_tok_s": dp2["tokens_per_s"],
                "tp2_tok_s": tp2["tokens_per_s"], "tp2_comm_share": tp2["tp_comm_s"] / tp2["step_s"],
                "tp2_per_gpu_tok_s_vs_1gpu": tp2["tokens_per_s"] / 2 / one["tokens_per_s"],
                "dp2_mem_gib": dp2_mem.total / GIB, "tp2_mem_gib": tp2_mem.total / GIB,
                "dp2_fits": fits(dp2_mem, gib), "tp2_fits": fits(tp2_mem, gib), "usable_gib": USABLE_FRACTION * gib,
            })
    return rows


def _k(x: float) -> str:
    return f"{x / 1e3:,.1f}k"


def anchor_markdown(res: dict) -> str:
    out = ["| layout (GPT-2 124M, B=16, T=1024, bf16, RTX 3090) | measured tok/s | predicted tok/s | compute ms | "
           "exposed comm ms | TP wire MB/step |", "|---|---:|---:|---:|---:|---:|"]
    for name, p in res["predicted"].items():
        m = res["measured"].get(name)
        out.append(f"| {name} | {_k(m) if m else '-'} | {_k(p['tokens_per_s'])} | {1e3 * p['compute_s']:.0f} | "
                   f"{1e3 * p['exposed_comm_s']:.0f} | {p['tp_wire_bytes'] / 1e6:.0f} |")
    peak = PEAK_FLOPS[ANCHOR["gpu"]]
    out.append(f"\nPredicted: gpt_tp's step (FSDP2, sequence-parallel TP). Measured: build-nanogpt (DDP; TP without sequence "
               f"parallelism, logits gathered). MFU calibrated on the 1-GPU figure: {100 * res['mfu_1gpu']:.0f}% of "
               f"{peak / 1e12:g} TFLOP/s. The measured TP x2 needs a TP compute efficiency of "
               f"{res['implied_tp_efficiency']:.2f} on top of gpt_tp's communication to be as slow as it was.")
    return "\n".join(out) + "\n"


def sizes_markdown(rows: list[dict]) -> str:
    out = ["| model | system | 1 GPU tok/s | DP=2 tok/s | TP=2 tok/s | TP comm share of step | TP=2 per GPU vs 1 GPU | "
           "memory/GPU DP=2 / TP=2 (GiB) |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fit = lambda gib, ok: f"{gib:.1f}" + ("" if ok else f" > {r['usable_gib']:.1f}")  # noqa: E731
        out.append(f"| {r['model']} | {r['system']} | {_k(r['1gpu_tok_s'])} | {_k(r['dp2_tok_s'])} | {_k(r['tp2_tok_s'])} | "
                   f"{100 * r['tp2_comm_share']:.0f}% | {r['tp2_per_gpu_tok_s_vs_1gpu']:.2f} | "
                   f"{fit(r['dp2_mem_gib'], r['dp2_fits'])} / {fit(r['tp2_mem_gib'], r['tp2_fits'])} |")
    out.append("\nB=16 per replica, T=1024, bf16-mixed, gpt_tp's step (DP: FSDP2; TP: sequence-parallel plan). MFU 0.8 on "
               "the 3090 (the anchor's 1-GPU figure), 0.5 on H100. Memory: the planner's estimate (python -m gpt_tp.cli.planner) with its "
               f"overhead; 'N > M' marks a layout that needs N GiB, more than the M GiB it may use ({USABLE_FRACTION:.0%} of the GPU).")
    return "\n".join(out) + "\n"


def bench_markdown(bench: dict, link: Link) -> str:
    """Communication time of each measured run's collectives on another link."""
    out = [f"| run | TP wire MB/step | DP wire MB/step | comm ms on {link.name} | measured step ms |", "|---|---:|---:|---:|---:|"]
    for r in bench["runs"]:
        if "error" in r or not isinstance(r.get("collectives"), list):
            continue
        c = r["collectives"]
        wire = lambda d: sum(x["wire_bytes"] for x in c if x["dim"] == d) / 1e6  # noqa: E731
        out.append(f"| {r['name']} | {wire(TP):.1f} | {wire(DP):.1f} | "
                   f"{1e3 * comm_seconds(c, link):.2f} | {1e3 * r['step_time_s']['median']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m benchmarks.costmodel", description=__doc__)
    ap.add_argument("--bench", help="a bench.json from python -m benchmarks.bench: price its measured collectives")
    ap.add_argument("--link", help=f"with --bench: the link to price its runs on, one of {', '.join(LINKS)} "
                    "(default nvlink-h100)")
    args = ap.parse_args(argv)
    if args.link is not None and args.link not in LINKS:
        raise CostModelError(f"unknown --link {args.link!r}; choose from {', '.join(LINKS)}")
    if args.bench:
        try:
            with open(args.bench) as f:
                bench = json.load(f)
            print(bench_markdown(bench, LINKS[args.link or "nvlink-h100"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CostModelError(f"--bench={args.bench}: not a bench.json from python -m benchmarks.bench ({e})") from None
        return 0
    if args.link is not None:
        raise CostModelError(f"--link {args.link} prices the runs of --bench; give --bench bench_out/bench.json "
                             "(the tables without --bench use the links of their systems)")
    print("## Anchor: build-nanogpt on NVLinked RTX 3090s\n")
    print(anchor_markdown(anchor_check()))
    print("## GPT-2 sizes, 2 GPUs: DP=2 vs TP=2\n")
    print(sizes_markdown(sizes_table()))
    return 0


if __name__ == "__main__":
    run(main)

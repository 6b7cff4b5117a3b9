"""A first-order cost model: when does tensor parallelism pay?

    python -m gpt_tp.perf.costmodel                       # anchor check + the table for GPT-2 sizes and links
    python -m gpt_tp.perf.costmodel --bench bench_out/bench.json --link nvlink-h100   # measured bytes, other links

Step time = compute + exposed communication.
- compute: flops_per_token(T) x tokens on this rank's TP group / (peak x MFU), divided by tp (each rank does
  1/tp of every matmul). MFU at TP=1 is calibrated from a measured single-device figure; `tp_efficiency` < 1
  models smaller matmuls and duplicated work at tp > 1.
- tensor-parallel collectives sit on the critical path (each block waits for its all-gather): fully exposed.
- data-parallel collectives (DDP's gradient all-reduce, FSDP's all-gathers and reduce-scatters) overlap with
  compute; only what exceeds the overlappable compute is exposed.
- a collective over a tensor of N bytes on p ranks sends (p-1)/p N per rank (ring all-gather / reduce-scatter),
  twice that for an all-reduce; at a link's bus bandwidth plus a fixed latency per collective.

The collective list for gpt_tp's plan (`step_collectives`) is derived by hand below and is the one the
benchmark measures (tests/test_costmodel.py compares them byte for byte).
"""

import argparse
import json
from dataclasses import dataclass

from gpt_tp.errors import UserError
from gpt_tp.model import GPTConfig
from gpt_tp.hardware import PEAK_FLOPS


class CostModelError(UserError):
    """A bad flag or bench file; the message says what to change."""


@dataclass(frozen=True)
class Link:
    """An interconnect: effective bus bandwidth per direction per GPU (what nccl-tests reports as busbw) and a
    per-collective latency."""

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

# The seed user's figures: build-nanogpt GPT-2 124M, B=16, T=1024, bf16, NVLinked RTX 3090s.
ANCHOR = dict(gpu="3090", link="nvlink-3090", batch_size=16, seq_len=1024,
              tokens_per_s={"1 GPU": 66.5e3, "DDP x2": 132e3, "TP x2 (naive)": 70.5e3})


def wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes each rank sends (ring): (p-1)/p N for all-gather / reduce-scatter, 2 (p-1)/p N for all-reduce."""
    if group_size <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (group_size - 1) / group_size * nbytes


def _coll(dim: str, kind: str, p: int, count: int, nbytes: float) -> dict:
    return {"dim": dim, "kind": kind, "group_size": p, "count": count, "bytes": int(nbytes),
            "wire_bytes": wire_bytes(kind, nbytes, p) if count else 0.0}


def _merge(rows: list[dict]) -> list[dict]:
    out: dict = {}
    for r in rows:
        if r["count"] == 0:
            continue
        m = out.setdefault((r["dim"], r["kind"]), {**r, "count": 0, "bytes": 0, "wire_bytes": 0.0})
        m["count"] += r["count"]
        m["bytes"] += r["bytes"]
        m["wire_bytes"] += r["wire_bytes"]
    return sorted(out.values(), key=lambda r: (r["dim"], r["kind"]))


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


def local_param_counts(config: GPTConfig, tp: int) -> tuple[int, int]:
    """(elements per block, elements in the root: wte, wpe, ln_f) this TP rank holds under TP_PLAN."""
    C = config.n_embd
    block = (3 * C * C + 3 * C) // tp + C * C // tp + C + 4 * C + (4 * C * C + 4 * C) // tp + 4 * C * C // tp + C
    root = config.vocab_size * C // tp + config.block_size * C + 2 * C
    return block, root


def fsdp_shard_bytes(config: GPTConfig, tp: int, dp: int, dtype_bytes: int = 4) -> tuple[int, int]:
    """Bytes of one block's and of the root's all-gathered parameters under FSDP2 (each local tensor padded
    along dim 0 to a multiple of dp)."""
    C, V = config.n_embd, config.vocab_size
    block_shapes = [(3 * C // tp, C), (3 * C // tp, 1), (C, C // tp), (C, 1), (C, 1), (C, 1), (C, 1), (C, 1),
                    (4 * C // tp, C), (4 * C // tp, 1), (C, 4 * C // tp), (C, 1)]
    root_shapes = [(V // tp, C), (config.block_size, C), (C, 1), (C, 1)]
    size = lambda shapes: sum(_ceil_to(r, dp) * c for r, c in shapes) * dtype_bytes  # noqa: E731
    return size(block_shapes), size(root_shapes)


def step_collectives(config: GPTConfig, batch_size: int, seq_len: int, dp: int = 1, tp: int = 1,
                     precision: str = "32-true", plan: str = "sp", dp_mode: str = "fsdp") -> list[dict]:
    """Collectives of one training step per (mesh dim, kind): count, full-tensor bytes, wire bytes per rank.

    plan="sp" is gpt_tp's TP_PLAN (Megatron sequence parallelism), exactly as the benchmark measures it:
      per block, forward: all-gather of the LayerNorm output before attention and before the MLP, reduce-scatter
        of c_proj's output after each; backward: the conjugates. Under bf16 autocast LayerNorm outputs float32,
        but the plan casts it to bf16 before the gather (gpt_tp.parallel.GatherInput), so the forward all-gathers
        (and their backward reduce-scatters) move 2-byte elements, as do the c_proj outputs. The token embedding
        (float32, not autocast) reduce-scatters into the stream (fwd) and
        all-gathers its gradient (bwd); ln_f's output is all-gathered for lm_head (fwd), reduce-scattered (bwd).
      cross-entropy (gpt_tp.parallel.loss, vocab-parallel): 2 all-reduces in float32: the max (B x T values), then the
        sum of exps and the target logit together (2 B x T values).
      replicated parameters (wpe, LayerNorms): their float32 gradients are per-rank partial sums, summed in one
        all-reduce over TP (at DP > 1 after FSDP2's reduce-scatter, so each rank sends its DP shard).
    plan="megatron": tensor parallelism without sequence parallelism: per block 2 all-reduces forward and 2
      backward of the bf16/fp32 activations (the same wire bytes as the all-gather + reduce-scatter pairs),
      replicated LayerNorm work, no replicated-gradient reduction.
    plan="naive": "megatron" plus lm_head's logits gathered to every rank (output_layouts=Replicate()), the
      obvious first attempt: B x T x vocab floats per step.
    dp_mode="fsdp" (gpt_tp, FSDP2; under bf16-mixed its MixedPrecisionPolicy gathers bf16 parameters and
      reduce-scatters float32 gradients): per block all-gather forward, all-gather again in backward (resharded
      after forward), reduce-scatter of the gradients; the root (embeddings, ln_f) is gathered once. dp_mode="ddp": one all-reduce of all float32 gradients (bucketed).
    """
    for name, val, ok in (("plan", plan, ("sp", "megatron", "naive")), ("dp_mode", dp_mode, ("fsdp", "ddp")),
                          ("precision", precision, ("32-true", "bf16-mixed"))):
        if val not in ok:
            raise ValueError(f"{name}={val!r}: choose one of {', '.join(ok)}")
    L, C, V = config.n_layer, config.n_embd, config.vocab_size
    B, T = batch_size, seq_len
    act = B * T * C
    mm = 2 if precision == "bf16-mixed" else 4  # matmul outputs under autocast
    ln = mm  # LayerNorm outputs are cast to the autocast dtype before they are gathered (ln_1, ln_2, ln_f)
    # parameters compute in bf16 when FSDP2 gathers them so (bf16-mixed, DP > 1): the embedding's output then has
    # 2-byte elements
    emb = mm if dp > 1 and dp_mode == "fsdp" else 4
    rows = []
    if tp > 1:
        TPd = "tensor_parallel"
        if plan == "sp":
            rows += [
                _coll(TPd, "all_gather", tp, 2 * L + 1, (2 * L + 1) * act * ln),  # fwd: ln_1, ln_2 per block, ln_f
                _coll(TPd, "all_gather", tp, 2 * L + 1, 2 * L * act * mm + act * emb),  # bwd: of c_proj RS, of wte RS
                _coll(TPd, "reduce_scatter", tp, 2 * L + 1, 2 * L * act * mm + act * emb),  # fwd: c_proj x 2, wte
                _coll(TPd, "reduce_scatter", tp, 2 * L + 1, (2 * L + 1) * act * ln),  # bwd: of the gathers
            ]
            # wpe + LayerNorm weights and biases, this rank's FSDP2 shard of each (dim 0 split into ceil(n / dp))
            replicated = -(-config.block_size // dp) * C + 2 * (2 * L + 1) * -(-C // dp)
            rows.append(_coll(TPd, "all_reduce", tp, 1, replicated * 4))
        else:
            # per block 2 fwd + 2 bwd all-reduces; the embedding's output (fwd) and lm_head's input grad (bwd)
            rows.append(_coll(TPd, "all_reduce", tp, 4 * L + 2, 4 * L * act * mm + 2 * act * 4))
            if plan == "naive":
                rows.append(_coll(TPd, "all_gather", tp, 1, B * T * V * mm))
        if plan != "naive":
            rows.append(_coll(TPd, "all_reduce", tp, 2, B * T * 12))  # vocab-parallel cross-entropy
    if dp > 1:
        DPd = "data_parallel"
        if dp_mode == "fsdp":
            block, root = fsdp_shard_bytes(config, tp, dp)  # float32 gradients reduce-scattered
            gblock, groot = fsdp_shard_bytes(config, tp, dp, mm)  # parameters gathered in bf16 under bf16-mixed
            rows += [
                _coll(DPd, "all_gather", dp, 2 * L + 1, 2 * L * gblock + groot),
                _coll(DPd, "reduce_scatter", dp, L + 1, L * block + root),
            ]
        else:
            block, root = local_param_counts(config, tp)
            rows.append(_coll(DPd, "all_reduce", dp, 1, (L * block + root) * 4))
    if dp * tp > 1:  # grad norm (gpt_tp.parallel.clip_grad_norm): one float32 all-reduced over the whole mesh
        rows.append(_coll("world" if dp > 1 and tp > 1 else "data_parallel" if dp > 1 else "tensor_parallel", "all_reduce", dp * tp, 1, 4))
    return _merge(rows)


def comm_seconds(collectives: list[dict], link: Link, dim: str | None = None) -> float:
    """Time of the listed collectives (optionally one mesh dim's) on a link: wire bytes / bandwidth + latency."""
    rows = [c for c in collectives if dim is None or c["dim"] == dim]
    return sum(c["wire_bytes"] / link.bandwidth + c["count"] * link.latency for c in rows)


def state_bytes_per_rank(config: GPTConfig, dp: int, tp: int, dp_mode: str = "fsdp") -> float:
    """Parameters + gradients + AdamW moments, float32 (16 bytes per parameter): split by tp, and by dp under FSDP."""
    block, root = local_param_counts(config, tp)
    n = config.n_layer * block + root
    return 16 * n / (dp if dp_mode == "fsdp" else 1)


def activation_bytes_per_rank(config: GPTConfig, batch_size: int, seq_len: int, tp: int, plan: str = "sp") -> float:
    """Rough bf16 activation memory with flash attention: ~34 B T C bytes per block (Korthikanti et al. 2022),
    split by tp under sequence parallelism (about 24/34 of it without), plus the logits (bf16 + float32 loss)."""
    per_block = 34 * batch_size * seq_len * config.n_embd
    split = per_block / tp if plan == "sp" else per_block * (10 + 24 / tp) / 34
    logits = 6 * batch_size * seq_len * config.vocab_size / (tp if plan != "naive" else 1)
    return config.n_layer * split + logits


def estimate(config: GPTConfig, batch_size: int, seq_len: int, dp: int, tp: int, link: Link, peak_flops: float,
             mfu: float, precision: str = "bf16-mixed", plan: str = "sp", dp_mode: str = "fsdp",
             tp_efficiency: float = 1.0, dp_overlap: float = 1.0) -> dict:
    """Predicted step time and tokens/s of a dp x tp layout. batch_size is per data-parallel rank."""
    colls = step_collectives(config, batch_size, seq_len, dp, tp, precision, plan, dp_mode)
    tokens = batch_size * seq_len  # per TP group
    compute = config.flops_per_token(seq_len) * tokens / (peak_flops * mfu) / tp
    if tp > 1:
        compute /= tp_efficiency
    tp_comm = comm_seconds(colls, link, "tensor_parallel")
    dp_comm = comm_seconds(colls, link, "data_parallel")
    exposed_dp = max(0.0, dp_comm - dp_overlap * compute)
    step = compute + tp_comm + exposed_dp
    return {
        "dp": dp, "tp": tp, "compute_s": compute, "tp_comm_s": tp_comm, "dp_comm_s": dp_comm,
        "exposed_comm_s": tp_comm + exposed_dp, "step_s": step, "tokens_per_s": tokens * dp / step,
        "tp_wire_bytes": sum(c["wire_bytes"] for c in colls if c["dim"] == "tensor_parallel"),
        "memory_bytes": state_bytes_per_rank(config, dp, tp, dp_mode) + activation_bytes_per_rank(config, batch_size, seq_len, tp, plan),
    }


# ---------------------------------------------------------------------------------------------------------------
# The anchor check and the tables


def anchor_check(tp_efficiency: float = 1.0) -> dict:
    """Calibrate MFU on the 1-GPU anchor, then predict DDP x2 and naive TP x2 on the 3090 NVLink bridge.
    Also: the tp_efficiency the measured naive TP figure implies, and TP x2 over PCIe."""
    a = ANCHOR
    config, B, T = GPTConfig.from_name("gpt2"), a["batch_size"], a["seq_len"]
    peak, link = PEAK_FLOPS[a["gpu"]], LINKS[a["link"]]
    mfu1 = a["tokens_per_s"]["1 GPU"] * config.flops_per_token(T) / peak
    kw = dict(config=config, batch_size=B, seq_len=T, peak_flops=peak, mfu=mfu1)
    pred = {
        "1 GPU": estimate(dp=1, tp=1, link=link, **kw),
        "DDP x2": estimate(dp=2, tp=1, link=link, dp_mode="ddp", **kw),
        "TP x2 (naive)": estimate(dp=1, tp=2, link=link, plan="naive", tp_efficiency=tp_efficiency, **kw),
        "TP x2 (gpt_tp SP)": estimate(dp=1, tp=2, link=link, plan="sp", tp_efficiency=tp_efficiency, **kw),
        "TP x2 (naive) over PCIe 4": estimate(dp=1, tp=2, link=LINKS["pcie4"], plan="naive", tp_efficiency=tp_efficiency, **kw),
        "DDP x2 over PCIe 4": estimate(dp=2, tp=1, link=LINKS["pcie4"], dp_mode="ddp", **kw),
    }
    # tp_efficiency at which the naive TP prediction meets the measured 70.5k tok/s
    naive = pred["TP x2 (naive)"]
    target_step = B * T / a["tokens_per_s"]["TP x2 (naive)"]
    implied = (naive["compute_s"] * tp_efficiency) / max(1e-9, target_step - naive["tp_comm_s"])
    pred["TP x2 (naive) over PCIe 4, at that efficiency"] = estimate(
        dp=1, tp=2, link=LINKS["pcie4"], plan="naive", tp_efficiency=implied * tp_efficiency, **kw)
    return {"mfu_1gpu": mfu1, "predicted": pred, "measured": a["tokens_per_s"], "implied_naive_tp_efficiency": implied}


# (label, gpu, link, single-device MFU, memory per GPU in bytes)
SYSTEMS = [
    ("H100 SXM, NVLink", "H100", "nvlink-h100", 0.5, 80e9),
    ("H100 PCIe", "H100", "pcie5", 0.5, 80e9),
    ("RTX 3090, NVLink bridge", "3090", "nvlink-3090", 0.8, 24e9),
    ("RTX 3090, PCIe 4", "3090", "pcie4", 0.8, 24e9),
]


def sizes_table(systems=SYSTEMS, batch_size: int = 16, seq_len: int = 1024) -> list[dict]:
    """Per GPT-2 size and system: 2 GPUs as DDP vs TP=2 (gpt_tp's SP plan): tokens/s, TP comm share, and memory
    per GPU against the device's. MFU 0.8 on the 3090 is the anchor's; 0.5 on H100 is a typical figure."""
    rows = []
    for size in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        config = GPTConfig.from_name(size)
        for label, gpu, ln, mfu, mem in systems:
            kw = dict(config=config, batch_size=batch_size, seq_len=seq_len, link=LINKS[ln], peak_flops=PEAK_FLOPS[gpu], mfu=mfu)
            one = estimate(dp=1, tp=1, **kw)
            ddp = estimate(dp=2, tp=1, dp_mode="ddp", **kw)
            tp2 = estimate(dp=1, tp=2, **kw)
            rows.append({
                "model": size, "system": label, "1gpu_tok_s": one["tokens_per_s"], "ddp2_tok_s": ddp["tokens_per_s"],
                "tp2_tok_s": tp2["tokens_per_s"], "tp2_comm_share": tp2["tp_comm_s"] / tp2["step_s"],
                "tp2_per_gpu_tok_s_vs_1gpu": tp2["tokens_per_s"] / 2 / one["tokens_per_s"],
                "ddp_mem_gb": ddp["memory_bytes"] / 1e9, "tp2_mem_gb": tp2["memory_bytes"] / 1e9,
                "ddp_fits": ddp["memory_bytes"] <= mem, "tp2_fits": tp2["memory_bytes"] <= mem, "gpu_mem_gb": mem / 1e9,
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
    out.append(f"\nMFU calibrated on the 1-GPU figure: {100 * res['mfu_1gpu']:.0f}% of 71 TFLOP/s. The measured naive "
               f"TP x2 needs a TP compute efficiency of {res['implied_naive_tp_efficiency']:.2f} on top of its "
               f"communication to be as slow as it was.")
    return "\n".join(out) + "\n"


def sizes_markdown(rows: list[dict]) -> str:
    out = ["| model | system | 1 GPU tok/s | DDP x2 tok/s | TP=2 tok/s | TP comm share of step | TP=2 per GPU vs 1 GPU | "
           "memory/GPU DDP / TP=2 (GB) |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fit = lambda gb, ok: f"{gb:.1f}" + ("" if ok else f" > {r['gpu_mem_gb']:g}")  # noqa: E731
        out.append(f"| {r['model']} | {r['system']} | {_k(r['1gpu_tok_s'])} | {_k(r['ddp2_tok_s'])} | {_k(r['tp2_tok_s'])} | "
                   f"{100 * r['tp2_comm_share']:.0f}% | {r['tp2_per_gpu_tok_s_vs_1gpu']:.2f} | "
                   f"{fit(r['ddp_mem_gb'], r['ddp_fits'])} / {fit(r['tp2_mem_gb'], r['tp2_fits'])} |")
    out.append("\nB=16 per replica, T=1024, bf16, gpt_tp's sequence-parallel plan. MFU 0.8 on the 3090 (the anchor's "
               "1-GPU figure), 0.5 on H100. Memory: float32 params + grads + AdamW + rough bf16 activations; "
               "'N > 24' marks a layout that needs N GB, more than the GPU holds.")
    return "\n".join(out) + "\n"


def bench_markdown(bench: dict, link: Link) -> str:
    """Communication time of each measured run's collectives on another link."""
    out = [f"| run | TP wire MB/step | DP wire MB/step | comm ms on {link.name} | measured step ms |", "|---|---:|---:|---:|---:|"]
    for r in bench["runs"]:
        if "error" in r or not isinstance(r.get("collectives"), list):
            continue
        c = r["collectives"]
        wire = lambda d: sum(x["wire_bytes"] for x in c if x["dim"] == d) / 1e6  # noqa: E731
        out.append(f"| {r['name']} | {wire('tensor_parallel'):.1f} | {wire('data_parallel'):.1f} | "
                   f"{1e3 * comm_seconds(c, link):.2f} | {1e3 * r['step_time_s']['median']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpt_tp.perf.costmodel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", help="a bench.json from python -m gpt_tp.perf.bench: price its measured collectives")
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
            raise CostModelError(f"--bench={args.bench}: not a bench.json from python -m gpt_tp.perf.bench ({e})") from None
        return 0
    if args.link is not None:
        raise CostModelError(f"--link {args.link} prices the runs of --bench; give --bench bench_out/bench.json "
                             "(the tables without --bench use the links of their systems)")
    print("## Anchor: build-nanogpt on NVLinked RTX 3090s\n")
    print(anchor_markdown(anchor_check()))
    print("## GPT-2 sizes, 2 GPUs: DDP vs TP=2\n")
    print(sizes_markdown(sizes_table()))
    return 0


if __name__ == "__main__":
    from gpt_tp.entry import run

    run(main)

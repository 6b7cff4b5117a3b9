"""The one table of accelerator figures: dense bf16 peak FLOP/s per device (for MFU and the cost model) and the
links between devices (for the cost model), with the detection of the device this process runs on."""

from dataclasses import dataclass

import torch

from gpt_tp.errors import UserError

GIB = 1024**3

# matched against torch.cuda.get_device_name()
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "3090": 71e12, "4090": 165e12, "A6000": 155e12}


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


def detect_peak_flops(device: torch.device) -> float | None:
    """The PEAK_FLOPS entry whose name is in the CUDA device's name; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def resolve_peak_flops(peak_flops: float | None, gpu: str | None, device: torch.device) -> float | None:
    """Peak FLOP/s per device for MFU: --peak-flops, else PEAK_FLOPS[--gpu], else detected (None on CPU)."""
    if peak_flops is not None and not peak_flops > 0:
        raise UserError(f"--peak-flops={peak_flops} must be > 0 (FLOP/s per device, e.g. 989e12 for an H100)")
    if peak_flops is None and gpu is not None and gpu not in PEAK_FLOPS:
        raise UserError(f"--gpu={gpu!r} is not known; choose one of {', '.join(PEAK_FLOPS)} or give --peak-flops")
    return peak_flops or PEAK_FLOPS.get(gpu) or detect_peak_flops(device)


def detect_device_memory_gib() -> float | None:
    """Memory of CUDA device 0 in GiB, or None without CUDA."""
    return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None


def check_peak_flops(peak_flops: float | None) -> None:
    """model.peak_flops, when given, is a positive FLOP/s figure (None: detected for known GPUs)."""
    if peak_flops is not None and not peak_flops > 0:
        raise UserError(f"model.peak_flops={peak_flops} must be > 0 (the device's peak FLOP/s), or null to detect it")


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: flops_per_token (GPTConfig.flops_per_token) x tokens/s over devices x peak."""
    return flops_per_token * tokens_per_s / (peak_flops * devices) if peak_flops else None

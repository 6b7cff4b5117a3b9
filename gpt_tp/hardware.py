"""Dense bf16 peak FLOP/s per device (for MFU and the cost model), the detection of this process's device, and MFU."""

import re

import torch
from lightning.pytorch.utilities import rank_zero_warn

GIB = 1024**3

# NVIDIA's dense (no sparsity) bf16 tensor-core figures; the first key whose words are all words of
# torch.cuda.get_device_name() matches ("NVIDIA H100 80GB HBM3" is the SXM; "NVIDIA A100-PCIE-40GB" an A100)
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200 NVL": 835e12, "H200": 989e12,
              "GH200": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12,
              "A10": 125e12, "A40": 150e12, "A6000": 155e12, "3090": 71e12, "4090": 165e12}


def detect_peak_flops(device: torch.device) -> float | None:
    """This CUDA device's peak FLOP/s; None on CPU, and on a GPU it does not know, with one line saying what to set."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    words = set(re.split(r"[^A-Z0-9]+", name.upper()))  # matched word by word: an A10 is no A100
    if (peak := next((v for k, v in PEAK_FLOPS.items() if set(k.upper().split()) <= words), None)) is None:
        rank_zero_warn(f"MFU is not reported: gpt_tp has no peak FLOP/s for the {name}; set model.peak_flops (benchmarks: "
                       "--peak-flops) to its dense bf16 FLOP/s per device")
    return peak


def detect_device_memory_gib() -> float | None:
    """Memory of CUDA device 0 in GiB, or None without CUDA."""
    return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: flops_per_token (GPTConfig.flops_per_token) x tokens/s over devices x peak."""
    return flops_per_token * tokens_per_s / (peak_flops * devices) if peak_flops else None

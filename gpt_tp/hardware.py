"""Dense bf16 peak FLOP/s per device (for MFU and the cost model), the detection of the device this process runs on,
and MFU."""

import torch

from gpt_tp.errors import UserError

GIB = 1024**3

# matched against torch.cuda.get_device_name()
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "3090": 71e12, "4090": 165e12, "A6000": 155e12}


def detect_peak_flops(device: torch.device) -> float | None:
    """The PEAK_FLOPS entry whose name is in the CUDA device's name; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


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

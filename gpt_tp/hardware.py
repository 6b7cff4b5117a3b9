"""Accelerator figures: dense bf16 peak FLOP/s per device, for MFU."""

import torch

# matched against torch.cuda.get_device_name()
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "3090": 71e12, "4090": 165e12, "A6000": 155e12}


def detect_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)

"""The peak FLOP/s table (MFU's denominator) by the names torch.cuda.get_device_name() gives."""

import pytest
import torch

from gpt_tp.hardware import detect_peak_flops

NAMES = {  # torch.cuda.get_device_name() -> dense bf16 TFLOP/s
    "NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H100 NVL": 835, "NVIDIA H200": 989,
    "NVIDIA H200 NVL": 835, "NVIDIA GH200 480GB": 989, "NVIDIA A100-SXM4-40GB": 312, "NVIDIA A100-SXM4-80GB": 312,
    "NVIDIA A100-PCIE-40GB": 312, "NVIDIA A100 80GB PCIe": 312, "NVIDIA L4": 121, "NVIDIA L40S": 362, "NVIDIA L40": 181,
    "NVIDIA A10": 125, "NVIDIA A40": 150, "NVIDIA RTX A6000": 155, "NVIDIA GeForce RTX 3090": 71,
    "NVIDIA GeForce RTX 4090": 165,
}


@pytest.mark.parametrize("name", NAMES)
def test_peak_flops_by_device_name(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert detect_peak_flops(torch.device("cuda", 0)) == NAMES[name] * 1e12


def test_unknown_gpu_names_model_peak_flops_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    with pytest.warns(UserWarning) as caught:
        assert detect_peak_flops(torch.device("cuda", 0)) is None
    assert len(caught) == 1 and "NVIDIA A10G" in str(caught[0].message) and "model.peak_flops" in str(caught[0].message)
    assert detect_peak_flops(torch.device("cpu")) is None

"""GPU checks (skipped without CUDA): the same parity as on CPU, on the GPU path (NCCL, bf16, compile, flash SDPA,
and Lightning's inference_mode, which gloo runs never exercise)."""

import pytest
import torch

from conftest import read_json, run_python, run_torchrun

pytestmark = pytest.mark.gpu


def _fit(tmp_path, name, nproc, *args):
    out = str(tmp_path / name)
    if nproc == 1:
        run_python("lightning_fit.py", "--accelerator", "gpu", "--out", out, *args)
    else:
        run_torchrun("lightning_fit.py", nproc, "--accelerator", "gpu", "--out", out, *args)
    return read_json(out + ".json"), torch.load(out + ".pt")


def test_one_gpu_bf16_compiled_trains(tmp_path):
    res, _ = _fit(tmp_path, "gpu1", 1, "--precision", "bf16-mixed", "--compile", "--val-batches", "2")
    losses = [r["train/loss"] for r in res["rows"]]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2 and res["fused"] is True
    assert res["val_loss"] is not None and res["val_loss"] < losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_gpus_matches_one_gpu(tmp_path):
    ref, ref_w = _fit(tmp_path, "one", 1)
    res, w = _fit(tmp_path, "tp2", 2, "--tp", "2", "--val-batches", "2")  # validation on DTensors, inference_mode off
    assert res["val_loss"] is not None
    ref_losses = [r["train/loss"] for r in ref["rows"]]
    assert [r["train/loss"] for r in res["rows"]] == pytest.approx(ref_losses, rel=1e-3)  # TF32 / kernel order
    for k, v in ref_w["init"].items():
        assert torch.equal(w["init"][k], v), k

"""--model.optimizer Muon: torch.optim.Muon's update on the block matrices, sharded over TP and FSDP2, against one device
running torch.optim.Muon itself (tests/workers/muon_parity.py), its communication against gpt_tp.sizing, its
checkpoints (tests/workers/ckpt_fit.py) and its mistakes."""

import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from lightning.pytorch.plugins import MixedPrecision

from conftest import ROOT, WORKERS
from benchmarks import collectives
from gpt_tp.errors import UserError
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.train.module import GPTModule
from gpt_tp.train.optim import Muon, is_muon_weight
from synthetic_data import SyntheticDataModule
from test_checkpoint import check_exact, check_resume_at, check_resumed, exact_resume_args, fits, straight_runs
from test_module import trainer


def test_one_device_is_torch_muon_and_adamw_bit_for_bit():
    """Unsharded, Muon(fused=True).build is torch.optim.Muon on the 8 block matrices (c_attn one
    [3C, C] matrix) plus build-nanogpt's fused AdamW on the rest: the same parameters after 3 steps, to the bit."""
    torch.manual_seed(0)
    ref = GPT(GPTConfig.from_name("tiny"))
    model = copy.deepcopy(ref)
    opt = Muon(fused=True).build(model, 3e-3)
    assert [(len(g["params"]), g["muon"], g["lr"]) for g in opt.param_groups] == [(2, False, 3e-3), (18, False, 3e-3),
                                                                                   (8, True, 0.02)]
    matrices = [p for n, p in ref.named_parameters() if is_muon_weight(n)]
    rest = [p for p in ref.parameters() if all(p is not q for q in matrices)]
    ref_opts = [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
                torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)]
    x = torch.randint(0, 1000, (3, 2, 16))
    for step in range(3):
        for m, opts in ((ref, ref_opts), (model, [opt])):
            F.cross_entropy(m(x[step]).flatten(0, 1), x[step].flatten()).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    torch.manual_seed(0)
    init = GPT(GPTConfig.from_name("tiny"))
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), init.parameters()))  # every one trained
    assert {k for s in opt.state.values() for k in s} == {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}


def test_step_closure_sees_every_group():
    """Lightning's closure zeroes the gradients inside optimizer.step: Muon's as well as AdamW's, so each step's
    gradients are that step's alone."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny"))
    opt = Muon(weight_decay=0.0, lr=0.0).build(model, 6e-4)
    for group in opt.param_groups:
        group["lr"] = 0.0
    x = torch.randint(0, 1000, (2, 16))

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        return loss

    opt.step(closure)
    first = [p.grad.clone() for p in model.parameters()]
    opt.step(closure)  # lr 0: the same parameters, so the same gradients, not their sum
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), first))


@pytest.mark.parametrize("dp,nproc,fp32", [
    (1, 2, False),
    pytest.param(1, 2, True, marks=pytest.mark.slow),
    pytest.param(2, 2, False, marks=pytest.mark.slow),
    pytest.param(2, 2, True, marks=pytest.mark.slow),
    pytest.param(2, 4, False, marks=pytest.mark.slow),
    pytest.param(2, 4, True, marks=pytest.mark.slow),
], ids=["tp2-bf16", "tp2-fp32", "dp2xtp1-bf16", "dp2xtp1-fp32", "dp2xtp2-bf16", "dp2xtp2-fp32"])
def test_sharded_muon_matches_one_device(parity_runs, dp, nproc, fp32):
    """8 steps from the same init and data, clip 1.0 by the global norm, the schedule on both peaks: losses within
    1e-3 relative of one device's torch.optim.Muon with bf16 Newton-Schulz as torch runs it, 1e-5 in float32. Every
    block matrix is owner-computed (gpt_tp.sizing.sizes.muon_scheme): the optimizer step's collectives are two
    all-to-alls over the whole mesh, benchmarks.collectives.muon_collectives' to the byte on every rank, and no rank
    sends more than all-gathering every matrix once would (muon_gather_all_bytes). By hand for L = 2, C = 64 (12 C^2
    elements a block; each rank owns matrices of 12 C^2 elements at 2 ranks, 7 or 5 C^2 at 4): a rank sends its shard
    of every matrix another owns, then its matrices' update blocks to the others."""
    tp = nproc // dp
    # tests/workers/muon_parity.py's runs, in conftest's PARITY_LAUNCHES (the quick case with test_tp_parity's)
    layout = f"dp{dp}xtp{tp}" if dp > 1 else f"tp{tp}"
    results = parity_runs("quick" if (layout, fp32) == ("tp2", False) else f"slow{nproc}",
                          f"muon_{layout}_{'fp32' if fp32 else 'bf16'}")
    tol, nbytes, config = (1e-5, 4, GPTConfig.from_name("tiny")) if fp32 else (1e-3, 2, GPTConfig.from_name("tiny"))
    C, L, label = 64, 2, {(1, 2): "tensor_parallel", (2, 1): "data_parallel", (2, 2): "world"}[dp, tp]
    owned = {2: [12, 12], 4: [7, 7, 5, 5]}[nproc]  # C^2 elements each rank owns (sizes.muon_owners: 4C^2 x 4, 3C^2 x 2,
    for res in results:                            # C^2 x 2)
        assert res["muon_groups"] == 1 and res["muon_params"] == 8
        assert res["losses"] == pytest.approx(res["ref_losses"], rel=tol)
        assert res["losses"][-1] < res["losses"][0] - 0.1
        assert res["buffers_like_params"] is True  # DTensors with their parameter's placements
        recorded = res["optimizer_collectives"]
        measured = collectives.merge([collectives.collective(g, k, n, 1, b) for g, k, n, b in recorded])
        modeled = collectives.muon_collectives(config, dp, tp, ns_bytes=nbytes, rank=res["rank"])
        assert measured == collectives.merge(modeled)
        mine = owned[res["rank"]]
        assert [r[:3] for r in recorded] == [[label, "all_to_all", nproc]] * 2
        assert [r[3] for r in recorded] == [(24 - mine) * C * C // nproc * nbytes, mine * C * C * (nproc - 1) // nproc * nbytes]
        assert sum(r[3] for r in recorded) <= collectives.muon_gather_all_bytes(config, dp, tp, nbytes)
    assert len({tuple(r["losses"]) for r in results}) == 1


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_muon_sends_at_most_one_gather_at_every_shipped_config(name):
    """At each shipped config's model and layout, the bytes any rank sends in a Muon step (muon_collectives: every
    matrix owner-computed there) are at most those of all-gathering every block matrix once, and below the sharded Gram
    scheme's (whose C x C float32 Grams, 5 a matrix, send 3.7-6.7x that)."""
    cfg = yaml.safe_load((ROOT / "configs" / name).read_text())
    strategy = cfg["trainer"]["strategy"]["init_args"]
    dp, tp = strategy["data_parallel_size"], strategy["tensor_parallel_size"]
    config = GPTConfig.resolve(cfg["model"]["model"])
    once = collectives.muon_gather_all_bytes(config, dp, tp)
    sent = [sum(r["wire_bytes"] for r in collectives.muon_collectives(config, dp, tp, rank=r)) for r in range(dp * tp)]
    sharded = sum(r["wire_bytes"] for r in collectives.muon_collectives(config, dp, tp, scheme="sharded"))
    assert {r["kind"] for r in collectives.muon_collectives(config, dp, tp)} == {"all_to_all"}
    assert 0 < max(sent) <= once < sharded


MUON = ("--optimizer", "muon", "--muon-fp32")  # ckpt_fit.py: Muon, Newton-Schulz in float32


@pytest.fixture(scope="module")
def muon_straight(tmp_path_factory):
    """Muon on the bundled sample at TP=2: 8 uninterrupted steps, and 4 whose checkpoint the tests resume."""
    return straight_runs(tmp_path_factory.mktemp("muon_straight"), *MUON)


@pytest.fixture(scope="module")
def muon_resumed(muon_straight, tmp_path_factory):
    """The two 2-process resumes below in one launch (each from a checkpoint saved in another launch): the 4-step
    run's folder with --resume last at TP=2 (`exact`), its step-4 checkpoint at DP=2 x TP=1 (`dp2xtp1`)."""
    tmp = tmp_path_factory.mktemp("muon_resumed")
    return fits(tmp, 2, {"exact": (*exact_resume_args(muon_straight, tmp), *MUON),
                         "dp2xtp1": ("--steps", "6", "--resume", str(muon_straight[2]), *MUON, "--dp", "2", "--batch-size", "2")})


@pytest.mark.slow
def test_muon_checkpoint_resumes_bit_identically(muon_straight, muon_resumed):
    check_exact(muon_straight[1], muon_resumed["exact"][0])


@pytest.mark.parametrize("layout,nproc,args", [("tp1", 1, []), ("dp2xtp1", 2, ["--dp", "2", "--batch-size", "2"])])
@pytest.mark.slow
def test_muon_checkpoint_reshards(muon_straight, muon_resumed, tmp_path, layout, nproc, args):
    """The TP=2 checkpoint's momentum buffers (DTensors in DCP) continue on one device and at DP=2 x TP=1."""
    if layout == "dp2xtp1":  # launched with muon_resumed's exact resume
        check_resumed(muon_straight[1], muon_resumed[layout][0])
    else:
        check_resume_at(muon_straight, tmp_path, layout, nproc, *MUON, *args)


@pytest.mark.slow
def test_resume_that_switches_optimizer_is_refused(muon_straight, tmp_path):
    _, _, saved = muon_straight
    before = sorted((f.name, f.stat().st_size) for f in saved.iterdir())
    cmd = [sys.executable, str(WORKERS / "ckpt_fit.py"), "--steps", "6", "--resume", str(saved),
           "--ckpt-dir", str(tmp_path / "c"), "--out", str(tmp_path / "o")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0] == (f"error: checkpoint {saved} holds model.optimizer=Muon's state, but this run has "
                         "model.optimizer=AdamW: resume with --model.optimizer Muon, or start a new run")
    assert sorted((f.name, f.stat().st_size) for f in saved.iterdir()) == before


def test_muon_needs_block_matrices():
    with pytest.raises(UserError, match=r"model.optimizer=Muon: this model has no 2-D block weights"):
        Muon().build(nn.Sequential(nn.Linear(4, 4)), 6e-4)


def test_fp16_refuses_muon():
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    with pytest.raises(UserError, match=r"model.optimizer=Muon does not train with trainer.precision=16-mixed"):
        trainer(2, plugins=plugins).fit(GPTModule("tiny", optimizer=Muon(), total_batch_size=None),
                                        SyntheticDataModule(batch_size=2, seq_len=32))

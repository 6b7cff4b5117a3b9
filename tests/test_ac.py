"""Activation checkpointing (model.activation_checkpointing): the same losses, gradients and weights as without it,
on one process and through Lightning at TP=2 (with compile) and DP=2 x TP=2 (FSDP2)."""

import copy

import pytest
import torch

from gpt_tp.errors import UserError
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.train.module import GPTModule
from gpt_tp.parallel import apply_ac


def test_modes_give_the_same_gradients_and_names():
    """One process, dropout 0.1 (the recomputation replays the same masks): bit-identical loss and gradients, the
    same parameter names; and the saved activations do shrink."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=512, dropout=0.1))
    x, y = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    out = {}
    for mode in ("none", "full", "selective"):
        model = copy.deepcopy(base)
        apply_ac(model, mode)
        saved = []
        torch.manual_seed(1)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
            loss = cross_entropy(model(x), y)
        loss.backward()
        out[mode] = loss.item(), {n: p.grad for n, p in model.named_parameters()}, sum(saved)
    for mode in ("full", "selective"):
        assert out[mode][0] == out["none"][0], mode
        assert out[mode][1].keys() == out["none"][1].keys()
        for name, g in out["none"][1].items():
            assert torch.equal(out[mode][1][name], g), (mode, name)
    # the bytes the forward hands autograd outside the checkpoints (the blocks' own are measured in test_planner.py)
    assert out["full"][2] < out["none"][2] / 4 and out["selective"][2] < out["none"][2] / 4, {m: v[2] for m, v in out.items()}


def test_unknown_mode_is_a_user_error():
    with pytest.raises(UserError, match="model.activation_checkpointing='some': use one of none, full, selective"):
        GPTModule("tiny", activation_checkpointing="some")


@pytest.mark.slow
def test_lightning_runs_with_ac_match_without(lightning_runs):
    """Trainer + ModelParallelStrategy, 6 optimizer steps, accumulation 2, clipping, fused AdamW: AC full at TP=2 and
    selective under FSDP2 (DP=2 x TP=2) equal the same layout without AC bit for bit (eager: the same ops in the same
    order); selective with compile at TP=2 within fp32 noise; configs/gpt2-xl-8gpu.yaml's recipe (FSDP2, compile,
    bf16-mixed, selective) against the same without AC within bf16 noise. The runs of one world size share one launch
    with test_tp_parity's and test_ddp's (conftest's LIGHTNING_LAUNCHES: each its own Trainer and model)."""
    (two, _), (four, _) = lightning_runs(2), lightning_runs(4)
    runs = {
        "full": (two["tp2"], two["ac_full"], 0.0),
        "selective_compile": (two["tp2"], two["ac_selc"], 1e-4),
        "selective_dp2xtp2": (four["fsdp"], four["fsdp_sel"], 0.0),
        "selective_dp2_compile_bf16": (two["xl"], two["xl_sel"], 1e-3),
    }
    for name, ((ref, ref_w), (res, w), tol) in runs.items():
        ref_losses = [r["train/loss"] for r in ref["rows"]]
        assert len(ref_losses) == 6 and ref_losses[-1] < ref_losses[0] - 0.2
        for key in ("train/loss", "train/grad_norm"):
            got = [r[key] for r in res["rows"]]
            assert got == pytest.approx([r[key] for r in ref["rows"]], rel=tol, abs=0), (name, key)
        worst = max((w["final"][k] - v).abs().max().item() for k, v in ref_w["final"].items())
        # fp32 reordering stays far below one Adam step (lr 3e-3); bf16 rounding can flip near-zero Adam updates:
        # bounded by 2 x lr per step over 6 steps (as in test_tp_parity)
        assert worst <= {0.0: 0.0, 1e-4: 3e-4, 1e-3: 2 * 3e-3 * 6}[tol], (name, worst)


@pytest.mark.slow
def test_full_checkpointing_compiles_on_one_device():
    """Full checkpointing of compiled blocks on one device: the loss and gradients of the eager, uncheckpointed
    model within 1e-5."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=512))
    x, y = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    grads = []
    for mode, compiled in (("none", False), ("full", True)):
        model = copy.deepcopy(base)
        apply_ac(model, mode)
        if compiled:
            for block in model.transformer.h:
                block.compile()
        loss = cross_entropy(model(x), y)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)

"""get_lr as a pure function, AdamW's parameter groups (AdamW.build), and the optimizer recorded as plain data."""

import math

import pytest
import torch

from gpt_tp.model import GPT, GPTConfig
from gpt_tp.train.optim import AdamW, Muon, get_lr, optimizer_from


def test_get_lr_build_nanogpt_values():
    assert get_lr(0) == pytest.approx(6e-4 / 715)
    assert get_lr(714) == pytest.approx(6e-4)  # last warmup step reaches max_lr
    assert get_lr(715) == pytest.approx(6e-4)  # cosine starts at max_lr
    mid = 715 + (19073 - 715) // 2
    assert get_lr(mid) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5) * (1 + math.cos(math.pi * 0.5)), rel=1e-4)
    assert get_lr(19073) == pytest.approx(6e-5)
    assert get_lr(10**6) == 6e-5


def test_get_lr_shape():
    lrs = [get_lr(s, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100) for s in range(120)]
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))  # warmup rises to max_lr at step 9
    assert all(a >= b for a, b in zip(lrs[10:101], lrs[11:101]))  # cosine never rises
    assert min(lrs) == pytest.approx(0.1) and max(lrs) == pytest.approx(1.0)


def test_adamw_groups_and_fused():
    m = GPT(GPTConfig.from_name("tiny"))
    opt = AdamW().build(m, 1e-3)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n_unique = len({id(p) for p in m.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_unique  # the tied wte/lm_head once
    assert sum(p is m.transformer.wte.weight for p in decay["params"]) == 1
    assert opt.defaults["fused"] is True  # CPU has a fused AdamW kernel
    assert (opt.defaults["betas"], opt.defaults["eps"]) == ((0.9, 0.95), 1e-8)
    assert AdamW(fused=False).build(m, 1e-3).defaults["fused"] is False


@pytest.mark.parametrize("optimizer", [AdamW(), Muon(lr=0.03, fp32=True, betas=(0.8, 0.9))])
def test_optimizer_hparam_is_plain_data_and_comes_back(optimizer, tmp_path):
    """A checkpoint's hparams hold the optimizer as {"class_path", "init_args"}: loadable with weights_only=True,
    and the same optimizer again."""
    torch.save({"optimizer": optimizer.hparam()}, tmp_path / "meta.pt")
    saved = torch.load(tmp_path / "meta.pt", weights_only=True)["optimizer"]
    assert saved["class_path"] == f"gpt_tp.train.optim.{type(optimizer).__name__}"
    assert optimizer_from(saved) == optimizer and type(optimizer_from(saved)) is type(optimizer)


@pytest.mark.parametrize("warmup,max_steps", [(10, 10), (10, 5), (10, 0), (0, 0)])
def test_get_lr_schedule_no_longer_than_warmup(warmup, max_steps):
    """max_steps <= warmup_steps (a short run of a config with a long warmup): the warmup, then min_lr."""
    lrs = [get_lr(s, max_lr=1.0, min_lr=0.1, warmup_steps=warmup, max_steps=max_steps) for s in range(20)]
    assert lrs[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert lrs[warmup:] == [0.1] * (20 - warmup)


def test_get_lr_ends_at_min_lr_at_max_steps():
    # the last step of the cosine is min_lr exactly, as the cosine itself gives there
    assert get_lr(100, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100) == 0.1
    assert get_lr(99, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 89 / 90)))

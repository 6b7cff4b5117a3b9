"""gpt_tp.parallel.loss: the fused vocab-parallel cross-entropy against torch's F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

from conftest import read_json, run_torchrun
from gpt_tp.parallel.loss import cross_entropy


def _grads(fn, x, y, dtype):
    a = x.to(dtype).clone().requires_grad_()
    loss = fn(a, y)
    loss.backward()
    return loss.double(), a.grad.double()


def torch_ce(a, y):
    return F.cross_entropy(a.flatten(0, 1).to(torch.promote_types(a.dtype, torch.float32)), y.flatten())


def test_matches_torch_in_float64_and_is_as_accurate_in_float32():
    torch.manual_seed(0)
    x = torch.randn(2, 32, 1000) * 4
    y = torch.randint(0, 1000, (2, 32))
    exact_loss, exact_grad = _grads(torch_ce, x, y, torch.float64)
    loss, grad = _grads(cross_entropy, x, y, torch.float64)
    assert loss.item() == pytest.approx(exact_loss.item(), rel=1e-12)
    assert (grad - exact_grad).abs().max().item() < 1e-15
    # float32: no worse than torch's own kernel, measured against the float64 result
    t_loss, t_grad = _grads(torch_ce, x, y, torch.float32)
    o_loss, o_grad = _grads(cross_entropy, x, y, torch.float32)
    assert abs(o_loss - exact_loss) <= 2e-7 * exact_loss and abs(t_loss - exact_loss) <= 2e-7 * exact_loss  # ~1 ulp
    assert (o_grad - exact_grad).abs().max() <= 2 * (t_grad - exact_grad).abs().max() + 1e-12


def test_bf16_logits_and_masked_vocabulary():
    """bf16 logits (autocast's lm_head) are reduced in float32 and the gradient comes back in bf16; -inf columns
    (the frozen bias masking vocabulary padding of imported HF weights) get probability 0 and gradient 0."""
    torch.manual_seed(1)
    x = torch.randn(2, 16, 128) * 2
    x[..., 100:] = float("-inf")
    y = torch.randint(0, 100, (2, 16))
    t_loss, t_grad = _grads(torch_ce, x, y, torch.bfloat16)
    a = x.to(torch.bfloat16).requires_grad_()
    loss = cross_entropy(a, y)
    loss.backward()
    assert loss.dtype == torch.float32 and a.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(t_loss.item(), rel=1e-6)
    assert (a.grad.double() - t_grad).abs().max().item() < 1e-3
    assert torch.all(a.grad[..., 100:] == 0)


def test_backward_keeps_one_float32_buffer():
    """What autograd saves: one (N, V) float32 buffer (exp(x - max)) plus O(N) statistics; torch's log_softmax +
    nll_loss path saves a buffer of the same size, loss_parallel's unfused ops several."""
    x = torch.randn(4, 64, 512, requires_grad=True)
    y = torch.randint(0, 512, (4, 64))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        cross_entropy(x, y)
    N, V = 4 * 64, 512
    assert max(saved) == N * V * 4
    assert sum(saved) - N * V * 4 <= 4 * N * 8  # the sum, target index and mask: O(N)


@pytest.mark.slow
def test_vocab_parallel_on_two_ranks(tmp_path):
    run_torchrun("loss_tp.py", 2, "--out", str(tmp_path / "r"))
    for rank in range(2):
        r = read_json(tmp_path / f"r.{rank}.json")
        assert r["loss_is_plain"]  # a plain scalar, the same on every rank: backward needs no loss_parallel()
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-6)
        assert r["grad_diff"] < 1e-7
        assert r["grad_placements"] == "(Shard(dim=2),)"  # the gradient stays vocab-sharded
        assert r["fwd_comms"] == {"allreduce_": 2}  # the max; then the sum of exps and the target logit together
        assert r["bwd_comms"] == 0
        assert "TP_PLAN" in r["replicate_error"] and "Replicate" in r["replicate_error"]

"""benchmarks/muon_variants.py, the experiment's Newton-Schulz variants: its torch.optim.Muon iteration equals
gpt_tp's float32 Newton-Schulz, Polar Express orthogonalizes, NorMuon's normalisation evens the neurons and keeps the
update's norm."""

import torch

from benchmarks.muon_variants import COEFFICIENTS, SAFETY, normalize_neurons, orthogonalize
from gpt_tp.train.muon import newton_schulz


def test_torch_coefficients_are_gpt_tps_newton_schulz():
    g = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))  # [rows, cols], rows > cols: flipped
    ours = orthogonalize(g, COEFFICIENTS["torch"], SAFETY["torch"])
    theirs = newton_schulz([g.T], [None], torch.float32)[0].T  # gpt_tp's, on [short, long]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_polar_express_orthogonalizes_closer_than_torchs_iteration():
    """A Gaussian 64 x 256 matrix: its singular values after torch's 5 iterations span 0.68-1.13; Polar Express's
    5 take them to 0.86-1.14, about twice as close to 1 at the worst."""
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    worst = {k: (torch.linalg.svdvals(orthogonalize(g, COEFFICIENTS[k], SAFETY[k])) - 1).abs().max() for k in SAFETY}
    assert worst["polar"] < 0.15 < 0.3 < worst["torch"], worst


def test_normuon_evens_the_neurons_and_keeps_the_norm():
    v = torch.randn(48, 16, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 3, 48)[:, None]
    second = torch.zeros(48, 1)  # one per row: rows >= cols
    out = normalize_neurons(v, second, beta2=0.95)
    torch.testing.assert_close(second, 0.05 * v.square().mean(dim=1, keepdim=True))
    rms = out.square().mean(dim=1).sqrt()
    torch.testing.assert_close(rms, rms.mean().expand(48), rtol=1e-5, atol=0)  # every neuron alike after one step
    torch.testing.assert_close(out.norm(), v.norm())
    wide = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    col = torch.zeros(1, 40)  # rows < cols: one per column
    normalize_neurons(wide, col, beta2=0.5)
    torch.testing.assert_close(col, 0.5 * wide.square().mean(dim=0, keepdim=True))

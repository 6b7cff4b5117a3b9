"""ShardedMuon, the optimizer --model.optimizer Muon builds: torch.optim.Muon's update for DTensor weights split by
TP and FSDP2, with no rank holding a whole matrix where its split allows (docs/train.md, "Muon")."""

import inspect
import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

_MUON = inspect.signature(torch.optim.Muon).parameters
NS_COEFFICIENTS, NS_STEPS, NS_EPS = (_MUON[k].default for k in ("ns_coefficients", "ns_steps", "eps"))
MOMENTUM = _MUON["momentum"].default


class _Layout:
    """How one matrix's Newton-Schulz runs on its shards. X is the matrix as torch orients it, [short, long]
    (transposed when rows > cols): its Gram X X^T sums over the long side, so the mesh dims that split the long side
    (`summed`) all-reduce it; those that split the short side (`gathered`, FSDP2's dim 0 of the row-parallel c_proj)
    are all-gathered first, each rank then keeping its own slice of the update."""

    def __init__(self, p: torch.Tensor, gather_all: bool = False):
        rows, cols = p.shape
        self.transpose = rows > cols
        self.scale = math.sqrt(max(1, rows / cols))  # adjust_lr_fn "original"
        self.mesh, self.placements, self.whole, self.summed, self.gathered = None, None, None, (), ()
        if isinstance(p, DTensor):
            self.mesh, self.placements, long = p.device_mesh, p.placements, 0 if self.transpose else 1
            self.global_shape = dict(shape=p.shape, stride=p.stride())  # FSDP2's shards may be uneven
            dims = [(i, getattr(pl, "dim", None)) for i, pl in enumerate(p.placements)
                    if not pl.is_replicate() and p.device_mesh.size(i) > 1]
            if any(d is None for _, d in dims):
                raise RuntimeError(f"Muon needs sharded or replicated weights, not {p.placements}")
            self.summed = () if gather_all else tuple(i for i, d in dims if d % 2 == long)
            self.gathered = tuple(i for i, d in dims if gather_all or d % 2 != long)
            self.whole = [Replicate() if i in self.gathered else pl for i, pl in enumerate(p.placements)]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's [rows, cols] shard -> whole along the short side (a no-op where nothing splits it)."""
        return self._redistribute(x, self.placements, self.whole)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """gather's inverse: this rank's slice (no communication)."""
        return self._redistribute(x, self.whole, self.placements)

    def _redistribute(self, x: torch.Tensor, source: list, target: list) -> torch.Tensor:
        if not self.gathered:
            return x
        dt = DTensor.from_local(x, self.mesh, source, run_check=False, **self.global_shape)
        return dt.redistribute(self.mesh, target).to_local()

    def key(self):
        return (self.mesh, self.summed) if self.summed else None


def _reduced(parts: list[torch.Tensor], keys: list) -> list[torch.Tensor]:
    """Each tensor summed over the mesh dims of its key (None: not split) in float32, one flat all-reduce per key: over
    the whole job's group where two or more dims span it, else dim by dim."""
    out = [p.float() for p in parts]
    for mesh, dims in dict.fromkeys(k for k in keys if k is not None):
        mine = [i for i, k in enumerate(keys) if k == (mesh, dims)]
        flat = torch.cat([out[i].reshape(-1) for i in mine])
        whole = 1 < len(dims) == mesh.ndim and mesh.size() == dist.get_world_size()
        for group in [None] if whole else [mesh.get_group(d) for d in dims]:
            dist.all_reduce(flat, group=group)
        for i, part in zip(mine, flat.split([out[i].numel() for i in mine])):
            out[i] = part.view_as(out[i])
    return out


def newton_schulz(xs: list[torch.Tensor], keys: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """torch.optim.Muon's Newton-Schulz on the long-side shards X_r [short, long_r] of several matrices at once:
    ||X||_F and each iteration's Gram X X^T = sum_r X_r X_r^T are summed over each matrix's ranks (`keys`, None:
    not split) in float32, one all-reduce per key; B = b A + c A A is then the same on every rank, and
    X_r <- a X_r + B X_r is local. Unsplit matrices run exactly torch's bf16 arithmetic."""
    a, b, c = NS_COEFFICIENTS
    xs = [x.to(dtype, copy=True) for x in xs]
    squares = _reduced([x.float().square().sum() for x in xs], keys)
    for x, sq, k in zip(xs, squares, keys):
        x.div_((x.norm() if k is None else sq.sqrt().to(dtype)).clamp(min=NS_EPS))
    for _ in range(NS_STEPS):
        grams = [x @ x.T if k is None else x.float() @ x.float().T for x, k in zip(xs, keys)]
        grams = [g.to(dtype) for g in _reduced(grams, keys)]
        xs = [torch.addmm(x, torch.addmm(g, g, g, beta=b, alpha=c), x, beta=a) for x, g in zip(xs, grams)]
    return xs


class ShardedMuon(torch.optim.AdamW):
    """One optimizer for the whole model: groups with "muon": True get torch.optim.Muon's update (momentum, Nesterov,
    Newton-Schulz over the shards, decoupled weight decay, lr x sqrt(max(1, rows/cols))), the others AdamW's.
    Per-parameter state as the two torch optimizers keep it (Muon's momentum_buffer a DTensor like its parameter),
    so DCP saves and reshards it. ns_dtype: torch.bfloat16 as torch.optim.Muon, float32 for tests. gather_all: every
    matrix gathered whole and orthogonalized on every rank (the baseline benchmarks/muon_comm.py measures)."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, gather_all: bool = False, **adamw):
        super().__init__(params, **adamw)
        self.ns_dtype, self.gather_all = ns_dtype, gather_all
        for group in self.param_groups:
            group.setdefault("muon", False)
            if group["muon"]:
                group.setdefault("momentum", MOMENTUM)
                group.setdefault("nesterov", True)
                if any(p.ndim != 2 for p in group["params"]):
                    raise ValueError("Muon groups take 2-D weights only")

    def __setstate__(self, state: dict) -> None:
        """load_state_dict: Adam's __setstate__ reads each parameter state's "step", which Muon's do not have."""
        muon = {p: s for p, s in state["state"].items() if "momentum_buffer" in s}
        adamw = defaultdict(dict, {p: s for p, s in state["state"].items() if p not in muon})
        super().__setstate__({**state, "state": adamw})
        self.state.update(muon)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning's closure zeroes the gradients: it must see every group
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g["muon"]]  # AdamW's step on AdamW's groups
        try:
            super().step()
        finally:
            self.param_groups = groups
        todo = [(g, p) for g in groups if g["muon"] for p in g["params"] if p.grad is not None]
        layouts, updates = [_Layout(p, self.gather_all) for _, p in todo], []
        for (group, p), layout in zip(todo, layouts):
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf = buf.to_local() if isinstance(buf, DTensor) else buf
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            update = layout.gather(update.to(self.ns_dtype))  # the short side whole, in Newton-Schulz's dtype
            updates.append(update.T if layout.transpose else update)
        updates = newton_schulz(updates, [layout.key() for layout in layouts], self.ns_dtype)
        for (group, p), layout, x in zip(todo, layouts, updates):
            local = p.to_local() if isinstance(p, DTensor) else p
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(layout.scatter(x.T if layout.transpose else x), alpha=-group["lr"] * layout.scale)
        return loss

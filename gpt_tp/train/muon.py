"""ShardedMuon, the optimizer --model.optimizer Muon builds: torch.optim.Muon's update for DTensor weights split by
TP and FSDP2 (docs/train.md, "Muon"), each split matrix by the scheme gpt_tp.sizing.sizes.muon_scheme weighs cheaper:
"owner" (its shards sent to one rank, the matrices spread over all ranks, Newton-Schulz once there, each rank's block
of the update sent back) or "sharded" (Newton-Schulz on the long-side shards, the Grams all-reduced)."""

import inspect
import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from gpt_tp.sizing.sizes import muon_costs, muon_owners, muon_scheme
from gpt_tp.torch_internals import cpu_bf16_matmul_is_native, shard_slices

_MUON = inspect.signature(torch.optim.Muon).parameters
NS_COEFFICIENTS, NS_STEPS, NS_EPS = (_MUON[k].default for k in ("ns_coefficients", "ns_steps", "eps"))
MOMENTUM = _MUON["momentum"].default


def _numel(block: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in block)


class _Layout:
    """How one matrix's Newton-Schulz runs, X as torch orients it, [short, long]. "local": whole on this rank. "owner":
    `blocks`, each rank's shard as slices of the matrix. "sharded": X X^T sums over the long side, so the mesh dims
    splitting it (`summed`) all-reduce it; those splitting the short side (`gathered`, FSDP2's dim 0 of a row-parallel
    c_proj) all-gather it first, each rank keeping its slice of the update. `scheme` forces one where splits allow."""

    def __init__(self, p: torch.Tensor, ns_bytes: int, scheme: str | None = None):
        rows, cols = p.shape
        self.transpose = rows > cols
        self.scale = math.sqrt(max(1, rows / cols))  # adjust_lr_fn "original"
        self.scheme, self.bytes, self.summed, self.gathered, self.blocks = "local", 0.0, (), (), None
        self.mesh = self.placements = self.whole = None
        if isinstance(p, DTensor):
            self.mesh, self.placements, long = p.device_mesh, p.placements, 0 if self.transpose else 1
            self.global_shape = dict(shape=p.shape, stride=p.stride())  # FSDP2's shards may be uneven
            dims = [(i, getattr(pl, "dim", None)) for i, pl in enumerate(p.placements)
                    if not pl.is_replicate() and p.device_mesh.size(i) > 1]
            if any(d is None for _, d in dims):
                raise RuntimeError(f"Muon needs sharded or replicated weights, not {p.placements}")
            self.summed = tuple(i for i, d in dims if d % 2 == long)
            self.gathered = tuple(i for i, d in dims if d % 2 != long)
            self.whole = [Replicate() if i in self.gathered else pl for i, pl in enumerate(p.placements)]
            split = [math.prod(self.mesh.size(i) for i in g) for g in (self.summed, self.gathered)]
            if dims:  # owner-computes where every rank holds a block of its own, and the blocks tile the matrix
                self.scheme = scheme or muon_scheme(min(rows, cols), max(rows, cols), *split, ns_bytes)
                if self.scheme == "owner" and math.prod(split) == dist.get_world_size():
                    self.blocks = [shard_slices(p, r) for r in range(dist.get_world_size())]
                if self.scheme == "owner" and sum(map(_numel, self.blocks or [])) != p.numel():
                    self.scheme, self.blocks = "sharded", None
                self.bytes = muon_costs(min(rows, cols), max(rows, cols), *split, ns_bytes)[self.scheme][0]

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


def newton_schulz(xs: list[torch.Tensor], keys: list, dtype: torch.dtype, mm: torch.dtype | None = None) -> list:
    """torch.optim.Muon's Newton-Schulz on the long-side shards X_r [short, long_r] of several matrices at once:
    ||X||_F and each iteration's Gram X X^T = sum_r X_r X_r^T are summed over each matrix's ranks (`keys`, None:
    not split) in float32, one all-reduce per key; B = b A + c A A is then the same on every rank, and
    X_r <- a X_r + B X_r is local. mm None: unsplit matrices run exactly torch's bf16 arithmetic; else the products
    run in mm (float32 on CPUs that emulate bf16 matmuls, many times slower), each rounded to dtype as a bf16 matmul's
    float32 sums are (bf16 products are exact in float32; the order of the sums may differ)."""
    a, b, c = NS_COEFFICIENTS
    mm = mm or dtype
    xs = [x.to(dtype, copy=True) for x in xs]
    squares = _reduced([x.float().square().sum() for x in xs], keys)
    for x, sq, k in zip(xs, squares, keys):
        x.div_((x.norm() if k is None else sq.sqrt().to(dtype)).clamp(min=NS_EPS))
    for _ in range(NS_STEPS):
        grams = [(x.to(mm) @ x.to(mm).T).to(dtype) if k is None else x.float() @ x.float().T for x, k in zip(xs, keys)]
        grams = [g.to(dtype).to(mm) for g in _reduced(grams, keys)]
        xs = [torch.addmm(x.to(mm), torch.addmm(g, g, g, beta=b, alpha=c).to(dtype).to(mm), x.to(mm), beta=a).to(dtype)
              for x, g in zip(xs, grams)]
    return xs


class ShardedMuon(torch.optim.AdamW):
    """One optimizer for the whole model: groups with "muon": True get torch.optim.Muon's update (momentum, Nesterov,
    Newton-Schulz by each matrix's scheme, decoupled weight decay, lr x sqrt(max(1, rows/cols))), the others AdamW's.
    State as the torch optimizers keep it (momentum_buffer a DTensor like its parameter: DCP saves, reshards it).
    ns_dtype: bf16 as torch.optim.Muon, float32 for tests. scheme: "owner"/"sharded" forced, None: muon_scheme's."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, scheme: str | None = None, **adamw):
        super().__init__(params, **adamw)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            group.setdefault("muon", False)
            if group["muon"]:
                group.setdefault("momentum", MOMENTUM)
                group.setdefault("nesterov", True)
                if any(p.ndim != 2 for p in group["params"]):
                    raise ValueError("Muon groups take 2-D weights only")
        matrices = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        self.layouts = {p: _Layout(p, torch.finfo(ns_dtype).bits // 8, scheme) for p in matrices}
        owned = [p for p in matrices if self.layouts[p].scheme == "owner"]
        self.owners = dict(zip(owned, muon_owners([p.numel() for p in owned], dist.get_world_size()))) if owned else {}
        cpu = any(p.device.type == "cpu" for p in matrices)
        emulated = ns_dtype == torch.bfloat16 and cpu and not cpu_bf16_matmul_is_native()
        self.mm = torch.float32 if emulated and any(lay.scheme != "local" for lay in self.layouts.values()) else None

    def describe(self, names: dict) -> str:
        """The run's line about Muon (names: parameter -> name): each kind of matrix's scheme, the bytes the busiest
        rank sends in a Muon step (owner-computed blocks exactly, the rest as muon_costs counts them), and those of
        all-gathering every split matrix once in Newton-Schulz's dtype."""
        kinds, nbytes, layouts = defaultdict(set), torch.finfo(self.ns_dtype).bits // 8, self.layouts
        for p, name in names.items():
            kinds[name.split(".", 3)[-1].removesuffix(".weight")].add(layouts[p].scheme)
        split = [p for p in names if layouts[p].scheme != "local"]
        world = dist.get_world_size() if split else 1
        sent = max(sum(layouts[p].bytes for p in split if p not in self.owners) + nbytes * sum(
            p.numel() - _numel(layouts[p].blocks[r]) if o == r else _numel(layouts[p].blocks[r])
            for p, o in self.owners.items()) for r in range(world))
        once = (world - 1) / world * sum(p.numel() for p in split) * nbytes
        return (f"Muon: {', '.join(k + ' ' + '/'.join(sorted(v)) for k, v in kinds.items())}; {sent / 2**20:.2f} MiB "
                f"sent per rank per step (all-gathering every matrix once: {once / 2**20:.2f} MiB)")

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
        shards = {}
        for group, p in todo:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if "momentum_buffer" not in (state := self.state[p]):
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf = buf.to_local() if isinstance(buf, DTensor) else buf
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            shards[p] = update.to(self.ns_dtype)
        rest = [p for p in shards if p not in self.owners]
        owned = {p: shards[p] for p in shards if p in self.owners}
        updates = self._by_owners(owned) if owned else {}
        xs = self._newton_schulz(rest, [self.layouts[p].gather(shards[p]) for p in rest])  # the short side whole
        updates.update((p, self.layouts[p].scatter(x)) for p, x in zip(rest, xs))
        for group, p in todo:
            local = p.to_local() if isinstance(p, DTensor) else p
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(updates[p], alpha=-group["lr"] * self.layouts[p].scale)
        return loss

    def _newton_schulz(self, ps: list, xs: list) -> list:
        """newton_schulz on the [rows, cols] matrices (or short-side-whole shards) xs of the parameters ps."""
        keys = [None if p in self.owners else self.layouts[p].key() for p in ps]
        flip = [self.layouts[p].transpose for p in ps]
        xs = newton_schulz([x.T if t else x for t, x in zip(flip, xs)], keys, self.ns_dtype, self.mm)
        return [x.T if t else x for t, x in zip(flip, xs)]

    def _by_owners(self, shards: dict) -> dict:
        """Owner-computed matrices' update shards -> this rank's blocks of their orthogonalized updates: one all-to-all
        sends each shard to its matrix's owner, which runs Newton-Schulz on it whole, another each rank its blocks."""
        me, world = dist.get_rank(), dist.get_world_size()
        order = sorted(shards, key=self.owners.__getitem__)  # by owner, then in the model's order
        mine = [p for p in order if self.owners[p] == me]
        blocks = {p: self.layouts[p].blocks for p in mine}
        sent = [sum(shards[p].numel() for p in order if self.owners[p] == r) for r in range(world)]
        got = [sum(_numel(blocks[p][r]) for p in mine) for r in range(world)]
        flat = torch.cat([shards[p].reshape(-1) for p in order])
        recv = flat.new_empty(sum(got))
        dist.all_to_all_single(recv, flat, got, sent)
        wholes = {p: flat.new_empty(p.shape) for p in mine}
        for r, piece in enumerate(recv.split(got)):
            for p, part in zip(mine, piece.split([_numel(blocks[p][r]) for p in mine])):
                wholes[p][blocks[p][r]] = part.view(wholes[p][blocks[p][r]].shape)
        wholes = dict(zip(mine, self._newton_schulz(mine, [wholes[p] for p in mine])))
        flat = torch.cat([wholes[p][blocks[p][r]].reshape(-1) for r in range(world) for p in mine] or [flat[:0]])
        recv = flat.new_empty(sum(sent))
        dist.all_to_all_single(recv, flat, sent, got)
        return {p: x.view_as(shards[p]) for p, x in zip(order, recv.split([shards[p].numel() for p in order]))}

"""A training step's collectives, derived and measured in the same rows: step_collectives, what gpt_tp's plan, FSDP2
and Muon send for a layout (from gpt_tp.sizing.sizes' TP-local shapes), and CollectiveRecorder, every collective
issued as a step runs, with its process group and the bytes of its full tensor."""

import torch

from gpt_tp.model import GPTConfig
from gpt_tp.sizing import sizes
from gpt_tp.sizing.memory import precision_bytes
from gpt_tp.torch_internals import TorchDispatchMode

TP, DP = "tensor_parallel", "data_parallel"

# collectives by the op's name (functional and c10d in-place ops alike) -> kind
KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective issued inside it as (mesh dim, kind, bytes): functional collectives (what DTensor
    emits) and c10d ops (torch.distributed.all_reduce, FSDP2's all-gathers and reduce-scatters).

    bytes is the size of the full tensor a collective produces or consumes (all-gather: its output, reduce-scatter:
    its input, all-reduce: the buffer, all-to-all: what this rank sends the others); `groups` maps process-group
    names to (label, size), e.g. from groups_of(mesh). Like CommDebugMode, DTensor ops are let through so their collectives are seen once desugared.
    """

    def __init__(self, groups: dict[str, tuple[str, int]]):
        super().__init__()
        self.groups = groups
        self.records: list[tuple[str, str, int, int]] = []  # (label, kind, group_size, nbytes)

    def _group(self, args) -> tuple[str, int]:
        for a in args:
            if isinstance(a, str) and a in self.groups:
                return self.groups[a]
            if isinstance(a, torch.ScriptObject):  # c10d ops carry the ProcessGroup boxed
                try:
                    pg = torch.distributed.ProcessGroup.unbox(a)
                except Exception:  # noqa: BLE001 - a boxed ReduceOp or Work, not the group
                    continue
                return self.groups.get(pg.group_name, (pg.group_name, pg.size()))
        return ("?", 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor or (isinstance(t, type) and issubclass(t, DTensor)) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        ns, _, name = func.name().partition("::")
        name = name.split(".")[0]
        if ns in _NAMESPACES and name in KINDS:
            kind = KINDS[name]
            label, size = self._group(args)
            if kind == "all_gather":
                if ns == "c10d":  # (output(s), input(s), pg, ...)
                    nbytes = _nbytes(args[0])
                else:  # (input(s), group_size, group_name)
                    nbytes = _nbytes(args[0]) * args[1]
            elif kind == "reduce_scatter" and ns == "c10d":
                nbytes = _nbytes(args[1])
            elif kind == "all_to_all" and ns == "c10d":  # (output, input, pg, out splits, in splits): the bytes sent
                inp, me = args[1], torch.distributed.ProcessGroup.unbox(args[2]).rank()  # to others, not to itself
                row = inp.element_size() * inp[0].numel() if len(inp) else 0
                nbytes = _nbytes(inp) - (args[4][me] if args[4] else len(inp) // size) * row
            else:
                nbytes = _nbytes(args[0])
            self.records.append((label, kind, size, nbytes))
        return out

    def summary(self) -> list[dict]:
        """Per (mesh dim, kind): count, bytes (full tensors) and wire_bytes (sent per rank, ring algorithm), in the
        rows of step_collectives."""
        return merge([collective(label, kind, size, 1, nbytes) for label, kind, size, nbytes in self.records])


def groups_of(mesh) -> dict[str, tuple[str, int]]:
    """Process-group name -> (mesh dim name, size) for every dim of a DeviceMesh, and the whole job as "world"
    (where gpt_tp.parallel.clip_grad_norm all-reduces the norm on a 2-D mesh)."""
    out = {torch.distributed.group.WORLD.group_name: ("world", torch.distributed.get_world_size())}
    for dim in mesh.mesh_dim_names:
        g = mesh[dim].get_group()
        out[g.group_name] = (dim, g.size())
    return out


# ---------------------------------------- Collectives of one training step, derived ---------------------------------


def wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes each rank sends for a collective over a tensor of nbytes (the full, unsharded size), with the ring
    algorithm: all-gather and reduce-scatter (p-1)/p N, all-reduce twice that (reduce-scatter + all-gather); an
    all-to-all's nbytes are already those this rank sends."""
    if kind == "all_to_all":
        return float(nbytes)
    return (2.0 if kind == "all_reduce" else 1.0) * (group_size - 1) / group_size * nbytes if group_size > 1 else 0.0


def collective(dim: str, kind: str, group_size: int, count: int, nbytes: float) -> dict:
    """`count` collectives of `kind` on mesh dim `dim` moving `nbytes` full-tensor bytes in all."""
    return {"dim": dim, "kind": kind, "group_size": group_size, "count": count, "bytes": int(nbytes),
            "wire_bytes": wire_bytes(kind, nbytes, group_size) if count else 0.0}


def merge(rows: list[dict]) -> list[dict]:
    """Rows summed per (dim, kind), sorted; rows of no collective left out."""
    out: dict = {}
    for r in [r for r in rows if r["count"]]:
        m = out.setdefault((r["dim"], r["kind"]), {**r, "count": 0, "bytes": 0, "wire_bytes": 0.0})
        for k in ("count", "bytes", "wire_bytes"):
            m[k] += r[k]
    return sorted(out.values(), key=lambda r: (r["dim"], r["kind"]))


def counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """{dim: {kind: count}} of a collectives list."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        out.setdefault(r["dim"], {})[r["kind"]] = out.get(r["dim"], {}).get(r["kind"], 0) + r["count"]
    return out


def tp_collectives(config: GPTConfig, batch_size: int, seq_len: int, dp: int, tp: int, precision: str) -> list[dict]:
    """The TP group's collectives of one step under TP_PLAN for L blocks (Korthikanti et al. 2022, section 4.2.2;
    docs/performance.md, "The layout"): all_gather 6L + 3, reduce_scatter 4L + 2, all_reduce 3. Under bf16 autocast
    the gathered LayerNorm and c_proj outputs move 2-byte elements; the embedding's, fp32 unless FSDP2 gathers bf16."""
    if tp <= 1:
        return []
    L, act = config.n_layer, batch_size * seq_len * config.n_embd
    mm = precision_bytes(precision)[2]  # matmul outputs, and LayerNorm outputs cast before their gather
    emb = mm if dp > 1 else 4
    partial = sizes.numel([p for p in sizes.local_params(config, tp) if p.sequence_partial], dp)
    return [
        collective(TP, "all_gather", tp, 2 * L + 1, (2 * L + 1) * act * mm),  # fwd: ln_1, ln_2 per block, ln_f
        collective(TP, "all_gather", tp, 4 * L + 2, (4 * L + 1) * act * mm + act * emb),  # bwd: again, c_proj's and wte's RS
        collective(TP, "reduce_scatter", tp, 2 * L + 1, 2 * L * act * mm + act * emb),  # fwd: c_proj x 2, wte
        collective(TP, "reduce_scatter", tp, 2 * L + 1, (2 * L + 1) * act * mm),  # bwd: of the gathers
        collective(TP, "all_reduce", tp, 1, partial * 4),
        collective(TP, "all_reduce", tp, 2, batch_size * seq_len * 12),  # cross-entropy
    ]


def fsdp_collectives(config: GPTConfig, dp: int, tp: int, precision: str) -> list[dict]:
    """The DP group's collectives of one step under FSDP2 (one unit per block, one root unit): all_gather 2L + 1
    (each unit before forward, each block again before backward), reduce_scatter L + 1 of float32 gradients."""
    if dp <= 1:
        return []
    L, g = config.n_layer, sizes.fsdp_gather_bytes(precision)
    block, root = (dp * sizes.numel(params(config, tp), dp)  # padded as FSDP2 does
                   for params in (sizes.block_params, sizes.root_params))
    return [collective(DP, "all_gather", dp, 2 * L + 1, (2 * L * block + root) * g),
            collective(DP, "reduce_scatter", dp, L + 1, (L * block + root) * 4)]


def norm_collective(dp: int, tp: int) -> list[dict]:
    """The grad norm (gpt_tp.parallel.clip_grad_norm): one float32 all-reduced over the whole mesh."""
    if dp * tp <= 1:
        return []
    return [collective("world" if dp > 1 and tp > 1 else DP if dp > 1 else TP, "all_reduce", dp * tp, 1, 4)]


def muon_collectives(config: GPTConfig, dp: int, tp: int, ns_steps: int = 5, ns_bytes: int = 2, rank: int = 0,
                     scheme: str | None = None) -> list[dict]:
    """Muon's optimizer step (gpt_tp.train.muon) on `rank`, for the 4L block matrices, each with short side C, by the
    scheme gpt_tp.sizing.sizes.muon_scheme picks for each kind (`scheme` forces one, as ShardedMuon's does). c_attn
    and c_fc are split along their long side over TP and DP, the c_projs along their long side over TP and their short
    side (FSDP2's dim 0) over DP. Owner-computed: two all-to-alls over the whole mesh in Newton-Schulz's dtype, this
    rank's shards of the matrices others own (sizes.muon_owners) to them, then its own matrices' update blocks back.
    Sharded: per group of ranks that split long sides one all-reduce of each matrix's squared norm and ns_steps of
    its C x C Gram, float32; at DP > 1 each c_proj all-gathered over DP."""
    L, C, p = config.n_layer, config.n_embd, dp * tp
    if p == 1:
        return []
    kinds = [(3 * C, True), (C, False), (4 * C, True), (4 * C, False)]  # (long side, split over DP along it) per block
    picks = [scheme or sizes.muon_scheme(C, long, tp * dp if col else tp, 1 if col else dp, ns_bytes)
             for long, col in kinds]
    owned = [long * C for _ in range(L) for (long, _), pick in zip(kinds, picks) if pick == "owner"]
    owners = sizes.muon_owners(owned, p)
    label = TP if dp == 1 else DP if tp == 1 else "world"
    rows = [collective(label, "all_to_all", p, 1, sum(n // p for n, o in zip(owned, owners) if o != rank) * ns_bytes),
            collective(label, "all_to_all", p, 1, sum(n - n // p for n, o in zip(owned, owners) if o == rank) * ns_bytes)
            ] if owned else []
    colwise = [d for d, n in ((DP, dp), (TP, tp)) if n > 1]
    groups: dict[tuple[str, int], int] = {}  # (label, size) -> matrices summed over it, in one flat all-reduce
    for (long, col), pick in zip(kinds, picks):
        dims = colwise if col else [TP] if tp > 1 else []
        if dims and pick == "sharded":
            group = ("world", dp * tp) if len(dims) == 2 else (dims[0], dp if dims == [DP] else tp)
            groups[group] = groups.get(group, 0) + L
    rows += [collective(label, "all_reduce", size, 1 + ns_steps, n * 4 * (1 + ns_steps * C * C))
             for (label, size), n in groups.items()]
    gathered = [long for (long, col), pick in zip(kinds, picks) if not col and pick == "sharded"]
    if dp > 1 and gathered:
        rows.append(collective(DP, "all_gather", dp, len(gathered) * L, L * sum(gathered) * C // tp * ns_bytes))
    return rows


def muon_gather_all_bytes(config: GPTConfig, dp: int, tp: int, ns_bytes: int = 2) -> float:
    """Every block matrix all-gathered whole once, in Newton-Schulz's dtype: wire bytes per rank (ring all-gather),
    the bound on Muon's step (docs/performance.md, "Muon")."""
    return wire_bytes("all_gather", config.n_layer * 12 * config.n_embd ** 2 * ns_bytes, dp * tp)


def step_collectives(config: GPTConfig, batch_size: int, seq_len: int, dp: int = 1, tp: int = 1,
                     precision: str = "32-true", optimizer: str = "adamw", rank: int = 0) -> list[dict]:
    """A step's collectives per (mesh dim, kind): count, full-tensor and per-rank wire bytes; batch_size per DP rank.
    AdamW's step communicates nothing; Muon's: muon_collectives (on `rank`)."""
    precision_bytes(precision)
    return merge(tp_collectives(config, batch_size, seq_len, dp, tp, precision)
                 + fsdp_collectives(config, dp, tp, precision) + norm_collective(dp, tp)
                 + (muon_collectives(config, dp, tp, rank=rank) if optimizer == "muon" else []))

"""Layout planner (python -m gpt_tp.cli.planner; resolve_layout for cli.py's `auto` sizes): each DP x TP layout's memory
per device, and the pick: TP divides the devices per node and the smallest TP that fits wins, since TP communicates
four times per layer on the critical path while FSDP2 overlaps its collectives (docs/scale.md, "The planner")."""

from dataclasses import dataclass, field

from gpt_tp.hardware import GIB
from gpt_tp.model import GPTConfig
from gpt_tp.ranks import Layout
from gpt_tp.sizing.layout import LayoutError, divisors, valid_tp_sizes
from gpt_tp.sizing.memory import USABLE_FRACTION, Memory, PlanError, fits, memory_per_device
from gpt_tp.sizing.sizes import padded_vocab


@dataclass
class Candidate:
    layout: Layout
    memory: Memory | None = None
    fits: bool = False
    reason: str = ""  # why the layout is invalid or does not fit; empty when it fits


@dataclass
class Plan:
    config: GPTConfig
    devices_per_node: int
    num_nodes: int
    batch_size: int
    seq_len: int
    device_memory_gib: float | None
    precision: str
    ac: str = "none"
    layouts: list[Candidate] = field(default_factory=list)  # every TP size that divides the devices per node
    choice: Candidate | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes


def plan(config: GPTConfig, devices_per_node: int, num_nodes: int = 1, batch_size: int = 16, seq_len: int = 1024,
         device_memory_gib: float | None = None, precision: str = "bf16-mixed", overhead_gib: float = 1.5,
         ac: str = "none", dp: int | str = "auto", tp: int | str = "auto", accum: int = 1,
         total_batch_size: int | None = None, optimizer: str = "adamw") -> Plan:
    """Each layout's memory estimate, validity and fit, and the choice (all fit when device_memory_gib is None): the
    smallest TP that fits among the layouts with the given dp and tp (a number, or "auto") whose batch_size x seq_len
    x DP x accum is total_batch_size (None: any). cli.py's `auto` sizes are this choice (resolve_layout)."""
    for name, v in [("devices_per_node", devices_per_node), ("num_nodes", num_nodes), ("batch_size", batch_size),
                    ("seq_len", seq_len), ("vocab_size", config.vocab_size)]:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{name}={v!r} must be a positive integer")
    if seq_len > config.block_size:
        raise PlanError(f"seq_len={seq_len} exceeds the model's block_size={config.block_size}: lower data.seq_len "
                        "(planner: --seq-len)")
    if device_memory_gib is not None and not device_memory_gib > 0:
        raise PlanError(f"device memory {device_memory_gib!r} GiB must be > 0 (planner --memory-gib)")
    if not overhead_gib >= 0:
        raise PlanError(f"overhead_gib={overhead_gib!r} must be >= 0 (planner --overhead-gib)")
    if device_memory_gib is not None and device_memory_gib * USABLE_FRACTION <= overhead_gib:
        raise PlanError(
            f"{USABLE_FRACTION:.0%} of {device_memory_gib:g} GiB per device leaves nothing after the {overhead_gib:g} "
            "GiB of CUDA context, NCCL buffers and allocator slack: no layout can fit; give the device's real memory "
            "(--memory-gib) or a smaller --overhead-gib")
    out = Plan(config, devices_per_node, num_nodes, batch_size, seq_len, device_memory_gib, str(precision), ac)
    valid = set(valid_tp_sizes(config, seq_len))
    shapes = {"n_head": config.n_head, "n_embd": config.n_embd, "vocab_size": config.vocab_size, "seq_len": seq_len}

    def layout_memory(dp: int, tp: int) -> tuple[Memory, bool]:
        m = memory_per_device(config, dp, tp, batch_size, seq_len, precision, overhead_gib, ac, optimizer, accum,
                              device_memory_gib)
        return m, fits(m, device_memory_gib)

    for size in divisors(devices_per_node):
        lay = Candidate(Layout(out.world_size // size, size))
        if size not in valid:
            lay.reason = f"TP={size} does not divide {', '.join(f'{n}={v}' for n, v in shapes.items() if v % size)}"
        else:
            lay.memory, lay.fits = layout_memory(lay.layout.dp, size)
            if not lay.fits:
                lay.reason = (f"needs {lay.memory.total / GIB:.1f} GiB > {USABLE_FRACTION:.0%} of "
                              f"{device_memory_gib:g} GiB")
        out.layouts.append(lay)
    in_memory = [lay for lay in out.layouts if lay.fits]
    fixed = " and ".join(f"{name}={size}" for name, size in (("data_parallel_size", dp), ("tensor_parallel_size", tp))
                         if size != "auto")
    for lay in in_memory:  # the rest of the run's settings: the sizes it gives, its tokens per step
        if (dp != "auto" and lay.layout.dp != int(dp)) or (tp != "auto" and lay.layout.tp != int(tp)):
            lay.fits, lay.reason = False, f"fits, but the run gives {fixed}"
        elif total_batch_size is not None and batch_size * seq_len * lay.layout.dp * accum != total_batch_size:
            tokens = batch_size * seq_len * lay.layout.dp * accum
            lay.fits, lay.reason = False, (f"fits, but B x T x DP x accumulation = {tokens} tokens, not "
                                           f"model.total_batch_size={total_batch_size}")
    out.choice = next((lay for lay in out.layouts if lay.fits), None)
    bad = [lay for lay in out.layouts if lay.memory is None]
    if bad:
        out.notes.append(f"valid TP sizes for this model ({', '.join(f'{n}={v}' for n, v in shapes.items())}): "
                         f"{', '.join(map(str, sorted(valid)))}; " + "; ".join(lay.reason for lay in bad))
        for t in divisors(config.n_head):  # TP sizes a node of this size allows with whole heads, other V or T
            if 1 < t <= devices_per_node and t not in valid and config.n_embd % t == 0:
                needs = []
                if config.vocab_size % t:
                    needs.append(f"vocab_size={padded_vocab(config.vocab_size, t)} (padded; model.vocab_size, "
                                 "planner: --vocab-size)")
                if seq_len % t:
                    needs.append(f"a sequence length that is a multiple of {t} (sequence parallelism splits T), e.g. "
                                 f"{seq_len // t * t} (data.seq_len, planner: --seq-len)")
                if devices_per_node % t:
                    needs.append(f"{t} or a multiple of {t} devices per node")
                out.notes.append(f"TP={t} would split whole heads with " + ", ".join(needs))
    given = [lay for lay in in_memory if "the run gives" not in lay.reason]
    if out.choice is None and given:  # the tokens per step rule out every layout that fits
        out.notes.append(
            f"model.total_batch_size={total_batch_size} tokens with data.batch_size={batch_size} x "
            f"data.seq_len={seq_len} x trainer.accumulate_grad_batches={accum} needs data-parallel size "
            f"{total_batch_size / (batch_size * seq_len * accum):g}, but the layouts that fit are "
            f"{', '.join(str(lay.layout) for lay in given)}: set "
            "trainer.accumulate_grad_batches or model.total_batch_size for one of them")
    elif out.choice is None and in_memory:  # the run's own sizes rule them out
        invalid = [f" ({lay.reason})" for lay in bad if tp != "auto" and lay.layout.tp == int(tp)]
        out.notes.append(f"the run gives {fixed}{''.join(invalid)}, but the layouts that fit are "
                         f"{', '.join(str(lay.layout) for lay in in_memory)}")
    elif out.choice is None:
        out.notes.append(f"no layout fits {device_memory_gib:g} GiB per device: {_no_fit_hint(out, layout_memory, valid)}")
    return out


def _no_fit_hint(p: Plan, layout_memory, valid: set[int]) -> str:
    """What would fit when nothing does: a smaller micro-batch only where the batch-independent state (weights,
    gradients, AdamW, overhead) fits; else more ranks to shard that state over (FSDP2 over DP) or larger TP groups."""
    sized = [lay for lay in p.layouts if lay.memory is not None]  # the node's valid TPs, smallest first: never empty
    best = min(sized, key=lambda lay: lay.memory.states + lay.memory.overhead)
    state = best.memory.states + best.memory.overhead
    if state <= p.device_memory_gib * GIB * USABLE_FRACTION:
        hints = ["lower data.batch_size (planner: --batch-size) and raise trainer.accumulate_grad_batches to keep the "
                 "tokens per step"]
    else:
        hints = [f"weights, gradients, AdamW state and overhead alone need {state / GIB:.1f} GiB at {best.layout}, "
                 "so a smaller batch cannot help"]
        for nodes in range(p.num_nodes + 1, 1025):  # more ranks: FSDP2 shards the state over data parallelism
            world = nodes * p.devices_per_node
            fit = next((lay.layout.tp for lay in sized if layout_memory(world // lay.layout.tp, lay.layout.tp)[1]), None)
            if fit is not None:
                hints.append(f"{nodes} nodes of {p.devices_per_node} (DP={world // fit} x TP={fit}: the state sharded "
                             f"over {world} ranks) would fit (planner: --nodes {nodes})")
                break
    bigger = [tp for tp in sorted(valid) if tp > p.devices_per_node and layout_memory(p.num_nodes, tp)[1]]
    if bigger:  # a node of `tp` devices, one TP group per node
        hints.append(f"nodes of {bigger[0]} devices (TP={bigger[0]}) would fit")
    return "; ".join(hints)


def format_plan(p: Plan) -> str:
    c = p.config
    mem = "unlimited" if p.device_memory_gib is None else f"{p.device_memory_gib:g} GiB"
    lines = [
        f"model: {c.n_layer} layers, {c.n_head} heads, n_embd={c.n_embd}, vocab={c.vocab_size}, "
        f"{c.num_params(non_embedding=False) / 1e6:.0f}M parameters",
        f"devices: {p.num_nodes} node(s) x {p.devices_per_node} = {p.world_size}, {mem} each; micro-batch "
        f"B={p.batch_size} x T={p.seq_len} per DP rank; precision {p.precision}; activation checkpointing {p.ac}",
        f"{'layout':<14}{'params':>8}{'grads':>8}{'adamw':>8}{'activ.':>8}{'transient':>10}{'overhead':>9}{'total GiB':>11}  status",
    ]
    for lay in p.layouts:
        name, m = str(lay.layout), lay.memory
        if m is None:
            lines.append(f"{name:<14}{'-':>62}  invalid: {lay.reason}")
            continue
        g = [x / GIB for x in (m.params, m.grads, m.optimizer, m.activations, m.transient, m.overhead, m.total)]
        status = ("fits" if lay.fits else lay.reason) + ("  <- chosen" if lay is p.choice else "")
        lines.append(f"{name:<14}{g[0]:8.2f}{g[1]:8.2f}{g[2]:8.2f}{g[3]:8.2f}{g[4]:10.2f}{g[5]:9.2f}{g[6]:11.2f}  {status}")
    lines += [f"note: {n}" for n in p.notes]
    if p.choice is not None:
        lines.append(f"choice: data_parallel_size={p.choice.layout.dp}, tensor_parallel_size={p.choice.layout.tp}")
    return "\n".join(lines)


def resolve_layout(config: GPTConfig, world_size: int, devices_per_node: int, num_nodes: int, batch_size: int,
                   seq_len: int, device_memory_gib: float | None = None, precision: str = "bf16-mixed",
                   dp: int | str = "auto", tp: int | str = "auto", ac: str = "none", accum: int = 1,
                   total_batch_size: int | None = None, optimizer: str = "adamw") -> tuple[int, int]:
    """(dp, tp) when either size is "auto" (docs/scale.md): plan()'s choice, or a LayoutError with its refusal."""
    if world_size != devices_per_node * num_nodes:
        raise LayoutError(f"world_size={world_size} != devices_per_node={devices_per_node} x num_nodes={num_nodes}")
    if dp != "auto" and tp != "auto":
        return int(dp), int(tp)
    p = plan(config, devices_per_node, num_nodes, batch_size, seq_len, device_memory_gib, precision, ac=ac, dp=dp,
             tp=tp, accum=accum, total_batch_size=total_batch_size, optimizer=optimizer)
    if p.choice is None:
        raise LayoutError(refusal(p))
    return p.choice.layout.dp, p.choice.layout.tp


def refusal(p: Plan) -> str:
    """Why a plan has no choice, in one line: what `cli.py fit` with `auto` sizes and the planner command both say."""
    return (f"no data_parallel_size x tensor_parallel_size layout of {p.world_size} devices works for this run: "
            f"{p.notes[-1]} (python -m gpt_tp.cli.planner with the same arguments shows the table)")

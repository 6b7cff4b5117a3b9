"""Command: the layout planner's table, for a named model or `python cli.py fit`'s arguments (docs/scale.md)."""

from gpt_tp.entry import ArgumentParser, run
from gpt_tp.hardware import detect_device_memory_gib
from gpt_tp.model import SIZES, GPTConfig
from gpt_tp.sizing import AC_MODES, PRECISIONS, LayoutError, PlanError
from gpt_tp.sizing.planner import Plan, format_plan, plan, refusal


def training_settings(args: list[str]) -> dict:
    """Model, batch and device settings of `python cli.py fit *args`, read by the trainer's own parser."""
    from gpt_tp.cli.config import read_training_config  # imports Lightning: only when a training config is given
    from gpt_tp.train.optim import optimizer_from
    t = read_training_config(args)
    trainer, model, precision = t.fit.trainer, t.fit.model, t.fit.trainer.precision
    return {"config": t.model, "devices_per_node": t.devices, "num_nodes": int(trainer.num_nodes),
            "batch_size": t.fit.data.batch_size, "seq_len": t.fit.data.seq_len,
            "precision": "32-true" if precision is None else str(precision), "ac": model.activation_checkpointing,
            # a numeric TP fixes DP (the devices over TP), which the plan derives from its own devices, flags included
            "dp": t.dp if t.tp == "auto" else "auto", "tp": t.tp, "accum": trainer.accumulate_grad_batches or 1,
            "total_batch_size": model.total_batch_size, "optimizer": optimizer_from(model.optimizer.as_dict()).kind}


def main(argv: list[str] | None = None) -> Plan:
    ap = ArgumentParser(
        prog="python -m gpt_tp.cli.planner",
        description="List the DP x TP layouts of a GPT-2 on a cluster, with estimated memory per device, and pick "
        "the one with the smallest tensor-parallel size that fits.\n\nAny other arguments are those of `python cli.py "
        "fit` (--config FILE, repeatable, and overrides such as --data.batch_size 8 or --model.model.n_layer 4): the "
        "model, devices, nodes, batch size, seq_len, precision and activation checkpointing are read from them as the "
        "trainer reads them; the flags below win over them.",
    )
    ap.add_argument("--model", choices=list(SIZES), help="named model size (default gpt2)")
    ap.add_argument("--vocab-size", type=int, help="override the vocabulary (e.g. padded for a TP size)")
    ap.add_argument("--devices-per-node", type=int, help="GPUs per node (TP stays within a node)")
    ap.add_argument("--nodes", type=int, help="number of nodes (default 1)")
    ap.add_argument("--memory-gib", type=float, help="memory per device in GiB (default: CUDA device 0's, else no limit)")
    ap.add_argument("--batch-size", type=int, help="micro-batch per data-parallel rank (data.batch_size; default 16)")
    ap.add_argument("--seq-len", type=int, help="sequence length T (data.seq_len; default the model's block_size, at most 1024)")
    ap.add_argument("--precision", choices=list(PRECISIONS), help="trainer.precision (default bf16-mixed)")
    ap.add_argument("--ac", choices=AC_MODES, help="activation checkpointing per block (model.activation_checkpointing; default none)")
    ap.add_argument("--overhead-gib", type=float, default=1.5, help="CUDA context + NCCL + allocator slack per device")
    args, training = ap.parse_known_args(argv)
    if training and not training[0].startswith("-"):
        ap.error(f"unrecognized arguments: {' '.join(training)}")
    # without a training config: GPT-2, and plan()'s own defaults for the rest
    settings = training_settings(training) if training else {"config": GPTConfig.from_name("gpt2"),
                                                             "devices_per_node": None, "seq_len": None}
    if args.model:
        settings["config"] = GPTConfig.from_name(args.model)
    if args.vocab_size is not None:
        settings["config"].vocab_size = args.vocab_size
    flags = {"devices_per_node": args.devices_per_node, "num_nodes": args.nodes, "batch_size": args.batch_size,
             "seq_len": args.seq_len, "precision": args.precision, "ac": args.ac}
    settings |= {key: val for key, val in flags.items() if val is not None}
    if settings["devices_per_node"] is None:
        raise PlanError("give --devices-per-node (or a --config with a number in trainer.devices)")
    if settings["seq_len"] is None:
        settings["seq_len"] = min(1024, settings["config"].block_size)
    memory = args.memory_gib if args.memory_gib is not None else detect_device_memory_gib()
    p = plan(settings.pop("config"), **settings, device_memory_gib=memory, overhead_gib=args.overhead_gib)
    print(format_plan(p))
    return p


def command(argv: list[str] | None = None) -> None:
    """main, then, where no layout works, `cli.py fit`'s own line for `auto` sizes (exit 2)."""
    p = main(argv)
    if p.choice is None:
        raise LayoutError(refusal(p))


if __name__ == "__main__":
    run(command)

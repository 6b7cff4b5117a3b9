"""TrainingCLI, gpt_tp's LightningCLI, and read_training_config: `cli.py fit`'s settings without running it."""

import contextlib
import dataclasses
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentError, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from gpt_tp.checkpoint.contents import Contents
from gpt_tp.cli.checks import check_ckpt_path
from gpt_tp.errors import UserError
from gpt_tp.hardware import detect_device_memory_gib
from gpt_tp.model import GPTConfig
from gpt_tp.model.hf import read_hf_config
from gpt_tp.sizing import LayoutError
from gpt_tp.sizing.planner import resolve_layout
from gpt_tp.train.optim import optimizer_from
from gpt_tp.train.run import Run, resolve_run
from gpt_tp.train.datamodule import GPTDataModule
from gpt_tp.train.module import GPTModule
from gpt_tp.infer.predict import PROMPT_FLAGS, Prompts, PromptWriter


SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size")  # what a Hugging Face folder's config.json decides


def default_loggers(save_dir: str = "logs") -> list:
    """HeldCSVLogger always (a failed write stops every rank alike); HeldTensorBoardLogger where installed."""
    dirs = {"HeldCSVLogger": save_dir}
    if importlib.util.find_spec("tensorboard"):  # its own folder, so both number their versions alike
        dirs["HeldTensorBoardLogger"] = f"{save_dir}/tensorboard"
    return [{"class_path": f"gpt_tp.train.logs.{cls}", "init_args": {"save_dir": d, "name": "gpt_tp"}}
            for cls, d in dirs.items()]


class TrainingParser(LightningArgumentParser):
    """LightningCLI's parser that raises ArgumentError instead of exiting; for_subcommand: the subcommand it parses."""

    def __init__(self, *args, for_subcommand: str | None = None, **kwargs):
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)
        self.for_subcommand = for_subcommand


MAX_STEPS = ("model.max_steps follows trainer.max_steps (one number: the run's length and its learning-rate schedule's); "
             "set --trainer.max_steps only")


class ConfigFile(ActionConfigFile):
    """--config, refusing a file that sets model.max_steps: the link from trainer.max_steps would overwrite it silently
    (a link target has no default: only a config file puts it in the namespace, at the top or under `fit:`)."""

    def __call__(self, parser, cfg, values, option_string=None) -> None:
        had = [k for k in cfg.keys() if k.endswith("model.max_steps")]
        super().__call__(parser, cfg, values, option_string)
        if [k for k in cfg.keys() if k.endswith("model.max_steps")] != had:
            raise UserError(f"{values}: {MAX_STEPS}")


def _short_union_error(message: str) -> str:
    """jsonargparse's "does not validate against any of the Union subtypes" lists every subtype's error (600+
    characters): keep the first, and for a nested flag on a list (--trainer.callbacks.dirpath) say what it set."""
    m = re.match(r'Parser key "(?P<key>[^"]+)": Does not validate against any of the Union subtypes .*? Errors: - '
                 r'(?P<first>.+?)(?= - |$)', message)
    if m is None:
        return message
    expected = re.findall(r" - Expected a (typing\.Literal\[[^\]]*\]|<class '[^']+'>)", message)
    given = re.search(r"Given value: (.*)$", message)
    if given and len(expected) == message.count(" - "):  # every subtype only says "Expected a <type>": list them
        names = [n.strip(" '") for e in expected
                 for n in (e[len("typing.Literal["):-1].split(",") if e.startswith("typing.") else [e[8:-2]])]
        choices = ["null" if n == "NoneType" else n for n in names]
        return f"{m['key']}: expected one of {', '.join(dict.fromkeys(choices))}; got {given[1]!r}"
    nested = re.search(r"NestedArg\(key='([^']+)'", message)
    hint = (f" (--{m['key']}.{nested[1]} sets {nested[1]} on the last entry of {m['key']}; set it in that entry of your "
            "config file instead)") if nested else ""
    return f"{m['key']}: {m['first']}{hint}"


def parse(parser: LightningArgumentParser, args: list[str] | None, sub: str | None = None):
    """parser.parse_args (None: the command line); a mistake is a UserError naming it and `cli.py <sub> --help`."""
    argv = sys.argv[1:] if args is None else args
    try:
        return parser.parse_args(args)
    except ArgumentError as e:
        message = _short_union_error(" ".join(str(e).split()))
        if "model.max_steps" in message:  # a link target: jsonargparse's own refusal, said plainly
            raise UserError(MAX_STEPS) from None
        unknown = re.match(r'Parser key "model.optimizer": .*Expected a dot import path string: (\S+)$', message)
        if unknown:  # not a class_path of gpt_tp.train.optim's
            raise UserError(f"model.optimizer={unknown[1]}: use one of AdamW, Muon (--model.optimizer Muon "
                            "--model.optimizer.lr 0.02)") from None
        sub = sub or next((a for a in argv if a in TrainingCLI.subcommands()), None)
        raise UserError(f"{message} (see python cli.py {sub + ' ' if sub else ''}--help)") from None


class TrainingCLI(LightningCLI):
    """gpt_tp's LightningCLI: its model, data module, trainer and trainer defaults; fit, validate and predict."""

    def __init__(self, args: list[str] | None = None, run: bool = True, model_class: type = GPTModule, **kwargs):
        """model_class: GPTModule or a subclass of it (benchmarks/fit.py trains the reference plans through it)."""
        super().__init__(model_class, GPTDataModule, save_config_kwargs={"overwrite": True},
                         trainer_defaults={"logger": default_loggers(), "gradient_clip_val": 1.0,
                                           "inference_mode": False},  # DTensors do not support inference_mode on GPUs
                         parser_kwargs={sub: {"for_subcommand": sub} for sub in ("fit", "validate", "predict")},
                         auto_configure_optimizers=False,  # GPTModule.configure_optimizers: AdamW + warmup/cosine
                         parser_class=TrainingParser, args=args, run=run, **kwargs)

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        """LightningCLI's parser with gpt_tp's --config (ConfigFile)."""
        parser = self.parser_class(**kwargs)
        parser.add_argument("-c", "--config", action=ConfigFile, help="Path to a configuration file in json or yaml format.")
        return parser

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit, validate and predict; `test` is not offered (gpt_tp's data has a train and a val split only)."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k != "test"}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """trainer.max_steps is model.max_steps too; fit's --simulate, --overwrite_checkpoints; predict's prompts."""
        parser.link_arguments("trainer.max_steps", "model.max_steps")
        sub = getattr(parser, "for_subcommand", None)
        if sub == "fit":
            parser.add_argument("--simulate", action="store_true",
                                help="check the config at its full world size on this machine, without GPUs: one rank "
                                     "on a fake process group with fake tensors, its peak memory against the planner's")
            parser.add_argument("--simulate_rank", type=int, default=0, help="the rank --simulate builds")
            parser.add_argument("--simulate_memory_gib", type=float | None, default=None,
                                help="device memory --simulate checks the peak against (default: this machine's GPU)")
            parser.add_argument("--overwrite_checkpoints", type=bool, default=False,
                                help="a fresh run (no --ckpt_path) whose ModelCheckpoint dirpath holds another run's "
                                     "checkpoints deletes them first (default: refused, in one line)")
        if sub == "predict":
            parser.add_class_arguments(Prompts, None, as_group=True)
            parser.link_arguments(PROMPT_FLAGS, "data.prompts",  # the flags' values as the fields of the Prompts
                                  compute_fn=lambda *values: dict(zip(PROMPT_FLAGS, values)))
            parser.add_argument("--output", type=str | None, default=None,
                                help="also write {prompt, sample, text} JSON lines to this file (rank 0)")
            parser.add_argument("--overwrite_output", action="store_true", help="replace an existing --output file")
            parser.add_lightning_class_args(PromptWriter, "prompt_writer")
            parser.link_arguments("output", "prompt_writer.output")
            parser.link_arguments("overwrite_output", "prompt_writer.overwrite")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Parsed; a file given to --ckpt_path is read here without unpickling (garbage refused before Lightning loads it)."""
        self.config = parse(parser, args)
        self.argv = sys.argv[1:] if args is None else list(args) if isinstance(args, list) else []  # set_by's
        if sub := self.config.get("subcommand"):
            check_ckpt_path(self.config[sub].get("ckpt_path"), parsed=True)


def model_parallel(strategy) -> bool:
    """The trainer.strategy value is a ModelParallelStrategy (subclasses included); a registry name ("ddp") is not."""
    if isinstance(strategy, str):
        return False
    module, _, name = strategy.class_path.rpartition(".")
    try:
        return issubclass(getattr(importlib.import_module(module), name), ModelParallelStrategy)
    except (ImportError, AttributeError) as e:
        raise UserError(f"trainer.strategy.class_path={strategy.class_path}: cannot import it ({e})") from None


def parallel_sizes(strategy, world: int | None) -> tuple[int | str, int | str]:
    """(DP, TP) of a trainer.strategy value on `world` devices (None: not known yet), as TrainingConfig has them."""
    if not model_parallel(strategy):
        return "auto" if world is None else world, 1
    tp, dp = (strategy.init_args.get(k, "auto") for k in ("tensor_parallel_size", "data_parallel_size"))
    if dp == "auto" and tp != "auto" and world is not None and world % int(tp) == 0:
        dp = world // int(tp)
    return dp, tp


def check_config(cfg) -> None:
    """The checks a parsed config (one subcommand's namespace) gets before anything is built."""
    GPTConfig.resolve(cfg.model.model)  # its own checks, before jsonargparse buries them in a union-type error
    if str(cfg.trainer.precision).startswith("16") and model_parallel(cfg.trainer.strategy):
        raise UserError(f"trainer.precision={cfg.trainer.precision}: ModelParallelStrategy has no fp16 gradient scaler for "
                        "tensor-parallel/FSDP2 parameters; use trainer.precision=bf16-mixed (fp16 with its scaler "
                        "trains under --trainer.strategy ddp or on one device)")


def built_config(model, init_from: str | None) -> GPTConfig:
    """The GPTConfig GPTModule builds from model.model and model.init_from, reading init_from's config.json only."""
    config = GPTConfig.resolve(model)
    if init_from is None:
        return config
    cfg_file = Path(init_from) / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"model.init_from={init_from}: {cfg_file} not found (a Hugging Face GPT-2 folder holds "
                        "config.json and model.safetensors)")
    try:
        return read_hf_config(cfg_file, vocab_size=config.vocab_size)
    except UserError as e:  # read_hf_config turns a file that is not JSON, or a wrong field, into one
        raise UserError(f"model.init_from={init_from}: {e}") from None


def device_count(devices) -> int | None:
    """trainer.devices as a number per node (2, "2", [0, 1], "0,1"); None where the hardware tells (-1, "auto")."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        devices = devices.strip()
        if "," in devices:
            return len([d for d in devices.split(",") if d.strip()])
        devices = int(devices) if devices.lstrip("-").isdigit() else None
    return devices if isinstance(devices, int) and devices > 0 else None


def counted_devices(cfg, to: str) -> tuple[int, int]:
    """(devices per node, nodes) of a config that must name a number of devices `to` plan or simulate."""
    devices = device_count(cfg.trainer.devices)
    if devices is None:
        raise LayoutError(f"trainer.devices={cfg.trainer.devices!r}: give a number of devices per node to {to}")
    return devices, cfg.trainer.num_nodes


def set_by(argv: list[str], key: str) -> bool:
    """The command line sets `key` or a field of it (--key V, --key=V, --key.field V): only its flags are the user's
    choice over what a checkpoint records (a --config file's values are not)."""
    return any(a.split("=", 1)[0] == f"--{key}" or a.startswith(f"--{key}.") for a in argv)


def resolve_model(cfg, path: str | None, saved: Contents | None, argv: list[str]) -> None:
    """cfg.model.model becomes the model the run builds: the recorded model and optimizer of the checkpoint it loads
    (`saved`: what `path` holds) where the command line `argv` does not set them (a flag that disagrees is refused);
    or init_from's config.json's, a warning naming the model.model fields it does not use."""
    model = cfg.model
    if saved is not None and saved.model is not None:
        whole = next((k for k in ("init_from", "model") if any(a.split("=", 1)[0] == f"--model.{k}" for a in argv)), None)
        fields = [f.name for f in dataclasses.fields(GPTConfig) if whole or set_by(argv, f"model.model.{f.name}")]
        asked = built_config(model.model, model.init_from) if fields else None
        given = {f"model.model.{f}": (getattr(asked, f), getattr(saved.model, f)) for f in fields}
        if set_by(argv, "model.optimizer"):  # the class: its settings may change on resume
            given["model.optimizer"] = (type(optimizer_from(model.optimizer.as_dict())).__name__, saved.optimizer)
        for key, (now, was) in ((k, v) for k, v in given.items() if v[0] != v[1]):
            flag = f"--{key}={now}" if set_by(argv, key) else f"--model.{whole}={model[whole]} ({key}={now})"
            raise UserError(f"{flag}, but {path} was trained with {key}={was}: drop the flag (the checkpoint's value "
                            "is used), or start a new run")
        model.model, model.init_from = Namespace(**dataclasses.asdict(saved.model)), None
        if not set_by(argv, "model.optimizer") and isinstance(recorded := saved.hparams.get("optimizer"), dict):
            model.optimizer = Namespace(class_path=recorded["class_path"], init_args=Namespace(**recorded["init_args"]))
    elif model.init_from is not None:
        with contextlib.suppress(UserError):  # a folder GPTModule refuses: its loader names what is wrong with it
            built = built_config(model.model, model.init_from)  # its config.json decides the shape
            asked = GPTConfig.resolve(model.model)  # the run records the model built
            unused = [f"{k}={getattr(asked, k)}" for k in SHAPE_FIELDS if getattr(asked, k) != getattr(built, k)]
            if unused and not isinstance(model.model, str):
                rank_zero_warn(f"model.init_from={model.init_from} builds its config.json's model ("
                               f"{', '.join(f'{k}={getattr(built, k)}' for k in SHAPE_FIELDS)}); model.model's "
                               f"{', '.join(unused)} are not used, and the run records the model built")
            model.model = Namespace(**dataclasses.asdict(built))


def plan_layout(cfg, fit: bool) -> None:
    """trainer.strategy's `auto` data- and tensor-parallel sizes planned (gpt_tp.sizing.planner.resolve_layout) and set."""
    init = getattr(cfg.trainer.strategy, "init_args", None)
    if init is None or "auto" not in (init.get("data_parallel_size"), init.get("tensor_parallel_size")):
        return
    devices, nodes = counted_devices(cfg, "plan an 'auto' layout")
    dp, tp = resolve_layout(
        built_config(cfg.model.model, cfg.model.init_from), devices * nodes, devices, nodes,
        cfg.data.batch_size, cfg.data.seq_len, detect_device_memory_gib(), str(cfg.trainer.precision),
        dp=init.data_parallel_size, tp=init.tensor_parallel_size, ac=cfg.model.activation_checkpointing,
        accum=cfg.trainer.accumulate_grad_batches or 1, total_batch_size=cfg.model.total_batch_size if fit else None,
        optimizer=optimizer_from(cfg.model.optimizer.as_dict()).kind)
    init.data_parallel_size, init.tensor_parallel_size = dp, tp
    rank_zero_info(f"gpt_tp planner: DP={dp} x TP={tp} (python -m gpt_tp.cli.planner shows the table)")


def run_of(cfg, subcommand: str, config: GPTConfig, devices: int, nodes: int) -> Run:
    """The Run of a subcommand's parsed arguments: the same checks and lines for a launch and for --simulate."""
    fit = subcommand == "fit"
    dp, tp = map(int, parallel_sizes(cfg.trainer.strategy, devices * nodes))
    seq_len = cfg.data.seq_len if subcommand != "predict" else None
    model = cfg.model
    source = (f"model.init_from={model.init_from}" if model.init_from is not None
              else f"model.model={model.model}" if isinstance(model.model, str) else None)
    init = "trainer.strategy.init_args"  # cli.py's names for LayoutError's quantities (the shape's: its source's)
    flags = {"tp": f"{init}.tensor_parallel_size={tp}", "dp": f"{init}.data_parallel_size={dp}",
             "world_size": f"trainer.devices={devices} x trainer.num_nodes={nodes}",
             "devices": f"trainer.devices={devices}", "seq_len": f"data.seq_len={seq_len}"}
    for q in ("n_head", "n_embd", "vocab_size"):
        flags[q] = f"{source} ({q}={getattr(config, q)})" if source else f"model.model.{q}={getattr(config, q)}"
    return resolve_run(config, dp, tp, str(cfg.trainer.precision), model.activation_checkpointing, model.compile,
                       seq_len, cfg.data.batch_size if fit else None,
                       1 if (acc := cfg.trainer.accumulate_grad_batches) is None else acc,
                       model.total_batch_size if fit else None,
                       world_size=devices * nodes, devices_per_node=devices, flags=flags)


@dataclass
class TrainingConfig:
    """What `python cli.py fit` with the same arguments trains (every --config file, the overrides, the defaults)."""

    fit: Namespace  # the parsed and checked namespace: fit.model, fit.data, fit.trainer as cli.py fit has them
    model: GPTConfig  # the model GPTModule builds: model.model (a size or the fields), or model.init_from's config
    devices: int | None  # trainer.devices per node; None where the hardware decides at launch ("auto", -1)
    dp: int | str  # parallel_sizes on devices x trainer.num_nodes: "auto" where the planner or the hardware decides
    tp: int | str


class _ParseOnly(TrainingCLI):
    """TrainingCLI that parses `cli.py fit`'s arguments and stops: no seeding, no classes built, nothing run."""

    def __init__(self, args: list[str]):
        super().__init__(args=args, run=False)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        self.config = parse(parser, args, sub="fit")
        self.config["seed_everything"] = False  # LightningCLI seeds unless it is false: a parse seeds nothing

    def instantiate_classes(self) -> None:
        """Parse only."""


def read_training_config(args: list[str]) -> TrainingConfig:
    """The settings of `python cli.py fit *args` by its parser, defaults and checks; a mistake is a UserError."""
    for flag, value in zip(args, args[1:]):
        if flag in ("--config", "-c") and not Path(value).is_file():
            raise UserError(f"--config {value}: no such file (give a training YAML such as configs/cpu.yaml)")
    cfg = _ParseOnly(args).config
    check_config(cfg)
    per_node = device_count(cfg.trainer.devices)
    world = None if per_node is None else per_node * int(cfg.trainer.num_nodes)
    dp, tp = parallel_sizes(cfg.trainer.strategy, world)
    return TrainingConfig(cfg, built_config(cfg.model.model, cfg.model.init_from), per_node, dp, tp)

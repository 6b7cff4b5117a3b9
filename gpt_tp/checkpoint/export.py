"""Turn a distributed checkpoint into single-device weights.

torch: OUT_DIR/model.pt, {"config": GPTConfig fields, "state_dict": the single-device GPT state dict}.
hf: OUT_DIR/config.json + OUT_DIR/model.safetensors in Hugging Face GPT-2's layout, usable as model.init_from.
Runs in one process on the CPU, whatever layout saved the checkpoint; an existing non-empty OUT_DIR is never
overwritten (docs/train.md, "Checkpoints")."""

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from gpt_tp.entry import ArgumentParser, run
from gpt_tp.errors import UserError
from gpt_tp.model import hf_config_dict, to_hf_state_dict
from gpt_tp.checkpoint.contents import load_consolidated


class ExportError(UserError):
    """An output folder export cannot write; the message says which and what to do."""


def export(checkpoint: str, out: str, fmt: str = "both") -> Path:
    """Write `checkpoint`'s model to the new folder `out` in `fmt` ("torch", "hf" or "both"); returns the folder."""
    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"--out {out_dir} exists and is not an empty folder; choose a new --out (nothing is overwritten)")
    config, state = load_consolidated(checkpoint)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise ExportError(f"--out {out_dir}: cannot create it ({e.strerror}); choose a --out in a writable folder") from e
    try:
        if fmt in ("torch", "both"):
            torch.save({"config": dataclasses.asdict(config), "state_dict": state}, tmp / "model.pt")
        if fmt in ("hf", "both"):
            from safetensors.torch import save_file
            hf = to_hf_state_dict(state, config)
            hf.pop("lm_head.weight")  # tied to wte (tie_word_embeddings); safetensors refuses shared storage
            save_file({k: v.detach().clone().contiguous() for k, v in hf.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2))
            shutil.copymode(tmp / "config.json", tmp / "model.safetensors")  # safetensors writes 0600: the umask's
    except BaseException as e:  # a full disk, an interrupt: never a half-written export left
        full = shutil.disk_usage(tmp.parent).free < 2**20  # torch's zip writer reports a full disk with no errno
        shutil.rmtree(tmp, ignore_errors=True)
        if full and not isinstance(e, OSError):
            raise ExportError(f"--out {out_dir}: no space left on its device; free space or choose another --out") from e
        raise
    tmp.rename(out_dir)  # replaces an existing out_dir, empty (checked above), as POSIX rename does
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser("python -m gpt_tp.checkpoint.export", __doc__)
    ap.add_argument("checkpoint", help="a distributed checkpoint folder (e.g. checkpoints/tp2/last.ckpt)")
    ap.add_argument("--out", required=True, help="new output folder")
    ap.add_argument("--format", choices=("torch", "hf", "both"), default="both")
    args = ap.parse_args(argv)
    print(f"wrote {export(args.checkpoint, args.out, args.format)}")
    return 0


if __name__ == "__main__":
    run(main)  # a bad checkpoint or --out: one line, exit code 2 (gpt_tp.entry)

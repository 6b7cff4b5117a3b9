"""Distributed checkpoint folders: checked, published whole or not at all, recovered after a kill (docs/train.md)."""

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import zlib
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gpt_tp.checkpoint.lightning_internals import META
from gpt_tp.errors import UserError
from gpt_tp.sizing.sizes import checkpoint_bytes

PARTIAL = ".partial"
OLD = ".old"  # a checkpoint being replaced under its name
SUMS = "crc32.json"  # each file's CRC-32, recorded at save and checked at load

SPACE_TEXTS = ("No space left on device", "Disk quota exceeded", f"[Errno {errno.ENOSPC}]", f"[Errno {errno.EDQUOT}]")


def is_space_error(e: BaseException | None) -> bool:
    """A full disk or quota anywhere in the chain (DCP wraps each rank's OSError, so its text counts too)."""
    while e is not None:
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(t in str(e) for t in SPACE_TEXTS):
            return True
        e = e.__cause__ or e.__context__
    return False


def root_cause(e: BaseException) -> str:
    """The storage error under `e` in one line: the first `[Errno N] ...` in its chain or text, else its first line."""
    for x in (e, e.__cause__, e.__context__):
        if isinstance(x, OSError):
            return f"{type(x).__name__}: {x}"
        if x is not None and (found := re.search(r"\[Errno \d+\] [^\n]*", str(x))):
            return found[0]
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def checkpoint_space(folder: str | os.PathLike, config) -> tuple[int, int]:
    """(free bytes in `folder`, bytes a checkpoint of a model of GPTConfig `config` needs): the one measure of room to
    save, before a run (gpt_tp.cli.checks.check_space) and after a save that failed (ModelParallel)."""
    return shutil.disk_usage(folder).free, checkpoint_bytes(config)


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the path or parameters and what to do."""


def check_checkpoint(path: str | os.PathLike, expected_shapes: dict[str, tuple[int, ...]] | None = None, part=slice(0)) -> None:
    """Raise CheckpointError unless `path` is a complete, intact (check_intact; CRC-32s of the files in `part`) distributed
    checkpoint whose tensors (keys of expected_shapes, e.g. 'model.transformer.wte.weight') have the expected shapes."""
    p = Path(path)
    if not p.exists():
        aside = p.with_name(p.name + OLD)
        if aside.is_dir():
            raise CheckpointError(f"checkpoint folder {p} does not exist: a save that replaced it was interrupted and "
                                  f"{aside} holds it; load {aside}, or resume training from {p} (which moves it back "
                                  "first)")
        raise CheckpointError(f"checkpoint folder {p} does not exist (for a run: --ckpt_path takes a checkpoint folder or 'last')")
    if p.name.endswith(PARTIAL):
        raise CheckpointError(f"{p} is an unfinished checkpoint (its save was interrupted); resume from a checkpoint without '{PARTIAL}'")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file, not a distributed checkpoint folder (.metadata + *.distcp + {META})")
    inside = sorted(d.name for d in p.iterdir() if (d / ".metadata").is_file()) if not (p / ".metadata").exists() else []
    if inside:
        pick = "last.ckpt" if "last.ckpt" in inside else inside[-1]
        raise CheckpointError(f"{p} is a folder of checkpoints ({len(inside)}), not one: give {p / pick}, or 'last'")
    if missing := [f for f in (".metadata", META) if not (p / f).is_file()]:
        raise CheckpointError(f"{p} is not a complete distributed checkpoint: {', '.join(missing)} missing")
    try:
        metadata = FileSystemReader(str(p)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is the same user error
        raise CheckpointError(f"{p}/.metadata is unreadable ({type(e).__name__}: {e}); the checkpoint is corrupt") from e
    files = {getattr(s, "relative_path", None) for s in (metadata.storage_data or {}).values()} - {None}
    if missing := sorted(f for f in files if not (p / f).is_file()):
        raise CheckpointError(f"{p} is missing shard files {', '.join(missing)}; copy the whole checkpoint folder")
    check_intact(p, part, metadata)
    if expected_shapes is None:
        return
    saved = {k.removeprefix("state_dict."): tuple(v.size) for k, v in metadata.state_dict_metadata.items()
             if k.startswith("state_dict.") and isinstance(v, TensorStorageMetadata)}
    problems = [f"{k}: checkpoint {saved[k]} vs model {s}" for k, s in expected_shapes.items() if k in saved and saved[k] != s]
    problems += [f"{k}: in the model, not in the checkpoint" for k in expected_shapes if k not in saved]
    problems += [f"{k}: in the checkpoint, not in the model" for k in saved if k not in expected_shapes]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {p} does not fit this model (another model size?); set model.model to the "
                              f"size it was trained with: {problems[0]}{more}")


def crc32(path: Path) -> int:
    with open(path, "rb") as f:  # 16 MiB at a time
        return functools.reduce(lambda crc, chunk: zlib.crc32(chunk, crc), iter(lambda: f.read(1 << 24), b""), 0)


def checksums(folder: Path, part: slice) -> dict[str, int]:
    """The CRC-32 of each file in `folder`, of the sorted names those in `part` (one rank's share)."""
    return {f.name: crc32(f) for f in sorted(folder.iterdir())[part] if f.name != SUMS}


def damage(p: Path, part: slice = slice(None), metadata=None) -> str | None:
    """What is wrong with the files of the checkpoint folder `p`: a shard shorter than its .metadata says, or (of the
    sorted files, those in `part`) a CRC-32 other than the one its save recorded; None: nothing found."""
    stored = (metadata or FileSystemReader(str(p)).read_metadata()).storage_data.values()
    ends = {s.relative_path: s.offset + s.length for s in sorted(stored, key=lambda s: s.offset + s.length)}  # the max
    if short := [f"{p / f} is cut short ({size} bytes; its .metadata needs {n})" for f, n in sorted(ends.items())
                 if (size := (p / f).stat().st_size) < n]:
        return short[0]
    saved = json.loads((p / SUMS).read_text()) if (p / SUMS).is_file() else {}
    bad = [f for f, crc in checksums(p, part if saved else slice(0)).items() if saved.get(f, crc) != crc]
    return f"{p / bad[0]} does not match the CRC-32 its save recorded" if bad else None


def _intact(p: Path) -> bool:
    with contextlib.suppress(Exception):  # an unreadable .metadata: not intact
        return damage(p) is None
    return False


def check_intact(p: Path, part: slice = slice(None), metadata=None) -> None:
    """Raise CheckpointError naming what `damage` finds and the newest intact checkpoint beside `p`."""
    if (what := damage(p, part, metadata)) is None:
        return
    newest = (m.parent for m in sorted(p.parent.glob(f"*.ckpt/{META}"), key=os.path.getmtime, reverse=True))
    intact = next((o for o in newest if not o.is_symlink() and o.resolve() != p.resolve() and _intact(o)), None)
    fix = f"the newest intact checkpoint beside it is {intact}" if intact else "no intact checkpoint is beside it"
    raise CheckpointError(f"checkpoint {p} is damaged: {what}; {fix}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover_interrupted_saves(folder: str | os.PathLike, clean: bool = False) -> list[Path]:
    """Undo what a save killed mid-way left in `folder`: a `<name>.old` without its `<name>` goes back to `<name>`;
    with clean, other `.old` and all `.partial` folders go. Returns those put back; safe to run concurrently."""
    restored = []
    for old in sorted(Path(folder).glob(f"*{OLD}")):
        name = old.with_name(old.name.removesuffix(OLD))
        if not name.exists() and not name.is_symlink():
            with contextlib.suppress(FileNotFoundError):  # another process put it back first
                os.rename(old, name)
                restored.append(name)
        elif clean:
            shutil.rmtree(old, ignore_errors=True)
    if clean:
        for stale in Path(folder).glob(f"*{PARTIAL}"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in Path(folder).glob("*.ckpt.new"):  # a link a kill left before renaming it over last.ckpt
            stale.unlink(missing_ok=True)
    return restored


def publish(tmp: Path, final: Path, sums: list[dict[str, int]]) -> None:
    """Make the finished `tmp`, with the CRC-32s `sums` (each rank's checksums), the checkpoint `final`, never leaving
    `final` without one that recover_interrupted_saves cannot bring back."""
    (tmp / SUMS).write_text(json.dumps(dict(sorted(kv for d in sums for kv in d.items()))))
    for f in (tmp / META, tmp / SUMS, tmp):
        _fsync(f)
    old = final.with_name(final.name + OLD)
    if final.is_symlink() or final.is_file():
        final.unlink()
    elif final.exists():
        os.rename(final, old)  # a crash from here to the next rename: recover_interrupted_saves puts `old` back
    os.rename(tmp, final)  # atomic: the checkpoint appears complete or not at all
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)

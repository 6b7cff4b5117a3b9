"""Tokenize a text dataset into GPT-2 token shards in build-nanogpt's format.

Resumable through ``{prefix}_prepare.json``. Inputs, usage and errors: docs/data.md, "Preparing data"."""

import argparse
import json
import os
import signal
import sys
import time
import warnings
from collections import deque
from itertools import chain, islice, takewhile
from pathlib import Path

import numpy as np

from gpt_tp.data.shards import (GPT2_VOCAB, SHARD_RE, DataError, _SHARD_LIKE_RE, atomic_file, check_token_ids,
                                shard_header, shard_name, write_shard)
from gpt_tp.data.sources import load_rows, local_files, texts_of
from gpt_tp.data.tokenizer import ENCODING, get_encoding
from gpt_tp.entry import ArgumentParser, run

DEFAULT_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_CONFIG = "sample-10BT"
DEFAULT_OUT = "edu_fineweb10B"
DEFAULT_PREFIX = "edufineweb"
DEFAULT_SHARD_SIZE = 100_000_000
CHUNK_DOCS = 64  # documents per task sent to a worker
_enc = None  # a worker process's encoding


def _init_worker(encoding: str, pool: bool = False) -> None:
    global _enc
    if pool:  # Ctrl-C reaches the whole process group: the main process alone answers it (main), no worker traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _enc = get_encoding(encoding)


def _tokenize_chunk(chunk) -> list[np.ndarray]:
    """Each ``(index, text)`` as uint16 ``[eot] + encode_ordinary(text)``, ids checked before the cast (none wraps)."""
    out = []
    for index, text in chunk:
        tokens = np.array([_enc.eot_token] + _enc.encode_ordinary(text), dtype=np.int64)
        check_token_ids(tokens, GPT2_VOCAB, f"--encoding {_enc.name}, document {index}")
        out.append(tokens.astype(np.uint16))
    return out


def tokenized(texts, workers: int, encoding: str, first_index: int = 0):
    """Each text's uint16 tokens, in order, from ``workers`` processes with a bounded number of chunks in flight."""
    it = enumerate(texts, first_index)
    chunks = iter(lambda: list(islice(it, CHUNK_DOCS)), [])
    if workers <= 1:
        _init_worker(encoding)
        yield from chain.from_iterable(map(_tokenize_chunk, chunks))
        return
    import multiprocessing as mp
    with mp.Pool(workers, initializer=_init_worker, initargs=(encoding, True)) as pool:
        pending = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_tokenize_chunk, (chunk,)))
            if len(pending) >= 4 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


def _state_path(out: Path, prefix: str) -> Path:
    return out / f"{prefix}_prepare.json"


def _write_json(path: Path, obj) -> None:
    with atomic_file(path) as f:  # a full disk: the previous state stays, no half-written file beside it
        f.write((json.dumps(obj, indent=1) + "\n").encode())


def check_out_dir(out: Path, prefix: str, settings: dict) -> dict:
    """The output folder's resume state (its complete shards); DataError for shards of another run or format."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a folder: give a folder for the shards")
    ours = []
    for name in sorted(os.listdir(out)) if out.is_dir() else []:
        m = SHARD_RE.match(name)
        if m is None:
            if _SHARD_LIKE_RE.match(name) and not name.endswith((".tmp", ".json")):
                raise DataError(f"--out {out} holds {name}, a shard of another format (not uint16 .npy): "
                                "use an empty --out folder")
            continue
        shard_header(out / name)  # DataError for non-uint16 .npy
        if m.group("prefix") != prefix:
            raise DataError(f"--out {out} holds shards of prefix {m.group('prefix')!r}, not {prefix!r}: "
                            "use an empty --out folder (or that --prefix to resume them)")
        ours.append(name)
    sp = _state_path(out, prefix)
    if not sp.exists():
        if ours:
            raise DataError(f"--out {out} holds {prefix} shards without {sp.name} (made by another tool, e.g. "
                            "build-nanogpt's fineweb.py): they are usable as is; to prepare again use an empty --out")
        return {"settings": settings, "shards": [], "complete": False}
    state = json.loads(sp.read_text())
    if state.get("settings") != settings:
        old = state.get("settings") or {}
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        raise DataError(f"--out {out} holds shards prepared with other settings ({', '.join(diff)} differ, see "
                        f"{sp.name}): use another --out, or delete the folder to start over")
    good = list(takewhile(lambda e: (out / e["file"]).exists() and shard_header(out / e["file"])[0] == e["tokens"],
                          state["shards"]))  # the leading shards that are on disk, complete
    return {**state, "shards": good, "complete": state.get("complete", False) and len(good) == len(state["shards"])}


def default_out(local, prefix: bool = False) -> str:
    """--out (prefix: --prefix) when none is given: FineWeb-Edu's for the Hub, else named for the first local input."""
    name = Path(local[0]).resolve().stem if local else None
    return (name or DEFAULT_PREFIX) if prefix else f"{name}_shards" if name else DEFAULT_OUT


def prepare(out_dir=None, dataset=None, config=None, split="train", local=None, text_column="text",
            shard_size=DEFAULT_SHARD_SIZE, prefix=None, workers=None, encoding=ENCODING, progress=True) -> dict:
    """Tokenize ``local`` files/folders, or else the Hugging Face ``dataset`` / ``config`` / ``split`` (streamed;
    default FineWeb-Edu sample-10BT), into ``prefix`` shards under ``out_dir`` (None: default_out's); return the state."""
    prefix = default_out(local, prefix=True) if prefix is None else prefix
    if local and (dataset or config):
        raise DataError("--local reads local files: do not also give --dataset/--config")
    if shard_size < 1:
        raise DataError(f"--shard-size must be positive, got {shard_size}")
    if not prefix or not SHARD_RE.match(shard_name(prefix, "val", 0)) or "/" in prefix:
        raise DataError(f"--prefix {prefix!r}: use a plain file-name prefix such as edufineweb")
    workers = workers or max(1, (os.cpu_count() or 2) // 2)
    if local:
        source = {"local": [[Path(f).name, os.path.getsize(f)] for f in local_files(local)[0]]}
        where = f"--local {' '.join(map(str, local))}"
    else:
        dataset, config = dataset or DEFAULT_DATASET, config or (DEFAULT_CONFIG if not dataset else None)
        source = {"dataset": dataset, "config": config, "split": split}
        where = f"--dataset {dataset} --config {config} --split {split}"
    settings = {**source, "text_column": text_column, "encoding": encoding, "shard_size": shard_size, "prefix": prefix}
    if (enc := get_encoding(encoding)).n_vocab > GPT2_VOCAB:  # loaded here to fail before any worker starts
        raise DataError(f"--encoding {encoding} has {enc.n_vocab:,} token ids; shards hold GPT-2 BPE ids (0..{GPT2_VOCAB - 1}), "
                        "the vocabulary the model trains on: use --encoding r50k_base")

    out = Path(default_out(local) if out_dir is None else out_dir)
    state = check_out_dir(out, prefix, settings)
    if state["complete"]:
        _log(progress, f"{out}: already complete, {len(state['shards'])} shards, {state['tokens']:,} tokens")
        _warn_if_no_train_shard(out, state)
        return state
    shards = state["shards"]
    index = len(shards)
    next_doc, skip = (shards[-1]["next_doc"], shards[-1]["next_doc_token"]) if shards else (0, 0)
    if shards:
        _log(progress, f"{out}: resuming after {index} complete shards, at document {next_doc:,}")

    docs = texts_of(load_rows(dataset, config, split, local), text_column, where)
    first = next(docs)  # a wrong --text-column or an empty input fails here, before --out is created
    out.mkdir(parents=True, exist_ok=True)
    texts = islice(chain([first], docs), next_doc, None)
    buf = np.empty(shard_size, dtype=np.uint16)
    fill, ndocs, ntok, t0 = 0, next_doc, sum(s["tokens"] for s in shards), time.time()
    from tqdm.auto import tqdm
    bar = tqdm(unit="tok", unit_scale=True, desc=f"{prefix} shard {index}", disable=not progress, initial=ntok)

    def flush(next_at):
        nonlocal fill, index
        name = shard_name(prefix, "val" if index == 0 else "train", index)
        write_shard(out / name, buf[:fill])
        shards.append({"file": name, "tokens": fill, "next_doc": next_at[0], "next_doc_token": next_at[1]})
        _write_json(_state_path(out, prefix), {**state, "shards": shards, "complete": False})
        fill, index = 0, index + 1
        bar.set_description(f"{prefix} shard {index}")

    for doc, tokens in enumerate(tokenized(texts, workers, encoding, next_doc), next_doc):
        done = skip if doc == next_doc else 0  # these tokens already ended the last complete shard
        ndocs, ntok = doc + 1, ntok + len(tokens) - done
        while done < len(tokens):
            n = min(shard_size - fill, len(tokens) - done)
            buf[fill : fill + n] = tokens[done : done + n]
            fill, done = fill + n, done + n
            if fill == shard_size:
                flush((doc, done) if done < len(tokens) else (doc + 1, 0))
        bar.update(len(tokens))
        if ndocs % 256 == 0:
            bar.set_postfix(docs=f"{ndocs:,}", docs_s=f"{(ndocs - next_doc) / (time.time() - t0 + 1e-9):,.0f}")
    if fill:
        flush((ndocs, 0))
    bar.set_description(f"{prefix} {index} shards")
    bar.set_postfix(docs=f"{ndocs:,}", docs_s=f"{(ndocs - next_doc) / (time.time() - t0 + 1e-9):,.0f}")
    bar.close()
    state = {**state, "shards": shards, "complete": True, "documents": ndocs, "tokens": ntok}
    _write_json(_state_path(out, prefix), state)
    _log(progress, f"{out}: {len(shards)} shards, {ndocs:,} documents, {ntok:,} tokens")
    _warn_if_no_train_shard(out, state)
    return state


def _warn_if_no_train_shard(out: Path, state: dict) -> None:
    if len(state["shards"]) <= 1:
        tokens, size = state["tokens"], state["settings"]["shard_size"]
        warnings.warn(f"{out}: all {tokens:,} tokens fit in the val shard (--shard-size {size}), so there is no "
                      f"train shard to train on: rerun into an empty --out with a --shard-size below {tokens}, "
                      f"e.g. --shard-size {max(1, tokens // 10)} (shard 0 is val, the rest train)", stacklevel=3)


def _log(on: bool, msg: str) -> None:
    if on:
        print(msg, file=sys.stderr)


def _int(s: str) -> int:
    """An integer, also written like 1e8."""
    try:
        if float(s).is_integer():  # False for inf and nan
            return int(float(s))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"not an integer: {s!r}")


def main(argv=None) -> int:
    p = ArgumentParser("python -m gpt_tp.data.prepare", __doc__.split("\n\n")[0])
    p.add_argument("--dataset", help=f"Hugging Face dataset (default {DEFAULT_DATASET})")
    p.add_argument("--config", help=f"dataset config (default {DEFAULT_CONFIG} for {DEFAULT_DATASET})")
    p.add_argument("--split", default="train", help="dataset split to read (default train)")
    p.add_argument("--local", nargs="+", metavar="PATH",
                   help="local .jsonl/.json/.parquet/.txt files or folders instead of the Hub (a .txt file is one document)")
    p.add_argument("--text-column", default="text", help="column holding the text (default text)")
    p.add_argument("--out", dest="out_dir", metavar="OUT",
                   help=f"output folder (default {DEFAULT_OUT}; with --local, <first input's name>_shards)")
    p.add_argument("--shard-size", type=_int, default=DEFAULT_SHARD_SIZE, help="tokens per shard (default 1e8)")
    p.add_argument("--prefix", help=f"shard file prefix (default {DEFAULT_PREFIX}; with --local, the first input's name)")
    p.add_argument("--workers", type=int, help="tokenizer processes (default half the CPUs)")
    p.add_argument("--encoding", default=ENCODING, help=f"tiktoken encoding (default {ENCODING} = GPT-2 BPE)")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress bar")
    args = p.parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            prepare(**vars(args))
        except KeyboardInterrupt:
            out = args.out_dir or default_out(args.local)
            print(f"interrupted: the complete shards in {out} are kept; run the same command again to resume",
                  file=sys.stderr)
            return 130
    for w in caught:  # one plain line each, as the errors are
        print(f"warning: {w.message}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run(main)

"""Where prepare's documents come from: local files (jsonl/json, parquet, txt; maybe compressed) or a Hub dataset."""

from pathlib import Path

from gpt_tp.errors import DataError

LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
COMPRESSION = {".gz", ".bz2", ".xz", ".zst", ".lz4"}


def local_files(paths) -> tuple[list[str], str]:
    """The non-empty data files of ``paths`` (folders searched recursively, sorted) and their ``datasets`` builder."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and _builder(q) is not None)
            if not found:
                raise DataError(f"--local {p}: folder holds no {'/'.join(LOCAL_BUILDERS)} files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"--local {p}: no such file or folder")
    files = [f for f in files if f.stat().st_size > 0]  # empty files hold no documents
    if not files:
        raise DataError(f"--local {' '.join(map(str, paths))}: empty input, all files are empty")
    if bad := next((f for f in files if _builder(f) is None), None):
        raise DataError(f"--local {bad}: unknown file type; use {', '.join(LOCAL_BUILDERS)} (optionally compressed)")
    kinds = {_builder(f) for f in files}
    if len(kinds) > 1:
        raise DataError(f"--local mixes file types {sorted(kinds)}: prepare one type at a time")
    return [str(f) for f in files], kinds.pop()


def _builder(path: Path):
    """The builder of ``path``'s last suffix that is not a compression's; None for an unknown type."""
    return next((LOCAL_BUILDERS.get(s) for s in map(str.lower, reversed(path.suffixes)) if s not in COMPRESSION), None)


def load_rows(dataset=None, config=None, split="train", local=None):
    """The input as a streaming ``datasets`` iterable of rows; errors mapped to DataError."""
    import datasets
    if local:
        files, builder = local_files(local)
        kwargs = {"sample_by": "document"} if builder == "text" else {}  # a .txt file is one document
        try:
            return datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)
        except Exception as e:
            raise DataError(f"--local: cannot read {len(files)} {builder} file(s) ({type(e).__name__}: {e})") from e
    try:
        return datasets.load_dataset(dataset, name=config, split=split, streaming=True)
    except datasets.exceptions.DatasetNotFoundError as e:
        raise DataError(f"--dataset {dataset!r}: not found on the Hugging Face Hub or not accessible ({e}); "
                        "check the name, log in for gated data, or use --local FILES") from e
    except ConnectionError as e:
        hint = ("offline mode is on (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE) and it is not in the datasets cache"
                if "OfflineModeIsEnabled" in str(e) else "HF_DATASETS_OFFLINE=1 reads it from the datasets cache if there")
        raise DataError(f"--dataset {dataset!r}: cannot reach the Hugging Face Hub ({e}); without internet use "
                        f"--local FILES; {hint}") from e
    except ValueError as e:
        msg = str(e)
        for flag, value in (("split", split), ("config", config)):
            if flag in msg.lower():
                raise DataError(f"--{flag} {value!r}: no such {flag} of {dataset!r} ({msg})") from e
        raise DataError(f"--dataset {dataset!r} --config {config!r}: {msg}") from e


def texts_of(rows, text_column: str, where: str):
    """The non-empty ``text_column`` strings of ``rows``; DataError if the column is missing or no row holds text."""
    n = rows_seen = 0
    for rows_seen, row in enumerate(rows, 1):
        if text_column not in row:
            raise DataError(f"{where}: no text column {text_column!r} (columns: {sorted(row)}); set --text-column")
        text = row[text_column]
        if not isinstance(text, str):
            raise DataError(f"{where}: row {rows_seen - 1} column {text_column!r} is {type(text).__name__}, not text")
        if text:
            n += 1
            yield text
    if n == 0:
        empty = f" ({rows_seen} rows, all with empty {text_column!r})" if rows_seen else ""
        raise DataError(f"{where}: empty input, no documents{empty}")

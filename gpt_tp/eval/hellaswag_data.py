"""The HellaSwag file: checking its records, downloading the official val split once, rendering token rows."""

import json
import reprlib
import os
import urllib.request
from pathlib import Path

from gpt_tp.data.shards import atomic_file, resolve_data_dir
from gpt_tp.entry import run
from gpt_tp.errors import UserError

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
FILENAME = "hellaswag_val.jsonl"
DEFAULT_CACHE_DIR = "data/hellaswag"


class HellaSwagError(UserError):
    """A missing, unreadable or malformed HellaSwag file; the message names the line(s) and the fix."""


def check_record(rec) -> str | None:
    """What is wrong with one parsed record, or None if it is usable."""
    if not isinstance(rec, dict):
        return f"expected a JSON object, got {type(rec).__name__}"
    if missing := [k for k in ("ctx", "endings", "label") if k not in rec]:
        return f"missing key(s) {', '.join(map(repr, missing))}"
    if not isinstance(rec["ctx"], str):
        return f"'ctx' must be a string, got {type(rec['ctx']).__name__}"
    if not isinstance(endings := rec["endings"], list) or len(endings) != 4:
        n = len(endings) if isinstance(endings, list) else type(endings).__name__
        return f"'endings' must be a list of 4 strings, got {n}" + (" endings" if isinstance(endings, list) else "")
    if not all(isinstance(e, str) and e.strip() for e in endings):
        return "'endings' must hold 4 non-empty strings"
    if isinstance(label := rec["label"], bool) or not isinstance(label, int) or not 0 <= label <= 3:
        return f"'label' must be an integer 0-3, got {reprlib.repr(label)}"
    return None


def read_examples(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """The checked records of a HellaSwag .jsonl file (the first `limit` if given); blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise HellaSwagError(f"HellaSwag file {path} not found: pass an existing hellaswag_val.jsonl, or path=None to download it")
    if limit is not None and limit < 1:
        raise HellaSwagError(f"limit={limit} must be >= 1 (or None for every example)")
    examples, errors = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(examples) + len(errors) >= limit:
                break
            if not line.strip():
                continue
            try:
                problem = check_record(rec := json.loads(line))
            except json.JSONDecodeError as e:
                problem = f"invalid JSON ({e.msg} at column {e.colno})"
            if problem:
                errors.append(f"{path}:{lineno}: {problem}")
            else:
                examples.append(rec)
    if errors:  # the first and the count: one readable line however many there are
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise HellaSwagError(f"{len(errors)} malformed HellaSwag record(s) (each needs 'ctx', 4 'endings', 'label' "
                             f"0-3), the first {errors[0]}{more}; fix or delete them, or re-download the file (delete "
                             "it from the cache dir)")
    if not examples:
        raise HellaSwagError(f"{path} holds no HellaSwag records")
    return examples


def fetch_url(url: str, timeout: float = 60.0) -> bytes:
    """The bytes at url (the one network call; tests replace it)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def download(dest: str | os.PathLike, url: str = HELLASWAG_URL) -> Path:
    """Fetch url into dest atomically: a crash or a concurrent reader never sees a half-written file."""
    dest = Path(dest)
    try:  # fetched before the cache folder is made: a failed download leaves no empty folder behind
        data = fetch_url(url)
    except Exception as e:
        raise HellaSwagError(f"could not download HellaSwag from {url} ({type(e).__name__}: {e}). Offline, fetch the "
                             f"file elsewhere and copy it to {dest}, or pass its location as path=/--path.") from e
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest, unique=True) as f:  # a temporary name of its own: nodes may share the cache folder
        f.write(data)
    return dest


def resolve_path(path: str | os.PathLike | None = None, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> Path:
    """`path` (a relative one not here: from the repository root, like data.data_dir), else the cached download."""
    if path is not None:
        p = resolve_data_dir(path)
        if not p.is_file():
            raise HellaSwagError(f"HellaSwag file {p} not found: fetch it where there is internet (python -m "
                                 f"gpt_tp.eval.hellaswag_data writes {DEFAULT_CACHE_DIR}/{FILENAME}) and copy it here, "
                                 "or give no path to download it into the cache dir")
        return p
    dest = Path(cache_dir).expanduser() / FILENAME
    return dest if dest.is_file() else download(dest)


def render_example(example: dict, enc) -> tuple[list[list[int]], list[list[int]], int]:
    """build-nanogpt's render_example, unpadded: 4 rows of context + " " + ending, their ending masks, the label."""
    ctx = enc.encode(example["ctx"])
    ends = [enc.encode(" " + end) for end in example["endings"]]  # GPT-2: the space belongs to the ending's first token
    return [ctx + e for e in ends], [[0] * len(ctx) + [1] * len(e) for e in ends], example["label"]


def main() -> None:
    """`python -m gpt_tp.eval.hellaswag_data`: the file fetched into data/hellaswag, where the GPU configs read it."""
    print(resolve_path())


if __name__ == "__main__":
    run(main)

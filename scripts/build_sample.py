"""Build the bundled sample corpus data/sample/ from the public-domain Shakespeare plays (a maintainer's tool:
the repository ships the result).

Each play or poem is one document, in sorted file order; the output is deterministic. See docs/data.md,
"Bundled sample corpus"."""

import shutil
from pathlib import Path

from gpt_tp.data.prepare import prepare
from gpt_tp.data.shards import REPO_ROOT
from gpt_tp.errors import DataError
from gpt_tp.entry import ArgumentParser, run

PREFIX = "shakespeare"
SHARD_SIZE = 100_000
OUT = REPO_ROOT / "data" / "sample"


def build_sample(corpus, out=OUT, shard_size: int = SHARD_SIZE, progress: bool = True,
                 overwrite: bool = False) -> dict:
    """Tokenize the plays in ``corpus`` into ``out`` (its shakespeare_* files are replaced only with ``overwrite``)
    and copy ``corpus/metadata.txt``, their sources, to ``out/SOURCES.txt``. Returns prepare's final state."""
    corpus, out = Path(corpus), Path(out)
    files = sorted(f for f in corpus.glob("*.txt") if f.name != "metadata.txt")
    if not files:
        raise DataError(f"--corpus {corpus}: no .txt files; give the folder of the Project Gutenberg plays")
    old = sorted(out.glob(f"{PREFIX}_*"))
    if old and not overwrite:
        raise DataError(f"--out {out} already holds a built sample ({len(old)} {PREFIX}_* files): pass --overwrite to "
                        "replace them, or give an empty --out")
    for f in old:  # always a fresh, deterministic build
        f.unlink()
    state = prepare(out, local=files, shard_size=shard_size, prefix=PREFIX, workers=1, progress=progress)
    if (corpus / "metadata.txt").exists():
        shutil.copyfile(corpus / "metadata.txt", out / "SOURCES.txt")
    print(f"{out}: {len(files)} documents, {state['tokens']:,} tokens in {len(state['shards'])} shards")
    return state


def main(argv=None) -> dict:
    p = ArgumentParser("python scripts/build_sample.py", __doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="folder of the plays' .txt files (and metadata.txt, their sources)")
    p.add_argument("--out", default=str(OUT), help="output folder (default: the repository's data/sample)")
    p.add_argument("--shard-size", type=int, default=SHARD_SIZE, help=f"tokens per shard (default {SHARD_SIZE})")
    p.add_argument("--overwrite", action="store_true", help="replace the shakespeare_* files already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    return build_sample(a.corpus, a.out, a.shard_size, progress=not a.quiet, overwrite=a.overwrite)


if __name__ == "__main__":
    run(main)

"""Build the bundled sample corpus data/sample/ from the public-domain Shakespeare plays.

    python scripts/build_sample.py --corpus DIR        # DIR: the 42 Project Gutenberg texts (*.txt, metadata.txt)

Each play or poem (one ``*.txt`` file, Project Gutenberg text; data/sample/SOURCES.txt lists their
sources) is one document, in sorted file order, tokenized with GPT-2's BPE by gpt_tp.data.prepare into
shards of 100,000 tokens:
``shakespeare_val_000000.npy`` (the first 100k tokens: All's Well That Ends Well, Antony and
Cleopatra and the start of As You Like It) and ``shakespeare_train_000001.npy`` ... (the rest,
about 1.47M tokens). The output is deterministic; rebuilding gives identical files.
"""

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpt_tp.data.shards import DataError  # noqa: E402
from gpt_tp.entry import run  # noqa: E402
from gpt_tp.data.prepare import prepare  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="folder of the plays' .txt files (and metadata.txt, their sources)")
    p.add_argument("--out", default=str(ROOT / "data" / "sample"), help="output folder (default data/sample)")
    p.add_argument("--shard-size", type=int, default=100_000, help="tokens per shard (default 100000)")
    a = p.parse_args(argv)
    corpus = Path(a.corpus)
    files = sorted(f for f in corpus.glob("*.txt") if f.name != "metadata.txt")
    if not files:
        raise DataError(f"--corpus {corpus}: no .txt files; give the folder of the Project Gutenberg plays")
    out = Path(a.out)
    for old in out.glob("shakespeare_*"):  # always a fresh, deterministic build
        old.unlink()
    state = prepare(out, local=files, shard_size=a.shard_size, prefix="shakespeare", workers=1)
    if (corpus / "metadata.txt").exists():
        shutil.copyfile(corpus / "metadata.txt", out / "SOURCES.txt")
    print(f"{out}: {len(files)} documents, {state['tokens']:,} tokens in {len(state['shards'])} shards")


if __name__ == "__main__":
    run(main)

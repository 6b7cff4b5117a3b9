"""GPT-2's BPE (tiktoken's ``r50k_base`` = ``gpt2``) from the ranks file in ``gpt_tp/data/assets``: no network."""

import base64
import hashlib
from functools import cache
from pathlib import Path

import tiktoken

from gpt_tp.errors import DataError

ENCODING = "r50k_base"
EOT = 50256  # <|endoftext|>
RANKS = Path(__file__).resolve().parent / "assets" / "r50k_base.tiktoken"
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # the hash tiktoken checks
# GPT-2's pre-tokenizer regex (openai/gpt-2 encoder.py), as tiktoken's r50k_base uses it
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def get_encoding(name: str = ENCODING):
    """``r50k_base`` from the shipped ranks file, any other name through tiktoken (network or TIKTOKEN_CACHE_DIR)."""
    if name == ENCODING:
        return _r50k_base()
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:
        raise DataError(f"--encoding {name!r}: tiktoken cannot load it ({type(e).__name__}: {str(e).splitlines()[0]}); use {ENCODING} "
                        "(GPT-2's BPE, shipped with gpt_tp), or set TIKTOKEN_CACHE_DIR to a folder holding its ranks file") from e


@cache
def _r50k_base():
    data = RANKS.read_bytes() if RANKS.is_file() else b""
    if hashlib.sha256(data).hexdigest() != RANKS_SHA256:
        raise DataError(f"{RANKS} is missing or damaged (sha256 is not {RANKS_SHA256}): reinstall gpt_tp "
                        "(or restore the file with git checkout)")
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}
    return tiktoken.Encoding(ENCODING, pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT},
                             explicit_n_vocab=EOT + 1)

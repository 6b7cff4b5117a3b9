"""The data room: the token-shard format (shards.py), GPT-2's tokenizer (tokenizer.py) and the FineWeb-Edu
preparation command (prepare.py)."""

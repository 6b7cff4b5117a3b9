"""The data room: the token-shard format (shards.py), GPT-2's tokenizer (tokenizer.py), where documents come from
(sources.py), the preparation command (prepare.py) and the bundled sample's build command (sample.py)."""

"""The data room: the token-shard format, GPT-2's tokenizer and the preparation commands (docs/structure.md)."""

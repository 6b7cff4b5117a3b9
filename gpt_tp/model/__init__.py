"""The model room: GPT-2 as plain single-device PyTorch and Hugging Face GPT-2 files; no parallelism."""

from gpt_tp.model.gpt import BLOCK_MATRICES, GPT, SIZES, Block, CausalSelfAttention, GPTConfig, MLP  # noqa: F401
from gpt_tp.model.hf import HF_VOCAB_SIZE, from_hf_state_dict, hf_config_dict, load_hf_dir  # noqa: F401
from gpt_tp.model.hf import qkv_from_per_head, qkv_to_per_head, to_hf_state_dict  # noqa: F401

"""GPT-2 as plain single-device PyTorch (build-nanogpt's model): c_attn's output rows are ordered per head and every
reshape infers the number of heads, so a TP shard runs the same code. The loss is in gpt_tp/train/module.py."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gpt_tp.errors import UserError


@dataclass
class GPTConfig:
    """Model shape. Defaults are GPT-2 124M with build-nanogpt's padded vocabulary."""

    block_size: int = 1024
    """Longest sequence the learned position embedding covers."""
    vocab_size: int = 50304
    """50257 BPE tokens padded to a multiple of 64 (and of 128): faster matmuls, divisible by TP degrees 1-8."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block; tensor parallelism gives each rank n_head / tp whole heads."""
    n_embd: int = 768
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout after embeddings, attention and MLP; 0 for pre-training as in build-nanogpt."""
    vocab_used: int | None = None
    """Token ids the tokenizer can produce (50257) when below vocab_size: lm_head gets a frozen 0 / -inf bias so the
    padding is never predicted (imported Hugging Face weights: their zero rows give logit 0). None: plain GPT-2."""

    def __post_init__(self) -> None:
        sizes = {k: getattr(self, k) for k in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")}
        if any(v < 1 for v in sizes.values()):
            raise UserError("model." + ", model.".join(f"{k}={v}" for k, v in sizes.items() if v < 1) + ": must be >= 1")
        if not 0 <= self.dropout < 1:
            raise UserError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.n_embd % self.n_head:
            raise UserError(f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}")
        if self.vocab_used is not None and not 0 < self.vocab_used <= self.vocab_size:
            raise UserError(f"model.vocab_used={self.vocab_used} must be in 1..model.vocab_size={self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_name(cls, name: str, **overrides) -> "GPTConfig":
        if name not in SIZES:
            raise UserError(f"unknown model size {name!r}; choose one of {', '.join(SIZES)} or give the fields")
        return cls(**{**SIZES[name], **overrides})

    @classmethod
    def resolve(cls, value) -> "GPTConfig":
        """A GPTConfig from a size name, a GPTConfig, or its fields (a dict or a namespace)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.from_name(value)
        return cls(**(dict(value) if isinstance(value, dict) else vars(value)))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; wte is tied to lm_head, wpe is left out with non_embedding (as nanoGPT reports)."""
        C, L = self.n_embd, self.n_layer
        per_block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
        return L * per_block + 2 * C + self.vocab_size * C + (0 if non_embedding else self.block_size * C)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 N (num_params) + 12 L C T (attention), as nanoGPT's estimate_mfu (PaLM B)."""
        return 6 * self.num_params(non_embedding=True) + 12 * self.n_layer * self.n_embd * seq_len

    def vocab_mask(self) -> torch.Tensor:
        """(vocab_size,) 0 for usable token ids, -inf for the padding from vocab_used on: lm_head's bias."""
        return torch.where(torch.arange(self.vocab_size) < self.vocab_used, 0.0, float("-inf"))


SIZES = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    # tests and the CPU demo: 4 heads so TP=2 and TP=4 both split whole heads
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=128),
}

# a block's matrices: Hugging Face stores them transposed (Conv1D), --model.optimizer Muon updates them
BLOCK_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim, self.dropout = config.head_dim, config.dropout
        # q, k, v for all heads in one matmul; output rows are grouped per head: [h: q(hd) k(hd) v(hd)]
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 * nh * hd), nh = heads held here
        B, T = qkv.shape[:2]  # from qkv: c_attn may gather a sequence slice x
        qkv = qkv.view(B, T, -1, 3, self.head_dim)  # (B, T, nh, 3, hd)
        q, k, v = qkv.transpose(1, 2).unbind(dim=3)  # each (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)
        self.checkpoint_kwargs = None  # activation checkpointing, set by gpt_tp.parallel.apply_ac (None: off)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_kwargs is None:
            return self._forward(x)
        # recompute the block in backward (non-reentrant); parameter names stay
        return checkpoint(self._forward, x, use_reentrant=False, **self.checkpoint_kwargs)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        # drawn from the global RNG before any module exists, so a model built on the meta device and initialised
        # after sharding (gpt_tp.parallel.materialize) gets exactly the numbers of the single-device init
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.vocab_used is not None)
        if self.lm_head.bias is not None:
            self.lm_head.bias.requires_grad_(False)  # a fixed mask over the vocabulary padding
        self.tie_weights()
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def tie_weights(self) -> None:
        """lm_head shares wte's matrix (GPT-2 ties them). Call again after anything that replaces parameters."""
        self.lm_head.weight = self.transformer.wte.weight

    @torch.no_grad()
    def init_weights(self, fill=torch.Tensor.copy_) -> None:
        """build-nanogpt's init. Every parameter is drawn at its full (unsharded) shape on the CPU from init_seed and
        handed to fill(param, full): the same numbers whatever the device or the sharding (gpt_tp.parallel's fill keeps
        the local shard)."""
        gen = torch.Generator().manual_seed(self.init_seed)

        def init(param: torch.Tensor, std: float | None = None, const: float | torch.Tensor = 0.0) -> None:
            full = torch.empty(param.shape, device="cpu")  # float32 draws, then cast: same numbers in any dtype
            fill(param, full.copy_(torch.as_tensor(const)) if std is None else full.normal_(0.0, std, generator=gen))

        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = 0.02 * (2 * self.config.n_layer) ** -0.5 if hasattr(module, "RESIDUAL_SCALE_INIT") else 0.02
                if module is not self.lm_head:  # lm_head.weight is wte.weight, initialised as an embedding
                    init(module.weight, std)
                if module.bias is not None:
                    init(module.bias, const=self.config.vocab_mask() if module is self.lm_head else 0.0)
            elif isinstance(module, nn.Embedding):
                init(module.weight, 0.02)
            elif isinstance(module, nn.LayerNorm):
                init(module.weight, const=1.0)
                init(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab_size). Under bf16 autocast the residual stream is bf16."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        tok, at = self.transformer.wte(idx), self.transformer.wpe(pos)  # (B, T, C), (T, C)
        bf16 = torch.is_autocast_enabled(idx.device.type) and torch.get_autocast_dtype(idx.device.type) == torch.bfloat16
        x = self.transformer.drop(tok.bfloat16() + at.bfloat16() if bf16 else tok + at)  # as FSDP2's bf16 wte, wpe
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab_size)

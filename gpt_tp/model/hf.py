"""Hugging Face GPT-2 files in and out: state-dict conversion, config.json, and loading a folder. HF keeps OpenAI's
Conv1D layout: weights are (in, out), the transpose of nn.Linear's, and c_attn's output columns are [q | k | v], each
over all heads. HF's vocabulary is the unpadded 50257."""

import json
from pathlib import Path

import torch

from gpt_tp.errors import UserError
from gpt_tp.model.gpt import BLOCK_MATRICES, GPT, GPTConfig

HF_VOCAB_SIZE = 50257


def qkv_to_per_head(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows [q | k | v] (each n_head blocks of hd) -> rows grouped per head [h: q k v]. Works for weight and bias."""
    return w.unflatten(0, (3, n_head, -1)).transpose(0, 1).flatten(0, 2)  # (3, nh, hd, ...) -> (nh * 3 * hd, ...)


def qkv_from_per_head(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of qkv_to_per_head."""
    return w.unflatten(0, (n_head, 3, -1)).transpose(0, 1).flatten(0, 2)  # (nh, 3, hd, ...) -> (3 * nh * hd, ...)


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Map a transformers GPT2LMHeadModel state dict onto ours (vocab padded with zero rows)."""
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("transformer.")
        if k == "lm_head.weight" or k.endswith((".attn.bias", ".attn.masked_bias")):  # tied; old causal-mask buffers
            continue
        if k.endswith(BLOCK_MATRICES):
            v = v.t()
        if k.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            v = qkv_to_per_head(v, config.n_head)
        if k == "wte.weight" and v.shape[0] < config.vocab_size:
            v = torch.cat([v, v.new_zeros(config.vocab_size - v.shape[0], v.shape[1])])
        out["transformer." + k] = v.contiguous()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    if config.vocab_used is not None:
        out["lm_head.bias"] = config.vocab_mask()
    return out


def to_hf_state_dict(sd: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our (full, unsharded) state dict -> transformers GPT2LMHeadModel layout, vocab cut back to 50257."""
    out = {}
    for name, v in sd.items():
        if name.startswith("lm_head."):  # weight tied to wte; bias is our padding mask
            continue
        k = name.removeprefix("transformer.")
        if k.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            v = qkv_from_per_head(v, config.n_head)
        if k.endswith(BLOCK_MATRICES):
            v = v.t()
        if k == "wte.weight":
            v = v[:HF_VOCAB_SIZE]
        out["transformer." + k] = v.contiguous()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def hf_config_dict(config: GPTConfig) -> dict:
    """The config.json transformers expects for this model (vocabulary 50257)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": HF_VOCAB_SIZE,
            "n_positions": config.block_size, "n_ctx": config.block_size, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "activation_function": "gelu_new",
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": True}


def read_hf_config(cfg_file: Path, vocab_size: int = 50304) -> GPTConfig:
    """GPTConfig from a Hugging Face GPT-2 config.json file; a file that is not one is a UserError naming it."""
    try:
        hf = json.loads(Path(cfg_file).read_text())
        if hf.get("model_type") != "gpt2":
            raise UserError(f"expected a GPT-2 checkpoint (model_type 'gpt2'), got model_type={hf.get('model_type')!r}")
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UserError(f"unsupported activation_function {hf['activation_function']!r}: gpt_tp uses GELU (tanh)")
        if missing := [k for k in ("n_positions", "n_layer", "n_head", "n_embd", "vocab_size") if k not in hf]:
            raise UserError(f"GPT-2 config fields {', '.join(missing)} missing")
        vocab = max(vocab_size, hf["vocab_size"])
        return GPTConfig(block_size=hf["n_positions"], vocab_size=vocab, n_layer=hf["n_layer"], n_head=hf["n_head"],
                         n_embd=hf["n_embd"], vocab_used=hf["vocab_size"] if hf["vocab_size"] < vocab else None)
    except UserError as e:
        raise UserError(f"{cfg_file}: {e}") from e
    except (ValueError, TypeError) as e:  # not JSON, or a field of the wrong type
        raise UserError(f"{cfg_file}: not a GPT-2 config.json ({type(e).__name__}: {e})") from e


def load_hf_dir(path: str, vocab_size: int = 50304) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Read a local Hugging Face GPT-2 directory (config.json + model.safetensors) into our layout; a config.json
    that is not GPT-2's, or weights that are unreadable or do not fit it, raise UserError naming the file."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg_file, weights = p / "config.json", p / "model.safetensors"
    if not p.is_dir():
        raise UserError(f"{p}: no such folder; model.init_from takes a Hugging Face GPT-2 folder "
                        "(config.json + model.safetensors)")
    if not cfg_file.exists() and (p / ".metadata").is_file():
        raise UserError(f"{p} is a gpt_tp checkpoint, not a Hugging Face folder: give it as --ckpt_path, or export it "
                        f"first (python -m gpt_tp.checkpoint.export {p} --out DIR)")
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found: a Hugging Face GPT-2 directory needs config.json and model.safetensors")
    config = read_hf_config(cfg_file, vocab_size)
    try:
        hf_state = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: any unreadable file is the same mistake
        raise UserError(f"{weights} is unreadable ({e}); copy or export the folder again") from e
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in GPT(config).state_dict().items()}
    try:
        state = from_hf_state_dict(hf_state, config)
    except RuntimeError as e:  # c_attn of another width than config.json's
        raise UserError(f"{weights} does not fit {cfg_file} ({e})") from e
    problems = [f"{k}: {tuple(v.shape)} vs config {expected[k]}"
                for k, v in state.items() if k in expected and tuple(v.shape) != expected[k]]
    problems += [f"{k} missing" for k in expected if k not in state] + [f"{k} unexpected" for k in state if k not in expected]
    if problems:
        more = f" ... and {len(problems) - 6} more" if len(problems) > 6 else ""
        raise UserError(f"{weights} does not fit {cfg_file}: {'; '.join(problems[:6])}{more}; copy or export the folder again")
    return config, state

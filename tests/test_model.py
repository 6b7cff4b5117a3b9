"""The single-device model: sizes, init, layout, and the Hugging Face GPT-2 mapping (checked with transformers)."""

import json

import pytest
import torch

from gpt_tp.model import GPT, GPTConfig, from_hf_state_dict, hf_config_dict, load_hf_dir, qkv_from_per_head, qkv_to_per_head, to_hf_state_dict



@pytest.fixture
def transformers():
    """Only the Hugging Face comparisons need transformers; the other model tests run without it."""
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_named_sizes_match_hugging_face_parameter_counts(name, transformers):
    ours = GPTConfig.from_name(name, vocab_size=50257)
    cfg = transformers.GPT2Config(**{k: v for k, v in hf_config_dict(ours).items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(cfg)
        mine = GPT(ours)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in mine.parameters()) == n_hf == ours.num_params(non_embedding=False)
    assert {"gpt2": 124_439_808, "gpt2-xl": 1_557_611_200}.get(name, n_hf) == n_hf


def test_default_config_is_gpt2_124m_with_padded_vocab():
    c = GPTConfig()
    assert (c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size) == (12, 12, 768, 1024, 50304)
    assert c.vocab_size % 64 == 0 and c.vocab_size >= 50257
    with pytest.raises(ValueError, match="unknown model size 'gpt3'.*gpt2-xl"):
        GPTConfig.from_name("gpt3")
    with pytest.raises(ValueError, match="n_embd=100 must be divisible by model.n_head=12"):
        GPTConfig(n_embd=100)


def test_init_is_build_nanogpt():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=8, n_head=4, n_embd=256, vocab_size=4096, block_size=256)
    m = GPT(cfg)
    assert m.lm_head.weight is m.transformer.wte.weight
    assert m.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert m.transformer.wpe.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for block in m.transformer.h:
        assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
        resid = 0.02 / (2 * cfg.n_layer) ** 0.5
        assert block.attn.c_proj.weight.std().item() == pytest.approx(resid, rel=0.05)
        assert block.mlp.c_proj.weight.std().item() == pytest.approx(resid, rel=0.05)
        for b in (block.attn.c_attn.bias, block.attn.c_proj.bias, block.mlp.c_fc.bias, block.ln_1.bias):
            assert torch.count_nonzero(b) == 0
        assert torch.all(block.ln_1.weight == 1)
    # deterministic for a seed, different across seeds
    torch.manual_seed(0)
    assert torch.equal(GPT(cfg).transformer.h[3].mlp.c_fc.weight, m.transformer.h[3].mlp.c_fc.weight)
    torch.manual_seed(1)
    assert not torch.equal(GPT(cfg).transformer.h[3].mlp.c_fc.weight, m.transformer.h[3].mlp.c_fc.weight)


def test_meta_build_then_init_weights_equals_eager_build():
    cfg = GPTConfig.from_name("tiny")
    torch.manual_seed(3)
    eager = GPT(cfg)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = GPT(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights()
    for (n, a), b in zip(eager.named_parameters(), meta.parameters()):
        assert torch.equal(a, b), n


def test_parameter_layout_is_independent_of_heads_and_attention_keeps_heads_whole():
    """The per-head q/k/v row order: the first half of c_attn's rows are exactly heads 0..nh/2-1 with their own q,k,v,
    so a rank holding them computes those heads' attention alone (what TP relies on)."""
    torch.manual_seed(0)
    cfg = GPTConfig.from_name("tiny")
    attn = GPT(cfg).transformer.h[0].attn
    x = torch.randn(2, 16, cfg.n_embd)
    full = attn.c_attn(x).view(2, 16, cfg.n_head, 3, cfg.head_dim)  # (B, T, nh, 3, hd)
    half = torch.nn.functional.linear(x, attn.c_attn.weight[: 3 * cfg.n_embd // 2], attn.c_attn.bias[: 3 * cfg.n_embd // 2])
    assert torch.equal(half.view(2, 16, -1, 3, cfg.head_dim), full[:, :, : cfg.n_head // 2])


def test_qkv_permutation_round_trip():
    w = torch.randn(3 * 64, 64)
    b = torch.randn(3 * 64)
    assert torch.equal(qkv_from_per_head(qkv_to_per_head(w, 4), 4), w)
    assert torch.equal(qkv_from_per_head(qkv_to_per_head(b, 4), 4), b)
    # head 1's q rows come right after head 0's v rows
    per_head = qkv_to_per_head(w, 4)
    assert torch.equal(per_head[48:64], w[16:32])


def _hf_tiny(transformers):
    torch.manual_seed(0)
    ours = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=50304, vocab_used=50257)
    cfg = transformers.GPT2Config(**{k: v for k, v in hf_config_dict(ours).items() if k != "architectures"})
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a wrong mapping shows
        for n, p in hf.named_parameters():
            if "ln" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return ours, hf


def test_hugging_face_import_gives_the_same_logits(transformers):
    ours, hf = _hf_tiny(transformers)
    m = GPT(ours).eval()
    m.load_state_dict(from_hf_state_dict(hf.state_dict(), ours))
    assert m.lm_head.weight is m.transformer.wte.weight
    idx = torch.randint(0, 50257, (2, 40))
    with torch.no_grad():
        ref = hf(idx).logits
        got = m(idx)
    assert got.shape[-1] == 50304
    torch.testing.assert_close(got[..., :50257], ref, rtol=1e-4, atol=1e-4)
    # the vocabulary padding (never trained in HF's weights) is masked, so the loss over all 50304 logits is HF's
    assert m.config.vocab_used == 50257 and not m.lm_head.bias.requires_grad
    assert torch.all(got[..., 50257:] == float("-inf"))
    y = torch.randint(0, 50257, (2, 40))
    loss = torch.nn.functional.cross_entropy(got.flatten(0, 1), y.flatten())
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(ref.flatten(0, 1), y.flatten()).item(), rel=1e-5)


def test_hugging_face_export_round_trip(tmp_path, transformers):
    ours, hf = _hf_tiny(transformers)
    m = GPT(ours).eval()
    m.load_state_dict(from_hf_state_dict(hf.state_dict(), ours))
    exported = to_hf_state_dict(m.state_dict(), ours)
    assert exported["transformer.wte.weight"].shape == (50257, 64)
    assert exported["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D (in, out)
    cfg = transformers.GPT2Config(**{k: v for k, v in hf_config_dict(ours).items() if k != "architectures"})
    hf2 = transformers.GPT2LMHeadModel(cfg).eval()
    missing, unexpected = hf2.load_state_dict(exported, strict=False)
    assert not unexpected and all(k.endswith("attn.bias") or k.endswith("masked_bias") for k in missing)
    idx = torch.randint(0, 50257, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(hf2(idx).logits, hf(idx).logits, rtol=1e-5, atol=1e-5)
    # through a local directory, as users would have it
    hf.save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    cfg2, sd = load_hf_dir(tmp_path / "gpt2")
    assert (cfg2.n_layer, cfg2.n_head, cfg2.n_embd, cfg2.block_size, cfg2.vocab_size) == (2, 4, 64, 64, 50304)
    m2 = GPT(cfg2).eval()
    m2.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(m2(idx)[..., :50257], hf(idx).logits, rtol=1e-4, atol=1e-4)


def test_hugging_face_bad_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="expected a GPT-2 checkpoint.*llama"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "activation_function": "relu"}))
    with pytest.raises(ValueError, match="activation_function 'relu'"):
        load_hf_dir(tmp_path)


def test_sequence_longer_than_block_size_is_refused():
    m = GPT(GPTConfig.from_name("tiny"))
    with pytest.raises(ValueError, match="exceeds model.block_size=128"):
        m(torch.zeros(1, 129, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_autocast_keeps_a_bf16_residual_stream(dtype):
    """Under bf16 autocast every block takes a bf16 residual stream on one device, the embeddings each rounded to bf16
    (as FSDP2's bf16 gathers of wte and wpe give it at DP > 1); fp16 autocast and none leave it float32."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    seen = []
    model.transformer.h[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=dtype):
        model(idx)
    model(idx)
    tok, pos = model.transformer.wte(idx), model.transformer.wpe(torch.arange(16))
    assert seen == [dtype if dtype == torch.bfloat16 else torch.float32, torch.float32]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = []
        model.transformer.h[0].register_forward_pre_hook(lambda m, args: x.append(args[0]))
        model(idx)
    assert torch.equal(x[0], tok.bfloat16() + pos.bfloat16())

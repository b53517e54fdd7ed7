"""The decoder computes what a LLaMA computes, with the shapes and init the paper describes."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hlat_api import MODEL_PRESETS, ModelDims
from hlat_trainer.export import hf_state_dict
from hlat_trainer.model import build_model, count_params

GQA = ModelDims(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=96,
                vocab_size=100, max_seq_len=32)


def hf_twin(dims: ModelDims) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=dims.vocab_size, hidden_size=dims.hidden_size,
        intermediate_size=dims.intermediate_size, num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
        max_position_embeddings=dims.max_seq_len, rope_theta=dims.rope_theta,
        rms_norm_eps=dims.norm_eps, tie_word_embeddings=False, attention_bias=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def copy_into_hf(ours: torch.nn.Module, hf: LlamaForCausalLM, dims: ModelDims) -> None:
    """Our fused, grouped layouts onto HF's separate projections: hlat-export's mapping."""
    hf.load_state_dict(hf_state_dict(ours.state_dict(), dims), strict=True)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_logits_match_huggingface_llama(kv_heads: int) -> None:
    dims = ModelDims(**{**GQA.__dict__, "kv_heads": kv_heads})
    ours = build_model(dims, seed=3)
    with torch.no_grad():  # non-trivial norm weights, so a missing norm weight would show
        for n, p in ours.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    hf = hf_twin(dims)
    copy_into_hf(ours, hf, dims)
    tokens = torch.randint(0, dims.vocab_size, (2, 17))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert count_params(ours) == sum(p.numel() for p in hf.parameters()) == dims.param_count()


def test_attention_is_causal() -> None:
    model = build_model(GQA, seed=1).eval()
    tokens = torch.randint(0, GQA.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % GQA.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_scaled_init_shrinks_output_projections_with_depth() -> None:
    dims = ModelDims(256, 8, 4, 4, 512, 64, 16)
    model = build_model(dims, seed=0)
    for i, layer in enumerate(model.layers):
        expected = 0.02 / math.sqrt(2 * (i + 1))
        for w in (layer.attention.wo.weight, layer.feed_forward.w_down.weight):
            assert w.std().item() == pytest.approx(expected, rel=0.05)
        assert layer.attention.wqkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert torch.equal(layer.attention_norm.weight, torch.ones(256))


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = (build_model(GQA, seed=s) for s in (5, 5, 6))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.output.weight, c.output.weight)


def test_presets_have_published_sizes() -> None:
    assert MODEL_PRESETS["7b"].param_count() == pytest.approx(6.74e9, rel=0.005)
    assert MODEL_PRESETS["70b"].param_count() == pytest.approx(68.98e9, rel=0.005)
    assert 1e6 < MODEL_PRESETS["tiny"].param_count() < 5e6
    # PaLM's 6N + 12*L*h*T: 6 x 6.607e9 non-embedding params + 12 x 32 x 4096 x 4096
    assert MODEL_PRESETS["7b"].flops_per_token(4096) == pytest.approx(4.609e10, rel=0.001)

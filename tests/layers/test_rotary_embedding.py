"""Rotary tables equal transformers' for every rope type we support."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nanovllm.config import get_rope_parameters, model_context_length
from nanovllm.layers.rotary_embedding import RotaryEmbedding

SCALINGS = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_cos_sin_match_transformers(name):
    head_dim, max_pos = 32, 512
    config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0, **SCALINGS[name]},
    )
    ours = RotaryEmbedding(head_dim, max_pos, get_rope_parameters(config))
    positions = torch.arange(max_pos)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    half = head_dim // 2
    torch.testing.assert_close(ours.cos_sin_cache[:, :half], cos[0, :, :half], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.cos_sin_cache[:, half:], sin[0, :, :half], rtol=1e-5, atol=1e-5)


def test_old_style_config_attributes_are_read():
    class Old:
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    params = get_rope_parameters(Old())
    assert params == {"type": "linear", "factor": 2.0, "rope_theta": 1234.0, "rope_type": "linear"}


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="longrope"):
        RotaryEmbedding(16, 64, {"rope_type": "longrope", "rope_theta": 10000.0})


def test_context_length_follows_vllm():
    def config(max_pos, **rope):
        return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=max_pos,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6, **rope})

    assert model_context_length(config(40960)) == 40960
    # Qwen3's long-context set-up: YaRN, factor 4 over its original 32,768 positions.
    assert model_context_length(config(40960, **SCALINGS["yarn"] | {"original_max_position_embeddings": 32768})
                                ) == 131072
    assert model_context_length(config(4096, **SCALINGS["linear"])) == 16384
    assert model_context_length(config(512, **SCALINGS["llama3"])) == 512  # llama3 configs give the stretched length

    class NoLimit:
        rope_theta = 1e4

    assert model_context_length(NoLimit()) is None


def test_yarn_table_reaches_the_stretched_context():
    """YaRN over 128 original positions, factor 4: the table holds 512 positions where
    max_position_embeddings says 256, and each equals transformers' at that position."""
    head_dim, max_pos = 32, 256
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_pos,
                         rope_parameters={"rope_type": "default", "rope_theta": 50000.0, **SCALINGS["yarn"]})
    ours = RotaryEmbedding(head_dim, max_pos, get_rope_parameters(config), model_context_length(config))
    assert ours.cos_sin_cache.shape == (512, head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), torch.arange(512)[None])
    half = head_dim // 2
    torch.testing.assert_close(ours.cos_sin_cache[:, :half], cos[0, :, :half], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.cos_sin_cache[:, half:], sin[0, :, :half], rtol=1e-5, atol=1e-5)


def test_every_layer_shares_the_models_one_table(qwen3_ckpt):
    from transformers import AutoConfig

    from nanovllm.models import get_model_class

    config = AutoConfig.from_pretrained(qwen3_ckpt)
    model = get_model_class(config)(config)
    tables = {layer.self_attn.rotary_emb.cos_sin_cache.data_ptr() for layer in model.model.layers}
    assert len(model.model.layers) > 1 and len(tables) == 1

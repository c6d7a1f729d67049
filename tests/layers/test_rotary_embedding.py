"""Rotary tables equal transformers' for every rope type we support."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nanovllm.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters

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

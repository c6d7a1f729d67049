"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, ...): Qwen3's attention, and in the MLP of
every `decoder_sparse_step`-th layer (except `mlp_only_layers`) a mixture of
`num_experts` experts of which each token uses `num_experts_per_tok`."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from nanovllm.config import num_experts_of
from nanovllm.layers.fused_moe import FusedMoE, expert_weight_target
from nanovllm.models.llama import LlamaMLP
from nanovllm.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config: PretrainedConfig, layer: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (num_experts_of(config) > 0 and layer not in (getattr(config, "mlp_only_layers", None) or [])
            and (layer + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, layer: int) -> nn.Module:
        if not is_sparse_layer(config, layer):
            return LlamaMLP(config)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only silu")
        return FusedMoE(num_experts_of(config), config.num_experts_per_tok, config.hidden_size,
                        config.moe_intermediate_size, renormalize=config.norm_topk_prob)

    def weight_target(self, name: str) -> tuple[str, object]:
        """Experts' gate_proj / up_proj / down_proj go into the layer's stacked w13 / w2."""
        return expert_weight_target(name) or super().weight_target(name)

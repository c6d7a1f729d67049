"""Model registry: config.architectures[0] -> our implementation."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none given in config.json)'}; "
        f"supported: {', '.join(MODEL_REGISTRY)}"
    )

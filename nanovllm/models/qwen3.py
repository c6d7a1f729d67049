"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys (no q/k/v bias
unless the config's attention_bias asks for it)."""
from nanovllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

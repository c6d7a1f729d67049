"""The Llama-family decoder: Llama 3.x, and through two switches Qwen2/2.5 and Qwen3.

    qkv_bias: Qwen2 adds a bias to the q/k/v projections.
    qk_norm:  Qwen3 RMS-normalises each query and key head before the rotary embedding.

Everything else (GQA, SwiGLU MLP, pre-norm residual blocks, rotary positions, tied or
untied LM head) is shared.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.config import get_rope_parameters, model_context_length
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, Route, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.compile import maybe_compile

if TYPE_CHECKING:  # imports Triton, which runs only where the kernels do
    from nanovllm.kernels.split_gemm import SplitSum


# Where checkpoints keep a layer's FP8 KV-cache scales (self_attn.<suffix>), and which of
# kv_scales each fills (None: both, the older single kv_scale).
KV_SCALE_NAMES = {
    ".k_scale": 0, ".v_scale": 1, ".k_proj.output_scale": 0, ".v_proj.output_scale": 1, ".kv_scale": None,
}


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool, rotary_emb: RotaryEmbedding):
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads, bias=qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # Llama and Qwen3 put a bias on o_proj too when attention_bias is set; Qwen2 never does.
        o_bias = getattr(config, "attention_bias", False)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb  # the model's one table, shared by every layer
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads)
        self.head_dim = head_dim
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor | SplitSum, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Attention from the fused projection's output: [num_tokens, num_heads * head_dim]
        for o_proj. The part of a layer that depends on how the step's tokens split into
        sequences (the prefill graphs run it between their pieces, executor/piecewise.py);
        the decoder layer calls qkv_proj before it and o_proj after it. out: a prefill
        step's output buffer to write into (the pieces' static one). qkv may be a SplitSum
        only where the attention stores_rotated (its kernels read one)."""
        if self.attn.stores_rotated():  # the Triton backend: norms, rotary and store in one kernel
            return self.attn.forward_rotary(qkv, positions, self.rotary_emb.cos_sin_cache, self.q_norm, self.k_norm,
                                            out)
        return self.attn(*self.split_heads(positions, qkv), out=out)

    @maybe_compile
    def split_heads(self, positions: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v heads from the fused projection, with q/k norms and rotary applied.
        Compiled as one function, the norms and the rotation fuse into one or two kernels
        instead of four: at decode batch sizes these are launch-bound."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only silu")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, defer: bool = False):
        """defer: the output may be a SplitSum (kernels/split_gemm.py), for a norm to read."""
        gate_up = self.gate_up_proj
        if gate_up.route(x, gated=True, defer=True) is Route.GATED:  # the GEMV with SiLU-and-mul in its epilogue
            return self.down_proj(gate_up(x, gated=True))
        return self.down_proj(self.act_fn(gate_up(x, defer=True)), defer=defer)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool, mlp: nn.Module,
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm, rotary_emb)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
        attn_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attn_out: where attention writes (the whole prefill graphs' static buffer). q/k/v
        may be a SplitSum where rotary_store reads it (Attention.stores_rotated)."""
        qkv, residual = self.pre_attention(hidden_states, residual, defer=self.self_attn.attn.stores_rotated())
        return self.post_attention(self.self_attn.attend(positions, qkv, out=attn_out), residual)

    def quantize_in_kernels(self) -> None:
        """Where the projections after the norms and SiLU-and-mul take FP8 inputs (their
        quantize_for), those kernels quantize what they write; not the norm before an MoE
        block, whose router reads the norm's output too."""
        self.input_layernorm.quantize_for(self.self_attn.qkv_proj)
        if isinstance(self.mlp, LlamaMLP):
            self.post_attention_layernorm.quantize_for(self.mlp.gate_up_proj)
            self.mlp.act_fn.quantize_for(self.mlp.down_proj)

    def pre_attention(self, hidden_states: torch.Tensor | SplitSum, residual: torch.Tensor | None,
                      defer: bool = False) -> tuple[torch.Tensor | SplitSum, torch.Tensor]:
        """The residual add, input norm and q/k/v projection: (qkv, residual); defer: qkv
        may be a SplitSum (kernels/split_gemm.py)."""
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return self.self_attn.qkv_proj(hidden_states, defer=defer), residual

    def post_attention(self, attn_output: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, the residual add and norm, the MLP: (hidden_states, residual). Projections
        whose reader is a norm or SiLU-and-mul may hand it a SplitSum (kernels/split_gemm.py):
        hidden_states may be one, which the next layer's input norm or the final norm reads."""
        hidden_states, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_output, defer=True),
                                                                residual)
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp(hidden_states, defer=True), residual
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool,
                 make_mlp: Callable[[PretrainedConfig, int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin table for all layers: at Qwen3's 40,960 positions it is 20 MiB in fp32.
        rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, get_rope_parameters(config),
                                     model_context_length(config))
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, qkv_bias, qk_norm, make_mlp(config, i), rotary_emb)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_out: torch.Tensor | None = None) -> torch.Tensor:
        """attn_out: a prefill step's buffer every layer's attention writes into in turn."""
        hidden_states, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden_size]
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_out)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # Checkpoint names that the loader folds into one of our fused parameters.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.model = LlamaModel(config, qkv_bias, self.qk_norm, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer: int) -> nn.Module:
        """The MLP of decoder layer `layer`."""
        return LlamaMLP(config)

    def weight_target(self, name: str) -> tuple[str, object]:
        """The parameter a checkpoint tensor goes into, and the shard of it (None: whole):
        names in packed_modules_mapping (q_proj -> qkv_proj shard "q", ...) land in their
        fused parameter; FP8 KV-cache scales in the attention's kv_scales, an FP8
        checkpoint's weight_scale_inv in the layer's weight_scale."""
        if name.endswith(".weight_scale_inv"):  # an FP8 checkpoint's block scales
            name = name.removesuffix("_inv")
        for suffix, shard in KV_SCALE_NAMES.items():
            if name.endswith(suffix):
                return name[: -len(suffix)] + ".attn.kv_scales", shard
        for ckpt_name, (fused_name, shard) in self.packed_modules_mapping.items():
            if f".{ckpt_name}." in name:
                return name.replace(f".{ckpt_name}.", f".{fused_name}."), shard
        return name, None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden_states, out)

"""A rank's model built and its weights loaded (the model's, and a draft model's under
speculative decoding): the layers made on the device in the configured dtype, inside
the rank's tensor-parallel group, the weights read (or dummy ones drawn), FP8 quantized
where asked, and the layers' Triton kernels set up; then its attention backend bound."""
from __future__ import annotations

import torch

from nanovllm.config import Config
from nanovllm.layers.attention import Attention, get_attention_backend
from nanovllm.layers.attention_backend import AttentionBackend
from nanovllm.layers.fused_moe import MoEOptions, use_moe_options
from nanovllm.layers.kernel_plan import use_triton_kernels
from nanovllm.layers.linear import quantize_after_loading
from nanovllm.layers.quantization import Fp8Options, use_fp8
from nanovllm.models import get_model_class
from nanovllm.utils.distributed import TPGroup, use_tp_group
from nanovllm.utils.loader import init_dummy_weights, load_model


def check_fp8_support(config: Config, device: torch.device) -> None:
    """FP8 weights, and an FP8 KV cache read by the Triton kernels, need FP8 conversions and
    tensor cores: compute capability 8.9 (Ada, Hopper) or later. Checked before loading."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        return
    if config.quantization == "fp8":
        raise ValueError("quantization='fp8' needs a GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper)")
    if config.kv_cache_dtype != "auto" and config.attention_backend_name == "triton":
        raise ValueError("an FP8 KV cache needs a GPU with FP8 conversions (compute capability 8.9+: Ada, Hopper) "
                         "for the Triton kernels; use attention_backend='torch' or kv_cache_dtype='auto'")


def build_model(config: Config, device: torch.device, group: TPGroup) -> torch.nn.Module:
    """config's model on `device`, this rank's shard of it, weights loaded."""
    check_fp8_support(config, device)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.torch_dtype)
    try:
        moe = MoEOptions(expert_parallel=config.enable_expert_parallel, kernel=config.kernels)
        fp8 = Fp8Options(config.fp8_weight_block, config.kernels) if config.quantization == "fp8" else None
        with torch.device(device), use_tp_group(group), use_moe_options(moe), use_fp8(fp8):
            model = get_model_class(config.hf_config)(config.hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.load_format == "dummy" and config.fp8_weight_block is not None:
        raise ValueError("load_format='dummy' cannot fill an FP8 checkpoint's layers; give the bf16 model's "
                         "config with quantization='fp8' instead")
    if config.load_format == "dummy":
        # Every rank fills its own shard from the same seed: consistent shapes, but not
        # the shards of the tensor_parallel_size 1 model's random weights.
        init_dummy_weights(model, config.seed)
    else:
        load_model(model, config.model, config.fp8_weight_block)
    if fp8 is not None:
        quantize_after_loading(model)
    if config.kernels == "triton":
        use_triton_kernels(model)
    return model


def bind_attention(model: torch.nn.Module, config: Config) -> tuple[list[Attention], AttentionBackend]:
    """The model's attention layers, each given config's attention backend (returned too)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    backend = get_attention_backend(config, layers[0].head_dim)
    for layer in layers:
        layer.backend = backend
    return layers, backend

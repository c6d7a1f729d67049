"""Engine configuration: one dataclass of vLLM-named engine arguments, checked once."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

# nano-vllm's default: 256-token blocks keep block tables short and the paged kernels'
# per-block overhead small.
DEFAULT_BLOCK_SIZE = 256
# On CPU there is no memory profile: the KV pool gets this many bytes unless
# num_kvcache_blocks says otherwise.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

DEVICES = ("auto", "cuda", "cpu")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class Config:
    """The model folder plus every engine argument (vLLM's names and meanings).

    `hf_config` is read from the checkpoint after the arguments are checked;
    `max_model_len` is capped by the model's `max_position_embeddings`.
    """

    model: str
    max_num_batched_tokens: int = field(default=16384, metadata={"help": "tokens computed per step; longer prompts are prefilled in chunks"})
    max_num_seqs: int = field(default=512, metadata={"help": "sequences running at once"})
    max_model_len: int = field(default=4096, metadata={"help": "longest prompt + output; capped by the model's max_position_embeddings"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "share of GPU memory for weights, activations and KV cache"})
    kvcache_block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "tokens per KV-cache block"})
    num_kvcache_blocks: int = field(default=-1, metadata={"help": "KV-cache blocks; -1 sizes the cache from free GPU memory (CPU: 1 GiB)"})
    enforce_eager: bool = field(default=False, metadata={"help": "no CUDA graphs and no torch.compile"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse the KV blocks of shared prompt prefixes"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "processes (GPUs) the model is split across"})
    device: str = field(default="auto", metadata={"help": "auto, cuda or cpu"})
    dtype: str = field(default="auto", metadata={"help": "auto (the checkpoint's), bfloat16, float16 or float32"})
    seed: int = field(default=0, metadata={"help": "seed for sampling (and dummy weights)"})
    load_format: str = field(default="auto", metadata={"help": "auto, or dummy: random weights of the right shapes"})
    attention_backend: str = field(default="auto", metadata={"help": "auto (Triton on CUDA, torch elsewhere), triton or torch"})
    max_logprobs: int = field(default=20, metadata={"help": "most alternatives a request may ask logprobs for"})
    hf_config: PretrainedConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_args()
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(
                f"model must be a local Hugging Face checkpoint folder with a config.json; got {self.model!r}"
            )
        self.hf_config = AutoConfig.from_pretrained(self.model)
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if limit is not None:
            self.max_model_len = min(self.max_model_len, limit)
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()

    def _check_args(self) -> None:
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size", "kvcache_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): each running sequence needs a token of budget per decode step"
            )
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.num_kvcache_blocks, int) or not (self.num_kvcache_blocks == -1 or self.num_kvcache_blocks > 0):
            raise ValueError(f"num_kvcache_blocks must be -1 (size from memory) or positive, got {self.num_kvcache_blocks!r}")
        for name, choices in (("device", DEVICES), ("dtype", ("auto", *DTYPES)), ("load_format", LOAD_FORMATS),
                              ("attention_backend", ATTENTION_BACKENDS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _check_tensor_parallel(self) -> None:
        """Each rank must hold whole attention heads, an equal slice of the MLP and of the
        vocabulary, and whole KV heads (split when there are at least as many as ranks,
        else replicated: each KV head on tensor_parallel_size / num_key_value_heads ranks)."""
        tp = self.tensor_parallel_size
        hf = self.hf_config
        num_heads = hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        for name, value in (("num_attention_heads", num_heads), ("intermediate_size", hf.intermediate_size),
                            ("vocab_size", hf.vocab_size)):
            if value % tp:
                raise ValueError(
                    f"tensor_parallel_size ({tp}) must divide the model's {name} ({value}); pick a divisor of it"
                )
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size ({tp}) and the model's num_key_value_heads ({num_kv_heads}) must divide "
                f"one another, so that each rank holds whole KV heads"
            )
        if self.torch_device.type == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size ({tp}) exceeds the {torch.cuda.device_count()} visible GPUs; "
                f"lower it or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
            )

    @classmethod
    def from_kwargs(cls, model: str, **engine_args: Any) -> Config:
        """Build from LLM(model, **engine_args); an unknown argument raises TypeError naming it."""
        known = {f.name for f in fields(cls) if f.init and f.name != "model"}
        for name in engine_args:
            if name not in known:
                raise TypeError(f"unknown engine argument {name!r}; known arguments: {', '.join(sorted(known))}")
        return cls(model, **engine_args)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA GPU; use device='cpu' or 'auto'")
        return torch.device(self.device)

    @property
    def attention_backend_name(self) -> str:
        """"auto" resolves to Triton on CUDA and the torch reference elsewhere."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.torch_device.type == "cuda" else "torch"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return dtype if dtype in DTYPES.values() else torch.float32

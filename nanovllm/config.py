"""Engine configuration: one dataclass of vLLM-named engine arguments, checked once.

Importing this module is cheap (torch and transformers load when a Config is built), so
the command line can make its flags from the fields without loading either.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from nanovllm.speculative_config import SpeculativeConfig, json_object
from nanovllm.utils import is_int
from nanovllm.utils.env import triton_interpreting

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# nano-vllm's default: 256-token blocks keep block tables short and the paged kernels'
# per-block overhead small.
DEFAULT_BLOCK_SIZE = 256
DEFAULT_MAX_MODEL_LEN = 4096  # for a model whose config gives no max_position_embeddings
# Rope scalings that stretch the positions a model takes by their factor (vLLM reads the
# context the same way; "llama3" configs already give the stretched length).
STRETCHING_ROPE_TYPES = ("linear", "yarn")
# max_prefill_graph_tokens=-1 (auto) where CUDA graphs run: a prompt joining running decodes
# then costs the host one replay instead of hundreds of launches, so it stalls their tokens
# far less (ITL at 20 requests/s in benchmarks/RESULTS.md, sessions 13 and 14).
DEFAULT_PREFILL_GRAPH_TOKENS = 2048
# On CPU there is no memory profile: the KV pool gets this many bytes, or what max_num_seqs
# sequences of max_model_len can fill where that is less, unless num_kvcache_blocks says otherwise.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

DEVICES = ("auto", "cuda", "cpu")
# dtype names, vLLM's aliases included -> torch's name for it
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")
# Where the default sampling parameters come from: the checkpoint's generation_config.json
# ("auto"), nanovllm's own ("vllm", vLLM's name for it), or another folder's.
GENERATION_CONFIGS = ("auto", "vllm")
REASONING_PARSERS = ("qwen3",)  # engine/reasoning.py's
# kv_cache_dtype names -> torch's FP8 dtype name ("auto": the model's dtype). vLLM's "fp8" is e4m3.
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
QUANTIZATIONS = ("fp8",)
# vLLM's name for an engine argument -> ours.
ALIASES = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}
# vLLM's engine arguments that change nothing here, at the values listed (None: at any
# value), so that scripts written for vLLM run; another value is a ValueError saying why.
NO_EFFECT: dict[str, tuple[Any, ...] | None] = {
    "disable_log_stats": None,  # the engine logs no periodic statistics offline
    "swap_space": None,  # no CPU swap: a preempted sequence is computed again, as in vLLM's V1 engine
    "disable_custom_all_reduce": None, "max_seq_len_to_capture": None, "enforce_eager_for_prefill": None,
    "tokenizer_mode": ("auto",), "task": ("auto", "generate"), "runner": ("auto", "generate"),
    "revision": (None,), "tokenizer_revision": (None,), "download_dir": (None,), "hf_token": (None,),
    "pipeline_parallel_size": (1,), "cpu_offload_gb": (0,), "distributed_executor_backend": (None, "mp"),
    "enable_lora": (False,), "skip_tokenizer_init": (False,),
}


def int_or_none(text: str) -> int | None:
    """A command-line integer, or "none" for None (the flag of an int argument that takes None)."""
    return None if text.lower() == "none" else int(text)


@dataclass
class Config:
    """The model folder plus every engine argument (vLLM's names and meanings).

    `hf_config` is read from the checkpoint after the arguments are checked;
    `max_model_len` defaults to the model's context as vLLM reads it (model_context_length); a
    larger value given is an error.
    """

    model: str
    max_num_batched_tokens: int = field(default=16384, metadata={"help": "tokens computed per step; longer prompts are prefilled in chunks"})
    max_num_seqs: int = field(default=512, metadata={"help": "sequences running at once"})
    max_model_len: int | None = field(default=None, metadata={"type": int, "help": "longest prompt + output; None: the model's context, its max_position_embeddings times a linear or YaRN rope scaling's factor (4096 where its config has none); more than that is an error"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "share of GPU memory for weights, activations and KV cache"})
    kvcache_block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "tokens per KV-cache block", "aliases": ("--block-size",)})
    num_kvcache_blocks: int = field(default=-1, metadata={"help": "KV-cache blocks; -1 sizes the cache from free GPU memory (CPU: 1 GiB at most)"})
    enforce_eager: bool = field(default=False, metadata={"help": "no CUDA graphs and no torch.compile"})
    max_prefill_graph_tokens: int = field(default=-1, metadata={"help": "steps with prompt tokens (prefills, and prompt chunks mixed into decode steps) of up to this many tokens replay CUDA graphs, captured at start-up per bucket of token counts, whole (attention included) with the Triton attention backend, else in layers + 1 pieces around attention; their activations come out of the memory gpu_memory_utilization leaves free; 0: they run eagerly; -1: 2048 where CUDA graphs run, else 0"})
    scheduling_policy: str = field(default="fcfs", metadata={"help": "fcfs: requests run in arrival order; priority: by each request's priority (lower first, then arrival), and preemption frees the lowest priority's newest"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse the KV blocks of shared prompt prefixes"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "vLLM's flag: prompts longer than max_num_batched_tokens are always prefilled in chunks, mixed into decode steps (False is refused)"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "processes (GPUs) the model is split across", "aliases": ("-tp",)})
    data_parallel_size: int = field(default=1, metadata={"help": "engine replicas, each on its own tensor_parallel_size GPUs (LLM.generate spreads the requests over them)", "aliases": ("-dp",)})
    enable_expert_parallel: bool = field(default=False, metadata={"help": "MoE models: place whole experts on the tensor-parallel ranks instead of a slice of every expert on each"})
    device: str = field(default="auto", metadata={"help": "auto, cuda or cpu"})
    dtype: str = field(default="auto", metadata={"help": "auto (the checkpoint's), bfloat16, float16 (half) or float32 (float); offline, a torch dtype too"})
    seed: int | None = field(default=0, metadata={"type": int_or_none, "help": "seed for sampling (and dummy weights); None (on the command line: none): a fresh one each run"})
    load_format: str = field(default="auto", metadata={"help": "auto, or dummy: random weights of the right shapes"})
    attention_backend: str = field(default="auto", metadata={"help": "auto (Triton on CUDA, torch elsewhere), triton or torch"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2: K/V stored in FP8 with per-layer scales, twice the tokens in the same memory"})
    calculate_kv_scales: bool = field(default=False, metadata={"help": "FP8 KV cache: take each layer's scales from the first prefill's keys and values (2x headroom over their largest; larger ones later saturate) instead of the checkpoint's (or 1.0)"})
    quantization: str | None = field(default=None, metadata={"help": "fp8: quantize the linear layers' weights to FP8 at load time (an FP8 checkpoint is detected from its config)"})
    max_logprobs: int = field(default=20, metadata={"help": "most alternatives a request may ask logprobs for; -1: the whole vocabulary (host buffers of max_num_seqs x vocabulary rows)"})
    tokenizer: str | None = field(default=None, metadata={"help": "folder of the tokenizer (default: the model's)"})
    trust_remote_code: bool = field(default=False, metadata={"help": "let transformers run code from the checkpoint's folder (tokenizer and config)"})
    generation_config: str = field(default="auto", metadata={"help": "default sampling parameters: auto (the checkpoint's generation_config.json), vllm (none), or a folder with one"})
    reasoning_parser: str | None = field(default=None, metadata={"help": "qwen3: the model's output starts with reasoning in <think>...</think>; structured outputs apply after it, and the server returns it as reasoning (and reasoning_content)"})
    speculative_config: dict | None = field(default=None, metadata={"type": json_object, "help": "speculative decoding, as vLLM's (JSON on the command line): {\"method\": \"ngram\", \"num_speculative_tokens\": K, \"prompt_lookup_max\": 5, \"prompt_lookup_min\": 5, \"disable_by_batch_size\": N} drafts up to K tokens from earlier occurrences of a sequence's last tokens (as vLLM's, the lookup bounds are 5 where neither is given, and one given sets the other); {\"model\": DRAFT_FOLDER, \"num_speculative_tokens\": K} drafts them with a smaller model of the same vocabulary (its greedy tokens). Each decode step (of fewer than N running sequences) verifies its drafts in one pass, drawing the tokens decoding would draw"})
    cpu_threads: int = field(default=0, metadata={"help": "torch threads on CPU; 0: all cores but one (or OMP_NUM_THREADS when set)"})
    hf_config: PretrainedConfig = field(init=False, repr=False)
    speculative: SpeculativeConfig | None = field(init=False, repr=False)  # speculative_config, checked
    draft: Config | None = field(init=False, repr=False)  # a draft model's (speculative method "draft_model")

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a local Hugging Face checkpoint folder (a path), got "
                            f"{type(self.model).__name__}")
        self._check_args()
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model must be a local Hugging Face checkpoint folder with a config.json; got {self.model!r}"
                             + hub_hint(self.model))
        from transformers import AutoConfig

        try:
            self.hf_config = AutoConfig.from_pretrained(self.model, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError) as exc:  # a corrupt or unknown config.json
            raise ValueError(f"cannot read {os.path.join(self.model, 'config.json')}: {exc}") from None
        if self.max_logprobs == -1 or self.max_logprobs > self.hf_config.vocab_size:  # vLLM's -1: no limit
            self.max_logprobs = self.hf_config.vocab_size
        limit = model_context_length(self.hf_config)
        if self.max_model_len is None:
            self.max_model_len = limit or DEFAULT_MAX_MODEL_LEN
        elif limit is not None and self.max_model_len > limit:  # as vLLM, an error rather than less
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's context ({limit}: "
                             f"max_position_embeddings and rope scaling); give at most {limit}")
        self._check_quantization_config()
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        self.draft = self._draft_config() if self.speculative and self.speculative.method == "draft_model" else None
        if (self.attention_backend == "triton" and self.torch_device.type != "cuda"
                and not triton_interpreting()):
            raise ValueError("attention_backend='triton' needs a CUDA GPU (on CPU its kernels run only under "
                             "Triton's interpreter, TRITON_INTERPRET=1, which is slow and meant for tests); use "
                             "'auto' or 'torch'")

    def _check_args(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size", "kvcache_block_size",
                     "data_parallel_size"):
            value = getattr(self, name)
            if name == "max_model_len" and value is None:  # the model's, once its config is read
                continue
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, least in (("max_logprobs", -1), ("cpu_threads", 0), ("max_prefill_graph_tokens", -1)):
            value = getattr(self, name)
            if not is_int(value) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): each running sequence needs a token of budget per decode step"
            )
        if (not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool)
                or not 0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not is_int(self.num_kvcache_blocks) or not (self.num_kvcache_blocks == -1 or self.num_kvcache_blocks > 0):
            raise ValueError(f"num_kvcache_blocks must be -1 (size from memory) or positive, got {self.num_kvcache_blocks!r}")
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):  # torch.bfloat16, as vLLM takes
            self.dtype = str(self.dtype).removeprefix("torch.")
        for name, choices in (("device", DEVICES), ("dtype", ("auto", *DTYPES)), ("load_format", LOAD_FORMATS),
                              ("attention_backend", ATTENTION_BACKENDS), ("scheduling_policy", SCHEDULING_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if self.seed is None:  # as vLLM's: runs differ
            self.seed = random.SystemRandom().randrange(1 << 31)
        if not is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 63:
            raise ValueError(f"seed must be a 64-bit signed integer or None, got {self.seed!r}")
        for name in ("enforce_eager", "enable_prefix_caching", "trust_remote_code", "enable_expert_parallel",
                     "calculate_kv_scales", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.enable_chunked_prefill:
            raise ValueError("enable_chunked_prefill=False is not supported: long prompts are always prefilled in "
                             "chunks of max_num_batched_tokens, mixed into decode steps")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales is for an FP8 KV cache: set kv_cache_dtype='fp8' too")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset); got {self.quantization!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {self.reasoning_parser!r}")
        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer must be a local folder; got {self.tokenizer!r}" + hub_hint(self.tokenizer))
        if self.generation_config not in GENERATION_CONFIGS and not os.path.isfile(
                os.path.join(self.generation_config, "generation_config.json")):
            raise ValueError(f"generation_config must be auto, vllm, or a folder with a generation_config.json; "
                             f"got {self.generation_config!r}")

    def _draft_config(self) -> Config:
        """The draft model's Config: its folder, and this one's ranks (or the first alone), dtype
        and cache layout (its KV cache has as many blocks, read through the same block tables); its context
        is its own, or speculative_config's max_model_len (at most that and max_model_len), where
        shorter than max_model_len (sequences past it draft nothing)."""
        spec = self.speculative
        ranks = spec.draft_tensor_parallel_size or self.tensor_parallel_size
        if ranks not in (1, self.tensor_parallel_size):
            raise ValueError(f"speculative_config: draft_tensor_parallel_size ({ranks}) must be "
                             f"tensor_parallel_size ({self.tensor_parallel_size}: the draft split over the model's "
                             f"ranks) or 1 (the draft whole on the first)")
        try:
            draft = replace(self, model=spec.model, speculative_config=None, quantization=spec.quantization,
                            tensor_parallel_size=ranks,
                            tokenizer=None, dtype=str(self.torch_dtype).removeprefix("torch."), reasoning_parser=None,
                            calculate_kv_scales=False, generation_config="vllm", max_model_len=None)
        except ValueError as e:
            raise ValueError(f"speculative_config's draft model: {e}") from None
        if draft.hf_config.vocab_size != self.hf_config.vocab_size and not _same_file(
                "tokenizer.json", self.tokenizer_path, draft.model):  # (an embedding padded otherwise is fine)
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.hf_config.vocab_size} "
                             f"tokens) differs from the model's ({self.hf_config.vocab_size}); a draft must share "
                             f"the model's tokenizer")
        for limit, whose in ((draft.max_model_len, "the draft model's context"), (self.max_model_len, "max_model_len")):
            if spec.max_model_len is not None and spec.max_model_len > limit:  # (as vLLM: an error, not less)
                raise ValueError(f"speculative_config: max_model_len ({spec.max_model_len}) exceeds {whose} ({limit})")
        draft.max_model_len = min(draft.max_model_len, self.max_model_len, spec.max_model_len or self.max_model_len)
        return draft

    def _check_quantization_config(self) -> None:
        """A checkpoint's quantization_config: block-scaled FP8 with dynamic activation scales
        (Qwen3's -FP8 releases) is loaded as such (quantization becomes "fp8"); anything
        else is refused here rather than loaded as garbage."""
        config = self._quantization_config()
        if config is None:
            return
        where = f"{os.path.join(self.model, 'config.json')}'s quantization_config"
        if config.get("quant_method") != "fp8":
            raise ValueError(f"{where} has quant_method {config.get('quant_method')!r}; nanovllm loads fp8 only")
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"{where}: only dynamic activation scales are supported, "
                             f"not {config.get('activation_scheme')!r}")
        block = config.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and block[0] > 0):
            raise ValueError(f"{where}: only square block-wise weight scales (weight_block_size [n, n]) are "
                             f"supported, got {block!r}")
        # MoE routers ("mlp.gate") stay in the model's dtype here whatever the checkpoint holds
        kept = [name for name in config.get("modules_to_not_convert") or config.get("ignored_layers") or []
                if name.split(".")[-1] not in ("lm_head", "embed_tokens", "gate")]
        if kept:  # layers left in bf16 among the FP8 ones: not a layout we load
            raise ValueError(f"{where} leaves {', '.join(kept[:3])}{' ...' if len(kept) > 3 else ''} unquantized; "
                             f"only checkpoints with every projection in FP8 are supported")
        self.quantization = "fp8"

    def _check_tensor_parallel(self) -> None:
        """Each rank must hold whole attention heads, an equal slice of the MLP and of the
        vocabulary, and whole KV heads (split when there are at least as many as ranks,
        else replicated: each KV head on tensor_parallel_size / num_key_value_heads ranks)."""
        import torch

        tp = self.tensor_parallel_size
        hf = self.hf_config
        num_heads = hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        sizes = [("num_attention_heads", num_heads), ("intermediate_size", hf.intermediate_size), ("vocab_size", hf.vocab_size)]
        num_experts = num_experts_of(hf)
        if num_experts:  # MoE: whole experts per rank, or a slice of every expert
            sizes.append(("num_experts", num_experts) if self.enable_expert_parallel
                         else ("moe_intermediate_size", hf.moe_intermediate_size))
        for name, value in sizes:
            if value % tp:
                raise ValueError(
                    f"tensor_parallel_size ({tp}) must divide the model's {name} ({value}); pick a divisor of it"
                )
        block = self.fp8_weight_block
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        for name, inputs in (("o_proj", num_heads * head_dim), ("down_proj", hf.intermediate_size)):
            if block is not None and inputs // tp % block:  # a rank's slice would cut a scale block
                raise ValueError(f"an FP8 checkpoint with {block}-wide blocks needs each rank's share of {name}'s "
                                 f"inputs ({inputs} / {tp}) to be a multiple of {block}; use another "
                                 f"tensor_parallel_size")
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
        """Build from LLM(model, **engine_args), vLLM's names for arguments accepted; an
        unknown argument raises TypeError naming it."""
        known = {f.name for f in fields(cls) if f.init and f.name != "model"}
        if engine_args.get("num_gpu_blocks_override", 0) is None:  # vLLM's "no override"
            del engine_args["num_gpu_blocks_override"]
        for alias, name in ALIASES.items():
            if alias in engine_args:
                if name in engine_args:
                    raise TypeError(f"give {alias} or {name}, not both")
                engine_args[name] = engine_args.pop(alias)
        for name, fine in NO_EFFECT.items():
            if name in engine_args:
                value = engine_args.pop(name)
                if fine is not None and value not in fine:
                    raise ValueError(f"{name}={value!r} is not supported by nanovllm; it takes "
                                     f"{' or '.join(map(repr, fine))} (no effect here)")
        for name in engine_args:
            if name not in known:
                raise TypeError(f"unknown engine argument {name!r}; known arguments: {', '.join(sorted(known))}")
        return cls(model, **engine_args)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def torch_device(self) -> torch.device:
        import torch

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
    def kernels(self) -> str:
        """Who computes what has a Triton kernel and a torch path: "triton" on CUDA (CUDA
        graphs need the kernels), and on CPU where the Triton attention was asked for (the
        interpreter); "torch" elsewhere. The layers' Triton kernels (layers/kernel_plan.py
        sets them up: the GEMV and split tiles, the norms, SiLU-and-mul), MoE (else one
        expert at a time), FP8 matmuls (else dequantize and multiply) and the decode graphs'
        input unpacking all follow it."""
        return "triton" if self.torch_device.type == "cuda" or self.attention_backend_name == "triton" else "torch"

    @property
    def fp8_weight_block(self) -> int | None:
        """The block size of an FP8 checkpoint's weight scales; None for a checkpoint in
        bf16/fp16/fp32 (quantized online when quantization="fp8")."""
        config = self._quantization_config()
        return None if config is None else config["weight_block_size"][0]

    def _quantization_config(self) -> dict | None:
        """config.json's quantization_config as a dict (transformers may hold an object)."""
        config = getattr(self.hf_config, "quantization_config", None)
        return config if config is None or isinstance(config, dict) else config.to_dict()

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, DTYPES[self.dtype])
        dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model's dtype, or an FP8 type."""
        import torch

        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        return getattr(torch, KV_CACHE_DTYPES[self.kv_cache_dtype])

    def cpu_thread_count(self) -> int | None:
        """Torch threads for a CPU engine: cpu_threads when set; None (torch's own choice)
        when OMP_NUM_THREADS is set; else every core this process may use but one, which
        stays free for tokenizing, the server, the OS. Torch's default of one per core
        spins on cores another process holds, and can run tens of times slower then."""
        if self.cpu_threads:
            return self.cpu_threads
        if os.environ.get("OMP_NUM_THREADS"):
            return None
        return max(1, len(os.sched_getaffinity(0)) - 1)


def _same_file(name: str, *folders: str) -> bool:
    """Whether every folder has the file `name`, with the same bytes."""
    contents = set()
    for folder in folders:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                contents.add(f.read())
        except OSError:
            return False
    return len(contents) == 1


def num_experts_of(hf_config: PretrainedConfig) -> int:
    """A mixture of experts' expert count (config.json's num_experts, or num_local_experts
    as transformers may write it); 0 for a dense model."""
    return getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0


def hub_hint(name: str) -> str:
    """What to do when `name` looks like a Hugging Face hub id (org/model) rather than a
    folder: nothing is downloaded here."""
    parts = name.split("/")
    if len(parts) == 2 and all(parts) and not os.path.exists(name):
        return (f". nanovllm loads local folders only and downloads nothing: fetch it where there is a network "
                f"with `hf download {name} --local-dir ./{parts[1]}`, then give that folder")
    return ""


def get_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope dict: {"rope_type": ..., "rope_theta": ..., scaling fields...}, read the
    transformers 5 way (`config.rope_parameters`), else from the older `rope_theta` and
    `rope_scaling` attributes."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def model_context_length(hf_config: Any) -> int | None:
    """The most positions the model takes (None where its config gives no
    max_position_embeddings): that, times the factor of a linear or YaRN rope scaling,
    YaRN's counted from its original_max_position_embeddings. Qwen3's long-context set-up
    (YaRN, factor 4 over 32,768) gives 131,072, as vLLM reads it."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    rope = get_rope_parameters(hf_config)
    if limit is None or rope["rope_type"] not in STRETCHING_ROPE_TYPES or not rope.get("factor"):
        return limit
    base = (rope.get("original_max_position_embeddings") or limit) if rope["rope_type"] == "yarn" else limit
    return int(base * rope["factor"])

"""Tiny Hugging Face checkpoints built offline, and a transformers oracle to compare against.

`make_tiny_checkpoint` writes a folder that looks like a real Qwen3 / Qwen3-MoE / Qwen2 / Llama release
(config.json, generation_config.json, safetensors weights, tokenizer files) but holds a
model of a few hundred KB with a byte-level BPE tokenizer trained on a built-in corpus.
Nothing is downloaded. The weights are re-drawn with a larger spread than Hugging Face's
default init so that greedy decoding has clear winners: two correct implementations then
agree token for token instead of flipping on float32 rounding.

`hf_greedy` and `hf_logits` run the checkpoint with transformers in float32; engine tests
use them as the reference.
"""
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)


EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Trained first, so they take ids 0, 1, 2 in this order.
SPECIAL_TOKENS = [EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN]

# ChatML, as Qwen's tokenizers ship it, without the tool-calling branches.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Tokens a tool-calling, reasoning model's tokenizer adds (plain added tokens, as Qwen3's:
# skip_special_tokens keeps them in the text).
TOOL_AND_REASONING_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# ChatML with tools as Qwen's templates render them (the function signatures in a system
# turn, calls as Hermes <tool_call> blocks, results as <tool_response> in a user turn) and
# enable_thinking: true opens <think> at the start of the reply, false writes it closed
# and empty, unset writes neither.
TOOLS_CHAT_TEMPLATE = (
    "{%- set first = messages[0] if messages else none -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if first and first['role'] == 'system' %}{{ first['content'] + '\n\n' }}{% endif -%}"
    "{{ '# Tools\n\nYou may call functions. Their signatures:\n<tools>\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor -%}"
    "{{ '</tools>\nReturn each call as <tool_call>\n{\"name\": <name>, \"arguments\": <arguments object>}\n"
    "</tool_call><|im_end|>\n' }}"
    "{%- elif first and first['role'] == 'system' -%}"
    "{{ '<|im_start|>system\n' + first['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{ '<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{- call['function']['arguments'] | tojson }}{{ '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{ '<think>\n' }}"
    "{%- elif enable_thinking is defined %}{{ '<think>\n\n</think>\n\n' }}{% endif -%}"
    "{%- endif -%}"
)

# RoPE base of the original Llama / Qwen1 models; big enough for max_position_embeddings=512.
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6

# Spread of the re-drawn weights. With hidden_size 64 a weight std of 0.2 gives logits of
# std ~1.6 over a vocab of 384: the top-1 / top-2 gap is then ~0.4 on average and below
# 1e-3 only for ~0.2 % of positions (HF's std 0.02 leaves gaps of ~1e-3 everywhere).
WEIGHT_STD = 0.2
BIAS_STD = 0.1
# RMSNorm gains are 1 + noise: far enough from 1 to catch a missing norm weight.
NORM_NOISE_STD = 0.1

# Small enough that the default tiny model (~0.5 MB in float32) splits into several shards.
SMALL_SHARD_SIZE = "100KB"
# transformers' default: one model.safetensors for any tiny model.
SINGLE_FILE_SHARD_SIZE = "50GB"

_ARCHITECTURES: dict[str, tuple[type[PreTrainedConfig], type[PreTrainedModel]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}
# qwen3_moe's experts: few and small, but every token still picks between them.
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                decoder_sparse_step=1)
# Qwen2's config has no head_dim field (the model derives it from hidden_size), and real
# Llama / Qwen2 checkpoints keep num_attention_heads * head_dim == hidden_size.
_ARCHS_WITH_DERIVED_HEAD_DIM = {"qwen2", "llama"}

# Training corpus of the tokenizer: English prose and Python-like code, so that common
# words and indentation get their own merges. Fixed text, so training is deterministic.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens
and predicts the next one. An inference engine keeps the keys and values of every past
token in a cache, so that each new token costs one small step instead of a full pass.
The scheduler decides which requests run in the next step: new prompts are prefilled in
large batches, and running sequences decode one token at a time. When the cache is full,
the most recent sequence is preempted and its blocks are returned to the pool.
Paged attention stores the cache in fixed-size blocks. A block table maps the logical
position of a token to the physical block that holds it, like pages of virtual memory.
Two requests that share a prompt prefix can share the blocks of that prefix, which saves
both memory and compute. Hello world! How are you today? I am fine, thank you very much.
Once upon a time there was a small model that wanted to write poems about the sea, the
mountains, the rivers and the stars. It learned that the sun rises in the east and sets
in the west, that water boils at one hundred degrees, and that cats like to sleep.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096.

def add(a, b):
    return a + b


class BlockManager:
    \"\"\"Keeps track of free and used blocks.\"\"\"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_block_ids = list(range(num_blocks))
        self.used_block_ids = set()

    def allocate(self, seq) -> None:
        for i in range(seq.num_blocks):
            block_id = self.free_block_ids.pop()
            self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)

    def deallocate(self, seq) -> None:
        for block_id in reversed(seq.block_table):
            self.used_block_ids.remove(block_id)
            self.free_block_ids.append(block_id)
        seq.block_table.clear()


def softmax(x):
    x = x - x.max(dim=-1, keepdim=True).values
    return x.exp() / x.exp().sum(dim=-1, keepdim=True)


for step in range(10):
    if step % 2 == 0:
        print(f"step {step}: even")
    else:
        print(f"step {step}: odd")

import torch
import torch.nn.functional as F

x = torch.randn(4, 8)
y = F.silu(x) * x
print(y.shape, y.dtype, y.device)
"""


def make_tokenizer(path: str | Path, vocab_size: int = 384, extra_tokens: list[str] = (),
                   chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the built-in corpus and save it to `path`.

    Every UTF-8 string round-trips through encode / decode (the 256 byte symbols are in
    the vocabulary). Ids 0, 1, 2 are "<|endoftext|>" (eos, pad and bos, as in Qwen),
    "<|im_start|>" and "<|im_end|>"; a ChatML chat template is included. Nothing is
    added around the encoded text (no BOS).

    Args:
        path: folder to write tokenizer.json, tokenizer_config.json and the chat template to.
        vocab_size: size of the trained vocabulary, special tokens included.
        extra_tokens: plain added tokens after it (e.g. TOOL_AND_REASONING_TOKENS).
        chat_template: the template saved with it.

    Returns:
        The tokenizer, as AutoTokenizer.from_pretrained(path) loads it back.
    """
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    min_vocab_size = len(byte_alphabet) + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level vocab needs at least {min_vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=byte_alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} needs more merges than the built-in corpus yields "
            f"(got {backend.get_vocab_size()}); pick a smaller vocab_size"
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=chat_template,
    )
    tokenizer.add_tokens(list(extra_tokens))
    tokenizer.save_pretrained(path)
    return tokenizer


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "qwen3",
    *,
    tie_word_embeddings: bool = False,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    intermediate_size: int = 128,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 512,
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    eos_token_ids: list[int] | None = None,
    tools: bool = False,
    moe: dict | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Write a randomly initialised Hugging Face checkpoint of `arch` with a tokenizer to `path`.

    Args:
        path: output folder (created if missing).
        arch: "qwen3", "qwen3_moe", "qwen2" (q/k/v biases) or "llama".
        tie_word_embeddings: share lm_head with the input embedding (no lm_head.weight saved).
        num_attention_heads, num_key_value_heads, head_dim, hidden_size, num_hidden_layers,
            intermediate_size, max_position_embeddings: the model's dimensions. Only qwen3
            allows num_attention_heads * head_dim != hidden_size.
        rope_scaling: RoPE scaling parameters, e.g. {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}; None for plain RoPE. Written to
            config.json as "rope_parameters", together with "rope_theta".
        sharded: split the weights into several safetensors files with an index.
        dtype: dtype of the saved weights (and of config.json's "dtype").
        seed: seed of the weights; the same arguments always give the same checkpoint.
        eos_token_ids: generation_config.json's eos_token_id list; default [<|endoftext|>].
        tools: a tokenizer with TOOL_AND_REASONING_TOKENS and TOOLS_CHAT_TEMPLATE.
        moe: qwen3_moe's expert fields, over TINY_MOE (8 experts, top 2 renormalised,
            moe_intermediate_size 32, the last layer a dense MLP).
        vocab_size: the embedding's rows, padded past the tokenizer's (default: as many), as
            some releases pad theirs (Qwen2.5-7B's 152,064 against the 0.5B's 151,936).

    Returns:
        `path`, as a Path.
    """
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(_ARCHITECTURES)}")
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} must be a multiple of num_key_value_heads={num_key_value_heads}"
        )
    if arch in _ARCHS_WITH_DERIVED_HEAD_DIM and num_attention_heads * head_dim != hidden_size:
        raise ValueError(
            f"{arch} needs num_attention_heads * head_dim == hidden_size, got "
            f"{num_attention_heads} * {head_dim} != {hidden_size}"
        )
    path = Path(path)
    tokenizer = (make_tokenizer(path, extra_tokens=TOOL_AND_REASONING_TOKENS, chat_template=TOOLS_CHAT_TEMPLATE)
                 if tools else make_tokenizer(path))
    config_cls, model_cls = _ARCHITECTURES[arch]
    # Qwen2Config has no head_dim field; the check above makes hidden_size // heads equal to it.
    head_dim_kwargs = {} if arch == "qwen2" else {"head_dim": head_dim}
    moe_kwargs = {**TINY_MOE, "mlp_only_layers": [num_hidden_layers - 1], **(moe or {})} if arch == "qwen3_moe" else {}
    config = config_cls(
        architectures=[model_cls.__name__],
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=RMS_NORM_EPS,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, **(rope_scaling or {})},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **head_dim_kwargs,
        **moe_kwargs,
    )
    model = model_cls(config)
    _reinitialise_weights(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=list(eos_token_ids or [tokenizer.eos_token_id]),
        pad_token_id=tokenizer.pad_token_id,
    )
    max_shard_size = SMALL_SHARD_SIZE if sharded else SINGLE_FILE_SHARD_SIZE
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    return path


def _reinitialise_weights(model: PreTrainedModel, seed: int) -> None:
    """Redraw every parameter from a seeded generator with a spread that separates the logits.

    Linear and embedding weights get N(0, WEIGHT_STD), biases N(0, BIAS_STD) and RMSNorm
    gains 1 + N(0, NORM_NOISE_STD). Tied weights are one parameter and are drawn once.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + NORM_NOISE_STD * noise)
            elif name.endswith(".bias"):
                param.copy_(BIAS_STD * noise)
            else:
                param.copy_(WEIGHT_STD * noise)


@functools.cache
def _load_reference_model(path: str) -> PreTrainedModel:
    """Load a checkpoint in float32 eval mode, once per resolved path."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _reference_model(path: str | Path) -> PreTrainedModel:
    """The cached float32 transformers model of the checkpoint at `path`."""
    return _load_reference_model(str(Path(path).resolve()))


@torch.inference_mode()
def hf_greedy(
    path: str | Path,
    prompt_token_ids: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool = False,
    logits_processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> list[list[int]]:
    """Greedy-decode each prompt on its own with transformers (float32, no padding).

    Every step is a full forward pass over prompt + generated tokens: quadratic, but
    trivial for tiny models, and it leans on no cache API (renamed across transformers 5.x).

    Args:
        path: checkpoint folder.
        prompt_token_ids: one list of token ids per prompt.
        max_new_tokens: most tokens to generate per prompt.
        ignore_eos: if True, generate exactly max_new_tokens tokens; EOS is neither a stop
            nor suppressed. Otherwise stop right after any eos id of generation_config.json.
        logits_processor: applied to each step's last-token logits before the argmax,
            with transformers' LogitsProcessor signature (input_ids [1, len], scores [1, vocab]).

    Returns:
        The new tokens of each prompt (the stopping eos included, as vLLM returns it).
    """
    model = _reference_model(path)
    eos_ids = model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    outputs = []
    for prompt in prompt_token_ids:
        token_ids = list(prompt)
        while len(token_ids) - len(prompt) < max_new_tokens:
            input_ids = torch.tensor([token_ids])
            scores = model(input_ids=input_ids).logits[:, -1]  # [1, vocab_size]
            if logits_processor is not None:
                scores = logits_processor(input_ids, scores)
            token = int(scores[0].argmax())
            token_ids.append(token)
            if token in eos_ids and not ignore_eos:
                break
        outputs.append(token_ids[len(prompt):])
    return outputs


@torch.inference_mode()
def hf_logits(path: str | Path, prompt_token_ids: list[int]) -> torch.Tensor:
    """Float32 logits of one full forward pass over a prompt, shape [len(prompt), vocab_size]."""
    model = _reference_model(path)
    return model(input_ids=torch.tensor([prompt_token_ids])).logits[0].float()

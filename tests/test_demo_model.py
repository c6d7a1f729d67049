"""The bundled demo model: it fits the size budget, loads through nanovllm, writes Python."""
from __future__ import annotations

import keyword
import re
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from nanovllm import LLM, SamplingParams, demo
from nanovllm.demo import DEMO_MODEL_DIR, demo_model_path

# The budget for everything the package ships for the demo model.
MAX_BUNDLE_BYTES = 20 * 1024 * 1024
MAX_TOKENS = 48
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PYTHON_WORDS = set(keyword.kwlist) | {"self", "cls", "print", "len", "range", "str", "int", "None"}
PROMPTS = [
    "def fibonacci(",
    "import os\n",
    "class Stack:\n    def __init__(self",
    "for i in range(10):",
    "if __name__ == '__main__':",
]
# Prompts that open a block: the next line must be indented.
BLOCK_OPENERS = ["for i in range(10):", "if __name__ == '__main__':"]


@pytest.fixture(scope="module")
def completions() -> dict[str, str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(demo_model_path(), device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {out.prompt: out.outputs[0].text for out in outputs}


def test_files_fit_the_size_budget():
    files = [f for f in Path(DEMO_MODEL_DIR).iterdir() if f.is_file()]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) <= MAX_BUNDLE_BYTES


def test_shape_suits_triton_and_tensor_parallel_2():
    config = AutoConfig.from_pretrained(DEMO_MODEL_DIR)
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.head_dim >= 16 and config.head_dim & (config.head_dim - 1) == 0
    assert config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.vocab_size % 2 == 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_is_python(completions, prompt):
    """An untrained model writes random tokens of its 4096; this one writes printable ASCII
    that uses Python keywords and builtins, or the prompt's own names, again and again."""
    text = completions[prompt]
    known = PYTHON_WORDS | set(IDENTIFIER.findall(prompt))
    hits = [word for word in IDENTIFIER.findall(text) if word in known]
    assert len(hits) >= 2, f"too few Python words in {text!r}"
    assert text.isascii() and all(c.isprintable() or c == "\n" for c in text), f"not source text: {text!r}"


@pytest.mark.parametrize("prompt", BLOCK_OPENERS)
def test_indents_the_body_of_a_block(completions, prompt):
    assert completions[prompt].startswith("\n    "), f"no indented block after {prompt!r}: {completions[prompt]!r}"


def test_chat_template_renders_chatml():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    messages = [{"role": "user", "content": "Write a function."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1
    assert tokenizer.decode(ids) == text


def test_missing_files_raise_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "DEMO_MODEL_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="train_demo_model.py"):
        demo_model_path()

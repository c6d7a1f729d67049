"""The bundled demo models: they fit the size budget, share a tokenizer, load through
nanovllm and write Python; the held-out modules stay out of training."""
from __future__ import annotations

import ast
import keyword
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nanovllm import LLM, SamplingParams, demo
from nanovllm.demo import DEMO_DRAFT_MODEL_DIR, DEMO_MODEL_DIR, TOKENIZER_FILES, demo_model_path, model_name
from nanovllm.demo.corpus import HELD_OUT_MODULES, held_out_sources, module_file, training_files

# The budget for everything the package ships for the two demo models.
MAX_BUNDLE_BYTES = 48 * 1000 * 1000
FOLDERS = [DEMO_MODEL_DIR, DEMO_DRAFT_MODEL_DIR]
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
def completions() -> dict[str, tuple[str, str]]:
    """Prompt -> (greedy completion, finish reason) from the target."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(demo_model_path(), device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {out.prompt: (out.outputs[0].text, out.outputs[0].finish_reason) for out in outputs}


def test_files_fit_the_size_budget():
    total = 0
    for folder in FOLDERS:
        files = [f for f in Path(folder).iterdir() if f.is_file()]
        assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {f.name for f in files}
        total += sum(f.stat().st_size for f in files)
    assert total <= MAX_BUNDLE_BYTES


def test_target_is_larger_with_a_long_context():
    target, draft = (AutoConfig.from_pretrained(folder) for folder in FOLDERS)
    assert target.max_position_embeddings >= 1024 and draft.max_position_embeddings >= 1024
    sizes = [(Path(folder) / "model.safetensors").stat().st_size for folder in FOLDERS]
    assert 4 <= sizes[0] / sizes[1] <= 10
    assert target.dtype == draft.dtype == torch.bfloat16


def test_models_share_the_tokenizer():
    for name in TOKENIZER_FILES:
        assert (Path(DEMO_MODEL_DIR) / name).read_bytes() == (Path(DEMO_DRAFT_MODEL_DIR) / name).read_bytes(), name
    target, draft = (AutoConfig.from_pretrained(folder) for folder in FOLDERS)
    assert target.vocab_size == draft.vocab_size >= len(AutoTokenizer.from_pretrained(DEMO_DRAFT_MODEL_DIR))


def test_draft_generates_what_transformers_generates():
    """The engine runs the draft (float32 on CPU) to the same greedy tokens as transformers."""
    prompt = "def fibonacci(n):"
    with LLM(DEMO_DRAFT_MODEL_DIR, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=16) as llm:
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(DEMO_DRAFT_MODEL_DIR, dtype=torch.float32)
    ids = torch.tensor([out.prompt_token_ids])
    expected = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.outputs[0].token_ids == expected[0, ids.shape[1]:].tolist()
    assert any(word in out.outputs[0].text for word in PYTHON_WORDS)


@pytest.mark.parametrize("folder", FOLDERS, ids=["target", "draft"])
def test_shape_suits_triton_and_tensor_parallel_2(folder):
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.head_dim >= 16 and config.head_dim & (config.head_dim - 1) == 0
    assert config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.vocab_size % 2 == 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_is_python(completions, prompt):
    """An untrained model writes random tokens of its vocabulary; this one writes printable
    ASCII that uses Python keywords and builtins, or the prompt's own names, again and
    again, or ends the code itself with end-of-sequence after a few statements that parse."""
    text, finish_reason = completions[prompt]
    assert text.isascii() and all(c.isprintable() or c == "\n" for c in text), f"not source text: {text!r}"
    if finish_reason == "stop":
        ast.parse(prompt + text)
    else:
        known = PYTHON_WORDS | set(IDENTIFIER.findall(prompt))
        hits = [word for word in IDENTIFIER.findall(text) if word in known]
        assert len(hits) >= 2, f"too few Python words in {text!r}"


@pytest.mark.parametrize("prompt", BLOCK_OPENERS)
def test_indents_the_body_of_a_block(completions, prompt):
    text, _ = completions[prompt]
    assert text.startswith("\n    "), f"no indented block after {prompt!r}: {text!r}"


def test_chat_template_renders_chatml():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    messages = [{"role": "user", "content": "Write a function."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("draft", [False, True], ids=["target", "draft"])
def test_missing_files_raise_a_clear_error(monkeypatch, tmp_path, draft):
    assert demo_model_path(draft) == (DEMO_DRAFT_MODEL_DIR if draft else DEMO_MODEL_DIR)
    monkeypatch.setattr(demo, "DEMO_DRAFT_MODEL_DIR" if draft else "DEMO_MODEL_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="train_demo_model.py"):
        demo_model_path(draft)


def test_bundled_models_are_named_demo_however_their_folder_is_given(monkeypatch, tmp_path):
    """The server's default model name: the folder's last part, "demo" / "demo-draft" for the
    bundled ones (a newcomer serving DEMO_MODEL_DIR found "model" and the README's "demo" a 404)."""
    link = tmp_path / "link"
    link.symlink_to(DEMO_DRAFT_MODEL_DIR)
    monkeypatch.chdir(Path(DEMO_MODEL_DIR).parent)
    assert [model_name(f) for f in (DEMO_MODEL_DIR, DEMO_MODEL_DIR + "/", "model", "./draft/", str(link))] == \
        ["demo", "demo", "demo", "demo-draft", "demo-draft"]
    assert model_name(str(tmp_path / "Qwen3-8B") + "/") == "Qwen3-8B"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is new in 3.11")
def test_held_out_modules_are_read_but_never_trained_on():
    assert list(held_out_sources()) == list(HELD_OUT_MODULES)
    files = set(training_files())
    assert files and not files & {module_file(name) for name in HELD_OUT_MODULES}

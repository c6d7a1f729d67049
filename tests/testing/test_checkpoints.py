"""Quick checks that the tiny checkpoints load with transformers and make a usable oracle."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nanovllm.testing.checkpoints import SPECIAL_TOKENS, hf_greedy, hf_logits, make_tiny_checkpoint, make_tokenizer

CHECKPOINT_FIXTURES = ["qwen3_ckpt", "qwen2_ckpt", "llama_ckpt", "llama_tied_ckpt", "qwen3_sharded_ckpt"]
# Well above float32 rounding of logits of magnitude ~5.
MIN_LOGIT_GAP = 1e-3
NUM_NEW_TOKENS = 32


def _tensor_names(path: Path) -> set[str]:
    """Names of all tensors in the checkpoint's safetensors files."""
    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def _random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """Token ids drawn uniformly from the vocabulary, special tokens excluded."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIAL_TOKENS), vocab_size, (length,), generator=generator).tolist()


def test_tokenizer_round_trips_utf8(tmp_path: Path) -> None:
    make_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "def f(x):\n    return x  # héllo wörld ✓ 日本語 🙂"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 384
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_is_deterministic(tmp_path: Path) -> None:
    first = make_tokenizer(tmp_path / "a")
    second = make_tokenizer(tmp_path / "b")
    assert first.get_vocab() == second.get_vocab()


@pytest.mark.parametrize("fixture_name", CHECKPOINT_FIXTURES)
def test_checkpoint_loads_with_transformers(fixture_name: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture_name)
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id]
    assert type(model).__name__ == config.architectures[0]


def test_sharded_checkpoint_has_index_and_shards(qwen3_sharded_ckpt: Path) -> None:
    index = json.loads((qwen3_sharded_ckpt / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert shards == {file.name for file in qwen3_sharded_ckpt.glob("*.safetensors")}


def test_tied_checkpoint_has_no_lm_head(llama_ckpt: Path, llama_tied_ckpt: Path) -> None:
    assert "lm_head.weight" in _tensor_names(llama_ckpt)
    assert "lm_head.weight" not in _tensor_names(llama_tied_ckpt)


def test_llama_config_has_llama3_rope(llama_ckpt: Path) -> None:
    rope = json.loads((llama_ckpt / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "llama3"
    assert rope["original_max_position_embeddings"] == 64


def test_hf_greedy_ignore_eos_returns_exact_count(tiny_ckpt: Path) -> None:
    prompts = [[5, 6, 7], _random_prompt(AutoConfig.from_pretrained(tiny_ckpt).vocab_size, 20, seed=1)]
    outputs = hf_greedy(tiny_ckpt, prompts, NUM_NEW_TOKENS, ignore_eos=True)
    assert [len(output) for output in outputs] == [NUM_NEW_TOKENS, NUM_NEW_TOKENS]
    # A healthy random model does not collapse into one repeated token.
    assert all(len(set(output)) >= NUM_NEW_TOKENS // 4 for output in outputs)


def test_hf_greedy_stops_after_eos(tmp_path: Path) -> None:
    prompt = [10, 20, 30]
    reference = hf_greedy(make_tiny_checkpoint(tmp_path / "a"), [prompt], NUM_NEW_TOKENS, ignore_eos=True)[0]
    stop_index = NUM_NEW_TOKENS // 2
    stop_token = reference[stop_index]
    # Same seed, so same weights; only generation_config's eos list differs.
    path = make_tiny_checkpoint(tmp_path / "b", eos_token_ids=[stop_token])
    output = hf_greedy(path, [prompt], NUM_NEW_TOKENS)[0]
    assert output == reference[: reference.index(stop_token) + 1]


def test_logits_have_clear_top1(tiny_ckpt: Path) -> None:
    vocab_size = AutoConfig.from_pretrained(tiny_ckpt).vocab_size
    prompt = _random_prompt(vocab_size, 64, seed=0)
    logits = hf_logits(tiny_ckpt, prompt)
    assert logits.shape == (len(prompt), vocab_size)
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps > MIN_LOGIT_GAP).float().mean() > 0.95

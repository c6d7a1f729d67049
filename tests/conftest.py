"""Shared pytest setup: the `gpu` marker and tiny checkpoints built once per session."""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU; it must be chosen before they are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.testing.checkpoints import make_tiny_checkpoint

# Llama 3.1-style RoPE scaling, shrunk so that original_max_position_embeddings (64) sits
# well inside the fixtures' max_position_embeddings (512) and both RoPE regimes get used.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# GQA 4:1 with num_attention_heads * head_dim == hidden_size (64), as in real Llama configs.
LLAMA_KWARGS = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "rope_scaling": LLAMA3_ROPE_SCALING}
TINY_ARCHS = ["qwen3", "qwen2", "llama", "qwen3_moe"]


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers used in this test suite."""
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped when torch.cuda.is_available() is False")
    config.addinivalue_line("markers", "slow: a combination the other tests cover piecewise; run with --run-slow")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` on machines without CUDA, and those marked `slow` unless
    --run-slow was given (they keep the default run near ten minutes on two cores)."""
    skips = []
    if not torch.cuda.is_available():
        skips.append(("gpu", pytest.mark.skip(reason="needs CUDA")))
    if not config.getoption("--run-slow"):
        skips.append(("slow", pytest.mark.skip(reason="slow: --run-slow runs it")))
    for item in items:
        for keyword, skip in skips:
            if keyword in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 with num_attention_heads * head_dim (128) != hidden_size (64), as in real Qwen3."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", head_dim=32)


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (q/k/v biases) with the default tiny dimensions."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with GQA 4:1, llama3 RoPE scaling and a separate lm_head."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", **LLAMA_KWARGS)


@pytest.fixture(scope="session")
def llama_tied_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama fixture's shapes with tied embeddings: no lm_head.weight in the file."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama_tied"), "llama", tie_word_embeddings=True, **LLAMA_KWARGS)


@pytest.fixture(scope="session")
def qwen3_sharded_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 split over several safetensors shards with a model.safetensors.index.json."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_sharded"), "qwen3", sharded=True)


@pytest.fixture(scope="session")
def qwen3_tools_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 whose tokenizer has <think>, </think>, <tool_call>, </tool_call> and a chat
    template with tools and enable_thinking (nanovllm.testing.checkpoints)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_tools"), "qwen3", head_dim=32, tools=True,
                                max_position_embeddings=2048)  # room for the tools in the prompt


@pytest.fixture(scope="session")
def qwen3_moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE: 8 experts, top 2 renormalised; layer 0 a mixture, layer 1 a dense MLP."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", head_dim=32)


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_ckpt(request: pytest.FixtureRequest) -> Path:
    """Each of the qwen3, qwen2, llama and qwen3_moe fixtures in turn (test ids: [qwen3], ...)."""
    return request.getfixturevalue(f"{request.param}_ckpt")

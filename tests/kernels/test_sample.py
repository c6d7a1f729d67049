"""The one-pass sampling kernel (kernels/sample.py) against the sampler's torch path.

Without CUDA the kernel runs under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); with CUDA also on bf16 logits of Qwen's vocabulary, repeated for
races and replayed from a CUDA graph. Every input is fresh random data.
"""
import pytest
import torch

from nanovllm.kernels.sample import sample_tokens
from nanovllm.sampling.ops import sample_unfiltered
from nanovllm.utils.keyed_noise import keyed_exponential

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]


def inputs(batch: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random logits, a mix of greedy and sampled rows, random keys and positions."""
    logits = (torch.randn(batch, vocab, device=DEVICE) * 4).to(dtype)
    temperatures = torch.rand(batch, device=DEVICE) * 1.5
    temperatures[::3] = 0.0
    keys = torch.randint(0, 1 << 62, (batch,), device=DEVICE)
    positions = torch.randint(0, 1 << 20, (batch,), device=DEVICE)
    return logits, temperatures, keys, positions


def scores(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
           tokens: torch.Tensor) -> torch.Tensor:
    """The torch path's score of each row's token: logits / T - log(E)."""
    noise = keyed_exponential(keys, positions, torch.arange(logits.size(1), device=logits.device))
    scaled = logits.float() / temperatures.clamp(min=1e-5).unsqueeze(1) - noise.log()
    return scaled.gather(1, tokens.unsqueeze(1)).squeeze(1)


def check_against_torch(logits, temperatures, keys, positions) -> None:
    """Greedy rows: exactly torch's argmax. Sampled rows: torch's token, or one whose score
    equals it to float32 rounding (a tie that the two log implementations may break
    differently)."""
    tokens = sample_tokens(logits, temperatures, keys, positions)
    expected = sample_unfiltered(logits, temperatures, keys, positions)
    greedy = temperatures == 0
    assert torch.equal(tokens[greedy], logits[greedy].float().argmax(dim=-1))
    differ = tokens != expected
    ours, theirs = (scores(logits[differ], temperatures[differ], keys[differ], positions[differ], t[differ])
                    for t in (tokens, expected))
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0), f"{int(differ.sum())} rows differ beyond a tie"
    assert differ.float().mean() <= 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("vocab", [384, 5000, 151936], ids=["one_chunk", "ragged", "qwen"])
def test_sample_tokens_equals_the_torch_path(dtype: torch.dtype, vocab: int) -> None:
    check_against_torch(*inputs(7, vocab, dtype))


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_sample_tokens_large_batch(dtype: torch.dtype) -> None:
    check_against_torch(*inputs(256, 151936, dtype))


def test_greedy_takes_the_first_maximum_across_chunks() -> None:
    """Equal maxima in several chunks: the lowest token id, as torch's argmax."""
    logits = torch.randn(3, 20000, device=DEVICE)
    logits[0, [5000, 9000, 19999]] = 50.0
    logits[1, [17, 4095, 4096]] = 50.0
    logits[2, [12288, 16384]] = 50.0
    tokens = sample_tokens(logits, torch.zeros(3, device=DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE),
                           torch.zeros(3, dtype=torch.int64, device=DEVICE))
    assert tokens.tolist() == [5000, 17, 12288]


def test_sample_tokens_rejects_bad_shapes() -> None:
    logits = torch.randn(2, 100, device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    ids = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="temperatures must be"):
        sample_tokens(logits, torch.ones(3, device=DEVICE), ids, ids)
    with pytest.raises(ValueError, match="contiguous"):
        sample_tokens(logits.t().contiguous().t(), ones, ids, ids)
    assert sample_tokens(logits[:0], ones[:0], ids[:0], ids[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_sample_tokens_repeat_and_replay_from_a_graph(dtype: torch.dtype) -> None:
    """The last chunk to finish picks the token: repeated launches agree (a merge that read
    a chunk before it was written would not), and a captured launch replayed on new
    logits written in place gives the eager result."""
    logits, temperatures, keys, positions = inputs(64, 151936, dtype)
    first = sample_tokens(logits, temperatures, keys, positions)
    for _ in range(100):
        assert torch.equal(sample_tokens(logits, temperatures, keys, positions), first)
    out = torch.empty_like(first)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(sample_tokens(logits, temperatures, keys, positions))
    for _ in range(3):
        logits.copy_(torch.randn_like(logits, dtype=torch.float32) * 4)
        positions.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, sample_tokens(logits, temperatures, keys, positions))

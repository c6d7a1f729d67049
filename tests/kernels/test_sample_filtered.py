"""The filtered sampling kernel (kernels/sample_filtered.py) against its torch reference
(sampling/ops.py's sample_filtered, run on the CPU).

Without CUDA the kernel runs under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); with CUDA also on bf16 logits of Qwen's vocabulary at batch 256.
Every input is fresh random data; each row has its own filters.
"""
import pytest
import torch

from nanovllm.kernels import sample_filtered as sample_filtered_module
from nanovllm.kernels.sample_filtered import sample_filtered_tokens
from nanovllm.sampling.ops import sample_filtered

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]


def inputs(batch: int, vocab: int, dtype: torch.dtype, ties: bool = False) -> tuple:
    """Random logits (small integers when ties: equal scores at every cut), every mix of
    greedy rows, top_k (off, 1, 5, 50, past the vocabulary), top_p (off, 0.5, 0.9) and
    min_p (off, 0.05), random keys and positions."""
    gen = torch.Generator().manual_seed(batch * vocab + ties)
    logits = torch.randint(-6, 3, (batch, vocab), generator=gen).float() if ties else \
        torch.randn(batch, vocab, generator=gen) * 4
    rows = torch.arange(batch)
    temperatures = torch.rand(batch, generator=gen) + 0.3
    temperatures[rows % 7 == 6] = 0.0
    top_k = torch.tensor([0, 1, 5, 50, vocab + 1])[rows % 5]
    top_p = torch.tensor([1.0, 0.5, 0.9])[rows % 3]
    min_p = torch.tensor([0.0, 0.05])[rows % 2]
    keys = torch.randint(0, 1 << 62, (batch,), generator=gen)
    positions = torch.randint(0, 1 << 20, (batch,), generator=gen)
    return tuple(x.to(DEVICE) for x in (logits.to(dtype), temperatures, top_k, top_p, min_p, keys, positions))


def check_against_torch(logits, temperatures, top_k, top_p, min_p, keys, positions) -> None:
    """Greedy rows: torch's argmax. The others: the reference's token; on CUDA a row may
    differ where its fast exp/log land a score on the other side of a cut."""
    tokens = sample_filtered_tokens(logits, temperatures, top_k, top_p, min_p, keys, positions)
    expected = sample_filtered(*(x.cpu() for x in (logits, temperatures)), tuple(x.cpu() for x in (top_k, top_p, min_p)),
                               keys.cpu(), positions.cpu())
    tokens = tokens.cpu()
    greedy = temperatures.cpu() == 0
    assert torch.equal(tokens[greedy], logits.cpu()[greedy].float().argmax(dim=-1))
    agree = (tokens == expected).float().mean().item()
    assert agree == 1.0 if not HAS_CUDA else agree >= 0.98, f"{agree:.3f} of rows agree"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("vocab", [384, 5000], ids=["one_chunk", "ragged"])
def test_filtered_tokens_equal_the_torch_path(dtype: torch.dtype, vocab: int) -> None:
    check_against_torch(*inputs(30, vocab, dtype))


def test_filtered_tokens_with_ties_at_the_cuts() -> None:
    """Integer logits: many tokens share the k-th score, the nucleus's last score and the
    maximum; every token equal to a cut is kept, as in the reference."""
    check_against_torch(*inputs(30, 3000, torch.float32, ties=True))


def test_filtered_tokens_at_a_large_vocabulary() -> None:
    """157 blocks: top-k's candidates come from k blocks of the row, top-p alone's from the
    best 157, as at Qwen's vocabulary."""
    check_against_torch(*inputs(10, 40_000, torch.float32))


@pytest.mark.parametrize("limits", [dict(_MAX_CANDIDATES=16), dict(_TOP_P_BLOCKS=1)], ids=["few_candidates", "one_block"])
def test_rows_the_candidates_cannot_hold_search_the_whole_row(monkeypatch, limits: dict) -> None:
    """With room for 16 candidates, or top-p alone given one block, most rows fall back
    to the searches over the whole row: the same tokens."""
    for name, value in limits.items():
        monkeypatch.setattr(sample_filtered_module, name, value)
    check_against_torch(*inputs(15, 3000, torch.float32))  # every filter value in 15 rows, as in 30
    check_against_torch(*inputs(15, 2000, torch.float32, ties=True))


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_filtered_tokens_large_batch(dtype: torch.dtype) -> None:
    check_against_torch(*inputs(256, 151936, dtype))


def test_a_row_keeps_only_what_its_filters_allow() -> None:
    """Many draws (positions) of one row over probabilities 0.4 / 0.25 / 0.2 / 0.15 (the
    rest ~0), by the kernel and the reference: top_k 3 draws the three best, top_p 0.5
    the first two (0.4 is short of it), min_p 0.55 the first two (0.25 / 0.4 = 0.625)."""
    vocab, n = 2000, 24  # draws enough to see every allowed token (top_k 3 misses 0.2 with p ~ 0.002)
    base = torch.full((vocab,), -20.0)
    base[[7, 1500, 900, 1999]] = torch.tensor([0.4, 0.25, 0.2, 0.15]).log()
    for (k, p, m), allowed in (((3, 1.0, 0.0), {7, 1500, 900}), ((0, 0.5, 0.0), {7, 1500}),
                               ((0, 1.0, 0.55), {7, 1500})):
        args = (base.expand(n, -1).contiguous(), torch.ones(n), torch.full((n,), k), torch.full((n,), p),
                torch.full((n,), m), torch.full((n,), 11), torch.arange(n))
        tokens = sample_filtered_tokens(*(x.to(DEVICE) for x in args))
        assert set(tokens.tolist()) == allowed
        assert set(sample_filtered(*args[:2], args[2:5], *args[5:]).tolist()) == allowed


def test_top_p_of_a_top_k_larger_than_the_block_count() -> None:
    """top_k 10 over a 1,000-token vocabulary (4 blocks) with top_p 0.5: top_p is of the
    ten best tokens' mass (0.5 of it needs the four best), not of the row's, whose long
    tail would let a fifth in."""
    vocab, n = 1000, 40
    base = torch.full((vocab,), torch.tensor(0.001).log().item())
    base[:10] = -0.1 * torch.arange(10).float()
    args = (base.expand(n, -1).contiguous(), torch.ones(n), torch.full((n,), 10), torch.full((n,), 0.5),
            torch.zeros(n), torch.full((n,), 11), torch.arange(n))
    assert set(sample_filtered(*args[:2], args[2:5], *args[5:]).tolist()) == {0, 1, 2, 3}
    assert set(sample_filtered_tokens(*(x.to(DEVICE) for x in args)).tolist()) == {0, 1, 2, 3}


def test_filtered_tokens_reject_bad_shapes() -> None:
    logits = torch.randn(2, 100, device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    ids = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="top_p must be"):
        sample_filtered_tokens(logits, ones, ids, torch.ones(3, device=DEVICE), ones, ids, ids)
    with pytest.raises(ValueError, match="contiguous"):
        sample_filtered_tokens(logits.t().contiguous().t(), ones, ids, ones, ones, ids, ids)
    assert sample_filtered_tokens(logits[:0], ones[:0], ids[:0], ones[:0], ones[:0], ids[:0], ids[:0]).shape == (0,)

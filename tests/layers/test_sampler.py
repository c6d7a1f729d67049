"""The sampler draws from softmax(logits / temperature) and is argmax at temperature 0."""
import torch

from nanovllm.layers.sampler import Sampler


def test_temperature_zero_is_argmax():
    logits = torch.randn(16, 50)
    tokens = Sampler()(logits, torch.zeros(16))
    assert torch.equal(tokens, logits.argmax(-1))


def test_samples_follow_the_softmax_distribution():
    torch.manual_seed(0)
    n, temperature = 40_000, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    tokens = Sampler()(row.expand(n, -1).contiguous(), torch.full((n,), temperature))
    observed = torch.bincount(tokens, minlength=5).double()
    expected = torch.softmax(row.double() / temperature, -1) * n
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 18.5  # the 0.999 quantile of chi-square with 4 degrees of freedom


def sample_counts(row: torch.Tensor, n: int, **filters: float) -> torch.Tensor:
    torch.manual_seed(0)
    batch = row.expand(n, -1).contiguous()
    k = torch.full((n,), filters.get("top_k", 0), dtype=torch.int64)
    p = torch.full((n,), filters.get("top_p", 1.0))
    m = torch.full((n,), filters.get("min_p", 0.0))
    tokens = Sampler()(batch, torch.ones(n), (k, p, m))
    return torch.bincount(tokens, minlength=row.numel()).double()


def assert_follows(observed: torch.Tensor, row: torch.Tensor, keep: list[int]) -> None:
    """Only `keep` is ever drawn, in proportion to softmax(row) renormalised over it."""
    mask = torch.zeros_like(row, dtype=torch.bool)
    mask[keep] = True
    assert observed[~mask].sum() == 0
    expected = torch.softmax(row.double().masked_fill(~mask, float("-inf")), -1)[mask] * observed.sum()
    chi_square = ((observed[mask] - expected) ** 2 / expected).sum().item()
    assert chi_square < 16.3  # the 0.999 quantile of chi-square with 3 degrees of freedom (at most)


def test_top_k_top_p_min_p_restrict_the_support():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    row = probs.log()
    assert_follows(sample_counts(row, 20_000, top_k=3), row, [0, 1, 2])
    # top_p 0.6: token 1 starts at mass 0.4 < 0.6 (kept), token 2 at 0.65 (dropped).
    assert_follows(sample_counts(row, 20_000, top_p=0.6), row, [0, 1])
    # min_p 0.45: tokens at least 0.45 times as likely as the top one (0.4): 0.2 stays, 0.1 goes.
    assert_follows(sample_counts(row, 20_000, min_p=0.45), row, [0, 1, 2])
    assert_follows(sample_counts(row, 5_000, top_k=4, top_p=0.9, min_p=0.3), row, [0, 1, 2])

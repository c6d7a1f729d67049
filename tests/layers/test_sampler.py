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

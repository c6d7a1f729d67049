"""Sampler: next tokens for a whole batch at once from the last-token logits."""
import torch
from torch import nn

from nanovllm.utils.compile import maybe_compile


class Sampler(nn.Module):
    @maybe_compile
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """logits: [batch, vocab]; temperatures: [batch] (0 = greedy). Returns [batch] token ids.

        Sampling uses the exponential-race form of the Gumbel-max trick:
        argmax(p / E) with E ~ Exp(1) draws from p without a cumulative sum.
        """
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        scaled = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        sampled = (probs / torch.empty_like(probs).exponential_(1.0)).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)

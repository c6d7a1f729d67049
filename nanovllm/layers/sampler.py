"""Sampler: next tokens for a whole batch at once from the last-token logits."""
import torch
from torch import nn

from nanovllm.utils.compile import maybe_compile


class Sampler(nn.Module):
    @maybe_compile
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """logits: [batch, vocab]; temperatures: [batch] (0 = greedy). Returns [batch] token ids.

        Sampling is the Gumbel-max trick in its exponential-race form: with E ~ Exp(1),
        argmax(softmax(x / T) / E) = argmax(x / T - log E), so no softmax and no cumulative
        sum are needed: one pass over the logits, which torch.compile fuses into one kernel.
        """
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        scaled = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
        sampled = (scaled - torch.empty_like(scaled).exponential_(1.0).log()).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)

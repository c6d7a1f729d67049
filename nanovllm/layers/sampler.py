"""Sampler: next tokens for a whole batch at once from the last-token logits."""
import torch
from torch import nn

from nanovllm.utils.compile import maybe_compile


class Sampler(nn.Module):
    @maybe_compile
    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """logits: [batch, vocab]; temperatures: [batch] (0 = greedy); filters: None (the
        fast path: no request restricts its tokens) or per-row (top_k [batch] int64 with 0
        for none, top_p [batch], min_p [batch]). Returns [batch] token ids.

        Sampling is the Gumbel-max trick in its exponential-race form: with E ~ Exp(1),
        argmax(softmax(x / T) / E) = argmax(x / T - log E), so without filters no softmax
        and no cumulative sum are needed: one pass over the logits, which torch.compile
        fuses into one kernel.
        """
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        scaled = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
        if filters is not None:
            scaled = self._apply_filters(scaled, *filters)
        sampled = (scaled - torch.empty_like(scaled).exponential_(1.0).log()).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)

    @staticmethod
    def _apply_filters(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """Set the logits of tokens outside each row's top-k / top-p / min-p set to -inf.
        The most likely token always stays."""
        probs = scaled.softmax(dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [batch, vocab]
        rank = torch.arange(scaled.size(-1), device=scaled.device)
        k = torch.where(top_k > 0, top_k, scaled.size(-1)).unsqueeze(1)
        # Probability mass of the tokens ranked before each one: drop it once it reaches p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank >= k) | (mass_before >= top_p.unsqueeze(1))
        drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
        drop[:, 0] = False
        return scaled.masked_fill(drop.scatter(1, order, drop), float("-inf"))

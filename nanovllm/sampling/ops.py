"""The sampler's tensor operations: penalties, temperature, filters and the keyed draw.

Each compiled path (`maybe_compile`: top-k on every row, the sort-free filters) is one
function over the whole [batch, vocab] logits, so torch.compile fuses its element-wise
work into a few passes. Penalties and temperature-only draws are Triton kernels on CUDA
(kernels/penalize.py, kernels/sample.py), with the torch functions here as their
reference. They take plain tensors and tuples (sampler.py holds the records that carry
them).
"""
from __future__ import annotations

import torch

from nanovllm.utils.compile import maybe_compile
from nanovllm.utils.keyed_noise import keyed_exponential


def penalize(logits: torch.Tensor, penalties: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Repetition (on prompt and output tokens, transformers' rule), then frequency and
    presence (on output tokens, OpenAI's rule): the reference of kernels/penalize.py."""
    counts_table, prompt_table, rows, repetition, frequency, presence = penalties
    counts = counts_table[rows]
    seen = (counts > 0) | prompt_table[rows]
    return penalized(logits, seen, counts, repetition.unsqueeze(1), frequency.unsqueeze(1), presence.unsqueeze(1))


def penalized(logits: torch.Tensor, seen: torch.Tensor | None, counts: torch.Tensor, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The penalties' arithmetic (shared with sampler.DraftPenalties): logits of seen tokens
    (None: every one) divided by the repetition penalty where positive, multiplied where
    not; then frequency times the output count and presence where it is above 0 taken off."""
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = repeated if seen is None else torch.where(seen, repeated, logits)
    return logits - frequency * counts - presence * (counts > 0)


# Rows of at least this many chunks (of up to ARGMAX_CHUNK tokens, a power of two) take
# their argmax in two passes.
ARGMAX_CHUNK = 256
_MIN_ARGMAX_CHUNKS = 8


def _pow2_divisor(n: int, limit: int) -> int:
    """The largest power of two up to `limit` (itself one) that divides n. Plain integer
    steps: inside a compiled function, where n is symbolic, they become a guard on n, where
    math.gcd would break the graph."""
    width = limit
    while n % width:
        width //= 2
    return width


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [batch, vocab], the first maximum on ties, as two reductions when
    the vocabulary splits into chunks: each chunk's max and its position, then the best
    chunk. One reduction over a 152k-token row runs in one program, which at batch 1
    leaves the GPU idle; chunks spread it out (benchmarks/RESULTS.md, session 4)."""
    batch, vocab = x.shape
    width = _pow2_divisor(vocab, ARGMAX_CHUNK)
    if vocab // width < _MIN_ARGMAX_CHUNKS:
        return x.argmax(dim=-1)
    chunk_max, offset = x.reshape(batch, vocab // width, width).max(dim=-1)  # [batch, chunks] each
    chunk = chunk_max.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (chunk * width + offset.gather(1, chunk)).squeeze(1)


def apply_penalties(logits: torch.Tensor, penalties: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The penalized logits in float32: on CUDA one Triton kernel (kernels/penalize.py, one
    pass), elsewhere the torch path; the same values either way. The sampling paths then
    take them like any logits, so none is compiled twice (with penalties and without)."""
    if logits.is_cuda:
        from nanovllm.kernels.penalize import penalize_logits  # imports triton: only on CUDA

        return penalize_logits(logits, *penalties)
    return penalize(logits.float(), penalties)


def _scale(logits: torch.Tensor, temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits divided by the temperature, and their argmax, in one pass."""
    logits = logits.float()
    return logits / temperatures.clamp(min=1e-5).unsqueeze(1), row_argmax(logits)


def _draw(
    scaled: torch.Tensor, greedy: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One Gumbel-max draw per row over the whole vocabulary (scaled [batch, vocab], -inf
    where filtered out); greedy rows keep their argmax."""
    noise = keyed_exponential(keys, positions, torch.arange(scaled.size(-1), device=scaled.device))
    return torch.where(temperatures == 0, greedy, row_argmax(scaled - noise.log()))


def sample_unfiltered(
    logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Temperature and keyed draws over the whole [batch, vocab] logits (the torch path of
    sample_fast, and its reference)."""
    scaled, greedy = _scale(logits, temperatures)
    return _draw(scaled, greedy, temperatures, keys, positions)


def sample_fast(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Tokens [batch] for a batch that uses temperature (and keys) only: on CUDA one Triton
    kernel (kernels/sample.py, one pass over the logits), elsewhere the torch path; the
    same draws either way."""
    if logits.is_cuda:
        from nanovllm.kernels.sample import sample_tokens  # imports triton: only on CUDA

        return sample_tokens(logits, temperatures, keys, positions)
    return sample_unfiltered(logits, temperatures, keys, positions)


def _draw_candidate(
    values: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    temperatures: torch.Tensor, greedy: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
) -> torch.Tensor:
    """Draw among each row's candidates, values / ids [batch, n] sorted most likely first
    (n = the largest top_k): min-p, then top-k, then top-p over the
    renormalized remainder mask candidates out; greedy rows keep their argmax."""
    rank = torch.arange(values.size(-1), device=values.device)
    k = torch.where(top_k > 0, top_k, values.size(-1)).unsqueeze(1)
    # min-p: probability relative to the most likely token, exp(x - x_max) < min_p.
    drop = ((rank >= k) | ((values - values[:, :1]).exp() < min_p.unsqueeze(1))) & (rank > 0)
    values = values.masked_fill(drop, float("-inf"))
    probs = values.softmax(dim=-1)
    # top-p: drop a candidate once the mass ranked before it reaches p.
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)) & (rank > 0)
    values = values.masked_fill(drop, float("-inf"))
    noise = keyed_exponential(keys, positions, ids)
    choice = (values - noise.log()).argmax(dim=-1, keepdim=True)
    return torch.where(temperatures == 0, greedy, ids.gather(1, choice).squeeze(1))


# Width of the chunks top_candidates takes maxima over (at most, a power of two; it must divide the vocabulary).
CANDIDATE_CHUNK = 64


def chunk_width(vocab_size: int, k: int) -> int:
    """The chunk width top_candidates uses for k of vocab_size, 1 when chunking does not pay
    (fewer than four chunks per candidate: a plain topk is as fast)."""
    width = _pow2_divisor(vocab_size, CANDIDATE_CHUNK)
    return width if width > 1 and 4 * k * width <= vocab_size else 1


def top_candidates(scores: torch.Tensor, k: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of each row, largest first, and their ids: [batch, k] each.

    A topk over the whole vocabulary is slow for large batches; two small ones do:
    split each row into chunks of `width` (chunk_width), take the k chunks with the
    largest maxima, and the k largest of their k * width scores. That is exact: those k
    maxima are k scores at least the k-th largest maximum, and every score outside the
    chosen chunks is at most that. width 1 is a plain topk.
    """
    if width == 1:
        return scores.topk(k, dim=-1)
    batch, vocab = scores.shape
    chunk_max = scores.view(batch, vocab // width, width).amax(dim=-1)
    chunks = chunk_max.topk(k, dim=-1).indices  # [batch, k]
    ids = (chunks.unsqueeze(-1) * width + torch.arange(width, device=scores.device)).view(batch, k * width)
    values, order = scores.gather(1, ids).topk(k, dim=-1)
    return values, ids.gather(1, order)


@maybe_compile
def sample_top_k(
    logits: torch.Tensor, temperatures: torch.Tensor,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keys: torch.Tensor, positions: torch.Tensor,
    k: int, width: int,
) -> torch.Tensor:
    """Every row sets top_k (<= k): temperature, the k best candidates and the draw among
    them, compiled as one function."""
    scaled, greedy = _scale(logits, temperatures)
    values, ids = top_candidates(scaled, k, width)
    return _draw_candidate(values, ids, *filters, temperatures, greedy, keys, positions)


# torch.compile specializes integer arguments equal to 0 or 1: the candidate count k passed
# to the compiled paths is at least this, so that every top_k shares one compiled function.
MIN_COMPILED_K = 2

# Halvings of the top-p threshold search: it ends within 2**-NUCLEUS_STEPS times a row's
# largest probability of the exact threshold (a sort of the vocabulary would tell ties at
# the boundary apart by position instead).
NUCLEUS_STEPS = 24


@maybe_compile
def sample_nucleus(
    logits: torch.Tensor, temperatures: torch.Tensor,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keys: torch.Tensor, positions: torch.Tensor,
    k: int, width: int,
) -> torch.Tensor:
    """Filters over the whole vocabulary without sorting it (rows without top_k, e.g. top-p
    alone): a row's top_k cut is its top_k-th best score, from top_candidates (k: at least
    the largest top_k); min-p is a cut at max + log(min_p); top-p keeps the
    tokens at least as likely as the threshold that leaves p of the renormalized mass
    above it, found by halving [0, max prob] NUCLEUS_STEPS times (a pass each, instead of
    sorting the vocabulary). Then one Gumbel-max draw over what is left."""
    top_k, top_p, min_p = filters
    scaled, greedy = _scale(logits, temperatures)
    row_max = scaled.amax(dim=-1, keepdim=True)
    min_p = min_p.unsqueeze(1)
    cut = torch.where(min_p > 0, row_max + min_p.log(), float("-inf"))  # min-p
    values, _ = top_candidates(scaled, k, width)
    kth = values.gather(1, (top_k.clamp(min=1, max=k) - 1).unsqueeze(1))
    cut = torch.where((top_k > 0).unsqueeze(1), torch.maximum(cut, kth), cut)
    scaled = scaled.masked_fill(scaled < cut, float("-inf"))
    probs = (scaled - row_max).exp()
    probs = probs / probs.sum(dim=-1, keepdim=True)
    low = torch.zeros_like(row_max)  # always leaves at least p above it
    high = probs.amax(dim=-1, keepdim=True)
    p = top_p.unsqueeze(1)
    for _ in range(NUCLEUS_STEPS):
        mid = (low + high) * 0.5
        enough = (probs * (probs >= mid)).sum(dim=-1, keepdim=True) >= p
        low = torch.where(enough, mid, low)
        high = torch.where(enough, high, mid)
    return _draw(scaled.masked_fill(probs < low, float("-inf")), greedy, temperatures, keys, positions)


def sample_filtered(
    logits: torch.Tensor, temperatures: torch.Tensor,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keys: torch.Tensor, positions: torch.Tensor,
) -> torch.Tensor:
    """Tokens [batch] under min-p, top-k and top-p (filters: [batch] top_k, 0 = off; top_p,
    1 = off; min_p, 0 = off) as the Triton kernel draws them (kernels/sample_filtered.py,
    no sort; on CUDA unless NANOVLLM_SAMPLER_KERNEL=0): its reference, by sorting. Scores
    are logits / T; min-p keeps scores >= max + log(min_p); top-k those >= the k-th
    largest score; top-p, among what is left, the most likely scores whose mass
    exp(score - max) first reaches top_p of theirs, every score equal to the last one
    kept. Then the keyed draw. (The compiled paths above cut the same way up to ties:
    their top-p halves a probability NUCLEUS_STEPS times, and top-k on every row ranks
    candidates.)"""
    top_k, top_p, min_p = (x.unsqueeze(1) for x in filters)
    scaled, greedy = _scale(logits, temperatures)
    vocab = scaled.size(-1)
    row_max = scaled.amax(dim=-1, keepdim=True)
    kept = scaled >= torch.where(min_p > 0, row_max + min_p.log(), float("-inf"))
    limited = (top_k > 0) & (top_k < vocab)
    if limited.any():
        k = int(top_k[limited].max())
        kth = scaled.topk(k, dim=-1).values.gather(1, top_k.clamp(1, k) - 1)
        kept &= ~limited | (scaled >= kth)
    nucleus = top_p < 1
    if nucleus.any():
        values = scaled.masked_fill(~kept, float("-inf")).sort(dim=-1, descending=True).values
        mass = (values - row_max).exp().cumsum(dim=-1)
        last = (mass < top_p * mass[:, -1:]).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
        kept &= ~nucleus | (scaled >= values.gather(1, last))
    return _draw(scaled.masked_fill(~kept, float("-inf")), greedy, temperatures, keys, positions)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Structured outputs: -inf at logits[rows[r], t] wherever bit t of bitmask[r] ([rows,
    words] int32) is 0, and for every t >= 32 * words, in place; returns logits. On CUDA one Triton kernel
    (kernels/token_bitmask.py), elsewhere this torch reference."""
    if logits.is_cuda:
        from nanovllm.kernels.token_bitmask import apply_token_bitmask as kernel  # imports triton: only on CUDA

        return kernel(logits, bitmask, rows)
    vocab = logits.size(-1)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [rows, <= vocab]
    allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.size(1)))  # past the bitmask: disallowed
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits

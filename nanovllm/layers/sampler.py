"""Sampler: next tokens for a whole batch at once from the last-token logits.

Every per-request parameter arrives as a [batch] tensor (SamplingTensors); parts that no
request in the batch uses are None and cost nothing. The order follows vLLM: logprobs
are taken from the raw logits; then min_tokens bans end-of-sequence and stop tokens,
the repetition / frequency / presence penalties apply, greedy rows take the argmax and
the others divide by their temperature, keep min-p, top-k and then top-p of what is
left, and draw.

Drawing is the Gumbel-max trick in its exponential-race form: with E ~ Exp(1),
argmax(softmax(x / T) / E) = argmax(x / T - log E), so no softmax and no cumulative sum
are needed unless a filter asks for them. E is a hash of (the sequence's key, the
token's position, the token id), computed inside the same fused pass: a seeded request
(its key derives from the seed) draws the same tokens whatever else is in the batch, and
on an H200 the hash is cheaper than torch's Philox generator (0.25 vs 0.42 ms for
256 x 151,936 logits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.utils.compile import maybe_compile

MASK32 = 0xFFFFFFFF
# Multiplier of a well-known 32-bit integer hash (xor-shift and multiply, twice, then a
# final xor-shift). It is below 2**27, so products of 32-bit values stay inside int64.
HASH_MULTIPLIER = 0x45D9F3B


@dataclass(slots=True)
class Penalties:
    output_counts: torch.Tensor  # [slots, vocab] int32: times each token was generated, per sequence
    in_prompt: torch.Tensor  # [slots, vocab] bool: the token occurs in the sequence's prompt
    rows: torch.Tensor  # [batch] int64: each row's slot in the two tables
    repetition: torch.Tensor  # [batch] float32 (1 = off)
    frequency: torch.Tensor  # [batch] float32
    presence: torch.Tensor  # [batch] float32

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.output_counts, self.in_prompt, self.rows, self.repetition, self.frequency, self.presence


@dataclass(slots=True)
class SamplingTensors:
    temperatures: torch.Tensor  # [batch] float32, 0 = greedy
    # The random draws hash these: [batch] int64 per-sequence keys (from the seed when
    # there is one) and positions of the tokens being drawn. None: random keys.
    keys: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    # top_k [batch] int64 (0 = off), top_p [batch], min_p [batch]: all three or none.
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    max_top_k: int = 0  # the largest top_k of any row; 0: no row sets one
    all_top_k: bool = False  # every row sets top_k (its draw needs only the max_top_k best candidates)
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [m], token ids [m]) that may not be drawn
    num_logprobs: int | None = None  # alternatives to return per row; None: no logprobs

    @property
    def is_fast(self) -> bool:
        """Temperature (and keys) only: what sample_fast does."""
        return (self.keys is not None and self.filters is None and self.penalties is None and self.banned is None
                and self.num_logprobs is None)


@dataclass(slots=True)
class SampledLogprobs:
    """Log-softmax of the raw logits around each sampled token, on the device."""

    chosen: torch.Tensor  # [batch] float32: the sampled token's logprob
    rank: torch.Tensor  # [batch] int64: 1 + how many tokens are more likely
    top_ids: torch.Tensor  # [batch, num_logprobs] int64, most likely first
    top_values: torch.Tensor  # [batch, num_logprobs] float32


@dataclass(slots=True)
class StepLogprobs:
    """SampledLogprobs copied to the host, read row by row."""

    chosen: list[float]
    rank: list[int]
    top_ids: list[list[int]]
    top_values: list[list[float]]

    def row(self, i: int) -> tuple[float, int, list[int], list[float]]:
        return self.chosen[i], self.rank[i], self.top_ids[i], self.top_values[i]


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective mix of 32-bit values held in int64."""
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    return (x >> 16) ^ x


def keyed_exponential(keys: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws that depend only on (key, position, token id): keys and positions
    [batch] int64, token_ids [batch, n] or [n] int64; returns [batch, n] float32. Runs
    inside the compiled sampling functions, fused with them."""
    row = _hash32(_hash32(_hash32(keys & MASK32) ^ (keys >> 32)) ^ (positions & MASK32))
    bits = _hash32(row.unsqueeze(1) ^ _hash32(token_ids * 2 + 1 & MASK32))
    return -open_unit_interval(bits).log()


def open_unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64) -> float32 uniforms strictly inside (0, 1), from their top 23
    bits. With 24, the top value rounds to 1.0 in float32, its E to 0, and a token with
    that draw (one in 2**24: ~1% of rows over a 152k vocabulary) would always win."""
    return ((bits >> 9).float() + 0.5) * 2.0**-23


def _penalize(logits: torch.Tensor, penalties: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """Repetition (on prompt and output tokens, transformers' rule), then frequency and
    presence (on output tokens, OpenAI's rule). Indexing the tables inside a compiled
    caller fuses the gather into the same pass as the arithmetic."""
    if penalties is None:
        return logits
    counts_table, prompt_table, rows, repetition, frequency, presence = penalties
    counts = counts_table[rows]
    seen = (counts > 0) | prompt_table[rows]
    repetition = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    return _penalize(logits.float(), p.as_tuple())


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
    chunk. One reduction over a 152k-token row runs in one program (~94 us on an H200 for
    a batch of 1, as much as a quarter of the model's layers); chunks spread it out."""
    batch, vocab = x.shape
    width = _pow2_divisor(vocab, ARGMAX_CHUNK)
    if vocab // width < _MIN_ARGMAX_CHUNKS:
        return x.argmax(dim=-1)
    chunk_max, offset = x.reshape(batch, vocab // width, width).max(dim=-1)  # [batch, chunks] each
    chunk = chunk_max.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (chunk * width + offset.gather(1, chunk)).squeeze(1)


def _scale(
    logits: torch.Tensor, temperatures: torch.Tensor, penalties: tuple[torch.Tensor, ...] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Penalized logits divided by the temperature, and their argmax, in one pass."""
    logits = _penalize(logits.float(), penalties)
    return logits / temperatures.clamp(min=1e-5).unsqueeze(1), row_argmax(logits)


def _draw(
    scaled: torch.Tensor, greedy: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One Gumbel-max draw per row over the whole vocabulary (scaled [batch, vocab], -inf
    where filtered out); greedy rows keep their argmax."""
    noise = keyed_exponential(keys, positions, torch.arange(scaled.size(-1), device=scaled.device))
    return torch.where(temperatures == 0, greedy, row_argmax(scaled - noise.log()))


@maybe_compile
def _sample_unfiltered(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    penalties: tuple[torch.Tensor, ...] | None,
) -> torch.Tensor:
    """The fast path: one fused pass over the [batch, vocab] logits."""
    scaled, greedy = _scale(logits, temperatures, penalties)
    return _draw(scaled, greedy, temperatures, keys, positions)


def sample_fast(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Tokens [batch] for a batch that uses temperature (and keys) only: on CUDA one Triton
    kernel (kernels/sample.py, one pass over the logits), elsewhere the torch path; the
    same draws either way."""
    if logits.is_cuda:
        from nanovllm.kernels.sample import sample_tokens  # it imports this module's constants

        return sample_tokens(logits, temperatures, keys, positions)
    return _sample_unfiltered(logits, temperatures, keys, positions, None)


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

    torch.topk over a 152k vocabulary takes ~0.6 ms for 256 rows. Two small ones do:
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
def _sample_top_k(
    logits: torch.Tensor, temperatures: torch.Tensor, penalties: tuple[torch.Tensor, ...] | None,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keys: torch.Tensor, positions: torch.Tensor,
    k: int, width: int,
) -> torch.Tensor:
    """Every row sets top_k (<= k): penalties, temperature, the k best candidates and the
    draw among them, compiled as one function."""
    scaled, greedy = _scale(logits, temperatures, penalties)
    values, ids = top_candidates(scaled, k, width)
    return _draw_candidate(values, ids, *filters, temperatures, greedy, keys, positions)


# torch.compile specializes integer arguments equal to 0 or 1: the candidate count k passed
# to the compiled paths is at least this, so that every top_k shares one compiled function.
_MIN_COMPILED_K = 2

# Halvings of the top-p threshold search: it ends within 2**-NUCLEUS_STEPS of a row's
# largest probability of the exact threshold (a sort of the vocabulary would tell ties
# at the boundary apart by position instead).
NUCLEUS_STEPS = 24


@maybe_compile
def _sample_nucleus(
    logits: torch.Tensor, temperatures: torch.Tensor, penalties: tuple[torch.Tensor, ...] | None,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keys: torch.Tensor, positions: torch.Tensor,
    k: int, width: int,
) -> torch.Tensor:
    """Filters over the whole vocabulary without sorting it (rows without top_k, e.g. top-p
    alone): a row's top_k cut is its top_k-th best score, from top_candidates (k: at least
    the largest top_k); min-p is a cut at max + log(min_p); top-p keeps the
    tokens at least as likely as the threshold that leaves p of the renormalized mass
    above it, found by halving [0, max prob] NUCLEUS_STEPS times (a pass each, instead of
    a ~10 ms sort of 256 x 152k). Then one Gumbel-max draw over what is left."""
    top_k, top_p, min_p = filters
    scaled, greedy = _scale(logits, temperatures, penalties)
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


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """logits: [batch, vocab]. Returns the [batch] int64 token ids and, when asked
        for, their logprobs."""
        logprobs = None
        if t.num_logprobs is not None:
            logprobs = logits.float().log_softmax(dim=-1)
        if t.banned is not None:
            logits = logits.index_put(t.banned, torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))
        keys, positions = t.keys, t.positions
        if keys is None:
            keys = torch.randint(0, 1 << 62, (logits.size(0),), device=logits.device)
            positions = torch.zeros_like(keys)
        penalties = t.penalties.as_tuple() if t.penalties is not None else None
        if t.filters is None and penalties is None:
            tokens = sample_fast(logits, t.temperatures, keys, positions)
        elif t.filters is None:
            tokens = _sample_unfiltered(logits, t.temperatures, keys, positions, penalties)
        else:
            vocab_size = logits.size(-1)
            # The rows' own top_k tensors cut; k only sizes the candidate set, so it is never
            # below _MIN_COMPILED_K (a top_k of 1, or none, would each compile again).
            k = min(max(t.max_top_k, _MIN_COMPILED_K), vocab_size)
            width = chunk_width(vocab_size, k)
            if t.all_top_k and t.max_top_k < vocab_size:  # only the k best candidates matter
                tokens = _sample_top_k(logits, t.temperatures, penalties, t.filters, keys, positions, k, width)
            else:
                tokens = _sample_nucleus(logits, t.temperatures, penalties, t.filters, keys, positions, k, width)
        if logprobs is None:
            return tokens, None
        return tokens, self._logprobs(logprobs, tokens, t.num_logprobs)

    def warm_up(self, vocab_size: int, device: torch.device, dtype: torch.dtype) -> None:
        """Run every compiled filtered path once, for a batch of several rows and of one
        (torch.compile specializes on 1): top-k on every row, the sort-free filters, and
        penalties alone, each with and without penalties. The compiles then happen here
        rather than when the first such request joins a running batch."""
        for batch in (2, 1):
            logits = torch.randn(batch, vocab_size, device=device, dtype=dtype)
            ones = torch.ones(batch, device=device)
            keys = torch.arange(batch, device=device)
            positions = keys + 1  # not keys itself: a compiled function guards on which arguments alias
            counts = torch.zeros(batch + 2, vocab_size, dtype=torch.int32, device=device)
            penalties = Penalties(counts, counts > 0, keys + 2, ones * 1.1, ones * 0.1, ones * 0.1)
            filters = (torch.full((batch,), 2, device=device), ones * 0.9, ones * 0.05)
            for p in (None, penalties):
                for all_top_k in (True, False):
                    self(logits, SamplingTensors(ones, keys, positions, filters, 2, all_top_k, p))
            self(logits, SamplingTensors(ones, keys, positions, penalties=penalties))

    @staticmethod
    def _logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, num: int) -> SampledLogprobs:
        chosen = logprobs.gather(1, tokens.unsqueeze(1))  # [batch, 1]
        rank = (logprobs > chosen).sum(dim=-1) + 1
        top_values, top_ids = logprobs.topk(num, dim=-1) if num > 0 else (logprobs[:, :0], tokens[:, None][:, :0])
        return SampledLogprobs(chosen.squeeze(1), rank, top_ids, top_values)

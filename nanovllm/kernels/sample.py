"""Temperature sampling in one pass over the logits: the sampler of temperature-only batches.

The draw is utils/keyed_noise.py's (the Gumbel-max trick with hashed noise): row b's token
is the argmax over the vocabulary of logits / T - log(E), with E = -log(U) and U a hash of
(keys[b], positions[b], token id) mapped into (0, 1); rows with T = 0 take the argmax of
the logits. The same float operations in the same order as the torch path
(sampling/ops.py), so both give the same token for a row whichever runs it.

Compiled from torch, the draw takes three passes over the logits and writes a [batch,
vocab] fp32 intermediate. Here program (row, chunk) reads its CHUNK logits once, computes
the hashes in 32-bit integer arithmetic, and keeps the chunk's best draw (a greedy row
draws no noise: its largest logit), the first on ties; the last chunk of a row to finish
(kernels/split_counters.py) picks the row's token from the chunks' results, the lowest
chunk on ties, so the first maximum over the row as torch's argmax. One launch, safe in a
CUDA graph.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch
from nanovllm.kernels.split_counters import last_to_count, split_counters
from nanovllm.utils.keyed_noise import HASH_MULTIPLIER, UNIFORM_DROPPED_BITS, UNIFORM_SCALE

# Logits per program: 38 chunks for a 151,936-token vocabulary.
_MAX_CHUNK = 4096
_NUM_WARPS = 8
_HASH_MULTIPLIER = tl.constexpr(HASH_MULTIPLIER)
_DROPPED_BITS = tl.constexpr(UNIFORM_DROPPED_BITS)
_UNIFORM_SCALE = tl.constexpr(UNIFORM_SCALE)


@triton.jit
def _hash32(x):
    """utils/keyed_noise.py's hash32 on uint32: products wrap at 2**32 as its masks do."""
    x = ((x >> 16) ^ x) * _HASH_MULTIPLIER
    x = ((x >> 16) ^ x) * _HASH_MULTIPLIER
    return (x >> 16) ^ x


@triton.jit
def _row_hash(keys_ptr, positions_ptr, row):
    """keyed_exponential's hash of a row's (key, position)."""
    key = tl.load(keys_ptr + row)
    position = tl.load(positions_ptr + row)
    return _hash32(_hash32(_hash32((key & 0xFFFFFFFF).to(tl.uint32)) ^ (key >> 32).to(tl.uint32))
                   ^ (position & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _gumbel_scores(scaled, row_hash, ids):
    """scaled - log(E) with E the keyed Exp(1) draw of each token id (keyed_exponential)."""
    bits = _hash32(row_hash ^ _hash32((ids * 2 + 1).to(tl.uint32)))
    uniform = ((bits >> _DROPPED_BITS).to(tl.float32) + 0.5) * _UNIFORM_SCALE
    return scaled - tl.log(-tl.log(uniform))


@triton.jit
def _sample_kernel(
    logits_ptr,  # [batch, vocab], row stride stride_row
    temperatures_ptr,  # [batch] fp32, 0 = greedy
    keys_ptr,  # [batch] int64 in [0, 2**62)
    positions_ptr,  # [batch] int64
    best_ptr,  # [batch, NUM_CHUNKS] fp32: each chunk's best score (its largest logit for a greedy row)
    best_ids_ptr,  # [batch, NUM_CHUNKS] int32: its token
    counters_ptr,  # [>= batch] int32, zero between launches
    out_ptr,  # [batch] int64
    vocab,
    stride_row,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = ids < vocab
    logits = tl.load(logits_ptr + row.to(tl.int64) * stride_row + ids, mask=valid, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperatures_ptr + row)
    if temperature == 0:  # the same for the whole program: a greedy row draws no noise
        scores = logits
    else:
        scores = _gumbel_scores(logits / tl.maximum(temperature, 1e-5), _row_hash(keys_ptr, positions_ptr, row), ids)
        scores = tl.where(valid, scores, float("-inf"))
    slot = row * NUM_CHUNKS + chunk
    best, best_id = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)  # one reduction
    tl.store(best_ptr + slot, best)
    tl.store(best_ids_ptr + slot, chunk * CHUNK + best_id)
    # Release this chunk's results, acquire the others': the program that brings the
    # count to NUM_CHUNKS sees them all.
    if last_to_count(counters_ptr + row, NUM_CHUNKS):
        chunks = tl.arange(0, CHUNKS_POW2)
        mask = chunks < NUM_CHUNKS
        first = row * NUM_CHUNKS + chunks
        # .cg: read from L2, where the other programs' stores are, never a stale L1 line
        values = tl.load(best_ptr + first, mask=mask, other=float("-inf"), cache_modifier=".cg")
        winners = tl.load(best_ids_ptr + first, mask=mask, other=0, cache_modifier=".cg")
        pick = tl.argmax(values, axis=0, tie_break_left=True)
        token = tl.sum(tl.where(chunks == pick, winners, 0), axis=0)
        tl.store(out_ptr + row, token.to(tl.int64))


def sample_tokens(
    logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One token per row, as sampling/ops.py's sample_fast draws it.

    Args:
        logits: [batch, vocab], any float dtype, contiguous in vocab.
        temperatures: [batch] float32; 0 takes the argmax.
        keys: [batch] int64 in [0, 2**62), the rows' draw keys.
        positions: [batch] int64, the positions of the tokens being drawn.

    Returns:
        [batch] int64 token ids.
    """
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in the vocabulary")
    for name, t in (("temperatures", temperatures), ("keys", keys), ("positions", positions)):
        if t.shape != (batch,):
            raise ValueError(f"{name} must be [{batch}], got {tuple(t.shape)}")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    counters = split_counters(logits.device, batch)  # allocated on the first call, before any capture
    if batch == 0:
        return out
    chunk = min(_MAX_CHUNK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    best = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    ids = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    launch(_sample_kernel, (batch, num_chunks),
        logits, temperatures, keys, positions, best, ids, counters, out,
        vocab, logits.stride(0),
        NUM_CHUNKS=num_chunks, CHUNKS_POW2=triton.next_power_of_2(num_chunks), CHUNK=chunk,
        num_warps=_NUM_WARPS,
    )
    return out

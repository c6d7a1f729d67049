"""min-p, top-k and top-p sampling without sorting: one program per row, nothing compiled
by torch (sampling/ops.py's sample_filtered is the reference, the same draws).

Row b's scores are s = logits / T. min-p keeps s >= max(s) + log(min_p); top-k keeps
the scores at least the k-th largest; top-p then keeps the fewest most likely of those
whose mass exp(s - max) reaches top_p of theirs, ties at the boundary kept. Both cuts
are thresholds on s, found as the largest key t with count(key >= t) >= k (or
mass(key >= t) >= p * mass), where a score's key is its float32 bits as an int32 in the
scores' order: a search over integers, so the threshold is exactly a score of the row.
Each pass of the search counts NUM_THRESHOLDS candidate thresholds at once, cutting the
range ~16-fold, and skips the chunks whose largest key is below the range (the first
pass records each chunk's). Then the keyed Gumbel-max draw of kernels/sample.py over
what is left; greedy rows (T = 0) take the argmax of the logits.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.sample import _gumbel_scores, _row_hash

_CHUNK = 1024
_NUM_THRESHOLDS = 16
_NUM_WARPS = 8
_LOWEST_KEY = tl.constexpr(-2147483647)  # below every score's key: no cut


@triton.jit
def _scores(row_ptr, start, vocab, temperature, CHUNK: tl.constexpr):
    """A chunk's token ids, validity, logits (fp32) and scores; -inf past the vocabulary."""
    ids = start + tl.arange(0, CHUNK)
    valid = ids < vocab
    logits = tl.load(row_ptr + ids, mask=valid, other=float("-inf")).to(tl.float32)
    return ids, valid, logits, logits / tl.maximum(temperature, 1e-5)


@triton.jit
def _ordered_key(scores):
    """int32 keys in the order of the float32 scores (-0.0 and 0.0 equal)."""
    bits = tl.where(scores == 0.0, 0.0, scores).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _threshold(row_ptr, chunk_max_ptr, vocab, temperature, row_max, cut, lo, hi, need,
               BY_MASS: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, NT: tl.constexpr):
    """The largest key t in [lo, hi] with measure(key >= t) >= need, given that lo has it;
    measure counts the tokens with s >= cut and key >= lo (BY_MASS: weighs them by
    exp(s - row_max))."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    floor = lo.to(tl.int32)
    steps = tl.arange(0, NT)
    while lo < hi:
        candidates = lo + ((hi - lo) * steps) // NT + 1  # [NT], all in (lo, hi]
        low = lo.to(tl.int32)
        total = tl.zeros([NT], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            if tl.load(chunk_max_ptr + chunk) > low:  # else no key here reaches a candidate
                ids, valid, logits, scores = _scores(row_ptr, chunk * CHUNK, vocab, temperature, CHUNK)
                keys = _ordered_key(scores)
                kept = valid & (scores >= cut) & (keys >= floor)
                if BY_MASS:
                    weight = tl.where(kept, tl.exp(scores - row_max), 0.0)
                else:
                    weight = kept.to(tl.float32)
                above = keys[:, None] >= candidates.to(tl.int32)[None, :]
                total += tl.sum(tl.where(above, weight[:, None], 0.0), axis=0)
        passed = tl.sum((total >= need).to(tl.int32), axis=0)  # candidates 0 .. passed - 1 have it
        new_lo = tl.max(tl.where(steps == passed - 1, candidates, lo), axis=0)
        hi = tl.where(passed < NT, tl.max(tl.where(steps == passed, candidates - 1, lo), axis=0), hi)
        lo = new_lo
    return lo.to(tl.int32)


@triton.jit
def _sample_filtered_kernel(
    logits_ptr,  # [batch, vocab], row stride stride_row
    temperatures_ptr,  # [batch] fp32, 0 = greedy
    top_k_ptr,  # [batch] int64, 0 = off
    top_p_ptr,  # [batch] fp32, 1 = off
    min_p_ptr,  # [batch] fp32, 0 = off
    keys_ptr,  # [batch] int64 in [0, 2**62)
    positions_ptr,  # [batch] int64
    chunk_max_ptr,  # [batch, NUM_CHUNKS] int32 scratch: each chunk's largest key
    out_ptr,  # [batch] int64
    vocab,
    stride_row,
    NUM_CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    NT: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    chunk_max_ptr += row * NUM_CHUNKS
    temperature = tl.load(temperatures_ptr + row)

    # Pass 1: the largest score and the argmax of the logits (the first on ties, as torch),
    # and each chunk's largest key.
    best = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    best_ids = tl.zeros([CHUNK], dtype=tl.int32)
    for chunk in range(NUM_CHUNKS):
        ids, valid, logits, scores = _scores(row_ptr, chunk * CHUNK, vocab, temperature, CHUNK)
        better = logits > best
        best = tl.where(better, logits, best)
        best_ids = tl.where(better, ids, best_ids)
        tl.store(chunk_max_ptr + chunk, tl.max(tl.where(valid, _ordered_key(scores), _LOWEST_KEY), axis=0))
    top_logit = tl.max(best, axis=0)
    greedy = tl.min(tl.where(best == top_logit, best_ids, vocab), axis=0)
    if temperature == 0:
        tl.store(out_ptr + row, greedy.to(tl.int64))
        return
    row_max = top_logit / tl.maximum(temperature, 1e-5)
    # (Division is monotonic, so the largest score is the largest logit's.)

    min_p = tl.load(min_p_ptr + row)
    cut = tl.where(min_p > 0, row_max + tl.log(min_p), float("-inf"))
    top_key = _ordered_key(row_max)
    floor = tl.zeros_like(top_key) + _LOWEST_KEY  # no cut yet
    top_k = tl.load(top_k_ptr + row)
    if (top_k > 0) & (top_k < vocab):
        floor = _threshold(row_ptr, chunk_max_ptr, vocab, temperature, row_max, float("-inf"), floor, top_key,
                           top_k.to(tl.float32), False, NUM_CHUNKS, CHUNK, NT)
    top_p = tl.load(top_p_ptr + row)
    if top_p < 1:
        mass = tl.zeros([CHUNK], dtype=tl.float32)
        low = floor
        for chunk in range(NUM_CHUNKS):
            if tl.load(chunk_max_ptr + chunk) >= low:
                ids, valid, logits, scores = _scores(row_ptr, chunk * CHUNK, vocab, temperature, CHUNK)
                kept = valid & (scores >= cut) & (_ordered_key(scores) >= low)
                mass += tl.where(kept, tl.exp(scores - row_max), 0.0)
        floor = _threshold(row_ptr, chunk_max_ptr, vocab, temperature, row_max, cut, floor, top_key,
                           top_p * tl.sum(mass, axis=0), True, NUM_CHUNKS, CHUNK, NT)

    # The keyed draw (kernels/sample.py's) over the tokens left.
    row_hash = _row_hash(keys_ptr, positions_ptr, row)
    drawn = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    drawn_ids = tl.zeros([CHUNK], dtype=tl.int32)
    for chunk in range(NUM_CHUNKS):
        if tl.load(chunk_max_ptr + chunk) >= floor:
            ids, valid, logits, scores = _scores(row_ptr, chunk * CHUNK, vocab, temperature, CHUNK)
            kept = valid & (scores >= cut) & (_ordered_key(scores) >= floor)
            draw = tl.where(kept, _gumbel_scores(scores, row_hash, ids), float("-inf"))
            better = draw > drawn
            drawn = tl.where(better, draw, drawn)
            drawn_ids = tl.where(better, ids, drawn_ids)
    top_draw = tl.max(drawn, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(drawn == top_draw, drawn_ids, vocab), axis=0).to(tl.int64))


def sample_filtered_tokens(
    logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    keys: torch.Tensor, positions: torch.Tensor,
) -> torch.Tensor:
    """One token per row, as sampling/ops.py's sample_filtered draws it.

    Args:
        logits: [batch, vocab], any float dtype, contiguous in vocab.
        temperatures: [batch] float32; 0 takes the argmax.
        top_k: [batch] int64 (0: off); top_p: [batch] float32 (1: off); min_p: [batch] float32 (0: off).
        keys: [batch] int64 in [0, 2**62), the rows' draw keys; positions: [batch] int64.

    Returns:
        [batch] int64 token ids.
    """
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in the vocabulary")
    for name, t in (("temperatures", temperatures), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                    ("keys", keys), ("positions", positions)):
        if t.shape != (batch,):
            raise ValueError(f"{name} must be [{batch}], got {tuple(t.shape)}")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    num_chunks = triton.cdiv(vocab, _CHUNK)
    chunk_max = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    _sample_filtered_kernel[(batch,)](
        logits, temperatures, top_k, top_p.float(), min_p.float(), keys, positions, chunk_max, out,
        vocab, logits.stride(0),
        NUM_CHUNKS=num_chunks, CHUNK=_CHUNK, NT=_NUM_THRESHOLDS, num_warps=_NUM_WARPS,
    )
    return out

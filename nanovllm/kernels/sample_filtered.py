"""min-p, top-k and top-p sampling without sorting the vocabulary, in one launch
(sampling/ops.py's sample_filtered is the reference: the same draws).

Row b's scores are s = logits / T. min-p keeps s >= max(s) + log(min_p); top-k keeps
the scores at least the k-th largest; top-p then keeps the fewest most likely of those
whose mass exp(s - max) reaches top_p of theirs, ties at the boundary kept; then the
keyed Gumbel-max draw of kernels/sample.py over what is left. Greedy rows (T = 0) take
the argmax of the logits.

Phase 1, program (row, split): SPLIT logits; their argmax, largest score and mass, and
the largest score of each BLOCK of them. Phase 2, the row's last program to finish
(kernels/split_counters.py): the k-th largest of the blocks' maxima, L, is at most the
k-th largest score, since those blocks hold k scores of at least L. So every token that
top-k keeps lies in the k blocks whose maximum is at least L, and is at least L: a few
more than k candidates, gathered into scratch, where the cuts are searched for in
registers. Without top-k, top-p takes the TOP_P_BLOCKS best blocks' candidates, enough when
their mass reaches top_p of the row's. When the candidates cannot hold what the filters
keep (more than _MAX_CANDIDATES, a min-p cut below L with top-p, no cut at all) the row
falls back to integer searches over the whole row: a score's key is its float32 bits as
an int32 in the scores' order, each pass counts _NUM_THRESHOLDS candidate thresholds and
skips the blocks whose largest key is below the range.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch
from nanovllm.kernels.sample import _gumbel_scores, _row_hash
from nanovllm.kernels.split_counters import last_to_count, split_counters

_MAX_SPLIT = 4096
_BLOCK = 256
_MAX_CANDIDATES = 1024
_TOP_P_BLOCKS = 256
_GROUP = 4  # blocks gathered at a time
_NUM_THRESHOLDS = 16
_NUM_WARPS = 8
_LOWEST_KEY = tl.constexpr(-2147483647)  # below every score's key: no cut


@triton.jit
def _scores(row_ptr, ids, valid, temperature):
    """Logits (fp32) and scores at ids; -inf where not valid."""
    logits = tl.load(row_ptr + ids, mask=valid, other=float("-inf")).to(tl.float32)
    return logits, logits / tl.maximum(temperature, 1e-5)


@triton.jit
def _ordered_key(scores):
    """int32 keys in the order of the float32 scores (-0.0 and 0.0 equal)."""
    bits = tl.where(scores == 0.0, 0.0, scores).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _narrow(lo, hi, candidates, total, need, steps, NT: tl.constexpr):
    """One pass of a threshold search: total[i] is the measure of key >= candidates[i];
    the range left is from the last candidate that has need to just below the first that
    has not."""
    passed = tl.sum((total >= need).to(tl.int32), axis=0)  # candidates 0 .. passed - 1 have it
    new_lo = tl.max(tl.where(steps == passed - 1, candidates, lo), axis=0)
    hi = tl.where(passed < NT, tl.max(tl.where(steps == passed, candidates - 1, lo), axis=0), hi)
    return new_lo, hi


@triton.jit
def _search(keys, weight, lo, hi, need, NT: tl.constexpr):
    """The largest key t in [lo, hi] with sum(weight where keys >= t) >= need, given that
    lo has it; keys and weight are 1-D blocks."""
    lo += tl.zeros([], dtype=tl.int64)
    hi += tl.zeros([], dtype=tl.int64)
    steps = tl.arange(0, NT)
    while lo < hi:
        candidates = lo + ((hi - lo) * steps) // NT + 1  # [NT], all in (lo, hi]
        above = keys[:, None] >= candidates.to(tl.int32)[None, :]
        lo, hi = _narrow(lo, hi, candidates, tl.sum(tl.where(above, weight[:, None], 0.0), axis=0), need, steps, NT)
    return lo.to(tl.int32)


@triton.jit
def _threshold(row_ptr, block_max_ptr, vocab, temperature, row_max, cut, lo, hi, need,
               BY_MASS: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, NT: tl.constexpr):
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
        for block in range(NUM_BLOCKS):
            if tl.load(block_max_ptr + block, cache_modifier=".cg") > low:  # else no key here reaches a candidate
                ids = block * BLOCK + tl.arange(0, BLOCK)
                valid = ids < vocab
                logits, scores = _scores(row_ptr, ids, valid, temperature)
                keys = _ordered_key(scores)
                kept = valid & (scores >= cut) & (keys >= floor)
                if BY_MASS:
                    weight = tl.where(kept, tl.exp(scores - row_max), 0.0)
                else:
                    weight = kept.to(tl.float32)
                above = keys[:, None] >= candidates.to(tl.int32)[None, :]
                total += tl.sum(tl.where(above, weight[:, None], 0.0), axis=0)
        lo, hi = _narrow(lo, hi, candidates, total, need, steps, NT)
    return lo.to(tl.int32)


@triton.jit
def _kept_block(row_ptr, block, vocab, temperature, cut, floor, BLOCK: tl.constexpr):
    """A block's token ids, scores, and which of them have s >= cut and key >= floor."""
    ids = block * BLOCK + tl.arange(0, BLOCK)
    valid = ids < vocab
    logits, scores = _scores(row_ptr, ids, valid, temperature)
    return ids, scores, valid & (scores >= cut) & (_ordered_key(scores) >= floor)


@triton.jit
def _draw_whole_row(row_ptr, block_max_ptr, vocab, temperature, row_max, cut, top_k, top_p, row_hash,
                    NUM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, NT: tl.constexpr):
    """The fallback: the cuts searched over the whole row, then the draw over it."""
    top_key = _ordered_key(row_max)
    floor = tl.zeros_like(top_key) + _LOWEST_KEY  # no cut yet
    if (top_k > 0) & (top_k < vocab):
        floor = _threshold(row_ptr, block_max_ptr, vocab, temperature, row_max, float("-inf"), floor, top_key,
                           top_k.to(tl.float32), False, NUM_BLOCKS, BLOCK, NT)
    if top_p < 1:
        mass = tl.zeros([BLOCK], dtype=tl.float32)
        for block in range(NUM_BLOCKS):
            if tl.load(block_max_ptr + block, cache_modifier=".cg") >= floor:
                ids, scores, kept = _kept_block(row_ptr, block, vocab, temperature, cut, floor, BLOCK)
                mass += tl.where(kept, tl.exp(scores - row_max), 0.0)
        floor = _threshold(row_ptr, block_max_ptr, vocab, temperature, row_max, cut, floor, top_key,
                           top_p * tl.sum(mass, axis=0), True, NUM_BLOCKS, BLOCK, NT)
    drawn = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    drawn_ids = tl.zeros([BLOCK], dtype=tl.int32)
    for block in range(NUM_BLOCKS):
        if tl.load(block_max_ptr + block, cache_modifier=".cg") >= floor:
            ids, scores, kept = _kept_block(row_ptr, block, vocab, temperature, cut, floor, BLOCK)
            draw = tl.where(kept, _gumbel_scores(scores, row_hash, ids), float("-inf"))
            better = draw > drawn
            drawn = tl.where(better, draw, drawn)
            drawn_ids = tl.where(better, ids, drawn_ids)
    top_draw = tl.max(drawn, axis=0)
    return tl.min(tl.where(drawn == top_draw, drawn_ids, vocab), axis=0)


@triton.jit(do_not_specialize=["batch"])  # one compile for every batch size (1 and multiples of 16 too)
def _sample_filtered_kernel(
    logits_ptr,  # [batch, vocab], row stride stride_row
    temperatures_ptr,  # [batch] fp32, 0 = greedy
    top_k_ptr,  # [batch] int64, 0 = off
    top_p_ptr,  # [batch] fp32, 1 = off
    min_p_ptr,  # [batch] fp32, 0 = off
    keys_ptr,  # [batch] int64 in [0, 2**62)
    positions_ptr,  # [batch] int64
    part_ptr,  # [3, batch, NUM_SPLITS] fp32: each split's largest logit, largest score, mass below that
    part_ids_ptr,  # [batch, NUM_SPLITS] int32: each split's argmax
    block_max_ptr,  # [batch, NUM_BLOCKS] int32: each block's largest key
    selected_ptr,  # [batch, BLOCKS_POW2] int32 scratch: the blocks gathered
    cand_ptr,  # [batch, MAX_CAND] fp32 scratch: the candidates' scores
    cand_ids_ptr,  # [batch, MAX_CAND] int32 scratch: their token ids
    counters_ptr,  # [>= batch] int32, zero between launches
    out_ptr,  # [batch] int64
    batch,
    vocab,
    stride_row,
    NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
    MAX_CAND: tl.constexpr,
    TOP_P_BLOCKS: tl.constexpr,
    GROUP: tl.constexpr,
    NT: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temperature = tl.load(temperatures_ptr + row)
    PER_SPLIT: tl.constexpr = SPLIT // BLOCK
    NUM_BLOCKS: tl.constexpr = NUM_SPLITS * PER_SPLIT

    # Phase 1: this split's argmax (the first on ties), largest score, mass below it, and
    # the largest key of each of its blocks.
    ids = split * SPLIT + tl.arange(0, PER_SPLIT)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = ids < vocab
    logits, scores = _scores(row_ptr, ids, valid, temperature)
    top_logit = tl.max(tl.max(logits, axis=1), axis=0)
    slot = row * NUM_SPLITS + split
    tl.store(part_ptr + slot, top_logit)
    tl.store(part_ids_ptr + slot, tl.min(tl.min(tl.where(logits == top_logit, ids, vocab), axis=1), axis=0))
    if temperature > 0:
        tl.store(block_max_ptr + row * NUM_BLOCKS + split * PER_SPLIT + tl.arange(0, PER_SPLIT),
                 tl.max(tl.where(valid, _ordered_key(scores), _LOWEST_KEY), axis=1))
        top = tl.max(tl.max(scores, axis=1), axis=0)
        safe_top = tl.where(top == float("-inf"), 0.0, top)
        tl.store(part_ptr + batch * NUM_SPLITS + slot, top)
        tl.store(part_ptr + 2 * batch * NUM_SPLITS + slot, tl.sum(tl.sum(tl.exp(scores - safe_top), axis=1), axis=0))
    # Release this split's results, acquire the others': the program that brings the
    # count to NUM_SPLITS sees them all (.cg loads: from L2, never a stale L1 line).
    if last_to_count(counters_ptr + row, NUM_SPLITS):
        splits = tl.arange(0, SPLITS_POW2)
        first = row * NUM_SPLITS + splits
        in_row = splits < NUM_SPLITS
        tops = tl.load(part_ptr + first, mask=in_row, other=float("-inf"), cache_modifier=".cg")
        top_ids = tl.load(part_ids_ptr + first, mask=in_row, other=0, cache_modifier=".cg")
        top_logit = tl.max(tops, axis=0)
        token = tl.min(tl.where(tops == top_logit, top_ids, vocab), axis=0)  # the first on ties, as torch
        if temperature > 0:
            token = _draw_row(row_ptr, row, temperature, top_logit, first, in_row, top_k_ptr, top_p_ptr,
                              min_p_ptr, keys_ptr, positions_ptr, part_ptr + batch * NUM_SPLITS, block_max_ptr,
                              selected_ptr, cand_ptr, cand_ids_ptr, batch, vocab, NUM_SPLITS, BLOCK, NUM_BLOCKS,
                              BLOCKS_POW2, MAX_CAND, TOP_P_BLOCKS, GROUP, NT)
        tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _draw_row(row_ptr, row, temperature, top_logit, first, in_row, top_k_ptr, top_p_ptr, min_p_ptr, keys_ptr,
              positions_ptr, part_ptr, block_max_ptr, selected_ptr, cand_ptr, cand_ids_ptr, batch, vocab,
              NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_POW2: tl.constexpr,
              MAX_CAND: tl.constexpr, TOP_P_BLOCKS: tl.constexpr, GROUP: tl.constexpr, NT: tl.constexpr):
    """Phase 2 of a sampled row: its token."""
    row_max = top_logit / tl.maximum(temperature, 1e-5)  # division is monotonic: the largest score
    tops = tl.load(part_ptr + first, mask=in_row, other=float("-inf"), cache_modifier=".cg")
    masses = tl.load(part_ptr + batch * NUM_SPLITS + first, mask=in_row, other=0.0, cache_modifier=".cg")
    row_mass = tl.sum(tl.where(tops > float("-inf"), masses * tl.exp(tops - row_max), 0.0), axis=0)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    cut = tl.where(min_p > 0, row_max + tl.log(min_p), float("-inf"))
    limited = (top_k > 0) & (top_k < vocab)
    block_max_ptr += row * NUM_BLOCKS
    row_hash = _row_hash(keys_ptr, positions_ptr, row)

    # L: the j-th largest block maximum; the blocks at least L hold the candidates.
    blocks = tl.arange(0, BLOCKS_POW2)
    block_keys = tl.load(block_max_ptr + blocks, mask=blocks < NUM_BLOCKS, other=_LOWEST_KEY, cache_modifier=".cg")
    num_valid = tl.cdiv(vocab, BLOCK)
    j = tl.minimum(tl.where(limited, top_k, TOP_P_BLOCKS), num_valid)
    low = _search(block_keys, (blocks < num_valid).to(tl.float32), _LOWEST_KEY, tl.max(block_keys, axis=0),
                  j.to(tl.float32), NT)
    chosen = block_keys >= low
    selected_ptr += row * BLOCKS_POW2
    tl.store(selected_ptr + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, blocks, mask=chosen)
    num_chosen = tl.sum(chosen.to(tl.int32), axis=0)
    tl.debug_barrier()  # the list, written by every thread, read by every thread
    cand_ptr += row * MAX_CAND
    cand_ids_ptr += row * MAX_CAND
    count = 0
    for start in range(0, num_chosen, GROUP):
        group = start + tl.arange(0, GROUP)
        chosen_blocks = tl.load(selected_ptr + group, mask=group < num_chosen, other=0)
        ids = chosen_blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        valid = (group < num_chosen)[:, None] & (ids < vocab)
        logits, scores = _scores(row_ptr, ids, valid, temperature)
        hit = tl.reshape(valid & (_ordered_key(scores) >= low) & (scores >= cut), [GROUP * BLOCK])
        slots = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        keep = hit & (slots < MAX_CAND)
        tl.store(cand_ptr + slots, tl.reshape(scores, [GROUP * BLOCK]), mask=keep)
        tl.store(cand_ids_ptr + slots, tl.reshape(ids, [GROUP * BLOCK]), mask=keep)
        count += tl.sum(hit.to(tl.int32), axis=0)
    tl.debug_barrier()

    # The cuts among the candidates. They hold every token that top-k keeps; without
    # top-k, every token that min-p keeps when its cut is at least L.
    index = tl.arange(0, MAX_CAND)
    present = index < count
    cand = tl.load(cand_ptr + index, mask=present, other=float("-inf"))
    cand_ids = tl.load(cand_ids_ptr + index, mask=present, other=0)
    cand_keys = tl.where(present, _ordered_key(cand), _LOWEST_KEY)
    top_key = _ordered_key(row_max)
    kth = tl.zeros_like(top_key) + _LOWEST_KEY  # past count the k-th largest lies below every candidate: no cut
    if limited & (top_k <= count):
        kth = _search(cand_keys, present.to(tl.float32), kth, top_key, top_k.to(tl.float32), NT)
    kept = present & (cand_keys >= kth)
    # Whether the candidates hold every token kept so far: L is at most the k-th largest
    # score when j = k, and min-p keeps none below L when its cut is at least L.
    whole = (limited & (top_k <= num_valid)) | (_ordered_key(cut) >= low)
    fits = (count <= MAX_CAND) & whole
    if top_p < 1:
        weight = tl.where(kept, tl.exp(cand - row_max), 0.0)
        held = tl.sum(weight, axis=0)
        need = top_p * tl.where(whole, held, row_mass)
        # Without top-k or min-p: enough when the candidates reach top_p of the row's mass.
        # (With top-k on, top_p is of the top-k tokens' mass, which only whole rows know.)
        fits = (count <= MAX_CAND) & (whole | ((~limited) & (cut == float("-inf")) & (held >= need)))
        if fits:
            kept &= cand_keys >= _search(cand_keys, weight, kth, top_key, need, NT)
    token = 0
    if fits:
        draw = tl.where(kept, _gumbel_scores(cand, row_hash, cand_ids), float("-inf"))
        top_draw = tl.max(draw, axis=0)
        token = tl.min(tl.where(draw == top_draw, cand_ids, vocab), axis=0)
    else:
        token = _draw_whole_row(row_ptr, block_max_ptr, vocab, temperature, row_max, cut, top_k, top_p, row_hash,
                                NUM_BLOCKS, BLOCK, NT)
    return token


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
    device = logits.device
    out = torch.empty(batch, dtype=torch.int64, device=device)
    counters = split_counters(device, batch)  # allocated on the first call, before any capture
    if batch == 0:
        return out
    split = max(_BLOCK, min(_MAX_SPLIT, triton.next_power_of_2(vocab)))
    num_splits = triton.cdiv(vocab, split)
    blocks_pow2 = triton.next_power_of_2(num_splits * split // _BLOCK)
    part = torch.empty(3, batch, num_splits, dtype=torch.float32, device=device)
    part_ids = torch.empty(batch, num_splits, dtype=torch.int32, device=device)
    block_max = torch.empty(batch, num_splits * split // _BLOCK, dtype=torch.int32, device=device)
    selected = torch.empty(batch, blocks_pow2, dtype=torch.int32, device=device)
    cand = torch.empty(batch, _MAX_CANDIDATES, dtype=torch.float32, device=device)
    cand_ids = torch.empty(batch, _MAX_CANDIDATES, dtype=torch.int32, device=device)
    launch(_sample_filtered_kernel, (batch, num_splits),
        logits, temperatures, top_k, top_p.float(), min_p.float(), keys, positions, part, part_ids, block_max,
        selected, cand, cand_ids, counters, out, batch, vocab, logits.stride(0),
        NUM_SPLITS=num_splits, SPLITS_POW2=triton.next_power_of_2(num_splits), SPLIT=split, BLOCK=_BLOCK,
        BLOCKS_POW2=blocks_pow2, MAX_CAND=_MAX_CANDIDATES, TOP_P_BLOCKS=_TOP_P_BLOCKS, GROUP=_GROUP,
        NT=_NUM_THRESHOLDS, num_warps=_NUM_WARPS,
    )
    return out

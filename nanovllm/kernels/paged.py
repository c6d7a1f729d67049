"""Pieces the Triton kernels share (inlined by Triton): cache addressing for the attention
kernels and the cache writers, the online softmax for decode and prefill attention; and on
the host, the attention kernels' TMA descriptors of K/V tiles (tma_tiles).

The paged KV cache holds, per layer, K and V as [blocks, block_size, kv_heads, head_dim];
a sequence's token t lives in block block_table[t // block_size] at offset
t % block_size. The online softmax works in log2 units: it takes the raw products q.k
and scales them by qk_scale = scale * log2(e) (times k_scale over FP8), so it uses exp2.

An FP8 cache holds K / k_scale and V / v_scale (per-layer scales, kv_scales = [k_scale,
v_scale] fp32 on the device): the writers load them with `kv_scales` and quantize with
`to_cache`; the attention kernels convert the FP8 tiles as they read them (to float16 for
16-bit queries, float32 for float32 ones) and fold k_scale into the scores' scale and
v_scale into the output.

Open V groups (NANOVLLM_FP8_V_OPEN_GROUPS=1, on a transposed V whose blocks hold whole
groups: v_open_groups). A transposed V puts a token's value as one element in each of
head_dim rows, so a decode step writing one token a row touches head_dim 32-byte sectors for
head_dim bytes. Instead, the tokens of a sequence's newest group of V_GROUP (its "open"
group: [length - length % V_GROUP, length)) stay token-major inside the group's own bytes,
each token's value a whole sector run (`open_group_shift`), and the token that completes
the group writes it transposed, whole sectors again (`close_v_groups`). Readers take tokens
at or past `open_start(length)` from the token-major form. Writers decide from the slot
mapping alone (`group_closes_in_launch`): a launch writes each sequence's tokens at
consecutive slots, one sequence's chunk after another, so the token that completes a group
writes it whole: its own and its launch's other tokens of the group into the token-major
form (those tokens' programs write nothing of V), then, after a barrier, the whole form
read back and stored transposed. The tokens of a group still open after the launch write
their token-major form. So the writers need what the engine's steps give them: each
sequence's tokens of a launch at consecutive indices and slots, no position written twice,
no partly filled block shared. Blocks hold whole groups, so a slot's place in its group is
its position's (slot % V_GROUP). The attention kernels' V tiles hold 32 tokens or a
multiple, so the open group lies in a row's last, masked tile.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import fp8_to_f16, to_fp8
from nanovllm.kernels.gpu import is_hopper_or_later
from nanovllm.utils.env import env_int

# tl.dot needs every operand dimension >= 16, so a query-head group is padded to 16 rows.
MIN_DOT_ROWS = 16
# Tokens of a transposed V's group: one 32-byte sector of each dimension in FP8.
V_GROUP = 32
GROUP = tl.constexpr(V_GROUP)  # the same, for the kernels
OPEN_V_GROUPS = env_int("NANOVLLM_FP8_V_OPEN_GROUPS", 0, least=0) > 0


def v_transposed(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether V is stored transposed beside a head-major K ([blocks, kv_heads, block_size,
    head_dim] in memory): [blocks, kv_heads, head_dim, block_size], each dimension of a
    block's head holding its tokens contiguously (executor/kv_cache.py, for an FP8 cache
    under NANOVLLM_FP8_V_TRANSPOSED), so that p.v reads V tiles as q.k reads K's. Kernels
    take it as V_T and address V with v_strides."""
    block_size = k_cache.shape[1]
    stride_block, _, stride_head, _ = k_cache.stride()
    return k_cache.stride(1) == k_cache.shape[3] and v_cache.stride() == (stride_block, 1, stride_head, block_size)


def v_open_groups(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether a sequence's newest V group is kept open (token-major) in this cache: under
    OPEN_V_GROUPS, for a transposed V whose blocks hold whole groups. Kernels take it as
    V_OPEN; their V tiles must then hold whole groups (check_open_tiles)."""
    return OPEN_V_GROUPS and v_transposed(k_cache, v_cache) and k_cache.shape[1] % V_GROUP == 0


def check_open_tiles(v_open: bool, block_n: int) -> None:
    """Raise ValueError where an attention kernel's tiles would split open V groups."""
    if v_open and block_n % V_GROUP:
        raise ValueError(f"tiles of {block_n} tokens split a V group of {V_GROUP} (open V groups)")


@triton.jit
def v_strides(cache_stride_offset, V_T: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """V's (token, dimension) strides in a cache whose K has token stride cache_stride_offset:
    K's (cache_stride_offset, 1), or transposed (V_T, v_transposed) (1, BLOCK_SIZE)."""
    if V_T:
        return 1, BLOCK_SIZE
    return cache_stride_offset, 1


def tma_tiles(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> tuple | None:
    """TMA descriptors of K viewed as [rows, head_dim] and V as the same or, transposed
    (v_transposed), as [rows, block_size] (a row: one dimension of a block's head), for an
    attention kernel's whole block_n-token tiles, where each tile is one contiguous range of
    rows: a head-major cache ([blocks, kv_heads, block_size, head_dim] in memory) whose
    blocks hold whole tiles, of 16-bit or FP8 elements (those measured; a float32 cache keeps
    loads), on a Hopper or later GPU (or a CPU, under the Triton interpreter), rows numbered
    in int32. None: loads instead. A kernel finds tile rows in the view with `tile_first_row`
    (a transposed V's tile: head_dim rows from `v_tile_first_row`, block_n columns from the
    tile's offset in its block)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, block_size, num_kv_heads, head_dim = k_cache.shape
    head_major = (block_size * num_kv_heads * head_dim, head_dim, block_size * head_dim, 1)
    device = k_cache.device
    transposed = v_transposed(k_cache, v_cache)
    if not (k_cache.element_size() <= 2 and block_size % block_n == 0
            and k_cache.stride() == head_major and (transposed or v_cache.stride() == head_major)
            and k_cache.numel() // min(head_dim, block_size if transposed else head_dim) < 2**31
            and (device.type == "cpu" or is_hopper_or_later(device))):
        return None
    k_desc = TensorDescriptor(k_cache, [k_cache.numel() // head_dim, head_dim], [head_dim, 1], [block_n, head_dim])
    if transposed:
        return k_desc, TensorDescriptor(v_cache, [v_cache.numel() // block_size, block_size], [block_size, 1],
                                        [head_dim, block_n])
    return k_desc, TensorDescriptor(v_cache, [v_cache.numel() // head_dim, head_dim], [head_dim, 1],
                                    [block_n, head_dim])


@triton.jit
def tile_first_row(block_ids, tile_start, head_offset, cache_stride_block, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr):
    """Row of a tma_tiles view where the tile of tokens [tile_start, tile_start + BLOCK_N)
    starts (block_ids from tile_blocks; the tile inside one block)."""
    return ((block_ids.to(tl.int64) * cache_stride_block + head_offset) // HEAD_DIM
            + tile_start % BLOCK_SIZE).to(tl.int32)


@triton.jit
def v_tile_first_row(block_ids, head_offset, cache_stride_block, BLOCK_SIZE: tl.constexpr):
    """Row of a transposed V's tma_tiles view ([rows, BLOCK_SIZE]) where the tile's block and
    head start: its HEAD_DIM rows follow, the tile's tokens at its offset in the block."""
    return ((block_ids.to(tl.int64) * cache_stride_block + head_offset) // BLOCK_SIZE).to(tl.int32)


@triton.jit
def paged_rows(block_ids, positions, head_offset, cache_stride_block, cache_stride_offset,
               BLOCK_SIZE: tl.constexpr):
    """Element offset of each position's head_dim row for one KV head: block_ids are the
    positions' blocks (read from the block table), head_offset = kv_head * head stride."""
    return block_ids.to(tl.int64) * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_offset + head_offset


@triton.jit
def tile_blocks(block_table_row, tile_start, end, offs_n, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block ids of the tile of tokens [tile_start, tile_start + BLOCK_N) (tile_start a
    multiple of BLOCK_N), 0 past end: one when a tile never crosses a block (BLOCK_N
    divides BLOCK_SIZE), else one per token."""
    if BLOCK_SIZE % BLOCK_N == 0:
        ids = tl.load(block_table_row + tile_start // BLOCK_SIZE, mask=tile_start < end, other=0)
    else:
        tokens = tile_start + offs_n
        ids = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=tokens < end, other=0)
    return ids


@triton.jit
def tile_rows(block_ids, tile_start, offs_n, head_offset, cache_stride_block, cache_stride_offset,
              BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offset of each of the tile's [BLOCK_N] head_dim rows, from tile_blocks's ids:
    within one block, one base plus offsets the loop does not change."""
    if BLOCK_SIZE % BLOCK_N == 0:
        base = block_ids.to(tl.int64) * cache_stride_block + (tile_start % BLOCK_SIZE) * cache_stride_offset
        rows = base + head_offset + offs_n * cache_stride_offset
    else:
        rows = paged_rows(block_ids, tile_start + offs_n, head_offset, cache_stride_block, cache_stride_offset,
                          BLOCK_SIZE)
    return rows


@triton.jit
def v_tile_offsets(block_ids, tile_start, offs_n, offs_d, head_offset, cache_stride_block, cache_stride_offset,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, V_T: tl.constexpr):
    """Element offsets [BLOCK_N, HEAD_DIM] of a V tile for loads: K's (tile_rows, head_dim
    contiguous), or in a transposed V (V_T) each dimension's tokens contiguous."""
    v_stride_t, v_stride_d = v_strides(cache_stride_offset, V_T, BLOCK_SIZE)
    rows = tile_rows(block_ids, tile_start, offs_n, head_offset, cache_stride_block, v_stride_t, BLOCK_SIZE, BLOCK_N)
    return rows[:, None] + offs_d[None, :] * v_stride_d


@triton.jit
def open_start(length, V_OPEN: tl.constexpr):
    """First position of a sequence's open V group (length when it has none, or V_OPEN is off)."""
    if V_OPEN:
        return length - length % GROUP
    return length


@triton.jit
def open_group_shift(tokens, offs_d, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """[tokens, HEAD_DIM]: what takes a transposed V's element offsets (token stride 1,
    dimension stride BLOCK_SIZE) of these tokens to their token-major form in their group:
    the group's elements counted row by row, token t's value the run [t, t + 1) * HEAD_DIM."""
    t = tokens % GROUP
    flat = t[:, None] * HEAD_DIM + offs_d[None, :]
    return (flat // GROUP - offs_d[None, :]) * BLOCK_SIZE + flat % GROUP - t[:, None]


@triton.jit
def open_v_offsets(v_tile, tokens, offs_d, first_open, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   V_OPEN: tl.constexpr):
    """A transposed V tile's element offsets [tokens, HEAD_DIM] (v_tile), those of tokens at
    or past first_open (open_start) moved to their token-major form."""
    if V_OPEN:
        shift = open_group_shift(tokens, offs_d, HEAD_DIM, BLOCK_SIZE)
        return v_tile + tl.where(tokens[:, None] >= first_open, shift, 0)
    return v_tile


@triton.jit
def completes_group(position):
    """Whether the token at this position (or slot) is its group's last."""
    return position % GROUP == GROUP - 1


@triton.jit
def group_closes_in_launch(slot_mapping_ptr, index, slot, num_tokens):
    """Whether the launch also writes the last token of the group of `slot` (at `index` of
    slot_mapping, of num_tokens): that token is then the group's writer."""
    to_last = GROUP - 1 - slot % GROUP
    last = index + to_last
    return (last < num_tokens) & (tl.load(slot_mapping_ptr + last, mask=last < num_tokens, other=-1) == slot + to_last)


@triton.jit
def earlier_launch_tokens(slot_mapping_ptr, index, slot):
    """Bit p set where the launch also writes the group's token at place p < V_GROUP - 1 of
    the group that the token at `index` (slot `slot`) completes (at index - V_GROUP + 1 + p
    of slot_mapping, the group's slot there)."""
    places = tl.arange(0, GROUP)
    indices = index - (GROUP - 1) + places
    slots = tl.load(slot_mapping_ptr + indices, mask=(indices >= 0) & (places < GROUP - 1), other=-1)
    return tl.sum(tl.where(slots == slot - (GROUP - 1) + places, 1 << places.to(tl.int64), 0))


@triton.jit
def open_offsets(first, offs, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Offsets in a group's token-major form of the elements `first + offs` (first: a
    multiple of min(HEAD_DIM, V_GROUP), shaped to broadcast with offs, whose elements run
    contiguously under it), each group's run of V_GROUP elements a row of the transposed
    block: element f at (f // V_GROUP) * BLOCK_SIZE + f % V_GROUP. Written so that the
    compiler sees offs's runs contiguous and moves them in wide loads and stores."""
    return (first // GROUP) * BLOCK_SIZE + first % GROUP + offs


@triton.jit
def store_open_v(v_cache_ptr, token, position, value, offs_d, mask, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """A token's value [rows, dims] (offs_d [dims] of HEAD_DIM; the rows its heads) in the
    token-major form of its group: token [rows] holds each head's transposed offset of its
    first element, position (or its slot) the token's place in the group."""
    RUN: tl.constexpr = HEAD_DIM if HEAD_DIM < GROUP else GROUP  # elements of one token in one of the group's runs
    place = position % GROUP
    group = tl.multiple_of(token - place, GROUP)  # blocks and heads hold whole groups
    local = open_offsets(place * HEAD_DIM + (offs_d // RUN) * RUN, offs_d % RUN, HEAD_DIM, BLOCK_SIZE)
    tl.store(v_cache_ptr + group[:, None] + local[None, :], value, mask=mask)


@triton.jit
def close_v_groups(v_cache_ptr, first_token, cache_stride_head, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr):
    """Rewrite a completed group transposed from its token-major form, which this program's
    threads have finished writing, in each of NUM_KV_HEADS heads (first_token: head 0's
    transposed offset of the group's first token's first element). Each head's form is
    read while the one before is written."""
    RUN: tl.constexpr = HEAD_DIM if HEAD_DIM < GROUP else GROUP  # elements of one token in one of the group's runs
    places = tl.arange(0, GROUP)
    # [V_GROUP, HEAD_DIM // RUN, RUN]: token t's elements r * RUN + j, read as runs
    runs = places[:, None, None] * HEAD_DIM + tl.arange(0, HEAD_DIM // RUN)[None, :, None] * RUN
    if RUN == GROUP:  # each run one token's: its offset in a form the compiler sees aligned
        open_form = (runs // GROUP) * BLOCK_SIZE + tl.arange(0, RUN)[None, None, :]
    else:
        open_form = open_offsets(runs, tl.arange(0, RUN)[None, None, :], HEAD_DIM, BLOCK_SIZE)
    dims = tl.arange(0, HEAD_DIM // RUN)[None, :, None] * RUN + tl.arange(0, RUN)[None, None, :]
    closed = places[:, None, None] + dims * BLOCK_SIZE  # the same elements' transposed offsets
    tl.debug_barrier()  # every thread's token-major stores are seen
    values = tl.load(v_cache_ptr + first_token // GROUP * GROUP + open_form)  # rounded: seen aligned
    for head in range(NUM_KV_HEADS):
        group = v_cache_ptr + tl.multiple_of(first_token + head * cache_stride_head, GROUP)  # heads: whole groups
        following = tl.load(group + cache_stride_head + open_form, mask=head + 1 < NUM_KV_HEADS)
        tl.debug_barrier()  # every thread has read this head's token-major form before any overwrites it
        tl.store(group + closed, values)
        values = following


@triton.jit
def store_decode_v(v_cache_ptr, token, v_new, position, stores, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """With open groups, where `stores`: a decode step's value v_new [1, HEAD_DIM] of the
    token at `position` (token: the transposed offset of its first element) in its
    token-major form, and its whole group transposed when it completes it."""
    offs_d = tl.arange(0, HEAD_DIM)
    store_open_v(v_cache_ptr, tl.full([1], 0, tl.int64) + token, position, v_new, offs_d,
                 (offs_d < tl.where(stores, HEAD_DIM, 0))[None, :], HEAD_DIM, BLOCK_SIZE)
    if completes_group(position) & stores:
        close_v_groups(v_cache_ptr, token - (GROUP - 1), 0, 1, HEAD_DIM, BLOCK_SIZE)


@triton.jit
def slot_rows(slot, heads, cache_stride_block, cache_stride_offset, cache_stride_head, BLOCK_SIZE: tl.constexpr):
    """Element offset of the head_dim row of each of `heads` at one flat cache slot
    (block_id * block_size + offset, int64)."""
    return (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_offset + heads * cache_stride_head


@triton.jit
def online_softmax_step(acc, l_i, m_i, scores, qk_scale, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores [rows, BLOCK_N] and its values [BLOCK_N, head_dim] into the
    running state: acc (unnormalised output), l_i (sum of exp2(score * qk_scale - m_i)),
    m_i (max of score * qk_scale). scores are the raw products q.k (-inf where masked),
    scaled here by qk_scale > 0 (to log2 units) in one fused multiply-add with the max's
    subtraction. A row's first folded tile must hold a finite score, so the new max is
    finite."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(tl.fma(scores, qk_scale, -m_new[:, None]))
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def attend_tile(q, k, v, token_mask, acc, l_i, m_i, qk_scale, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 FP8: tl.constexpr, FP8_ASM: tl.constexpr):
    """Fold one K/V tile ([BLOCK_N, HEAD_DIM], as loaded from the cache) into decode
    attention's state (q: [BLOCK_G, HEAD_DIM]); MASKED: only the tokens of token_mask count."""
    if FP8:
        k = k.to(q.dtype)
        if FP8_ASM and q.dtype == tl.float16:  # V converted before its transposed trip through shared memory
            v = fp8_to_f16(v)
        else:
            v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
    if MASKED:
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
    return online_softmax_step(acc, l_i, m_i, scores, qk_scale, v, DOT_PRECISION)


@triton.jit
def fp8_queries(q):
    """Queries for products with an FP8 cache's tiles: 16-bit ones in float16 (exact for
    FP8 values, and e4m3 converts to it in pairs), saturated to its range; float32 ones as
    they are."""
    if q.dtype != tl.float32:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def to_cache(x, scale, cache_ptr, FP8_MAX: tl.constexpr):
    """x in the cache's element type: as it is, or for an FP8 cache (FP8_MAX > 0) x / scale
    saturated to the format's largest finite value, rounded to nearest even."""
    if FP8_MAX > 0:
        return to_fp8(tl.div_rn(x.to(tl.float32), scale), cache_ptr.dtype.element_ty, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def kv_scales(kv_scales_ptr, FP8_MAX: tl.constexpr):
    """(k_scale, v_scale): the layer's scales for an FP8 cache (FP8_MAX > 0), else 1.0."""
    if FP8_MAX > 0:
        return tl.load(kv_scales_ptr), tl.load(kv_scales_ptr + 1)
    return 1.0, 1.0


@triton.jit
def merge_partials(partial_out_ptr, partial_lse_ptr, first_rows, count, group_mask, offs_d, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr):
    """The merged output [BLOCK_G, HEAD_DIM] of `count` partial results, each normalised on
    its own, with the log2-sum-exp2 of its scores: partial i of the group's rows is at rows
    first_rows + i of partial_out [.., HEAD_DIM] and partial_lse. Read from L2 (.cg), where
    other programs stored them, never a stale L1 line."""
    lse_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    merged = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for other in range(0, count):
        rows = first_rows + other
        lse = tl.load(partial_lse_ptr + rows, mask=group_mask, other=0.0, cache_modifier=".cg")
        part = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=group_mask[:, None],
                       other=0.0, cache_modifier=".cg")
        new_max = tl.maximum(lse_max, lse)
        alpha = tl.exp2(lse_max - new_max)
        weight = tl.exp2(lse - new_max)
        merged = merged * alpha[:, None] + part * weight[:, None]
        total = total * alpha + weight
        lse_max = new_max
    return merged / total[:, None]

"""Decode attention over an FP8 cache: V as the cache stores it against V stored
transposed within each block (issue 20's lever for 85% of bandwidth).

p.V multiplies over tokens, so each tensor-core operand register pairs two tokens of one
dim. As the cache stores V ([blocks, block_size, heads, head_dim]) those bytes lie a row
apart, and compiled for sm_90 every FP8 shape moves V into the operand layout one byte
per shared-memory load (bf16 has ldmatrix's transpose, which works on 16-bit elements
only). Stored transposed ([blocks, heads, head_dim, block_size]), a dim's tokens are
adjacent and V goes the way K does. One simplified kernel runs both (one program per row
and KV head, one block id per tile), so the layout is the only difference.

    python benchmarks/bench_v_layout.py ptx     # compile both for sm_90 here; count byte-wise loads
    python benchmarks/bench_v_layout.py check   # both against torch (CUDA, or TRITON_INTERPRET=1)
    python benchmarks/bench_v_layout.py bench   # CUDA: B=256 x 1,024, a sweep of tile shapes for each
"""
from __future__ import annotations

import argparse
import collections
import itertools
import re

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
SHAPES = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=256)  # Qwen3-0.6B, the engine's blocks
SWEEP = {"block_n": [64, 128], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]}


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, qk_scale, v_scale,
                   k_stride_block, k_stride_token, k_stride_head, v_stride_block, v_stride_head, tables_stride,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, V_TRANSPOSED: tl.constexpr):
    """One (row, KV head): its GQA group's queries over the whole context, tile by tile
    (BLOCK_N divides BLOCK_SIZE, so a tile lies in one block)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    group_mask = offs_g < GROUP
    q_rows = q_ptr + (b * NUM_HEADS + kv_head * GROUP + offs_g)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_rows, mask=group_mask[:, None], other=0.0).to(tl.float16)
    length = tl.load(lens_ptr + b)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_N):
        block = tl.load(tables_ptr + b * tables_stride + start // BLOCK_SIZE).to(tl.int64)
        first = tl.multiple_of(start % BLOCK_SIZE, BLOCK_N)  # the tile's first token in its block
        token_mask = start + offs_n < length
        k_rows = k_ptr + block * k_stride_block + kv_head * k_stride_head + (first + offs_n) * k_stride_token
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=token_mask[:, None], other=0.0).to(tl.float16)
        scores = tl.where(token_mask[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_base = v_ptr + block * v_stride_block + kv_head * v_stride_head
        if V_TRANSPOSED:
            # [HEAD_DIM, BLOCK_N], loaded unmasked so that the loads stay 16 bytes wide (a
            # mask that varies along the tokens splits them): the tile lies in an
            # allocated block, and its tokens past the end are zeroed (an FP8 byte there
            # may be a NaN, and 0 * NaN is not 0).
            v_t = tl.load(v_base + offs_d[:, None] * BLOCK_SIZE + (first + offs_n)[None, :]).to(tl.float16)
            v = tl.trans(tl.where(token_mask[None, :], v_t, 0.0))
        else:
            v_rows = v_base + (first + offs_n) * k_stride_token
            v = tl.load(v_rows[:, None] + offs_d[None, :], mask=token_mask[:, None], other=0.0).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    out_rows = out_ptr + (b * NUM_HEADS + kv_head * GROUP + offs_g)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(out_rows, (acc / l_i[:, None] * v_scale).to(out_ptr.dtype.element_ty), mask=group_mask[:, None])


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
           scale: float, k_scale: float, v_scale: float, v_transposed: bool, block_n: int = 64, num_warps: int = 4,
           num_stages: int = 2) -> torch.Tensor:
    """q [B, Hq, D]; k_cache [blocks, block_size, Hkv, D]; v_cache that shape, or
    [blocks, Hkv, D, block_size] when v_transposed; both FP8, dequantized by the scales."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    _decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, tables, lens, out, scale * LOG2_E * k_scale, v_scale,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1) if v_transposed else v_cache.stride(2), tables.stride(0),
        NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, BLOCK_G=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        V_TRANSPOSED=v_transposed, num_warps=num_warps, num_stages=num_stages)
    return out


def make_inputs(batch: int, context: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, v_cache transposed, block tables, lengths) at SHAPES."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_heads, num_kv_heads, head_dim, block_size = (SHAPES[key] for key in
                                                     ("num_heads", "num_kv_heads", "head_dim", "block_size"))
    per_row = -(-context // block_size)
    num_blocks = batch * per_row
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (torch.randn(cache_shape, generator=gen) * 0.5).to(torch.float8_e4m3fn).to(device)
    v_cache = (torch.randn(cache_shape, generator=gen) * 0.5).to(torch.float8_e4m3fn).to(device)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(batch, per_row).to(device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    # float16 queries: the interpreter's bf16 products are wrong; on CUDA the engine's bf16
    q_dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(q_dtype).to(device)
    return q, k_cache, v_cache, v_cache.permute(0, 2, 3, 1).contiguous(), tables, lens


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    group = q.shape[1] // k_cache.shape[2]
    outs = []
    for row in range(q.shape[0]):
        length, blocks = int(lens[row]), tables[row].long()
        keys = (k_cache[blocks].flatten(0, 1)[:length].float() * k_scale).repeat_interleave(group, 1)
        values = (v_cache[blocks].flatten(0, 1)[:length].float() * v_scale).repeat_interleave(group, 1)
        weights = (torch.einsum("hd,nhd->hn", q[row].float(), keys) * scale).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", weights, values))
    return torch.stack(outs)


def check(device: str, contexts: tuple[int, ...] = (1, 63, 300, 600)) -> float:
    """Both layouts against torch at 64- and 128-token tiles; the largest relative error."""
    worst = 0.0
    scale, k_scale, v_scale = SHAPES["head_dim"] ** -0.5, 0.5, 2.0
    for context in contexts:
        q, k_cache, v_cache, v_transposed, tables, lens = make_inputs(3, context, device)
        ref = reference(q, k_cache, v_cache, tables, lens, scale, k_scale, v_scale)
        for (flag, cache), block_n in itertools.product(((False, v_cache), (True, v_transposed)), (64, 128)):
            out = decode(q, k_cache, cache, tables, lens, scale, k_scale, v_scale, flag, block_n)
            worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item())
    return worst


def ptx_counts(v_transposed: bool, block_n: int, num_warps: int, num_stages: int) -> collections.Counter:
    """Global and shared-memory loads/stores in the kernel compiled for sm_90, the
    launch's divisibility by 16 of pointers and strides given as the JIT would find it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = dict(NUM_HEADS=16, GROUP=2, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_N=block_n, BLOCK_G=16,
                     V_TRANSPOSED=v_transposed)
    pointers = dict(q_ptr="bf16", k_ptr="fp8e4nv", v_ptr="fp8e4nv", tables_ptr="i32", lens_ptr="i32", out_ptr="bf16")
    names = _decode_kernel.arg_names
    signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers
                 else "fp32" if "scale" in name else "i32" for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name in pointers or "stride" in name}
    compiled = triton.compile(ASTSource(_decode_kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    return collections.Counter(re.findall(r"(?:ld|st)\.(?:global|shared)[.a-z0-9]*|ldmatrix|cp\.async\.c[ag]",
                                          compiled.asm["ptx"]))


def bench() -> None:
    from triton import testing
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    q, k_cache, v_cache, v_transposed, tables, lens = make_inputs(256, 1024, "cuda")
    moved = 2 * k_cache.numel() + 2 * q.numel() * q.element_size()
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / (testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
    timings = []
    for (flag, cache), values in itertools.product(((False, v_cache), (True, v_transposed)),
                                                   itertools.product(*SWEEP.values())):
        try:
            ms = testing.do_bench(lambda: decode(q, k_cache, cache, tables, lens, 0.088, 0.5, 2.0, flag, *values),
                                  return_mode="median")
        except (OutOfResources, CompilationError) as error:  # e.g. too much shared memory
            print(f"  V {'transposed' if flag else 'as stored'} {values}: {type(error).__name__}")
            continue
        timings.append((ms, flag, values))
    for flag in (False, True):
        print(f"V {'transposed' if flag else 'as stored'}, fastest first ({', '.join(SWEEP)}):")
        for ms, _, values in sorted(t for t in timings if t[1] == flag)[:5]:
            print(f"  {ms * 1e3:7.1f} us  {moved / (ms * 1e-3) / copy_bw:4.0%} of copy bandwidth  {values}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["ptx", "check", "bench"])
    mode = parser.parse_args().mode
    if mode == "ptx":
        for flag, values in itertools.product((False, True), ((64, 4, 3), (128, 2, 1), (64, 2, 2))):
            print(f"V {'transposed' if flag else 'as stored'}, tile/warps/stages {values}: "
                  f"{dict(sorted(ptx_counts(flag, *values).items()))}")
    elif mode == "check":
        print(f"largest relative error against torch: {check('cuda' if torch.cuda.is_available() else 'cpu'):.1e}")
    else:
        bench()


if __name__ == "__main__":
    main()

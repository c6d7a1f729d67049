"""Benchmark the Triton kernels on one GPU and print a table (never asserts on time).

    python benchmarks/bench_kernels.py            # copy bandwidth, decode, prefill, KV store
    python benchmarks/bench_kernels.py --sweep    # also try decode launch configs
    python benchmarks/bench_kernels.py --decode-only --sweep --decode-batch 32 --decode-context 512
    python benchmarks/bench_kernels.py --decode-only --decode-batch 128 --decode-config 64:2:2 --decode-config 32:1:2
    python benchmarks/bench_kernels.py --prefill-only --prefill-config 128:128:8:3 --prefill-config 64:64:4:3
    python benchmarks/bench_kernels.py --moe-only --moe-sweep  # the MoE kernels, every candidate config
    python benchmarks/bench_kernels.py --moe-only --moe-fp8  # the same over FP8 experts
    python benchmarks/bench_kernels.py --fp8-only  # decode attention over an FP8 cache, FP8 GEMMs against bf16
    python benchmarks/bench_kernels.py --fp8-gemm-only --fp8-tokens 1 16 64 128 256 [--fp8-gemm-sweep]
    python benchmarks/bench_kernels.py --decode-gemm-only [--decode-gemm-sweep]  # bf16 decode batches, 9-64 rows
    python benchmarks/bench_kernels.py --decode-gemm-only --decode-gemm-tokens 128 256 --decode-gemm-model 0.6B

Decode streams K/V for a batch of equal contexts and is compared with the device's own
copy bandwidth (the original design asked >= 80%). Prefill reads K/V through the paged cache
and is compared with torch's varlen_attn (FA2 inside torch, on packed contiguous K/V) and
scaled_dot_product_attention (padded batch, K/V expanded to every query head).
The fused MoE layer (Qwen3-30B-A3B's experts: 128, top 8, hidden 2048, inter 768) is
compared with the one-expert-at-a-time torch path and with the copy bandwidth over the
expert weights its routing touches. With an FP8 cache, decode attention's bandwidth counts
the bytes it reads: K/V in FP8. The FP8 linear layer (activation quantization + GEMM) is
compared with bf16 cuBLAS on Qwen3-8B's projections, per-channel and 128-block scales.
"""
import argparse
import inspect
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

DTYPE = torch.bfloat16
BYTES_PER_ELEMENT = 2  # bf16
COPY_BYTES = 2 * 1024**3  # large enough that L2 (50 MiB on H200) plays no part
DECODE_SWEEP = {
    "num_splits": [1, 2, 4, 8],
    "block_n": [32, 64, 128],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4],
}

# Over an FP8 cache (--fp8-only --sweep), at the default config's split count: (tokens per
# tile, warps, stages, registers per thread). Around the default (64-token tiles, four warps,
# three stages: 122 registers and 55 KB of shared memory a program in the sm_90 compile, so
# four programs an SM): other pipeline depths, two stages under a register cap that fits a
# fifth program (and may spill), eight warps, 32-token tiles, and the 128-token tiles in two
# warps without a pipeline (one stage: 16-byte loads into registers) that sessions 18-40
# launched (RESULTS.md, session 41); and 64-token tiles in two warps, which move a fifth less
# through shared memory per byte streamed than four (benchmarks/kernel_sass.py, session 42).
FP8_SWEEP = [(64, 4, 3, None), (64, 4, 2, None), (64, 4, 4, None), (64, 4, 2, 96), (64, 8, 3, None),
             (32, 4, 3, None), (32, 4, 4, None), (32, 2, 3, None), (128, 4, 3, None), (128, 4, 2, None),
             (128, 2, 1, None), (64, 2, 3, None), (64, 2, 2, None)]


@dataclass(slots=True)
class Row:
    """One line of the summary table."""

    name: str
    ms: float
    metric: str
    vs_copy: str = ""


def bench(fn: Callable[[], object], warmup: int, rep: int) -> float:
    """Median milliseconds of fn (triton.testing.do_bench flushes L2 between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def paged_cache(
    lengths: list[int], block_size: int, num_kv_heads: int, head_dim: int, table_tokens: int,
    dtype: torch.dtype = DTYPE, layout: str = "hnd",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and shuffled block tables [len(lengths), table_tokens / block_size] (-1 padded).
    The caches are [num_blocks, block_size, num_kv_heads, head_dim] views: with layout "hnd"
    (the engine's) of memory laid out [num_blocks, num_kv_heads, block_size, head_dim] (one
    head's tokens contiguous in a block; the kernels read the cache through its strides),
    with "nhd" of contiguous memory."""
    blocks = [-(-length // block_size) for length in lengths]
    num_blocks = sum(blocks)
    if layout == "hnd":
        kv = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=DTYPE, device="cuda").to(dtype)
        kv = kv.transpose(2, 3)
    else:  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=DTYPE, device="cuda").to(dtype)
    width = max(max(blocks), -(-table_tokens // block_size))
    # [batch, width] int32
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
    pool = torch.randperm(num_blocks, dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = pool[start : start + count]
        start += count
    return kv[0], kv[1], tables.cuda()


def bench_copy(args: argparse.Namespace) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), args.warmup, args.rep)
    return 2 * COPY_BYTES / (ms * 1e-3)


def bench_decode(args: argparse.Namespace, copy_bw: float, block_size: int,
                 cache_dtype: torch.dtype = DTYPE, sweep: bool = False) -> list[Row]:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from nanovllm.kernels.decode_attention import decode_attention, decode_attention_with_config
    from nanovllm.kernels.decode_config import DecodeConfig, decode_config

    batch, context = args.decode_batch, args.decode_context
    num_heads, num_kv_heads, head_dim = args.num_heads, args.num_kv_heads, args.head_dim
    spread = torch.Generator().manual_seed(0)  # --decode-spread: lengths uniform in context +- spread
    contexts = (context + torch.randint(-args.decode_spread, args.decode_spread + 1, (batch,), generator=spread)
                ).clamp(min=1).tolist()
    if args.longest_first:  # rows in descending length: programs of long rows launch first
        contexts.sort(reverse=True)
    k_cache, v_cache, tables = paged_cache(contexts, block_size, num_kv_heads, head_dim, args.table_tokens,
                                           cache_dtype, args.cache_layout)
    kv_scales = torch.tensor([0.01, 0.01], device="cuda") if cache_dtype != DTYPE else None
    fp8 = " fp8" if kv_scales is not None else ""
    q = torch.randn(batch, num_heads, head_dim, dtype=DTYPE, device="cuda")  # [B, Hq, D]
    out = torch.empty_like(q)
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    moved = (2 * sum(contexts) * num_kv_heads * cache_dtype.itemsize
             + 2 * batch * num_heads * BYTES_PER_ELEMENT) * head_dim

    def row(name: str, ms: float) -> Row:
        bandwidth = moved / (ms * 1e-3)
        return Row(name, ms, f"{bandwidth / 1e12:.2f} TB/s", f"{bandwidth / copy_bw:.0%}")

    config = decode_config(batch, num_kv_heads, tables.shape[1] * block_size, head_dim, DTYPE, q.device, cache_dtype)
    label = f"decode{fp8} bs{block_size} ({config.num_splits} splits, {config.block_n}-token tiles)"
    run = lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out, kv_scales=kv_scales)
    rows = [row(label, bench(run, args.warmup, args.rep))]

    def graph_replay(fn):
        """fn captured in a CUDA graph (after one run outside it), as the engine runs it: a
        short kernel's own launch takes longer than the kernel."""
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    rows.append(row(f"decode{fp8} bs{block_size} CUDA graph", bench(graph_replay(run), args.warmup, args.rep)))

    candidates = []
    if args.decode_config:  # the given shapes, the rest (split count and length, joins) the default's
        split_tokens = config.min_split_tiles * config.block_n
        candidates = [replace(config, block_n=block_n, num_warps=warps, num_stages=stages,
                              min_split_tiles=max(1, (split or split_tokens) // block_n))
                      for block_n, warps, stages, split in args.decode_config]
    elif sweep and fp8:
        candidates = [replace(config, block_n=block_n, num_warps=warps, num_stages=stages, max_registers=registers)
                      for block_n, warps, stages, registers in FP8_SWEEP]
    elif sweep:
        candidates = [DecodeConfig(**dict(zip(DECODE_SWEEP, values, strict=True)))
                      for values in itertools.product(*DECODE_SWEEP.values())]
    if candidates:
        results = []
        reference = run().clone()
        for candidate in candidates:

            def run_candidate(config: DecodeConfig = candidate) -> torch.Tensor:
                return decode_attention_with_config(q, k_cache, v_cache, tables, lens, scale, config, out, kv_scales)

            try:
                error = ((run_candidate().float() - reference.float()).norm() / reference.float().norm()).item()
                ms = bench(graph_replay(run_candidate), args.warmup, args.rep)
            except (OutOfResources, RuntimeError, CompilationError) as failure:  # e.g. too much shared memory
                print(f"  sweep {candidate}: failed ({type(failure).__name__})")
                continue
            results.append((ms, candidate, error))
            print(f"  sweep {ms * 1e3:8.1f} us  {moved / (ms * 1e-3) / copy_bw:4.0%}  {candidate}", flush=True)
        results.sort(key=lambda item: item[0])
        print(f"decode{fp8} bs{block_size} sweep, fastest first (error: relative to the default config's output):")
        for ms, candidate, error in results[: args.sweep_top]:
            print(f"  {ms * 1e3:8.1f} us  {moved / (ms * 1e-3) / 1e12:5.2f} TB/s  {moved / (ms * 1e-3) / copy_bw:4.0%}"
                  f"  error {error:.1e}  {candidate}")
    return rows


def prefill_flops(lens_q: list[int], lens_k: list[int], num_heads: int, head_dim: int) -> int:
    """Causal attention FLOPs: 2 matmuls x 2 FLOPs per (query, visible key, dim, head)."""
    visible = sum(len_q * (len_k - len_q) + len_q * (len_q + 1) // 2 for len_q, len_k in zip(lens_q, lens_k))
    return 4 * visible * num_heads * head_dim


def varlen_baseline(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int
) -> Callable[[], object]:
    """A causal call of torch's varlen_attn for this torch version (the API changed in 2.10-2.12)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, object] = {}
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)  # bottom-right aligned causal mask, as ours
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    fn = lambda: varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    fn()
    return fn


def sdpa_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int) -> Callable[[], object]:
    """SDPA on [batch, heads, len, dim] with K/V expanded to every query head."""
    from torch.nn.attention.bias import causal_lower_right

    len_q, len_k = q.shape[0] // batch, k.shape[0] // batch
    group = q.shape[1] // k.shape[1]
    qb = q.view(batch, len_q, -1, q.shape[-1]).transpose(1, 2)
    kb = k.repeat_interleave(group, dim=1).view(batch, len_k, -1, k.shape[-1]).transpose(1, 2)
    vb = v.repeat_interleave(group, dim=1).view(batch, len_k, -1, v.shape[-1]).transpose(1, 2)
    if len_q == len_k:
        fn = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    else:
        mask = causal_lower_right(len_q, len_k)
        fn = lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
    fn()
    return fn


def bench_prefill(args: argparse.Namespace, cached_fraction: float) -> list[Row]:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from nanovllm.kernels.prefill_attention import (PrefillConfig, prefill_attention, prefill_attention_with_config,
                                                    prefill_config)

    batch, len_k = args.prefill_seqs, args.prefill_len
    len_q = len_k - int(len_k * cached_fraction)
    num_heads, num_kv_heads, head_dim = args.num_heads, args.num_kv_heads, args.head_dim
    k_cache, v_cache, tables = paged_cache([len_k] * batch, args.prefill_block_size, num_kv_heads, head_dim, len_k)
    q = torch.randn(batch * len_q, num_heads, head_dim, dtype=DTYPE, device="cuda")  # [Nq, Hq, D]
    cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * len_q
    cu_k = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * len_k
    scale = head_dim**-0.5
    flops = prefill_flops([len_q] * batch, [len_k] * batch, num_heads, head_dim)
    tag = f"prefill {batch}x{len_q}" + (f" on {len_k - len_q} cached" if len_q < len_k else "")

    def row(name: str, ms: float) -> Row:
        return Row(name, ms, f"{flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s")

    config = prefill_config(len_q, head_dim, DTYPE)
    run = lambda: prefill_attention(q, k_cache, v_cache, cu_q, cu_k, tables, len_q, scale)
    label = f"{tag} ours ({config.block_m}x{config.block_n}, {config.num_warps} warps)"
    rows = [row(label, bench(run, args.warmup, args.rep))]
    reference = run().float() if args.prefill_config else None
    for candidate in (PrefillConfig(*values) for values in args.prefill_config or []):
        def run_candidate(c: PrefillConfig = candidate) -> torch.Tensor:
            return prefill_attention_with_config(q, k_cache, v_cache, cu_q, cu_k, tables, len_q, scale, c)

        name = (f"{tag} {candidate.block_m}x{candidate.block_n}, {candidate.num_warps} warps, "
                f"{candidate.num_stages} stages")
        try:
            error = ((run_candidate().float() - reference).norm() / reference.norm()).item()
            rows.append(row(f"{name} (error {error:.0e})", bench(run_candidate, args.warmup, args.rep)))
        except (OutOfResources, RuntimeError, CompilationError) as failure:  # a shape that does not fit
            print(f"{name}: failed ({type(failure).__name__}: {str(failure)[:200]})")

    # The baselines get each sequence's K/V packed contiguously, gathered from our cache.
    slots = (tables[:, :, None].long() * args.prefill_block_size + torch.arange(args.prefill_block_size, device="cuda"))
    slots = slots.view(batch, -1)[:, :len_k].reshape(-1)  # [batch * len_k]
    k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots]  # [batch * len_k, Hkv, D]
    v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots]
    for name, make in [
        ("torch varlen_attn", lambda: varlen_baseline(q, k, v, cu_q, cu_k, len_q, len_k)),
        ("torch SDPA", lambda: sdpa_baseline(q, k, v, batch)),
    ]:
        try:
            fn = make()
        except (ImportError, TypeError, RuntimeError, ValueError) as error:  # API differs between torch versions
            print(f"{tag} {name}: unavailable ({type(error).__name__}: {error})")
            rows.append(Row(f"{tag} {name}", float("nan"), "unavailable"))
            continue
        rows.append(row(f"{tag} {name}", bench(fn, args.warmup, args.rep)))
    return rows


def bench_store(args: argparse.Namespace, copy_bw: float) -> list[Row]:
    from nanovllm.kernels.store_kvcache import store_kvcache

    num_tokens, num_heads, num_kv_heads, head_dim = args.store_tokens, args.num_heads, args.num_kv_heads, args.head_dim
    block_size = 256
    num_blocks = -(-num_tokens // block_size) * 2
    kv = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=DTYPE, device="cuda")
    # [num_tokens, (Hq + 2 Hkv) * D]: key/value are strided views, as after the qkv projection
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=DTYPE, device="cuda")
    _, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]  # [num_tokens] int64
    ms = bench(lambda: store_kvcache(key, value, kv[0], kv[1], slot_mapping), args.warmup, args.rep)
    moved = 2 * 2 * num_tokens * num_kv_heads * head_dim * BYTES_PER_ELEMENT  # K and V, read + write
    bandwidth = moved / (ms * 1e-3)
    rows = [Row(f"store_kvcache {num_tokens} tokens", ms, f"{bandwidth / 1e12:.2f} TB/s", f"{bandwidth / copy_bw:.0%}")]

    # The engine's path: q/k norms, rotary and the store in one kernel, from the fused qkv.
    from nanovllm.kernels.rotary_store import rotary_store

    cos_sin = torch.randn(4096, head_dim, dtype=torch.float32, device="cuda")
    norm = torch.rand(head_dim, dtype=DTYPE, device="cuda") + 0.5
    for tokens in (args.decode_batch, num_tokens):
        positions = torch.randint(0, 4096, (tokens,), device="cuda")
        ms = bench(lambda: rotary_store(qkv[:tokens], positions, cos_sin, kv[0], kv[1], slot_mapping[:tokens], num_heads,
                                        norm, norm), args.warmup, args.rep)
        # q read and written, k and v read and written to the cache
        moved = 2 * tokens * (num_heads + 2 * num_kv_heads) * head_dim * BYTES_PER_ELEMENT
        bandwidth = moved / (ms * 1e-3)
        rows.append(Row(f"rotary_store {tokens} tokens", ms, f"{bandwidth / 1e12:.2f} TB/s", f"{bandwidth / copy_bw:.0%}"))
    return rows


MOE_SWEEP = {
    "block_m": [16, 32, 64, 128],
    "block_n": [64, 128],
    "block_k": [64, 128],
    "num_warps": [4, 8],
    "num_stages": [3],
}


def bench_moe(args: argparse.Namespace, copy_bw: float) -> list[Row]:
    import triton

    from nanovllm.kernels.fused_moe import fused_moe, moe_config
    from nanovllm.layers.fused_moe import quantize_experts, route, torch_moe

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=DTYPE, device="cuda") / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, dtype=DTYPE, device="cuda") / inter**0.5
    scales, element_bytes, kind = None, BYTES_PER_ELEMENT, ""
    if args.moe_fp8:  # Qwen3-30B-A3B-FP8's experts: 128 x 128 block scales, inputs quantized per token and block
        w13, w2, scales = quantize_experts(w13, w2, 128)
        element_bytes, kind = 1, " fp8"
    rows = []
    for tokens in args.moe_tokens:
        x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
        weights, ids = route(torch.randn(tokens, experts, device="cuda"), top_k, renormalize=True)
        touched = ids.unique().numel() * 3 * inter * hidden * element_bytes  # each hit expert's weights, once
        fused_ms = bench(lambda: fused_moe(x, w13, w2, weights, ids, scales=scales), args.warmup, args.rep)
        torch_ms = bench(lambda: torch_moe(x, w13, w2, weights, ids, scales=scales), args.warmup, args.rep)
        bandwidth = touched / (fused_ms * 1e-3)
        rows.append(Row(f"fused_moe{kind} {tokens} tokens {tuple(moe_config(tokens, args.moe_fp8))}", fused_ms,
                        f"{torch_ms / fused_ms:.1f}x torch", f"{bandwidth / copy_bw:.0%}"))
        rows.append(Row(f"torch_moe {tokens} tokens", torch_ms, f"{touched / (torch_ms * 1e-3) / 1e12:.2f} TB/s"))
        if args.moe_sweep:
            timings = []
            sweep = {**MOE_SWEEP, "num_stages": [3, 4]} if args.moe_fp8 else MOE_SWEEP  # FP8 tiles: half the bytes
            for values in itertools.product(*sweep.values()):
                if values[0] > 16 * tokens:  # blocks far taller than the tokens they hold
                    continue
                try:
                    ms = bench(lambda: fused_moe(x, w13, w2, weights, ids, config=values, scales=scales), 5, 40)
                except triton.runtime.errors.OutOfResources:  # fit_shared_memory's estimate was short
                    continue
                timings.append((ms, values))
            for ms, values in sorted(timings)[:args.sweep_top]:
                print(f"  moe sweep {tokens} tokens: {values} {ms * 1e3:.1f} us ({touched / (ms * 1e-3) / copy_bw:.0%} of copy)")
    return rows


# Qwen3-8B's projections (N, K) on one GPU: q|k|v, o, gate|up, down.
FP8_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def bench_fp8_linear(args: argparse.Namespace, copy_bw: float) -> list[Row]:
    """One FP8 linear layer (activations quantized per token, then the scaled GEMM) against
    bf16 F.linear, per-channel scales (cuBLAS row-wise) and 128-block scales (our Triton
    GEMM); weight bytes over time beside the copy bandwidth (what bounds small batches)."""
    from nanovllm.kernels.fp8 import quantize_activations
    from nanovllm.layers.quantization import fp8_linear, quantize_per_group

    rows = []
    for name, (n, k) in FP8_SHAPES.items():
        weight = torch.randn(n, k, dtype=DTYPE, device="cuda") * 0.02
        per_channel, block = quantize_per_group(weight, k), quantize_per_group(weight, 128)
        for tokens in args.fp8_tokens:
            x = torch.randn(tokens, k, dtype=DTYPE, device="cuda")
            q, q_scales = quantize_activations(x, k)

            def scaled_mm(fast_accum: bool) -> torch.Tensor:
                return torch._scaled_mm(q, per_channel[0].t(), scale_a=q_scales, scale_b=per_channel[1].view(1, -1),
                                        out_dtype=DTYPE, use_fast_accum=fast_accum)

            cases = [
                ("bf16", lambda: F.linear(x, weight), 2 * n * k),
                ("fp8 per-channel", lambda: fp8_linear(x, *per_channel, None, "triton"), n * k),
                # its two halves: what a small batch's time goes to
                ("  its activation quantizer", lambda: quantize_activations(x, k), 2 * tokens * k),
                ("  its cuBLAS row-wise GEMM", lambda: scaled_mm(False), n * k),
                ("fp8 block 128", lambda: fp8_linear(x, *block, None, "triton"), n * k),
            ]
            try:  # the tensor cores' fast accumulation (fewer promotions to fp32): its error, then its time
                exact = scaled_mm(False).float()
                error = ((scaled_mm(True).float() - exact).norm() / exact.norm()).item()
                cases.insert(4, (f"  the same, fast accumulation (error {error:.1e})", lambda: scaled_mm(True), n * k))
            except RuntimeError as exc:  # not offered for row-wise scales by this torch
                print(f"fast accumulation: {str(exc)[:120]}")
            for label, fn, nbytes in cases:
                ms = bench(fn, args.warmup, args.rep)
                tflops = 2 * tokens * n * k / (ms * 1e-3) / 1e12
                rows.append(Row(f"linear {name} {n}x{k} M={tokens} {label}", ms, f"{tflops:.0f} TFLOP/s",
                                f"{nbytes / (ms * 1e-3) / copy_bw:.0%}"))
    return rows


def graph_time(calls: list[Callable[[], object]], repeats: int = 30) -> float:
    """Milliseconds per call of `calls` captured in one CUDA graph, one after another: the
    kernels back to back as in the engine's graphs, each on its own weights (cold in L2)."""
    from bench_pdl import time_graph  # benchmarks/, this script's folder

    return time_graph(lambda: [call() for call in calls], repeats) * 1e3 / len(calls)


# kernels/decode_gemm.py's candidate tiles (--fp8-gemm-sweep, --decode-gemm-sweep); block_t
# follows the batch.
TILE_SWEEP = {"block_n": [64, 128], "splits": [1, 2, 3, 4, 6, 8], "num_stages": [4, 6],
                      "num_warps": [4, 8]}


def tile_rows(args: argparse.Namespace, label: str, kernel: str, cublas_ms: float, timed: Callable, default,
              tokens: int, n: int, k: int, weight_bytes: int, sweep: bool, copy_bw: float) -> list[Row]:
    """Rows of cuBLAS against kernels/decode_gemm.py's default tile (timed(None)); with sweep,
    every TILE_SWEEP tile (timed(config)) too, the fastest printed."""

    def row(what: str, ms: float) -> Row:
        return Row(f"{label} {what}", ms, f"{2 * tokens * n * k / (ms * 1e-3) / 1e12:.0f} TFLOP/s",
                   f"{weight_bytes / (ms * 1e-3) / copy_bw:.0%}")

    rows = [row("cuBLAS", cublas_ms), row(f"{kernel} {default}", timed(None))]
    if sweep:
        timings = []
        for values in itertools.product(*TILE_SWEEP.values()):
            config = replace(default, **dict(zip(TILE_SWEEP, values)))
            if config.splits > -(-k // config.block_k):
                continue
            try:
                timings.append((timed(config), config))
            except Exception as exc:  # noqa: BLE001 - a config that does not fit (shared memory)
                print(f"  {label} {config}: {type(exc).__name__}")
        for ms, config in sorted(timings, key=lambda t: t[0])[:args.sweep_top]:
            print(f"  {kernel} sweep {label}: {config} {ms * 1e3:.1f} us "
                  f"({weight_bytes / (ms * 1e-3) / copy_bw:.0%} of copy; cuBLAS {cublas_ms * 1e3:.1f} us)")
    return rows


def bench_channel_gemm(args: argparse.Namespace, copy_bw: float) -> list[Row]:
    """The per-channel FP8 GEMM of decode batches (kernels/decode_gemm.py's channel_gemm) against
    cuBLAS's row-wise scaled GEMM, on Qwen3-8B's projections, activations already quantized:
    each timed in a CUDA graph over copies of the weight (256 MB or more in all, so that
    every call reads its weight from memory as a model's layers do)."""
    from nanovllm.kernels.decode_gemm import channel_gemm, tile_config
    from nanovllm.kernels.fp8 import quantize_activations
    from nanovllm.kernels.gpu import num_sms
    from nanovllm.layers.quantization import quantize_per_group

    rows = []
    for name, (n, k) in FP8_SHAPES.items():
        copies = max(2, -(-(256 << 20) // (n * k)))
        weights = [quantize_per_group(torch.randn(n, k, dtype=DTYPE, device="cuda") * 0.02, k) for _ in range(copies)]
        for tokens in args.fp8_tokens:
            if tokens > 256:
                continue
            q, q_scales = quantize_activations(torch.randn(tokens, k, dtype=DTYPE, device="cuda"), k)

            def timed(config) -> float:
                return graph_time([lambda w=w: channel_gemm(q, q_scales, *w, None, DTYPE, config) for w in weights])

            cublas = graph_time([lambda w=w: torch._scaled_mm(q, w[0].t(), scale_a=q_scales, scale_b=w[1].view(1, -1),
                                                               out_dtype=DTYPE) for w in weights])
            rows += tile_rows(args, f"linear {name} {n}x{k} M={tokens}", "channel_gemm", cublas, timed,
                              tile_config(tokens, n, k, 1, num_sms(q.device)), tokens, n, k, n * k,
                              args.fp8_gemm_sweep, copy_bw)
    return rows


# Qwen3-0.6B's projections (N, K): q|k|v, o, gate|up, down.
SMALL_SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def bench_decode_gemm(args: argparse.Namespace, copy_bw: float) -> list[Row]:
    """kernels/decode_gemm.py's GEMM of 16-bit decode batches against cuBLAS (F.linear), on
    Qwen3-0.6B's and Qwen3-8B's bf16 projections, timed as bench_channel_gemm times its own."""
    from nanovllm.kernels.decode_gemm import decode_gemm, tile_config
    from nanovllm.kernels.gpu import num_sms

    rows = []
    models = {"0.6B": SMALL_SHAPES, "8B": FP8_SHAPES}
    if args.decode_gemm_model != "both":
        models = {args.decode_gemm_model: models[args.decode_gemm_model]}
    for model, shapes in models.items():
        for name, (n, k) in shapes.items():
            copies = max(2, -(-(256 << 20) // (2 * n * k)))
            weights = [torch.randn(n, k, dtype=DTYPE, device="cuda") * 0.02 for _ in range(copies)]
            for tokens in args.decode_gemm_tokens:
                x = torch.randn(tokens, k, dtype=DTYPE, device="cuda")

                def timed(config) -> float:
                    return graph_time([lambda w=w: decode_gemm(x, w, None, config) for w in weights])

                cublas = graph_time([lambda w=w: F.linear(x, w) for w in weights])
                rows += tile_rows(args, f"linear {model} {name} {n}x{k} M={tokens}", "decode_gemm", cublas, timed,
                                  tile_config(tokens, n, k, 2, num_sms(x.device)), tokens, n, k, 2 * n * k,
                                  args.decode_gemm_sweep, copy_bw)
    return rows


def launch_shape(text: str, form: str, lengths: tuple[int, ...], sizes: int) -> tuple[int, ...]:
    """A shape argument of one of `lengths` integers, the first `sizes` (tile sizes, warps)
    powers of two and the next (stages) at least one."""
    try:
        values = tuple(int(part) for part in text.split(":"))
    except ValueError:
        values = ()
    if len(values) not in lengths or values[sizes] < 1 or not all(
            value > 0 and value & (value - 1) == 0 for value in values[:sizes]):
        raise argparse.ArgumentTypeError(f"expected {form} (tile sizes and warps powers of two), got {text!r}")
    return values


def decode_shape(text: str) -> tuple[int, int, int, int]:
    """--decode-config's BLOCK_N:WARPS:STAGES[:SPLIT] (SPLIT absent or 0: the default config's)."""
    return (*launch_shape(text, "BLOCK_N:WARPS:STAGES[:SPLIT]", (3, 4), 2), 0)[:4]


def prefill_shape(text: str) -> tuple[int, int, int, int]:
    """--prefill-config's BLOCK_M:BLOCK_N:WARPS:STAGES."""
    return launch_shape(text, "BLOCK_M:BLOCK_N:WARPS:STAGES", (4,), 3)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=256)
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--longest-first", action="store_true",
                        help="decode rows in descending context length (with --decode-spread)")
    parser.add_argument("--decode-spread", type=int, default=0,
                        help="decode rows' lengths uniform in --decode-context +- this (seeded; default: all equal)")
    parser.add_argument("--cache-layout", choices=["nhd", "hnd"], default="hnd",
                        help="decode's cache memory: [blocks, heads, tokens, dim] (the engine's: each head's tokens "
                             "contiguous) or [blocks, tokens, heads, dim], read through the same kernel's strides")
    parser.add_argument(
        "--table-tokens", type=int, default=0,
        help="block-table width in tokens (the engine's graphs use max_model_len); default: the context",
    )
    parser.add_argument("--prefill-seqs", type=int, default=16)
    parser.add_argument("--prefill-only", action="store_true", help="only the copy and prefill attention")
    parser.add_argument("--prefill-config", type=prefill_shape, action="append", metavar="BLOCK_M:BLOCK_N:WARPS:STAGES",
                        help="also time prefill attention in this shape (repeatable)")
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--prefill-block-size", type=int, default=256)
    parser.add_argument("--store-tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    parser.add_argument("--sweep", action="store_true", help="also time every decode config in DECODE_SWEEP")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the copy and decode attention over a cache of 256-token blocks")
    parser.add_argument("--decode-cache", choices=["bf16", "fp8"], default="bf16",
                        help="with --decode-only: the cache's elements (fp8: e4m3)")
    parser.add_argument("--decode-config", type=decode_shape, action="append", metavar="BLOCK_N:WARPS:STAGES[:SPLIT]",
                        help="time this decode shape beside the default (repeatable; SPLIT: a split's fewest tokens, "
                             "default the default config's), instead of --sweep's")
    parser.add_argument("--sweep-top", type=int, default=8)
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    parser.add_argument("--moe-sweep", action="store_true", help="also time every MoE config in MOE_SWEEP")
    parser.add_argument("--moe-only", action="store_true", help="only the copy and the MoE kernels")
    parser.add_argument("--moe-fp8", action="store_true", help="the MoE kernels over FP8 experts (128 x 128 blocks)")
    parser.add_argument("--fp8-only", action="store_true", help="only the copy, FP8-cache decode and the FP8 GEMMs")
    parser.add_argument("--fp8-tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    parser.add_argument("--fp8-gemm-only", action="store_true",
                        help="only the copy and the per-channel FP8 GEMM of decode batches against cuBLAS")
    parser.add_argument("--fp8-gemm-sweep", action="store_true", help="with --fp8-gemm-only: every TILE_SWEEP tile")
    parser.add_argument("--decode-gemm-only", action="store_true",
                        help="only the copy and the bf16 GEMM of decode batches (decode_gemm) against cuBLAS")
    parser.add_argument("--decode-gemm-tokens", type=int, nargs="+", default=[9, 16, 32, 64])
    parser.add_argument("--decode-gemm-sweep", action="store_true", help="with --decode-gemm-only: every TILE_SWEEP tile")
    parser.add_argument("--decode-gemm-model", choices=["0.6B", "8B", "both"], default="both",
                        help="with --decode-gemm-only: whose projections (default: both)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available: the kernel benchmarks need an NVIDIA GPU. Nothing to do.")
        return 0
    args.table_tokens = args.table_tokens or args.decode_context + args.decode_spread
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", end="  ")
    import triton

    print(f"triton {triton.__version__}")

    copy_bw = bench_copy(args)
    rows = [Row(f"copy {COPY_BYTES >> 30} GiB", 2 * COPY_BYTES / copy_bw * 1e3, f"{copy_bw / 1e12:.2f} TB/s", "100%")]
    if args.decode_only:
        cache = torch.float8_e4m3fn if args.decode_cache == "fp8" else DTYPE
        rows += bench_decode(args, copy_bw, 256, cache, sweep=args.sweep)
    elif args.prefill_only:
        for cached_fraction in (0.0, 0.5):
            rows += bench_prefill(args, cached_fraction)
    elif args.decode_gemm_only:
        rows += bench_decode_gemm(args, copy_bw)
    elif args.fp8_gemm_only:
        rows += bench_channel_gemm(args, copy_bw)
    elif args.fp8_only:  # --sweep: only the FP8 cache at the default block size
        for block_size in (16, 256):
            rows += bench_decode(args, copy_bw, block_size)
            rows += bench_decode(args, copy_bw, block_size, torch.float8_e4m3fn, args.sweep and block_size == 256)
        rows += bench_fp8_linear(args, copy_bw)
    else:
        if not args.moe_only:
            for block_size in (16, 256):
                rows += bench_decode(args, copy_bw, block_size, sweep=args.sweep)
                rows += bench_decode(args, copy_bw, block_size, torch.float8_e4m3fn, args.sweep)
            for cached_fraction in (0.0, 0.5):
                rows += bench_prefill(args, cached_fraction)
            rows += bench_store(args, copy_bw)
        rows += bench_moe(args, copy_bw)

    print(
        f"\ndecode: B={args.decode_batch} ctx={args.decode_context} Hq={args.num_heads} Hkv={args.num_kv_heads} "
        f"D={args.head_dim} bf16; prefill: block {args.prefill_block_size}"
    )
    width = max(len(row.name) for row in rows)
    print(f"{'kernel':<{width}}  {'time (us)':>10}  {'throughput':>14}  {'vs copy':>7}")
    for row in rows:
        print(f"{row.name:<{width}}  {row.ms * 1e3:>10.1f}  {row.metric:>14}  {row.vs_copy:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

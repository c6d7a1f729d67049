"""Batch-1 decode's projections as one chain in a CUDA graph: cuBLAS against a Triton GEMV,
with and without programmatic dependent launch (PDL, Hopper).

Issue 23's question: at batch 1 a Qwen3-0.6B layer reads ~30 MB of weights in four
projections, each a few microseconds, and every kernel boundary leaves the memory system
idle while one kernel drains and the next ramps up. With PDL a kernel is launched while
the one before it still runs; it loads its weight tile (which depends on nothing) first,
then waits for the kernel before (`gdc_wait`) and only then reads its input. So the next
projection's weights stream in during the previous one's tail.

The chain: 28 layers x (qkv 1024 -> 4096, o 2048 -> 1024, gate_up 1024 -> 6144,
down 3072 -> 1024), each reading the previous one's output, every layer its own weights
(881 MB in all, far beyond L2). Each variant is captured in one CUDA graph and replayed;
the median replay is reported against the weights' read at the device's copy bandwidth.
Every variant's output is checked against torch first. The Triton variants are
kernels/gemv.py's kernel at other slab sizes and warp counts (the engine's: 8,192
elements, four warps, PDL on Hopper).

Then whole decoder layers the same way (`--layers`, or after the projections): RMSNorm,
q/k/v, rotary_store, decode attention over a 512-token paged context, o_proj, RMSNorm,
gate_up with SiLU-and-mul, down, the final RMSNorm; with rotary_store and decode attention
as two kernels, and as one (decode_attention_rotary) at several tile shapes, split sizes
and pipeline depths (`--rounds N` runs them N times in turns) and over a one-tile context
(no loop, no merge: the attention's fixed chain); with the GEMV
at other slab sizes and warp counts (a GEMV's registers may limit how many of the next
kernel's programs find room to start early); and, to show what each part costs, without
the norms and without attention. `--hops` times a chain of empty dependent launches: a
kernel boundary's own latency, with each launch waiting for the one before by PDL's
gdc_wait or by counters in memory (the hand-off a persistent kernel's phases would use).

    python benchmarks/bench_pdl.py            # CUDA only (Hopper for PDL)
    python benchmarks/bench_pdl.py --layers   # only the whole-layer chains
    python benchmarks/bench_pdl.py --hops     # only the empty launches
    python benchmarks/bench_pdl.py --layers --only tiles   # only the layer variants named so
    python benchmarks/bench_pdl.py --layers --only "one kernel, 128" --rounds 2
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import triton
import triton.language as tl

from nanovllm.entrypoints.bench import copy_bandwidth
from nanovllm.kernels.decode_attention import decode_attention_with_config
from nanovllm.kernels.decode_config import decode_config
from nanovllm.kernels import gemv as gemv_module
from nanovllm.kernels.gemv import _gemv_kernel, gemv as engine_gemv
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options
from nanovllm.kernels.rmsnorm import rms_norm
from nanovllm.kernels.rotary_store import rotary_store
from nanovllm.utils.context import Rotary

HIDDEN, QKV, ATTN_OUT, INTER = 1024, 4096, 2048, 3072
LAYERS = 28
# (K, N): what each projection reads and writes per row.
SHAPES = [(HIDDEN, QKV), (ATTN_OUT, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, elems: int, warps: int, pdl: bool) -> None:
    """kernels/gemv.py's kernel at a given slab size and warp count, with or without PDL."""
    n, k = w.shape
    kp = triton.next_power_of_2(k)
    block_n = max(1, elems // kp)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, w, y, 1, n, k, n, K=k, KP=kp, BLOCK_N=block_n, HAS_BIAS=False,
                                             GATED=False, PDL=pdl, num_warps=warps, **launch_options(pdl))


def chain(weights, buffers, step) -> torch.Tensor:
    """One pass through every layer's four projections; returns the last output."""
    h, a, g = buffers
    for wq, wo, wgu, wd in weights:
        step(h, wq, a)
        step(a[:ATTN_OUT], wo, h)
        step(h, wgu, g)
        step(g[:INTER], wd, h)
    return h


def time_graph(fn, repeats: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--layers", action="store_true", help="only the whole-layer chains")
    only.add_argument("--hops", action="store_true", help="only the empty dependent launches")
    parser.add_argument("--only", default="", help="of the whole-layer variants, those whose name holds this text")
    parser.add_argument("--rounds", type=int, default=1, help="times each whole-layer variant runs, in turns")
    args = parser.parse_args()
    if not args.layers:
        hops(args)
    if not (args.layers or args.hops):
        projections(args)
    if not args.hops:
        layers(args)


@triton.jit
def _hop_kernel(x_ptr, PDL: tl.constexpr):
    """Each program adds one to its counter: nothing to do but wait for the launch before."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    ptr = x_ptr + tl.program_id(0)
    tl.store(ptr, tl.load(ptr) + 1)


@triton.jit
def _load_acquire(ptr):
    """*ptr (int32) by one acquiring load at GPU scope: a spin by loads instead of atomics,
    which with 256 programs spinning measured slower than atomics (RESULTS.md, session 56)."""
    ptrs = ptr + tl.zeros([1], dtype=tl.int32)
    value = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return tl.max(value, 0)


@triton.jit
def _spin_until(ptr, target, BY_LOADS: tl.constexpr):
    """Spin until *ptr >= target, reading it by acquiring loads or acquiring atomics."""
    if BY_LOADS:
        seen = _load_acquire(ptr)
        while seen < target:
            seen = _load_acquire(ptr)
    else:
        seen = tl.atomic_add(ptr, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _counter_hop_kernel(x_ptr, done_ptr, passed_ptr, hop, PROGRAMS: tl.constexpr, BY_LOADS: tl.constexpr):
    """As _hop_kernel with PDL, but waiting for the launch before by a counter instead of
    gdc_wait: each program of launch `hop - 1` adds one to done[hop - 1] (release) after its
    store, and each program here spins until all PROGRAMS of them have (acquire). The last
    program past the wait zeroes the counters it used, for the graph's next replay."""
    gdc_launch_dependents()
    if hop > 0:
        _spin_until(done_ptr + hop - 1, PROGRAMS, BY_LOADS)
        if tl.atomic_add(passed_ptr + hop - 1, 1, sem="relaxed") == PROGRAMS - 1:
            tl.atomic_xchg(done_ptr + hop - 1, 0, sem="relaxed")
            tl.atomic_xchg(passed_ptr + hop - 1, 0, sem="relaxed")
        tl.debug_barrier()
    ptr = x_ptr + tl.program_id(0)
    tl.store(ptr, tl.load(ptr, cache_modifier=".cg") + 1)
    tl.debug_barrier()
    tl.atomic_add(done_ptr + hop, 1, sem="release")


@triton.jit
def _epoch_hop_kernel(x_ptr, done_ptr, epoch_ptr, hop, LAST: tl.constexpr, PROGRAMS: tl.constexpr,
                      BY_LOADS: tl.constexpr):
    """_counter_hop_kernel without the reset on the critical path: the counters only grow.
    Every launch of a replay reads the epoch (PROGRAMS times the replays before) and waits
    for done[hop - 1] to reach epoch + PROGRAMS. The last launch's programs count themselves
    in done[hop] instead, and the last of them, once all have read the epoch, raises it."""
    gdc_launch_dependents()
    target = tl.load(epoch_ptr, volatile=True) + PROGRAMS
    if hop > 0:
        _spin_until(done_ptr + hop - 1, target, BY_LOADS)
        tl.debug_barrier()
    ptr = x_ptr + tl.program_id(0)
    tl.store(ptr, tl.load(ptr, cache_modifier=".cg") + 1)
    tl.debug_barrier()
    if LAST:  # done[hop] counts this launch's programs, then is back at zero for the next replay
        if tl.atomic_add(done_ptr + hop, 1, sem="relaxed") == PROGRAMS - 1:
            tl.atomic_xchg(done_ptr + hop, 0, sem="relaxed")
            tl.atomic_add(epoch_ptr, PROGRAMS, sem="relaxed")
    else:
        tl.atomic_add(done_ptr + hop, 1, sem="release")


def hops(args: argparse.Namespace) -> None:
    """A chain of 224 empty launches (a batch-1 step's kernel count) in one CUDA graph: the
    time per launch is what a kernel boundary costs on the critical path; with PDL, each
    waiting by gdc_wait (the engine's) or by a counter the launch before counts up. Every
    launch adds one to each of its programs' cells: a launch that ran before the one it
    waits for had ended would lose an addition, which the check after the runs shows."""
    launches = 224
    pdl_ok = gdc_wait is not None and torch.cuda.get_device_capability()[0] >= 9
    for programs in (1, 256):
        for wait in ("none", "gdc_wait", "counter", "loads", "epoch", "epoch-loads") if pdl_ok else ("none",):
            x = torch.zeros(1024, dtype=torch.int32, device="cuda")
            done = torch.zeros(launches, dtype=torch.int32, device="cuda")
            passed = torch.zeros(launches, dtype=torch.int32, device="cuda")
            epoch = torch.zeros(1, dtype=torch.int32, device="cuda")

            def empty_launches(p=programs, w=wait):
                for hop in range(launches):
                    if w.startswith("epoch"):
                        _epoch_hop_kernel[(p,)](x, done, epoch, hop, LAST=hop == launches - 1, PROGRAMS=p,
                                                BY_LOADS=w == "epoch-loads", **launch_options(True))
                    elif w in ("counter", "loads"):
                        _counter_hop_kernel[(p,)](x, done, passed, hop, PROGRAMS=p, BY_LOADS=w == "loads",
                                                  **launch_options(True))
                    else:
                        _hop_kernel[(p,)](x, PDL=w == "gdc_wait", **launch_options(w == "gdc_wait"))
            seconds = time_graph(empty_launches, args.repeats)
            torch.cuda.synchronize()
            expected = launches * (1 + args.repeats)  # the warm-up run, then the replays
            ok = bool((x[:programs] == expected).all())
            print(f"{launches} empty launches of {programs:>3} programs, waiting by {wait:>11}: "
                  f"{seconds * 1e6 / launches:5.2f} us per launch{'' if ok else '  (ORDER BROKEN: additions lost)'}")


def projections(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    weights = [[torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for k, n in SHAPES] for _ in range(LAYERS)]
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    floor = nbytes / bandwidth
    x0 = torch.randn(HIDDEN, device="cuda", dtype=dtype)

    def buffers():
        return (x0.clone(), torch.zeros(QKV, device="cuda", dtype=dtype), torch.zeros(2 * INTER, device="cuda", dtype=dtype))

    def torch_step(x, w, y):
        torch.matmul(w, x.unsqueeze(1), out=y.unsqueeze(1))

    def cublas_step(x, w, y):  # as the model calls it: F.linear on a [1, K] row
        torch.nn.functional.linear(x.unsqueeze(0), w, out=y.unsqueeze(0))

    reference = chain(weights[:2], buffers(), lambda x, w, y: y.copy_((w.float() @ x.float()).to(dtype)))
    print(f"weights {nbytes / 1e6:.0f} MB; copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor {floor * 1e6:.0f} us "
          f"({floor * 1e6 / LAYERS:.1f} us per layer)")
    variants = [("cuBLAS (F.linear)", cublas_step), ("torch.matmul (gemv)", torch_step)]
    pdl_ok = gdc_wait is not None and torch.cuda.get_device_capability()[0] >= 9
    for elems in (4096, 8192, 16384):
        for warps in (4, 8):
            for pdl in (False, True):
                if pdl and not pdl_ok:
                    continue
                name = f"triton e={elems} w={warps}" + (" pdl" if pdl else "")
                variants.append((name, lambda x, w, y, e=elems, n=warps, p=pdl: gemv(x, w, y, e, n, p)))
    results = []
    for name, step in variants:
        try:
            out = chain(weights[:2], buffers(), step)
            err = ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
            if err > 2e-2:
                print(f"{name}: WRONG (relative error {err:.3g}); skipped")
                continue
            bufs = buffers()
            seconds = time_graph(lambda s=step, b=bufs: chain(weights, b, s), args.repeats)
        except Exception as exc:  # a variant this Triton or GPU cannot run
            print(f"{name}: failed: {str(exc).splitlines()[0][:200]}")
            continue
        results.append((seconds, name))
        print(f"{name:>32}: {seconds * 1e6:7.1f} us per pass, {seconds * 1e6 / LAYERS:5.1f} us per layer, "
              f"{floor / seconds:5.1%} of the copy bandwidth")
    best = min(results)
    print(f"best: {best[1]} at {best[0] * 1e6:.1f} us ({floor / best[0]:.1%}); cuBLAS {results[0][0] * 1e6:.1f} us")


# Qwen3-0.6B's attention and the engine's decode-graph cache layout.
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_CONTEXT, CONTEXT = 16, 8, 128, 256, 4096, 512
EPS = 1e-6


def layers(args: argparse.Namespace) -> None:
    """Whole batch-1 decoder layers in one CUDA graph, as the module's docstring lists them.
    Variants that compute something else (no norms, no attention, a one-tile context) print
    no difference from the reference."""
    torch.manual_seed(0)
    dtype, dev = torch.bfloat16, "cuda"
    blocks = MAX_CONTEXT // BLOCK_SIZE

    def make_layer():
        return dict(
            weights=[torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for k, n in SHAPES],
            norms=[1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=dtype) for _ in range(2)],
            qk_norms=[1 + 0.1 * torch.randn(HEAD_DIM, device=dev, dtype=dtype) for _ in range(2)],
            # head-major memory behind [blocks, tokens, heads, dim] views, as the engine's cache
            cache=[torch.randn(blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM, device=dev, dtype=dtype).transpose(1, 2)
                   for _ in range(2)],
        )

    model = [make_layer() for _ in range(LAYERS)]
    nbytes = sum(w.numel() * w.element_size() for layer in model for w in layer["weights"])
    kv_bytes = LAYERS * 2 * CONTEXT * KV_HEADS * HEAD_DIM * 2
    positions = torch.tensor([CONTEXT - 1], device=dev)
    slots = torch.tensor([CONTEXT - 1], device=dev)  # the block table is the identity
    block_tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
    context_lens = torch.tensor([CONTEXT], device=dev, dtype=torch.int32)
    inv_freq = 1e6 ** (-torch.arange(0, HEAD_DIM, 2, device=dev, dtype=torch.float32) / HEAD_DIM)
    angles = torch.arange(MAX_CONTEXT, device=dev, dtype=torch.float32)[:, None] * inv_freq[None]
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    x0 = torch.randn(1, HIDDEN, device=dev, dtype=dtype)
    final_norm = 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=dtype)

    def two_kernels(qkv, layer, config):
        k_cache, v_cache = layer["cache"]
        q = rotary_store(qkv, positions, cos_sin, k_cache, v_cache, slots, HEADS, *layer["qk_norms"], EPS)
        return decode_attention_with_config(q, k_cache, v_cache, block_tables, context_lens, HEAD_DIM ** -0.5, config)

    def one_kernel(qkv, layer, config):
        rotary = Rotary(positions, cos_sin, *layer["qk_norms"], EPS)
        return decode_attention_with_config(qkv, *layer["cache"], block_tables, context_lens, HEAD_DIM ** -0.5,
                                            config, rotary=rotary)

    one_tile = torch.tensor([64], device=dev, dtype=torch.int32), torch.tensor([63], device=dev)

    def one_kernel_one_tile(qkv, layer, config):  # a 64-token context: no loop, no merge
        lens, position = one_tile
        return decode_attention_with_config(qkv, *layer["cache"], block_tables, lens, HEAD_DIM ** -0.5, config,
                                            rotary=Rotary(position, cos_sin, *layer["qk_norms"], EPS))

    def no_attention(qkv, layer, config):  # the o_proj reads the queries instead
        return qkv[:, :HEADS * HEAD_DIM]

    def forward(attention, config, norms=True):
        h, residual = x0, torch.zeros_like(x0)
        for layer in model:
            wq, wo, wgu, wd = layer["weights"]
            if norms:
                h, residual = rms_norm(h, layer["norms"][0], EPS, residual)
            h = engine_gemv(attention(engine_gemv(h, wq), layer, config).reshape(1, HEADS * HEAD_DIM), wo)
            if norms:
                h, residual = rms_norm(h, layer["norms"][1], EPS, residual)
            h = engine_gemv(engine_gemv(h, wgu, gated=True), wd)
        return rms_norm(h, final_norm, EPS, residual)[0] if norms else h

    def with_gemv(elems, warps):  # the engine's GEMV with another slab size and warp count
        def run(attention, config):
            saved = gemv_module._TILE, gemv_module._NUM_WARPS
            gemv_module._TILE, gemv_module._NUM_WARPS = elems, warps
            try:
                return forward(attention, config)
            finally:
                gemv_module._TILE, gemv_module._NUM_WARPS = saved
        return run

    default = decode_config(1, KV_HEADS, MAX_CONTEXT, HEAD_DIM, dtype, torch.device(dev))
    reference = forward(two_kernels, default)
    floor = (nbytes + kv_bytes) / copy_bandwidth(torch.device("cuda"))
    print(f"whole layers, batch 1, context {CONTEXT}: weights {nbytes / 1e6:.0f} MB + KV {kv_bytes / 1e6:.0f} MB; "
          f"floor {floor * 1e6:.0f} us; the engine's decode config: {default}")
    variants = [("rotary_store + attention", forward, two_kernels, default), ("one kernel", forward, one_kernel, default),
                ("one kernel, 64-token tiles, 4 warps, splits >= 2", forward, one_kernel,
                 dataclasses.replace(default, block_n=64, num_warps=4, min_split_tiles=2))]
    # 128-token tiles (a one-tile split loads all its K/V before the wait), over warps, split
    # lengths and pipeline stages; and a row's 512 tokens in one split.
    variants += [(f"one kernel, 128-token tiles, {w} warps, splits >= {t}, {n} stages", forward, one_kernel,
                  dataclasses.replace(default, block_n=128, num_warps=w, min_split_tiles=t, num_stages=n))
                 for w in (8, 16) for t in (1, 2) for n in (2, 3)]
    variants += [("one kernel, one split", forward, one_kernel, dataclasses.replace(default, num_splits=1))]
    variants += [(f"one kernel, GEMV e={e} w={w}", with_gemv(e, w), one_kernel, default)
                 for e, w in ((4096, 2), (4096, 4), (8192, 8), (16384, 8))]
    # Last: they compute something else (the one-tile context also stores a key at slot 63).
    other = [("one kernel, no norms", lambda a, c: forward(a, c, norms=False), one_kernel, default),
             ("no attention", forward, no_attention, default),
             ("no attention, no norms", lambda a, c: forward(a, c, norms=False), no_attention, default),
             ("one kernel, context 64 (one tile)", forward, one_kernel_one_tile, default)]
    variants += other
    for _ in range(args.rounds):  # rounds in turn: a drifting clock shows as rounds disagreeing
        for name, run, attention, config in variants:
            if args.only not in name:
                continue
            out = run(attention, config)
            err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            seconds = time_graph(lambda r=run, a=attention, c=config: r(a, c), args.repeats)
            difference = "" if any(name == o[0] for o in other) else f" (relative difference {err:.1e})"
            print(f"{name:>36}: {seconds * 1e6:7.1f} us per pass, {seconds * 1e6 / LAYERS:5.1f} us per layer, "
                  f"{floor / seconds:5.1%} of the floor{difference}")


if __name__ == "__main__":
    main()

"""Decode attention compiled for an H200 (sm_90) on any machine, no GPU needed: registers,
shared memory, how many programs fit an SM, and the instructions of its K/V loop (per warp
and tile, and the bytes they move through shared memory), from Triton's own compiler and the
cuobjdump it ships.

    python benchmarks/kernel_sass.py [--batch 256] [--cache fp8] [--block-n 128 --warps 4 --stages 2]
                                     [--sass out.sass]

The launch is the engine's: decode_config's parameters for the batch (132 SMs, Qwen3-0.6B's
heads, 256-token blocks, the head-major cache) and the arguments specialised as a launch
specialises them (pointers 16-byte aligned, strides divisible by 16). With the device's
Triton version (gpu_check.sh prints it) the numbers are the device's: at 3.6, 150
registers and 71,712 bytes of shared memory for the bf16 shape (whole tiles by TMA copies;
128 and 71,680 with --no-tma, as Nsight Compute read them).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import tempfile
from unittest import mock

import torch

try:
    import triton
    import triton.backends.nvidia as nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # the quick start's install has no Triton
    raise SystemExit("kernel_sass.py compiles with Triton's NVIDIA backend: pip install triton") from None

import nanovllm.kernels.decode_config as decode_config_module
from nanovllm.kernels.decode_attention import _decode_split_kernel
from nanovllm.kernels.paged import MIN_DOT_ROWS

H200 = dict(sms=132, registers=65536, shared=233_472, max_warps=64)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 256


_FP8_MAX = {"bf16": 0.0, "fp8e4nv": 448.0, "fp8e5": 57344.0}


def compile_decode(config, cache: str = "bf16", rotary: bool = False, group: int = HEADS // KV_HEADS,
                   block_size: int = BLOCK_SIZE, head_major: bool = True, splits: int = 0,
                   tma: bool | None = None):
    """_decode_split_kernel compiled for sm_90 as the engine launches it on an H200 (PDL on,
    bf16 queries, head_dim 128, KV_HEADS heads of `group` queries each), over a cache of
    `cache` elements (bf16, fp8e4nv, fp8e5) in blocks of `block_size` tokens, head-major
    (a head's tokens HEAD_DIM apart) or tokens outside heads; with rotary, q/k/v as a SplitSum
    of `splits` parts (0: a tensor). tests/kernels/test_compile_sm90.py builds its variants
    with it."""
    if tma is None:  # as decode_config.tile_descriptors decides for the engine's launch
        tma = decode_config_module.TMA_TILES and head_major and block_size % config.block_n == 0 and not rotary
    pointers = dict(q_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}", block_tables_ptr="*i32",
                    context_lens_ptr="*i32", partial_out_ptr="*fp32", partial_lse_ptr="*fp32", counters_ptr="*i32",
                    out_ptr="*bf16", kv_scales_ptr="*fp32")
    scalars = dict(qk_scale="fp32", q_stride_b="i32", q_stride_h="i32", out_stride_b="i32", out_stride_h="i32",
                   cache_stride_block="i32", cache_stride_offset="constexpr", cache_stride_head="i32",
                   block_tables_stride_b="i32")
    rope = dict(positions_ptr="*i64", cos_sin_ptr="*fp32", q_norm_ptr="*bf16", k_norm_ptr="*bf16", eps="fp32",
                cos_sin_stride="i32", split_stride="i32",
                k_desc=f"tensordesc<{cache}[{config.block_n},{HEAD_DIM}]>" if tma else f"*{cache}",
                v_desc=f"tensordesc<{cache}[{config.block_n},{HEAD_DIM}]>" if tma else f"*{cache}")
    fp8 = cache != "bf16"
    constexprs = dict(cache_stride_offset=HEAD_DIM if head_major else KV_HEADS * HEAD_DIM,
                      NUM_HEADS=KV_HEADS * group, NUM_KV_HEADS=KV_HEADS, GROUP_SIZE=group, HEAD_DIM=HEAD_DIM,
                      BLOCK_SIZE=block_size, BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
                      BLOCK_N=config.block_n, MIN_SPLIT_TILES=config.min_split_tiles, JOIN_TAIL=config.join_tail,
                      DOT_PRECISION="tf32", FP8=fp8, ROTARY=rotary, QK_NORM=rotary, FP8_MAX=_FP8_MAX[cache],
                      FP8_ASM=True, SPLITS=splits, TMA=tma, PDL=True)
    signature = {**pointers, **scalars, **rope, **{name: "constexpr" for name in constexprs}}
    names = list(signature)
    aligned = [*pointers, "q_ptr", "positions_ptr", "cos_sin_ptr", "q_norm_ptr", "k_norm_ptr",
               "q_stride_b", "q_stride_h", "out_stride_b", "out_stride_h", "cache_stride_block", "cache_stride_head",
               "block_tables_stride_b", "cos_sin_stride"]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in set(aligned)}
    source = ASTSource(fn=_decode_split_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.max_registers:
        options["maxnreg"] = config.max_registers
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(kernel, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
        return subprocess.run([tool, *args, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loop_bodies(sass: str) -> list[list[str]]:
    """The opcodes (with their modifiers: LDS.64) of each conditional backward branch's body
    (a loop), in address order: an unconditional one jumps back from out-of-line code (a TMA
    barrier's retry), no loop."""
    lines = [(int(address, 16), text) for address, text in re.findall(r"/\*([0-9a-f]{4})\*/\s+(.*?)\s*;", sass)]
    bodies = []
    for address, text in lines:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and text.startswith("@") and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            body = [line for at, line in lines if start <= at <= address]
            bodies.append([t.split()[1] if t.startswith("@") else t.split()[0] for t in body])
    return bodies


_LANE_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def shared_accesses(body: list[str]) -> tuple[int, int]:
    """(bytes, wavefronts) a warp moves between registers and shared memory in one pass of a
    loop body (loop_bodies' opcodes): LDS / STS of 1-16 bytes a lane (4 unless the opcode
    says), LDSM / STSM of 1, 2 or 4 8 x 8 matrices of 16-bit values; an access takes a
    wavefront per 128 bytes, at least one (without bank conflicts, which the SASS does not
    show), and shared memory serves one a cycle; predicated ones are counted whole."""
    moved = wavefronts = 0
    for op in body:
        name, *modifiers = op.split(".")
        if name in ("LDS", "STS"):
            size = 32 * next((_LANE_BYTES[m] for m in modifiers if m in _LANE_BYTES), 4)
        elif name in ("LDSM", "STSM"):
            size = 128 * next((int(m) for m in modifiers if m in ("2", "4")), 1)  # no count: one
        else:
            continue
        moved += size
        wavefronts += max(1, size // 128)
    return moved, wavefronts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--cache", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--table-tokens", type=int, default=4096)
    parser.add_argument("--block-n", type=int, help="override decode_config's tile")
    parser.add_argument("--warps", type=int)
    parser.add_argument("--stages", type=int)
    parser.add_argument("--rotary", action="store_true", help="the rotary-fused variant (steps of up to 8 rows)")
    parser.add_argument("--sass", help="write the whole SASS here")
    parser.add_argument("--no-tma", action="store_true", help="whole K/V tiles by loads, not TMA copies")
    parser.add_argument("--group", type=int, default=HEADS // KV_HEADS,
                        help="query heads per KV head (Qwen3-0.6B's 2; Qwen3-8B's 4)")
    args = parser.parse_args()
    fp8 = args.cache == "fp8"
    with mock.patch.object(decode_config_module, "num_sms", lambda device: H200["sms"]):
        config = decode_config_module.decode_config(args.batch, KV_HEADS, args.table_tokens, HEAD_DIM, torch.bfloat16,
                                                    torch.device("cuda"), torch.float8_e4m3fn if fp8 else None)
    overrides = dict(block_n=args.block_n, num_warps=args.warps, num_stages=args.stages)
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    kernel = compile_decode(config, "fp8e4nv" if fp8 else "bf16", args.rotary, args.group,
                            tma=False if args.no_tma else None)
    sass = cuobjdump(kernel, "-sass")
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    registers = int(re.search(r"REG:(\d+)", cuobjdump(kernel, "-res-usage")).group(1))
    shared = kernel.metadata.shared
    threads = 32 * config.num_warps
    per_sm = min(H200["registers"] // (registers * threads), H200["shared"] // max(shared + 1024, 1),
                 H200["max_warps"] // config.num_warps)
    print(f"triton {triton.__version__}, {config}")
    print(f"{registers} registers per thread, {shared:,} bytes of shared memory: {per_sm} programs "
          f"({per_sm * config.num_warps} warps) per SM")
    bodies = loop_bodies(sass)
    if not bodies:
        print("no loop")
        return
    body = max(bodies, key=len)  # the K/V loop; the merge's loop is short
    tokens = config.block_n
    print(f"K/V loop: {len(body)} instructions per warp per {tokens}-token tile, "
          f"{len(body) * config.num_warps / tokens:.1f} warp-instructions per token and KV head")
    opcodes = collections.Counter(op.split(".")[0] for op in body)
    print("  " + ", ".join(f"{op} {count}" for op, count in opcodes.most_common(16)))
    # Shared memory's own bandwidth (128 bytes a cycle an SM) is spent on these moves besides
    # the copies that fill it: next to the K/V bytes the tile brings from memory, a measure
    # of how much of it a variant needs per byte streamed.
    moved, wavefronts = (count * config.num_warps for count in shared_accesses(body))
    streamed = tokens * HEAD_DIM * 2 * (1 if fp8 else 2)
    print(f"  shared memory: {moved:,} bytes moved to and from registers per tile, {moved / streamed:.1f}x the "
          f"{streamed:,} bytes of K/V it streams; {wavefronts / tokens:.1f} wavefronts per token and KV head, "
          f"{(wavefronts + streamed // 128) / tokens:.1f} with the copies that fill the tiles")


if __name__ == "__main__":
    main()

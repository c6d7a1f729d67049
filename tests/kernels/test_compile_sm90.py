"""Decode attention's variants, prefill attention's, decode_gemm.py's (FP8 and bf16), the
quantizing RMSNorm and SiLU-and-mul, split_gemm.py's GEMM (TMA) and the kernels that sum
it, the decode graphs' input unpacking, the samplers, the fused MoE GEMM, compiled for the
H200 (sm_90) on this CPU (the FP8 GEMM for Ada's sm_89 too): Triton's interpreter runs the
code as Python, so a kernel can pass every interpreter test and not compile for a GPU (a
constexpr branch that returns still has the code after it built, a shape that only the
interpreter broadcasts). Compiling each variant here catches that in CI; the GPU check runs
them. The compiles run in a child process without TRITON_INTERPRET, which the CPU tests set
before Triton is imported."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"  # kernel_sass.py, imported in the child process

# (group, cache element type, rotary, tile tokens, warps, stages, short last splits joined[, block size[, tokens
# outside heads[, SplitSum parts]]]): decode_config's shapes (64-token tiles over a bf16 or FP8 cache, bf16's few
# rows') and the sweeps' 128-token FP8 tiles in two warps without a pipeline; blocks of 256 tokens (one block per
# tile) unless said, and of 16 (tiles across blocks); the head-major cache unless said. Compiled as
# benchmarks/kernel_sass.py compiles the engine's launch.
VARIANTS = [(2, "bf16", True, 64, 4, 3, False), (8, "bf16", False, 64, 4, 3, True),
            (4, "fp8e4nv", False, 64, 4, 3, True), (2, "fp8e4nv", True, 64, 4, 3, False),
            (4, "fp8e5", False, 64, 4, 3, False), (2, "bf16", True, 64, 4, 3, False, 16),
            (4, "fp8e4nv", False, 64, 4, 3, True, 16), (2, "bf16", True, 128, 8, 2, False),
            (2, "bf16", False, 64, 4, 3, True, 256, True), (2, "fp8e4nv", False, 64, 4, 3, False, 16, True),
            (4, "fp8e4nv", False, 128, 2, 1, True, 16),
            # rotary from a q/k/v SplitSum of four splits, in the few-rows and the usual shape
            (2, "bf16", True, 128, 8, 2, False, 256, False, 4), (2, "bf16", True, 64, 4, 3, False, 256, False, 4),
            (2, "fp8e4nv", True, 64, 4, 3, False, 256, False, 4),
            # the FP8 default: 64-token tiles in two warps (by TMA in whole blocks, loads across blocks, and the
            # rotary variant from a SplitSum)
            (4, "fp8e4nv", False, 64, 2, 3, True), (4, "fp8e4nv", False, 64, 2, 3, True, 16),
            (2, "fp8e4nv", True, 64, 2, 3, False, 256, False, 4)]


def compile_decode(group: int, cache: str, rotary: bool, block_n: int, num_warps: int, num_stages: int,
                   join_tail: bool, block_size: int = 256, tokens_outer: bool = False, splits: int = 0) -> None:
    from nanovllm.kernels.decode_config import DecodeConfig

    from kernel_sass import compile_decode as compile_for_sm90

    config = DecodeConfig(num_splits=1, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                          min_split_tiles=4, join_tail=join_tail)
    compiled = compile_for_sm90(config, cache, rotary, group, block_size, head_major=not tokens_outer, splits=splits)
    assert compiled.asm["cubin"]


def compile_tile_gemm(tokens: int, capability: int, shared_memory: int, element: str = "fp8e4nv") -> None:
    """kernels/decode_gemm.py's GEMM with tile_config's tile for a batch of `tokens`, as the
    linear layers launch it (bf16 out): FP8 with per-channel scales (channel_gemm) or bf16
    (decode_gemm), within the GPU's shared memory per block (the H200's 232,448 bytes, an
    L40S's 101,376)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.decode_gemm import _tile_gemm_kernel, tile_config
    from nanovllm.utils.fp8 import fp8_promote

    fp8 = element.startswith("fp8")
    config = tile_config(tokens, 4096, 4096, 1 if fp8 else 2, 132, shared_memory)
    pointers = dict(a_ptr=element, w_ptr=element, a_scale_ptr="fp32", w_scale_ptr="fp32", bias_ptr="fp32",
                    out_ptr="bf16", partial_ptr="fp32", counters_ptr="i32")
    constants = dict(SCALED=fp8, HAS_BIAS=False, BLOCK_N=config.block_n, BLOCK_T=config.block_t,
                     BLOCK_K=config.block_k, NUM_STAGES=config.num_stages, DOT_PRECISION="tf32",
                     PROMOTE=fp8_promote(config.block_k) if fp8 else 0)
    names = _tile_gemm_kernel.arg_names
    signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers else "i32"
                 for name in names}
    # As the launch specializes them (pointers, K, strides: multiples of 16), so that the
    # K loop is pipelined through shared memory here too.
    aligned = [name for name in names
               if name in pointers or name in ("N", "K", "a_stride", "w_stride", "out_stride", "K_PER_SPLIT")]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(ASTSource(_tile_gemm_kernel, signature, constants, attrs),
                              target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= shared_memory, (config, compiled.metadata.shared)


def compile_rms_norm(splits: int = 0) -> None:
    """kernels/rmsnorm.py writing FP8 for the projection after it (Qwen3-8B's width), or
    reading a SplitSum of `splits` parts (Qwen3-0.6B's down_proj: 12)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.fp8 import row_warps
    from nanovllm.kernels.rmsnorm import _SPLIT_WARPS, _rms_norm_kernel

    quantize = not splits
    pointers = dict(x_ptr="fp32" if splits else "bf16", res_ptr="bf16", w_ptr="bf16",
                    out_ptr="fp8e4nv" if quantize else "bf16", res_out_ptr="bf16", scale_ptr="fp32")
    constants = dict(H=4096, HP=4096, HAS_RESIDUAL=True, QUANTIZE=quantize, FP8_MAX=448.0, SPLITS=splits, PDL=True)
    signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers
                 else "fp32" if name == "eps" else "i32" for name in _rms_norm_kernel.arg_names}
    compiled = triton.compile(ASTSource(_rms_norm_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=_SPLIT_WARPS if splits else row_warps(4096)))
    assert compiled.asm["cubin"]


def compile_unpack_decode_inputs() -> None:
    """kernels/decode_inputs.py, as the decode graphs capture it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.decode_inputs import _unpack_kernel

    pointers = dict(context_lens_ptr="i32", block_tables_ptr="i32", temperatures_ptr="fp32")
    signature = {name: "constexpr" if name == "BLOCK_COLUMNS" else "*" + pointers.get(name, "i64")
                 if name.endswith("_ptr") else "i32" for name in _unpack_kernel.arg_names}
    compiled = triton.compile(ASTSource(_unpack_kernel, signature, dict(BLOCK_COLUMNS=256)),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    assert compiled.asm["cubin"]


def compile_quantizing_silu_and_mul() -> None:
    """kernels/activation.py writing FP8 for down_proj: the pair over column blocks (the
    blocks' maxima read at 1 and 16 blocks: 1,024 and 12,288 columns), and the kernel of a
    row a program at 12,288 columns and the warps it gets."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.activation import (_QUANTIZED_BLOCK, _quantize_blocks_kernel, _silu_and_mul_amax_kernel,
                                             _silu_and_mul_quantize_kernel)

    pointers = dict(x_ptr="bf16", y_ptr="bf16", amax_ptr="fp32", q_ptr="fp8e4nv", scale_ptr="fp32")
    for kernel, constants, warps in (
            (_silu_and_mul_amax_kernel, dict(BLOCK=_QUANTIZED_BLOCK), 4),
            (_quantize_blocks_kernel, dict(BLOCK=_QUANTIZED_BLOCK, BLOCKS_P=1, FP8_MAX=448.0), 4),
            (_quantize_blocks_kernel, dict(BLOCK=_QUANTIZED_BLOCK, BLOCKS_P=16, FP8_MAX=448.0), 4),
            (_silu_and_mul_quantize_kernel, dict(N=12288, NP=16384, FP8_MAX=448.0), 32)):
        signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers else "i32"
                     for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps))
        assert compiled.asm["cubin"]


def compile_activation_quantizer() -> None:
    """kernels/fp8.py's quantize_activations: o_proj's input at Qwen3-8B's width in one load
    (16 warps), a block-scaled checkpoint's 128-wide groups, and a group read twice."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.fp8 import _quantize_kernel

    pointers = dict(x_ptr="bf16", q_ptr="fp8e4nv", scale_ptr="fp32")
    for group, block, warps in ((4096, 4096, 16), (128, 128, 4), (32768, 1024, 4)):
        constants = dict(GROUP_K=group, BLOCK=block, FP8_MAX=448.0)
        signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers else "i32"
                     for name in _quantize_kernel.arg_names}
        compiled = triton.compile(ASTSource(_quantize_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps))
        assert compiled.asm["cubin"]


def compile_split_gemm(rows: int) -> None:
    """kernels/split_gemm.py's GEMM as the linear layers launch it (bf16, TMA weight tiles),
    at Qwen3-0.6B's gate_up (K = 1,024), then SiLU-and-mul summing its splits."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.activation import _SPLIT_BLOCK, _silu_and_mul_kernel
    from nanovllm.kernels.split_gemm import BLOCK_N, _split_gemm_kernel, block_k

    BLOCK_K = block_k(1024, 2)

    signature = dict(x="*bf16", w_desc=f"tensordesc<bf16[{BLOCK_N},{BLOCK_K}]>", b_ptr="*bf16", part_ptr="*fp32",
                     M="i32", N="i32", K="i32", x_stride="i32", HAS_BIAS="constexpr", BLOCK_N="constexpr",
                     BLOCK_K="constexpr", ROWS="constexpr", PDL="constexpr")
    constants = dict(HAS_BIAS=False, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, ROWS=rows, PDL=True)
    compiled = triton.compile(ASTSource(_split_gemm_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4))
    assert compiled.asm["cubin"]
    constants = dict(N=3072, BLOCK=_SPLIT_BLOCK, SPLITS=1024 // BLOCK_K, PDL=True)
    signature = {name: "constexpr" if name in constants else "*fp32" if name == "x_ptr" else "*bf16"
                 if name == "out_ptr" else "i32" for name in _silu_and_mul_kernel.arg_names}
    compiled = triton.compile(ASTSource(_silu_and_mul_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4))
    assert compiled.asm["cubin"]


def compile_wide_gemm(block_m: int, element: str = "bf16", tiles=None) -> None:
    """wide_gemm.py's kernel as it is launched (x and W by TMA, the K loop pipelined): 16-bit
    split into fp32 parts, fp32 at half-width K steps (block_m-row x tiles), FP8 with its
    scales into one dense output (on one of its plans' tiles); within the H200's shared
    memory per block."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.wide_gemm import _BLOCK_N, _STAGES, Tiles, _block_k, _wide_gemm_kernel
    from nanovllm.utils.fp8 import fp8_promote

    fp8 = element.startswith("fp8")
    tiles = tiles or Tiles(block_m, _BLOCK_N, _block_k(3072, 4 if element == "fp32" else 2), _STAGES)
    signature = dict(x_desc=f"tensordesc<{element}[{tiles.block_m},{tiles.block_k}]>",
                     w_desc=f"tensordesc<{element}[{tiles.block_n},{tiles.block_k}]>", x_scale_ptr="*fp32",
                     w_scale_ptr="*fp32", b_ptr="*bf16", out_ptr="*bf16" if fp8 else "*fp32", M="i32", N="i32",
                     split_k="i32")
    constants = dict(SCALED=fp8, HAS_BIAS=fp8, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                     STAGES=tiles.stages, PRECISION="ieee" if element == "fp32" else "tf32",
                     PROMOTE=fp8_promote(tiles.block_k) if fp8 else 0,
                     PARTS=not fp8, PDL=True)
    signature.update(dict.fromkeys(constants, "constexpr"))
    names = _wide_gemm_kernel.arg_names
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ("out_ptr", "N", "split_k")}
    compiled = triton.compile(ASTSource(_wide_gemm_kernel, signature, constants, attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= 232_448, (tiles, element, compiled.metadata.shared)


def compile_fp8_wide_gemm() -> None:
    """wide_gemm.py's FP8 form on the tiles its plans launch."""
    from nanovllm.kernels.wide_gemm import _FP8_TILES

    compile_wide_gemm(_FP8_TILES.block_m, "fp8e4nv", _FP8_TILES)


def compile_rotary_store(splits: int, cache: str = "bf16") -> None:
    """kernels/rotary_store.py at Qwen3-0.6B's heads, reading q/k/v as a SplitSum of
    `splits` parts (0: a tensor), into a bf16 or FP8 cache."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.rotary_store import _rotary_store_kernel

    pointers = dict(qkv_ptr="fp32" if splits else "bf16", positions_ptr="i64", cos_sin_ptr="fp32", q_norm_ptr="bf16",
                    k_norm_ptr="bf16", q_out_ptr="bf16", k_cache_ptr=cache, v_cache_ptr=cache,
                    slot_mapping_ptr="i64", kv_scales_ptr="fp32")
    constants = dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_HQ=16, BLOCK_HKV=8,
                     QK_NORM=True, FP8_MAX=0.0 if cache == "bf16" else 448.0, SPLITS=splits, PDL=True)
    signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers
                 else "fp32" if name == "eps" else "i32" for name in _rotary_store_kernel.arg_names}
    compiled = triton.compile(ASTSource(_rotary_store_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4))
    assert compiled.asm["cubin"]


def compile_store_kvcache(cache: str) -> None:
    """kernels/store_kvcache.py at Qwen3-0.6B's heads into a bf16 or FP8 cache."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.store_kvcache import _store_kvcache_kernel

    pointers = dict(key_ptr="bf16", value_ptr="bf16", k_cache_ptr=cache, v_cache_ptr=cache, slot_mapping_ptr="i64",
                    kv_scales_ptr="fp32")
    constants = dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_H=8,
                     FP8_MAX=0.0 if cache == "bf16" else 448.0)
    signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers else "i32"
                 for name in _store_kvcache_kernel.arg_names}
    compiled = triton.compile(ASTSource(_store_kvcache_kernel, signature, constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert compiled.asm["cubin"]


def compile_prefill(cache: str, tma: bool = False, search: bool = False) -> None:
    """Prefill attention as prefill_config sets it up for bf16 queries, head_dim 128 and
    prompts of 64 tokens or more (Hopper's wgmma), over a bf16 or an FP8 cache; tma: its
    whole key tiles by TMA copies (NANOVLLM_PREFILL_TMA); search: the grid of any split
    into sequences (max_seqlen_q=None, the prefill graphs' launch)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.prefill_attention import _prefill_kernel, prefill_config

    config = prefill_config(1 << 14, 128, torch.bfloat16)
    pointers = dict(q_ptr="bf16", k_cache_ptr=cache, v_cache_ptr=cache, cu_seqlens_q_ptr="i32",
                    cu_seqlens_k_ptr="i32", block_tables_ptr="i32", out_ptr="bf16", kv_scales_ptr="fp32",
                    num_seqs_ptr="i32", k_desc=cache, v_desc=cache)
    constants = dict(GROUP_SIZE=4, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                     DOT_PRECISION="tf32", FP8=cache != "bf16", TILE_SEARCH=search, TMA=tma)
    signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers
                 else "fp32" if name == "qk_scale" else "i32" for name in _prefill_kernel.arg_names}
    if tma:
        tile = f"[{config.block_n},128]"
        signature.update(k_desc=f"tensordesc<{cache}{tile}>", v_desc=f"tensordesc<{cache}{tile}>")
    compiled = triton.compile(ASTSource(_prefill_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    assert compiled.asm["cubin"]


def compile_samplers() -> None:
    """kernels/sample.py's and sample_filtered.py's kernels over Qwen's vocabulary, as their
    launchers set them up."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import nanovllm.kernels.sample as sample
    import nanovllm.kernels.sample_filtered as filtered

    vocab, chunk = 151_936, sample._MAX_CHUNK
    chunks = triton.cdiv(vocab, chunk)
    constants = dict(NUM_CHUNKS=chunks, CHUNKS_POW2=triton.next_power_of_2(chunks), CHUNK=chunk)
    pointers = dict(logits_ptr="bf16", temperatures_ptr="fp32", keys_ptr="i64", positions_ptr="i64", best_ptr="fp32",
                    best_ids_ptr="i32", counters_ptr="i32", out_ptr="i64")
    signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers else "i32"
                 for name in sample._sample_kernel.arg_names}
    compiled = triton.compile(ASTSource(sample._sample_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=sample._NUM_WARPS))
    assert compiled.asm["cubin"]
    split = filtered._MAX_SPLIT
    splits = triton.cdiv(vocab, split)
    constants = dict(NUM_SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits), SPLIT=split, BLOCK=filtered._BLOCK,
                     BLOCKS_POW2=triton.next_power_of_2(splits * split // filtered._BLOCK),
                     MAX_CAND=filtered._MAX_CANDIDATES, TOP_P_BLOCKS=filtered._TOP_P_BLOCKS, GROUP=filtered._GROUP,
                     NT=filtered._NUM_THRESHOLDS)
    pointers = dict(logits_ptr="bf16", top_k_ptr="i64", keys_ptr="i64", positions_ptr="i64", out_ptr="i64",
                    part_ids_ptr="i32", block_max_ptr="i32", selected_ptr="i32", cand_ids_ptr="i32",
                    counters_ptr="i32")
    signature = {name: "constexpr" if name in constants else f"*{pointers.get(name, 'fp32')}" if name.endswith("_ptr")
                 else "i32" for name in filtered._sample_filtered_kernel.arg_names}
    compiled = triton.compile(ASTSource(filtered._sample_filtered_kernel, signature, constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=filtered._NUM_WARPS))
    assert compiled.asm["cubin"]


def compile_fused_moe(fp8_block: int, gated: bool, fp8_inputs: bool = False, config=(16, 64, 128, 4, 4)) -> None:
    """kernels/fused_moe.py's grouped GEMM in bf16, its weights bf16 or FP8 with block scales,
    its inputs bf16 or FP8 (with FP8 weights), as the launch specializes it (pointers, sizes and
    strides multiples of 16); none of its registers spilled to the stack."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernel_sass import cuobjdump
    from nanovllm.kernels.fused_moe import _moe_gemm_kernel, gemm_constants

    a_dtype = torch.float8_e4m3fn if fp8_inputs else torch.bfloat16
    constants = gemm_constants(config, a_dtype, gated, fp8_block, top_k=8)
    options = dict(num_warps=constants.pop("num_warps"), num_stages=constants.pop("num_stages"))
    pointers = dict(a_ptr="fp8e4nv" if fp8_inputs else "bf16", b_ptr="fp8e4nv" if fp8_block else "bf16",
                    c_ptr="bf16", weight_ptr="fp32", scale_ptr="fp32", a_scale_ptr="fp32", sorted_pairs_ptr="i32",
                    block_expert_ptr="i32")
    names = _moe_gemm_kernel.arg_names
    signature = {name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers else "i32"
                 for name in names}
    aligned = [name for name in names if name in pointers or name == "K" or name.startswith("stride")]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(ASTSource(_moe_gemm_kernel, signature, constants, attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    usage = cuobjdump(compiled, "-res-usage")
    assert "STACK:0" in usage, f"{config} spills: {usage}"


def test_kernel_variants_compile_for_sm90() -> None:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


if __name__ == "__main__":
    sys.path.insert(0, str(BENCHMARKS))
    failed = []
    for variant in VARIANTS:
        try:
            compile_decode(*variant)
        except Exception as exc:  # every variant's error, not only the first
            failed.append(f"{variant}: {type(exc).__name__}: {str(exc)[:1500]}")
    for gpu in [(16, 90, 232_448), (64, 90, 232_448), (128, 90, 232_448), (128, 89, 101_376),
                (16, 90, 232_448, "bf16"), (64, 90, 232_448, "bf16")]:
        try:
            compile_tile_gemm(*gpu)
        except Exception as exc:
            failed.append(f"tile gemm {gpu}: {type(exc).__name__}: {str(exc)[:1500]}")
    # SiLU-and-mul at Qwen3-8B's intermediate width and the widest it takes (29,568: Qwen2.5-72B's)
    for name, compile_one in (("prefill attention, bf16 cache", lambda: compile_prefill("bf16")),
                              ("prefill attention, FP8 cache", lambda: compile_prefill("fp8e4nv")),
                              ("prefill attention, TMA tiles", lambda: compile_prefill("bf16", tma=True)),
                              ("prefill attention, FP8 cache, TMA tiles", lambda: compile_prefill("fp8e4nv", tma=True)),
                              ("prefill attention, TMA tiles, tile search",
                               lambda: compile_prefill("bf16", tma=True, search=True)),
                              ("quantizing rms_norm", compile_rms_norm),
                              ("rms_norm of a SplitSum", lambda: compile_rms_norm(12)),
                              ("split gemm, 16 rows", lambda: compile_split_gemm(16)),
                              ("split gemm, 64 rows", lambda: compile_split_gemm(64)),
                              ("wide gemm, 64-row tiles", lambda: compile_wide_gemm(64)),
                              ("wide gemm, 128-row tiles", lambda: compile_wide_gemm(128)),
                              ("wide gemm, 128-row tiles, fp32", lambda: compile_wide_gemm(128, "fp32")),
                              ("wide gemm, FP8 plans' tiles", compile_fp8_wide_gemm),
                              ("rotary_store of a SplitSum", lambda: compile_rotary_store(4)),
                              ("rotary_store of a SplitSum, FP8 cache", lambda: compile_rotary_store(4, "fp8e4nv")),
                              ("store_kvcache, bf16 cache", lambda: compile_store_kvcache("bf16")),
                              ("store_kvcache, FP8 cache", lambda: compile_store_kvcache("fp8e4nv")),
                              ("decode inputs' unpacking", compile_unpack_decode_inputs),
                              ("samplers", compile_samplers),
                              ("fused MoE, FP8 experts in 16-wide blocks", lambda: compile_fused_moe(16, True)),
                              ("fused MoE, FP8 experts in 32-wide blocks", lambda: compile_fused_moe(32, False, True)),
                              ("quantizing silu_and_mul", compile_quantizing_silu_and_mul),
                              ("activation quantizer", compile_activation_quantizer)):
        try:
            compile_one()
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:1500]}")
    from nanovllm.kernels.fused_moe import FP8_MOE_CONFIGS, MOE_CONFIGS

    # every row of both tables: bf16's gate_up, FP8's gate_up and down with FP8 inputs, and its
    # largest row with 16-bit inputs (blocks that do not divide an input's width)
    moe_variants = ([(0, True, False, config) for _, config in MOE_CONFIGS]
                    + [(128, gated, True, config) for _, config in FP8_MOE_CONFIGS for gated in (True, False)]
                    + [(128, True, False, FP8_MOE_CONFIGS[-1][1])])
    for variant in moe_variants:
        try:
            compile_fused_moe(*variant)
        except Exception as exc:
            failed.append(f"fused MoE {variant}: {type(exc).__name__}: {str(exc)[:1500]}")
    print("\n".join(failed))
    sys.exit(1 if failed else 0)

"""Decode attention launched a few times, for Nsight Compute to read one launch's hardware
counters (issue 20: what holds FP8 decode at 60-68% of copy bandwidth where bf16's reaches
95%). `gpu_check.sh ncu-decode` runs it under ncu for each cache type.

    ncu --clock-control none --kernel-name regex:_decode_split_kernel --launch-skip 3 \\
        --launch-count 1 --section SpeedOfLight python benchmarks/ncu_decode.py --cache fp8
"""
import argparse

import torch

from bench_kernels import paged_cache  # benchmarks/ is the script's own folder
from nanovllm.kernels.decode_attention import decode_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", choices=["bf16", "fp8"], default="fp8")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--table-tokens", type=int, default=0,
                        help="block tables this many tokens wide (default: --context); the engine's are max_model_len")
    parser.add_argument("--launches", type=int, default=5)
    args = parser.parse_args()
    cache_dtype = torch.float8_e4m3fn if args.cache == "fp8" else torch.bfloat16
    # Qwen3-0.6B's heads, the engine's 256-token blocks (as bench_kernels.py's decode rows)
    k_cache, v_cache, tables = paged_cache([args.context] * args.batch, 256, 8, 128, args.table_tokens or args.context,
                                           cache_dtype)
    q = torch.randn(args.batch, 16, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
    scales = torch.tensor([0.01, 0.01], device="cuda") if args.cache == "fp8" else None
    out = torch.empty_like(q)
    for _ in range(args.launches):
        decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, out=out, kv_scales=scales)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

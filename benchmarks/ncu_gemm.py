"""A decode step's four projections (Qwen3-0.6B's shapes, on cuBLAS as the engine ran them at
9-64 rows before the split-K tiles, and runs q/k/v and gate_up from 65, o_proj and
down_proj from 257, past the wide tiles) inside one NVTX range "measure",
for Nsight Compute to read each kernel's counters (issues 19, 23: every one of them takes
~5.5 us or more at 9-64 rows, several times the read of its weights). `gpu_check.sh
ncu-gemm` runs it under ncu.

    ncu --nvtx --nvtx-include "measure/" --section SpeedOfLight --section LaunchStats \\
        python benchmarks/ncu_gemm.py --rows 32
"""
import argparse

import torch
import torch.nn.functional as F

# (name, in features, out features): q/k/v fused, o, gate/up fused, down
PROJECTIONS = [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _, k, n in PROJECTIONS]
    inputs = [torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda") for _, k, _ in PROJECTIONS]
    for _ in range(args.warmup):
        for x, w in zip(inputs, weights, strict=True):
            F.linear(x, w)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("measure")
    for x, w in zip(inputs, weights, strict=True):
        F.linear(x, w)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""Small-batch projections on one GPU: our GEMV (nanovllm/kernels/gemv.py) against cuBLAS
(F.linear, after a compiled SiLU-and-mul for the gated down projection). Prints a table;
never asserts on time.

    python benchmarks/bench_gemv.py            # Qwen3-0.6B's and Llama-3-8B's projections
    python benchmarks/bench_gemv.py --sweep    # instead, every launch config on Qwen3-0.6B's, best first

Each figure is one replay of a CUDA graph of `--calls` launches, divided by the count: the
decode graphs do not pay Python's launch cost either. The launches cycle through enough
copies of the weight that L2 holds none of them when it is read, as in a decode step,
whose 28 layers of weights are many times the size of L2.
"""
import argparse
import itertools
import math

import torch
import torch.nn.functional as F

DTYPE = torch.bfloat16
L2_FLUSH_BYTES = 256 * 1024**2  # the weight copies a graph cycles through: 5x the H200's L2
# name: (N, K, gated); gated reads [gate | up] of width 2K and multiplies silu(gate) * up
SHAPES = {
    "qwen3-0.6b qkv": (4096, 1024, False),
    "qwen3-0.6b o": (1024, 2048, False),
    "qwen3-0.6b gate_up": (6144, 1024, False),
    "qwen3-0.6b down": (1024, 3072, True),
    "llama3-8b qkv": (6144, 4096, False),
    "llama3-8b o": (4096, 4096, False),
    "llama3-8b gate_up": (28672, 4096, False),
    "llama3-8b down": (4096, 14336, True),
}
SWEEP = {
    "block_n": [16, 32],
    "block_k": [128, 256, 512],
    "num_warps": [4, 8],
    "num_stages": [3, 4, 6],
    "num_splits": [1, 2, 4, 8, 16],
}


@torch.compile(dynamic=False)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def graph_us(step, copies: int, calls: int) -> float:
    """Microseconds per call of step(i) (i = the weight copy), replayed from one CUDA graph."""
    for i in range(copies):  # compile, allocate, autotune outside the capture
        step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            step(i % copies)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def operands(rows: int, n: int, k: int, gated: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(rows, 2 * k if gated else k, dtype=DTYPE, device="cuda")
    copies = max(2, math.ceil(L2_FLUSH_BYTES / (n * k * DTYPE.itemsize)))
    weights = [torch.randn(n, k, dtype=DTYPE, device="cuda") / k**0.5 for _ in range(copies)]
    return x, weights


def check(x: torch.Tensor, weight: torch.Tensor, gated: bool, config=None) -> None:
    """Our result against the fp32 reference, so a fast config is also a right one."""
    from nanovllm.kernels.gemv import gemv

    k = weight.shape[1]
    xin = F.silu(x[:, :k].float()) * x[:, k:].float() if gated else x.float()
    ref = xin @ weight.float().T
    err = ((gemv(x, weight, gated=gated, config=config).float() - ref).norm() / ref.norm()).item()
    if err > 1e-2:
        raise AssertionError(f"gemv relative error {err:.2e} with {config}")


def time_both(x: torch.Tensor, weights: list[torch.Tensor], gated: bool, calls: int) -> tuple[float, float]:
    """(cuBLAS, gemv) microseconds per call."""
    from nanovllm.kernels.gemv import gemv

    def cublas(i: int) -> torch.Tensor:
        return F.linear(silu_and_mul(x) if gated else x, weights[i])

    def ours(i: int) -> torch.Tensor:
        return gemv(x, weights[i], gated=gated)

    return graph_us(cublas, len(weights), calls), graph_us(ours, len(weights), calls)


def compare(args: argparse.Namespace) -> None:
    from nanovllm.kernels.gemv import gemv_config

    print(f"{'projection':<20} {'rows':>4} {'cuBLAS us':>10} {'TB/s':>6} {'gemv us':>8} {'TB/s':>6} {'speed-up':>8}  config")
    for name, (n, k, gated) in SHAPES.items():
        for rows in args.rows:
            x, weights = operands(rows, n, k, gated)
            check(x, weights[0], gated)
            base, fast = time_both(x, weights, gated, args.calls)
            weight_bytes = n * k * DTYPE.itemsize
            print(f"{name:<20} {rows:>4} {base:>10.2f} {weight_bytes / base / 1e6:>6.2f} {fast:>8.2f} "
                  f"{weight_bytes / fast / 1e6:>6.2f} {base / fast:>7.2f}x  {gemv_config(n, k, x.device)}")


def time_config(x: torch.Tensor, weights: list[torch.Tensor], gated: bool, config, calls: int) -> float:
    from nanovllm.kernels.gemv import gemv

    check(x, weights[0], gated, config)
    return graph_us(lambda i: gemv(x, weights[i], gated=gated, config=config), len(weights), calls)


def sweep(args: argparse.Namespace) -> None:
    from triton.runtime.errors import OutOfResources

    from nanovllm.kernels.gemv import GemvConfig

    for name, (n, k, gated) in SHAPES.items():
        if not name.startswith("qwen3"):
            continue
        for rows in (1, 8):
            x, weights = operands(rows, n, k, gated)
            results = []
            for values in itertools.product(*SWEEP.values()):
                config = GemvConfig(**dict(zip(SWEEP, values)))
                if config.block_k * config.num_splits > k * 2:
                    continue
                try:
                    us = time_config(x, weights, gated, config, args.calls)
                except OutOfResources:
                    continue
                results.append((us, config))
            results.sort(key=lambda r: r[0])
            print(f"{name}, {rows} rows: best of {len(results)}")
            for us, config in results[:5]:
                print(f"  {us:6.2f} us {n * k * DTYPE.itemsize / us / 1e6:5.2f} TB/s  {config}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--calls", type=int, default=64, help="launches per CUDA graph")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "bf16")
    sweep(args) if args.sweep else compare(args)


if __name__ == "__main__":
    main()

"""Whether Triton compiles kernels in parallel threads on this machine: a cold start spends
most of its engine build compiling ~30 kernel variants one after another (issue 19, item 4),
which a thread pool could overlap if Triton's compiler lets go of the interpreter lock.

    python benchmarks/parallel_compile.py [--kernels 8] [--threads 8] [--size 24]

Compiles --kernels variants of a test kernel (unrolled --size times, a compile of a few
seconds each) for this machine's GPU, once one after another and once on --threads threads,
prints both wall times and the speed-up. Nothing is launched; without a GPU it compiles
for sm_90 all the same.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import triton
import triton.language as tl
from triton.compiler import ASTSource


@triton.jit
def _unrolled(x_ptr, y_ptr, n, BLOCK: tl.constexpr, SIZE: tl.constexpr, SALT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(SIZE):
        acc += tl.exp(x * (i + SALT)) * tl.sin(x + i)
    tl.store(y_ptr + offs, acc, mask=offs < n)


def compile_one(target, size: int, salt: int) -> float:
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "SIZE": "constexpr",
                 "SALT": "constexpr"}
    source = ASTSource(_unrolled, signature, {"BLOCK": 1024, "SIZE": size, "SALT": salt})
    start = time.perf_counter()
    triton.compile(source, target=target)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=8)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--size", type=int, default=24)
    args = parser.parse_args()
    try:
        target = triton.runtime.driver.active.get_current_target()
    except RuntimeError:  # no GPU here: compile for an H100/H200 all the same (ptxas ships with Triton)
        from triton.backends.compiler import GPUTarget

        target = GPUTarget("cuda", 90, 32)
    print(f"triton {triton.__version__}, target {target}, {os.cpu_count()} CPUs")
    try:
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
        print("triton.runtime._async_compile.AsyncCompileMode: present")
    except ImportError:
        print("triton.runtime._async_compile.AsyncCompileMode: absent")
    times = {}
    for label, threads, salt in (("one after another", 1, 0), (f"{args.threads} threads", args.threads, 1000)):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="parallel-compile-")  # nothing cached
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            each = list(pool.map(lambda i: compile_one(target, args.size, salt + i), range(args.kernels)))
        times[label] = time.perf_counter() - start
        print(f"{label}: {times[label]:.2f} s for {args.kernels} kernels (each {min(each):.2f}-{max(each):.2f} s)")
    first, second = times.values()
    print(f"speed-up with threads: {first / second:.2f}x")


if __name__ == "__main__":
    main()

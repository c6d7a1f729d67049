"""Time the sampler alone on a decode batch of Qwen3's vocabulary (prints; never asserts).

    python benchmarks/bench_sampler.py [--batch 256] [--vocab 151936] [--eager]

Each configuration is what one decode step of the offline benchmark pays to sample, as in
the engine: GPU time (CUDA events, median of 50) and host time to queue the call. The
filtered configurations run the filtered Triton kernel (the default);
NANOVLLM_SAMPLER_KERNEL=0 times the compiled paths instead, torch.compile on unless --eager
(sampling/sampler.py).
"""
import argparse
import time

import torch

from nanovllm.sampling.sampler import Penalties, Sampler, SamplingTensors
from nanovllm.utils.compile import set_compile_enabled


def configurations(batch: int, vocab: int, device: torch.device) -> dict[str, SamplingTensors]:
    temps = torch.full((batch,), 0.6, device=device)
    filters = (torch.full((batch,), 50, device=device), torch.full((batch,), 0.9, device=device),
               torch.zeros(batch, device=device))
    counts = torch.randint(0, 2, (batch + 2, vocab), dtype=torch.int32, device=device)
    penalties = Penalties(counts, counts > 0, torch.arange(batch, device=device) + 2,
                          torch.full((batch,), 1.1, device=device), torch.zeros(batch, device=device),
                          torch.zeros(batch, device=device))
    keys = torch.randint(0, 1 << 62, (batch,), device=device)
    positions = torch.randint(0, 4096, (batch,), device=device)
    return {
        "temperature only": SamplingTensors(temps),
        "seeded": SamplingTensors(temps, keys=keys, positions=positions),
        "top_k 50 + top_p 0.9": SamplingTensors(temps, filters=filters, max_top_k=50, all_top_k=True),
        "top_k 20 + top_p 0.95 (Qwen3's)": SamplingTensors(temps, filters=(torch.full_like(filters[0], 20),
                                                                          torch.full_like(filters[1], 0.95),
                                                                          filters[2]), max_top_k=20, all_top_k=True),
        "repetition 1.1": SamplingTensors(temps, penalties=penalties),
        "top_k + top_p + repetition": SamplingTensors(temps, filters=filters, max_top_k=50, all_top_k=True,
                                                      penalties=penalties),
        "top_p 0.9 alone (threshold search)": SamplingTensors(temps, filters=(torch.zeros_like(filters[0]), *filters[1:])),
        "logprobs 5": SamplingTensors(temps, num_logprobs=5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--eager", action="store_true", help="without torch.compile")
    args = parser.parse_args()
    device = torch.device("cuda")
    set_compile_enabled(not args.eager)
    sampler = Sampler()
    logits = torch.randn(args.batch, args.vocab, device=device, dtype=torch.bfloat16) * 3
    print(f"batch {args.batch}, vocab {args.vocab}, bf16 logits, compile {'off' if args.eager else 'on'}")
    for name, t in configurations(args.batch, args.vocab, device).items():
        for _ in range(3):  # compile and warm up
            sampler(logits, t)
        torch.cuda.synchronize()
        gpu, host = [], []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            sampler(logits, t)
            host.append(time.perf_counter() - t0)
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end))
        print(f"{name:30s} gpu {sorted(gpu)[25]:.3f} ms   host {sorted(host)[25] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()

"""Where a decode step's time goes: torch.profiler over a few steady-state steps.

    python benchmarks/profile_step.py --batch 1     # the single-request latency case
    python benchmarks/profile_step.py --batch 256   # the throughput case
    python benchmarks/profile_step.py --batch 256 --filtered   # top_k 50, top_p 0.9, repetition 1.1
    python benchmarks/profile_step.py --arch qwen3-8b --batch 128 --tensor-parallel-size 2   # rank 0's view
    python benchmarks/profile_step.py --arch qwen3-8b --batch 128 --quantization fp8 --kv-cache-dtype fp8
    python benchmarks/profile_step.py --batch 8 --mixed 1024   # a 1,024-token prompt joining 8 decodes (prefill graphs)
    python benchmarks/profile_step.py --batch 8 --mixed 1024 --max-prefill-graph-tokens 0   # the same, eager
    python benchmarks/profile_step.py --batch 1 --speculative 4   # n-gram speculation's verification steps (greedy)
    python benchmarks/profile_step.py --batch 1 --speculative 4 --draft self   # a draft model, every draft kept
    python benchmarks/profile_step.py --arch qwen3-8b --batch 1 --speculative 4 --draft qwen3-0.6b

Prints the top operators by device time and by host time, the wall time per step, and the
GPU's timeline over the profiled steps: busy (the union of every kernel's and copy's
interval: PDL-launched kernels overlap, so their times do not add up), idle, the gaps, and
the copies and torch kernels that feed the CUDA graphs their inputs.
With --mixed N it profiles the steps where one N-token prompt joins the running decodes
(mixed steps; eager with --max-prefill-graph-tokens 0): their host time to launch, their time to finish, and where the
host time goes (cProfile, by own time and by cumulative time).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.bench import ARCHS, write_dummy_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=list(ARCHS), default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--filtered", action="store_true", help="sample with top_k 50, top_p 0.9, repetition_penalty 1.1")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="profiles rank 0 (NCCL kernels included)")
    parser.add_argument("--mixed", type=int, default=0, metavar="N",
                        help="profile the mixed steps where an N-token prompt joins the running decodes")
    parser.add_argument("--quantization", choices=["fp8"], default=None, help="FP8 weights (online quantization)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e4m3 | fp8_e5m2")
    parser.add_argument("--speculative", type=int, default=0, metavar="K",
                        help="speculative decoding, K n-gram drafts a step (greedy: dummy weights' output repeats, "
                             "so most steps verify drafts)")
    parser.add_argument("--draft", choices=["self", *ARCHS],
                        help="with --speculative K, K drafts a step from a draft model instead: the model itself "
                             "(every draft kept) or an --arch shape (dummy weights: none kept)")
    parser.add_argument("--max-prefill-graph-tokens", type=int, default=-1,
                        help="the engine argument: steps with prompt tokens up to this many replay prefill graphs "
                             "(-1: the default)")
    args = parser.parse_args()
    if args.draft and not args.speculative:
        parser.error("--draft needs --speculative K (the drafts a step)")

    folder = write_dummy_checkpoint(args.arch, tempfile.mkdtemp(prefix="nanovllm-profile-"))
    speculative = None
    if args.draft:
        draft = folder if args.draft == "self" else write_dummy_checkpoint(
            args.draft, tempfile.mkdtemp(prefix="nanovllm-profile-draft-"))
        speculative = {"model": draft, "num_speculative_tokens": args.speculative}
    elif args.speculative:
        speculative = {"method": "ngram", "num_speculative_tokens": args.speculative, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 1}
    llm = LLM(folder, load_format="dummy", max_model_len=4096, tensor_parallel_size=args.tensor_parallel_size,
              max_prefill_graph_tokens=args.max_prefill_graph_tokens, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, speculative_config=speculative)
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(args.context)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0 if args.speculative else 0.6, max_tokens=10_000 // 4, ignore_eos=True)
    if args.filtered:
        params = SamplingParams(temperature=0.6, max_tokens=10_000 // 4, ignore_eos=True, top_k=50, top_p=0.9,
                                repetition_penalty=1.1)
    for p in prompts:
        llm.add_request(llm.make_request(p, params))
    while llm.step().prompt_tokens:  # not is_prefill: a step that verifies drafts counts as one
        pass
    for _ in range(10):  # steady-state decode
        llm.step()
    if args.mixed:
        profile_mixed(llm, rng, args)
        llm.shutdown()
        return
    torch.cuda.synchronize()
    llm.reset_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    wall = (time.perf_counter() - start) / args.steps
    if args.speculative:
        s = llm.stats()
        print(f"speculative: {s['spec_decode_num_drafts']} verifications of {args.steps} steps x {args.batch} rows, "
              f"{s['spec_decode_num_accepted_tokens']} of {s['spec_decode_num_draft_tokens']} drafts kept: "
              f"{(args.steps * args.batch + s['spec_decode_num_accepted_tokens']) / args.steps:.2f} tokens a step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            llm.step()
    print(f"batch {args.batch}, context ~{args.context}: {wall * 1e3:.3f} ms per decode step (unprofiled)")
    table = prof.key_averages()
    kernels = [e for e in table if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    launches = sum(e.count for e in kernels) / args.steps
    busy_ms = sum(e.self_device_time_total for e in kernels) / args.steps / 1e3
    print(f"per step: {launches:.0f} kernels, {busy_ms:.3f} ms of GPU time (overlapping kernels counted each)")
    print(timeline(prof.events(), args.steps))
    print(table.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    llm.shutdown()


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, float, list[float]]:
    """(busy, span, gaps) of device intervals (start, end): busy is their union's length,
    span from the first start to the last end, gaps the idle stretches between them."""
    intervals = sorted(intervals)
    busy, gaps = 0.0, []
    start, end = intervals[0]
    for s, e in intervals[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy, max(e for _, e in intervals) - intervals[0][0], gaps


# Device activity that only moves a step's inputs: copies, and torch's own small kernels.
_INPUT_OPS = ("Memcpy", "memcpy", "void at::native::")


def timeline(events, steps: int, min_gap_us: float = 2.0) -> str:
    """The GPU's timeline over the profiled steps (events: torch.profiler's, in us)."""
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False)]  # kernels and copies, not record_function ranges
    if not device:
        return "GPU timeline: no device activity recorded"
    busy, span, gaps = busy_and_gaps([(e.time_range.start, e.time_range.end) for e in device])
    long_gaps = [g for g in gaps if g >= min_gap_us]
    inputs = [e for e in device if e.name.startswith(_INPUT_OPS)]
    return (f"GPU timeline per step: busy {busy / steps:.1f} of {span / steps:.1f} us ({busy / span:.1%}); "
            f"{len(long_gaps) / steps:.1f} gaps of {min_gap_us:g} us or more, {sum(long_gaps) / steps:.1f} us in all "
            f"(largest {max(long_gaps, default=0):.1f}); input copies and torch kernels: {len(inputs) / steps:.1f}, "
            f"{sum(e.time_range.end - e.time_range.start for e in inputs) / steps:.1f} us")


def profile_mixed(llm: LLM, rng: random.Random, args: argparse.Namespace) -> None:
    """Steps where one args.mixed-token prompt (one output token) joins the running decodes:
    each starts with the GPU idle, so its host time and its GPU time show apart."""
    def mixed_step(profiler: cProfile.Profile | None = None) -> tuple[float, float]:
        prompt = [rng.randint(0, 10000) for _ in range(args.mixed)]
        llm.add_request(llm.make_request(prompt, SamplingParams(max_tokens=1)))
        torch.cuda.synchronize()
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        is_prefill = llm.step().is_prefill
        if profiler is not None:
            profiler.disable()
        launched = time.perf_counter()
        if not is_prefill:
            raise RuntimeError("the step after a new prompt was not a prefill step")
        torch.cuda.synchronize()
        done = time.perf_counter()
        for _ in range(3):  # back to steady decoding; the prompt's request finishes
            llm.step()
        return launched - start, done - start

    for _ in range(3):  # warm-up: first shapes compile
        mixed_step()
    times = [mixed_step() for _ in range(args.steps)]
    host = sorted(t[0] for t in times)[len(times) // 2]
    total = sorted(t[1] for t in times)[len(times) // 2]
    prefill_graphs = llm.executor.runner.prefill_graphs
    graphs = "eager" if not llm.stats()["prefill_graph_replays"] else (
        "whole graphs" if prefill_graphs.capture_attention else "piecewise graphs")
    print(f"mixed step ({graphs}), {args.mixed}-token prompt + {args.batch} decodes: host {host * 1e3:.2f} ms to "
          f"return, {total * 1e3:.2f} ms until the GPU is done (medians of {len(times)})")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            mixed_step()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    profiler = cProfile.Profile()
    for _ in range(5):
        mixed_step(profiler)
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()

"""Summarize step traces (NANOVLLM_STEP_TRACE=FILE, nanovllm/engine/stats.py): each run's
steps over time, to compare how two ways of serving the same requests scheduled them.

    NANOVLLM_STEP_TRACE=/tmp/trace python benchmarks/bench_serving.py --offline ...
    python benchmarks/step_trace.py /tmp/trace.*

A trace's runs are its stretches of steps apart by more than --gap seconds; each is cut
into --buckets equal spans of time, and each span prints its steps, prompt tokens, mean
decode batch (over decode steps) and mean running and waiting sequences.
"""
from __future__ import annotations

import argparse


def read(path: str) -> list[tuple[float, bool, int, int, int, int]]:
    rows = []
    with open(path) as f:
        for line in f:
            t, kind, prompt, decode, running, waiting = line.split()
            rows.append((float(t), kind == "p", int(prompt), int(decode), int(running), int(waiting)))
    return rows


def split_runs(rows: list, gap: float) -> list[list]:
    runs: list[list] = []
    for row in rows:
        if not runs or row[0] - runs[-1][-1][0] > gap:
            runs.append([])
        runs[-1].append(row)
    return runs


def summarize(run: list, buckets: int) -> None:
    start, end = run[0][0], run[-1][0]
    prefills = [r for r in run if r[1]]
    decodes = [r for r in run if not r[1]]
    batch = sum(r[3] for r in decodes) / max(len(decodes), 1)
    print(f"  {end - start:.2f} s, {len(prefills)} prefill steps ({sum(r[2] for r in prefills):,} prompt tokens), "
          f"{len(decodes)} decode steps (mean batch {batch:.1f}), most running {max(r[4] for r in run)}")
    print("    span s       steps  prefill  prompt tok  decode batch  running  waiting")
    width = (end - start) / buckets or 1.0
    for i in range(buckets):
        part = [r for r in run if i * width <= r[0] - start < (i + 1) * width or (i == buckets - 1 and r[0] == end)]
        if not part:
            continue
        dec = [r for r in part if not r[1]]
        print(f"    {i * width:5.2f}-{(i + 1) * width:5.2f} {len(part):6d} {sum(r[1] for r in part):8d} "
              f"{sum(r[2] for r in part):11,d} {sum(r[3] for r in dec) / max(len(dec), 1):13.1f} "
              f"{sum(r[4] for r in part) / len(part):8.1f} {sum(r[5] for r in part) / len(part):8.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds without a step that part two runs")
    parser.add_argument("--buckets", type=int, default=10)
    parser.add_argument("--min-steps", type=int, default=20, help="leave out shorter runs (warm-up requests)")
    args = parser.parse_args(argv)
    for path in args.traces:
        for number, run in enumerate(r for r in split_runs(read(path), args.gap) if len(r) >= args.min_steps):
            print(f"{path}, run {number + 1}:")
            summarize(run, args.buckets)


if __name__ == "__main__":
    main()

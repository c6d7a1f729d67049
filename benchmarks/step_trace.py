"""Summarize step traces (NANOVLLM_STEP_TRACE=FILE, nanovllm/engine/stats.py): each run's
steps over time, to compare how two ways of serving the same requests scheduled them.

    NANOVLLM_STEP_TRACE=/tmp/trace python benchmarks/bench_serving.py --offline ...
    python benchmarks/step_trace.py /tmp/trace.*

A trace's runs are its stretches of steps apart by more than --gap seconds; each is cut
into --buckets equal spans of time, and each span prints its steps, prompt tokens, mean
decode batch (over decode steps) and mean running and waiting sequences.

With --bandwidth (TB/s, e.g. the copy bandwidth bench_offline.py prints) each run's decode
steps are also grouped by batch size (powers of two) against their memory floor: a step
must read the K/V of every token its attention attends (the trace's last column, times the
header's bytes per token) and the weights once (of an MoE model's experts, the share a
batch's routing touches, as bench_offline.py's floor counts them). A step's time is the gap
to the next record: the engine records a step once it has launched it and read the step
before, so the records lie one step's time apart (the run's last step has no next record
and is left out). Prefill steps are summed apart (their floor is FLOPs, not bytes).

    python benchmarks/step_trace.py /tmp/trace.* --bandwidth 4.26
"""
from __future__ import annotations

import argparse


def read(path: str) -> tuple[dict[str, float], list[tuple]]:
    """(the header's floor terms, the rows: time, is_prefill, prompt tokens, decode tokens,
    running, waiting, context tokens (0 in traces from before the column))."""
    header, rows = {}, []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                words = line[1:].split()
                header.update((key, float(value)) for key, value in zip(words[::2], words[1::2]))
                continue
            t, kind, prompt, decode, running, waiting, *context = line.split()
            rows.append((float(t), kind == "p", int(prompt), int(decode), int(running), int(waiting),
                         int(context[0]) if context else 0))
    return header, rows


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


def batch_bracket(batch: int) -> tuple[int, int]:
    """The power-of-two range holding batch: 1, 2, 3-4, 5-8, 9-16, ..."""
    high = 1 << max(batch - 1, 0).bit_length()
    return high // 2 + 1, high


def against_floor(run: list, header: dict[str, float], bandwidth: float) -> None:
    """The run's decode steps by batch size against their memory floor; its prefill steps apart."""
    kv, weights = header["kv_bytes_per_token"], header["weight_bytes"]
    experts, share = header.get("expert_bytes", 0.0), header.get("expert_share", 0.0)
    groups: dict[tuple[int, int], list[float]] = {}
    prefill = [0, 0.0]
    for row, after in zip(run, run[1:]):
        seconds = after[0] - row[0]
        if row[1]:
            prefill[0] += 1
            prefill[1] += seconds
            continue
        group = groups.setdefault(batch_bracket(row[3]), [0, 0.0, 0.0])
        group[0] += 1
        group[1] += seconds
        touched = experts * (1 - (1 - share) ** row[3])  # the experts a batch of row[3] tokens routes to
        group[2] += (row[6] * kv + weights - experts + touched) / bandwidth
    total = run[-1][0] - run[0][0]
    print(f"    against the floor at {bandwidth / 1e12:.2f} TB/s (K/V read + weights once a step):")
    print("    batch      steps  seconds  share  ms/step  floor s  of floor")
    for (low, high), (steps, seconds, floor) in sorted(groups.items()):
        print(f"    {f'{low}-{high}' if low < high else str(low):9s} {steps:6d} {seconds:8.3f} {seconds / total:6.1%} "
              f"{seconds / steps * 1e3:8.3f} {floor:8.3f} {floor / seconds:9.1%}")
    print(f"    prefill   {prefill[0]:6d} {prefill[1]:8.3f} {prefill[1] / total:6.1%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds without a step that part two runs")
    parser.add_argument("--buckets", type=int, default=10)
    parser.add_argument("--min-steps", type=int, default=20, help="leave out shorter runs (warm-up requests)")
    parser.add_argument("--bandwidth", type=float, metavar="TB/s",
                        help="also each run's decode steps by batch size against their memory floor")
    args = parser.parse_args(argv)
    for path in args.traces:
        header, rows = read(path)
        for number, run in enumerate(r for r in split_runs(rows, args.gap) if len(r) >= args.min_steps):
            print(f"{path}, run {number + 1}:")
            summarize(run, args.buckets)
            if args.bandwidth:
                if "kv_bytes_per_token" not in header or not any(row[6] for row in run):
                    raise SystemExit(f"{path}: no floor terms (a trace from before they were written)")
                against_floor(run, header, args.bandwidth * 1e12)


if __name__ == "__main__":
    main()

"""Draw benchmarks/throughput.png from benchmarks/throughput.csv (nano-vllm's workload:
256 requests, Qwen3-0.6B, output tokens per second). Needs matplotlib, which nanovllm
itself does not: `pip install matplotlib`."""
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def main() -> None:
    with open(os.path.join(HERE, "throughput.csv")) as f:
        rows = list(csv.DictReader(f))
    labels = [f"{r['engine']}\n({r['gpu']})" for r in rows]
    values = [float(r["output_tok_per_s"]) for r in rows]
    colors = ["#1f77b4" if r["engine"] == "nanovllm" else "#bbbbbb" if "floor" in r["engine"] else "#ff7f0e"
              for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=120)
    bars = ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values[::-1]], padding=3)
    ax.set_xlabel("output tokens / s (nano-vllm's benchmark: 256 requests, Qwen3-0.6B)")
    ax.set_xlim(0, max(values) * 1.18)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "throughput.png"))


if __name__ == "__main__":
    main()

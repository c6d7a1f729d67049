"""Where the engine process's loop spends its time (engine_process.EngineLoop): totals
over its life and a trace of its latest iterations, logged when it ends, so that a
stream's gaps can be told apart: taking requests, stepping, or building outputs."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

TRACE_STEPS = 20_000


class LoopIteration(NamedTuple):
    """One iteration of the engine loop, for its trace (seconds)."""

    intake_s: float  # applying the commands that arrived
    step_s: float
    collect_s: float  # building and queueing the outputs
    num_tokens: int
    is_prefill: bool


class LoopStats:
    """The loop's totals (seconds) and its latest TRACE_STEPS iterations."""

    def __init__(self):
        self.num_steps = 0
        self.step_s = 0.0  # in engine.step()
        self.collect_s = 0.0  # building the steps' outputs
        self.intake_s = 0.0  # reading and adding requests
        self.idle_s = 0.0  # waiting for requests with nothing to do, since the first step
        self.trace: deque[LoopIteration] = deque(maxlen=TRACE_STEPS)

    def waited(self, seconds: float) -> None:
        """A wait for requests with nothing to run; counted as idle from the first step on
        (before it, the server is only starting)."""
        if self.num_steps:
            self.idle_s += seconds

    def record(self, iteration: LoopIteration, took_step: bool) -> None:
        """Add an iteration (took_step: it ran engine.step()) to the totals and the trace."""
        self.num_steps += took_step
        self.intake_s += iteration.intake_s
        self.step_s += iteration.step_s
        self.collect_s += iteration.collect_s
        self.trace.append(iteration)

    def totals(self) -> str:
        """The totals as one line, for the log at the loop's end."""
        return (f"{self.num_steps} steps, {self.step_s:.2f} s in them, {self.collect_s:.2f} s building their outputs, "
                f"{self.intake_s:.2f} s taking requests, {self.idle_s:.2f} s idle")


def trace_summary(trace: Sequence[LoopIteration]) -> str:
    """Percentiles of the loop's iterations by kind, and the slowest of them: one line. A
    step's time includes waiting for the step before it on the GPU (it reads its tokens)."""
    def pct(values: list[float]) -> str:
        if not values:
            return "none"
        values = sorted(values)
        p50, p99 = (values[min(len(values) - 1, int(q * len(values)))] * 1e3 for q in (0.5, 0.99))
        return f"p50 {p50:.1f} / p99 {p99:.1f} / max {values[-1] * 1e3:.1f} ms"

    kinds = {"decode steps": [t for t in trace if t.num_tokens and not t.is_prefill],
             "prefill steps": [t for t in trace if t.is_prefill]}
    parts = [f"last {len(trace)} iterations: " + "; ".join(
        f"{name} ({len(rows)}) {pct([r.step_s for r in rows])}" for name, rows in kinds.items())]
    parts.append(f"taking requests {pct([t.intake_s for t in trace])}; "
                 f"building outputs {pct([t.collect_s for t in trace])}")
    slowest = sorted(trace, key=lambda t: t.intake_s + t.step_s + t.collect_s, reverse=True)[:5]
    parts.append("slowest (requests/step/outputs ms, tokens, kind): " + ", ".join(
        f"{t.intake_s * 1e3:.1f}/{t.step_s * 1e3:.1f}/{t.collect_s * 1e3:.1f} {t.num_tokens} "
        f"{'prefill' if t.is_prefill else 'decode'}" for t in slowest))
    return "; ".join(parts)

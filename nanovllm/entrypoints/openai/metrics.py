"""Prometheus metrics for /metrics, named like vLLM's with a `nanovllm:` prefix.

Gauges and token counters are read from the latest statistics the engine process sent
when Prometheus scrapes; the latency histograms are filled from its messages as each
request finishes. Each app gets its own registry, so several servers can live in one
process (tests).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from nanovllm.serving.async_engine import AsyncLLMEngine
from nanovllm.serving.messages import RequestMetrics

# Bucket bounds in seconds, roughly x2-x2.5 apart: TTFT spans a small GPU prefill (ms) to
# a long queue under load (a minute); TPOT one decode step (ms) to a crawling CPU run.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)

# (name, kind, help, key of AsyncLLMEngine.latest_stats)
ENGINE_METRICS = (
    ("nanovllm:num_requests_running", "gauge", "Sequences holding KV blocks (prefilling or decoding).",
     "num_requests_running"),
    ("nanovllm:num_requests_waiting", "gauge", "Sequences queued for their prefill.", "num_requests_waiting"),
    ("nanovllm:kv_cache_usage_perc", "gauge", "Share of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
    ("nanovllm:kv_cache_blocks_used", "gauge", "KV-cache blocks in use.", "kv_blocks_used"),
    ("nanovllm:prefix_cache_hit_rate", "gauge", "Share of prompt tokens found in the prefix cache.",
     "prefix_cache_hit_rate"),
    ("nanovllm:prompt_tokens", "counter", "Prompt tokens of requests that have started generating.",
     "prompt_tokens_total"),
    ("nanovllm:generation_tokens", "counter", "Generated tokens.", "generation_tokens_total"),
)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.latest_stats
        for name, kind, help_text, key in ENGINE_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(stats[key]))
            yield family


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]):
            return Histogram(name, help_text, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("nanovllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                              TTFT_BUCKETS)
        self.tpot = histogram("nanovllm:time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.", TPOT_BUCKETS)
        self.e2e = histogram("nanovllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             E2E_BUCKETS)

    def observe(self, metrics: RequestMetrics) -> None:
        """Record a finished request (called on the event loop)."""
        for histogram, value in ((self.ttft, metrics.time_to_first_token), (self.tpot, metrics.time_per_output_token),
                                 (self.e2e, metrics.e2e_latency)):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

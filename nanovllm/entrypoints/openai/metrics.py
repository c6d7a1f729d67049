"""Prometheus metrics for /metrics, named like vLLM's with a `nanovllm:` prefix, and the
server's periodic log line of the same statistics.

Gauges and the token and preemption counters are read from the latest statistics the
engine process sent when Prometheus scrapes; the latency histograms and the finish-reason
counter are filled from its messages as each request finishes. Each app gets its own
registry, so several servers can live in one process (tests).
With `serve -dp N` the engine gauges and counters carry a `replica` label: "0".."N-1"
for each replica and "total" for all of them (leave it out before summing).

    nanovllm:num_requests_running          gauge      sequences holding KV blocks
    nanovllm:num_requests_waiting          gauge      sequences queued for their prefill
    nanovllm:kv_cache_usage_perc           gauge      share of KV blocks in use (1 = full)
    nanovllm:kv_cache_blocks_used          gauge      KV blocks in use
    nanovllm:prefix_cache_hit_rate         gauge      share of prompt tokens found in the prefix cache
    nanovllm:prefix_cache_queries_total    counter    prompt tokens looked up in the prefix cache
    nanovllm:prefix_cache_hits_total       counter    of them, tokens found there
    nanovllm:prompt_tokens_total           counter    prompt tokens of requests that started generating
    nanovllm:generation_tokens_total       counter    generated tokens
    nanovllm:num_preemptions_total         counter    sequences preempted (their KV blocks freed, recomputed later)
    nanovllm:engine_prefill_steps_total    counter    engine steps on the prefill path: with prompt tokens (decodes
                                                      may ride along), or drafts to verify
    nanovllm:engine_decode_steps_total     counter    engine steps of decode tokens only
    nanovllm:engine_decode_step_tokens_total counter  tokens of those steps (over decode steps: the mean batch)
    nanovllm:spec_decode_num_drafts_total  counter    speculative decoding: a sequence's drafts verified in a step
    nanovllm:spec_decode_num_draft_tokens_total    counter  drafted tokens verified
    nanovllm:spec_decode_num_accepted_tokens_total counter  of them, tokens kept
    nanovllm:spec_decode_num_accepted_tokens_per_pos_total{position}  counter  kept by their place in a step
    nanovllm:request_success_total         counter    finished completions, by finished_reason (stop, length, abort)
    nanovllm:time_to_first_token_seconds   histogram  arrival to first token
    nanovllm:time_per_output_token_seconds histogram  mean time between output tokens after the first
    nanovllm:e2e_request_latency_seconds   histogram  arrival to last token
    nanovllm:startup_seconds               gauge      the engine's start-up, by phase (label phase:
                                                      config, setup, load_weights, compile_warmup,
                                                      memory_profile, cuda_graph_capture,
                                                      prefill_graph_capture, tokenizer (waiting for
                                                      it); engine: all of building the
                                                      engine; sampler_warm_up: compiling the sampler
                                                      after it, before the server is ready; process:
                                                      the engine process's start and imports before
                                                      the engine; server_ready: from the API
                                                      process's start until it served, all included)
"""
from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from nanovllm.serving.engine_client import EngineClient
from nanovllm.serving.messages import RequestMetrics
from nanovllm.serving.router import PER_POS

logger = logging.getLogger("nanovllm.stats")

# Bucket bounds in seconds, roughly x2-x2.5 apart: TTFT spans a small GPU prefill (ms) to
# a long queue under load (a minute); TPOT one decode step (ms) to a crawling CPU run.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)

# (name, kind, help, key of EngineClient.latest_stats)
ENGINE_METRICS = (
    ("nanovllm:num_requests_running", "gauge", "Sequences holding KV blocks (prefilling or decoding).",
     "num_requests_running"),
    ("nanovllm:num_requests_waiting", "gauge", "Sequences queued for their prefill.", "num_requests_waiting"),
    ("nanovllm:kv_cache_usage_perc", "gauge", "Share of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
    ("nanovllm:kv_cache_blocks_used", "gauge", "KV-cache blocks in use.", "kv_blocks_used"),
    ("nanovllm:prefix_cache_hit_rate", "gauge", "Share of prompt tokens found in the prefix cache.",
     "prefix_cache_hit_rate"),
    ("nanovllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("nanovllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("nanovllm:prompt_tokens", "counter", "Prompt tokens of requests that have started generating.",
     "prompt_tokens_total"),
    ("nanovllm:generation_tokens", "counter", "Generated tokens.", "generation_tokens_total"),
    ("nanovllm:num_preemptions", "counter", "Sequences preempted: KV blocks freed, recomputed later.", "preemptions"),
    ("nanovllm:engine_prefill_steps", "counter", "Engine steps on the prefill path: with prompt tokens (decodes may "
     "ride along), or drafts to verify.",
     "prefill_steps"),
    ("nanovllm:engine_decode_steps", "counter", "Engine steps of decode tokens only.", "decode_steps"),
    ("nanovllm:engine_decode_step_tokens", "counter", "Tokens of the decode-only steps (over decode steps: the "
     "mean decode batch).", "decode_tokens"),
    ("nanovllm:spec_decode_num_drafts", "counter", "Speculative decoding: a sequence's drafts verified in a step.",
     "spec_decode_num_drafts"),
    ("nanovllm:spec_decode_num_draft_tokens", "counter", "Speculative decoding: drafted tokens verified.",
     "spec_decode_num_draft_tokens"),
    ("nanovllm:spec_decode_num_accepted_tokens", "counter", "Speculative decoding: drafted tokens kept.",
     "spec_decode_num_accepted_tokens"),
)


class _EngineCollector(Collector):
    def __init__(self, engine: EngineClient, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.server_ready_s = 0.0  # set once the server serves (ServerMetrics.server_ready_s)

    def collect(self):
        stats = self.engine.latest_stats
        replicas = getattr(self.engine, "replica_stats", None)  # serve -dp N: each replica, and the total
        for name, kind, help_text, key in ENGINE_METRICS:
            labels = ["model_name"] if replicas is None else ["model_name", "replica"]
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_text, labels=labels)
            if replicas is None:
                family.add_metric([self.model_name], float(stats[key]))
            else:
                family.add_metric([self.model_name, "total"], float(stats[key]))
                for i, replica in enumerate(replicas):
                    family.add_metric([self.model_name, str(i)], float(replica.get(key, 0)))
            yield family
        yield self._accepted_per_pos(stats, replicas)
        yield self._startup(stats, replicas)

    def _accepted_per_pos(self, stats: dict, replicas: list[dict] | None) -> CounterMetricFamily:
        """Kept drafts by their place among a step's drafts (vLLM's vector of them)."""
        labels = ["model_name", "position"] if replicas is None else ["model_name", "position", "replica"]
        family = CounterMetricFamily("nanovllm:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: "
                                     "drafted tokens kept, by their place among a step's drafts (0: the first).",
                                     labels=labels)
        named = [([], stats)] if replicas is None else [(["total"], stats)] + [
            ([str(i)], replica) for i, replica in enumerate(replicas)]
        for replica, values in named:
            for position, count in enumerate(values.get(PER_POS, [])):
                family.add_metric([self.model_name, str(position)] + replica, float(count))
        return family

    def _startup(self, stats: dict, replicas: list[dict] | None) -> GaugeMetricFamily:
        """The start-up phases' seconds, per replica with -dp N (they start side by side)."""
        labels = ["model_name", "phase"] if replicas is None else ["model_name", "phase", "replica"]
        family = GaugeMetricFamily("nanovllm:startup_seconds", "Seconds each phase of the engine's start-up took.",
                                   labels=labels)
        for i, replica_stats in enumerate([stats] if replicas is None else replicas):
            for key, value in replica_stats.items():
                if key == "startup_s":
                    phase = "engine"
                elif key.startswith("startup_"):
                    phase = key.removeprefix("startup_").removesuffix("_s")
                else:
                    continue
                family.add_metric([self.model_name, phase] + ([] if replicas is None else [str(i)]), float(value))
        if self.server_ready_s:
            family.add_metric([self.model_name, "server_ready"] + ([] if replicas is None else ["total"]),
                              self.server_ready_s)
        return family


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str):
        self.registry = CollectorRegistry()
        self._engine_collector = _EngineCollector(engine, model_name)
        self.registry.register(self._engine_collector)

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]):
            return Histogram(name, help_text, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("nanovllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                              TTFT_BUCKETS)
        self.tpot = histogram("nanovllm:time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.", TPOT_BUCKETS)
        self.e2e = histogram("nanovllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             E2E_BUCKETS)
        self.successes = Counter("nanovllm:request_success", "Finished completions, by finish reason.",
                                 ["model_name", "finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):  # present (at 0) from the start, as Prometheus prefers
            self.successes.labels(model_name, reason)
        self.model_name = model_name

    @property
    def server_ready_s(self) -> float:
        """Seconds from the API process's start until it served (0 until then)."""
        return self._engine_collector.server_ready_s

    @server_ready_s.setter
    def server_ready_s(self, seconds: float) -> None:
        self._engine_collector.server_ready_s = seconds

    def observe(self, metrics: RequestMetrics) -> None:
        """Record a finished request (called on the event loop)."""
        for histogram, value in ((self.ttft, metrics.time_to_first_token), (self.tpot, metrics.time_per_output_token),
                                 (self.e2e, metrics.e2e_latency)):
            if value is not None:
                histogram.observe(value)
        for reason in metrics.finish_reasons:
            self.successes.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def log_stats(engine: EngineClient, interval: float) -> None:
    """Every `interval` seconds while there is work, one line like vLLM's: prompt and
    generation throughput since the last line, requests running and waiting, KV-cache
    usage and prefix-cache hit rate. Runs until cancelled."""
    last = dict(engine.latest_stats)
    while True:
        await asyncio.sleep(interval)
        now = engine.latest_stats
        prompt = (now.get("prompt_tokens_total", 0) - last.get("prompt_tokens_total", 0)) / interval
        generation = (now.get("generation_tokens_total", 0) - last.get("generation_tokens_total", 0)) / interval
        if prompt or generation or now.get("num_requests_running") or now.get("num_requests_waiting"):
            logger.info("prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d, waiting %d, "
                        "KV cache usage %.1f%%, prefix cache hit rate %.1f%%", prompt, generation,
                        now.get("num_requests_running", 0), now.get("num_requests_waiting", 0),
                        100 * now.get("kv_cache_usage", 0.0), 100 * now.get("prefix_cache_hit_rate", 0.0))
        last = dict(now)

"""Serving benchmark: random requests over HTTP to `nanovllm serve`, with vLLM's metrics.

    pip install -e ".[serve,bench]"
    # start a server (Qwen3-0.6B architecture, dummy weights), benchmark it, stop it;
    # --offline first runs the same requests through LLM.generate in this process
    python benchmarks/bench_serving.py --offline --num-prompts 1000 --input-len 1024 --output-len 128
    python benchmarks/bench_serving.py --request-rate 20          # Poisson arrivals, 20 req/s
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --model-name NAME   # a running server
    # 64 system prompts x 16 requests, interleaved, on two replicas: prefix-affinity routing
    # against round-robin (the hit rate comes from the server's /metrics)
    python benchmarks/bench_serving.py -dp 2 --num-prompts 1024 --shared-prefixes 64 --dp-routing round-robin

Requests: --num-prompts prompts of exactly --input-len random token ids (seeded, ids below
--vocab-size), sent as token-id prompts to /v1/completions with max_tokens --output-len,
ignore_eos, streaming with usage. They arrive all at once (--request-rate inf) or as a
Poisson process, and at most --max-concurrency are in flight. With --shared-prefixes N,
each prompt starts with one of N shared prefixes (--prefix-len tokens, half the prompt by
default), each prefix an equal share, in a random order; the prefix cache's hit rate over
the run is read from the server's /metrics.

Metrics, as `vllm bench serve` defines them:
  TTFT  request sent -> first chunk with a choice
  ITL   time between consecutive chunks of a request (every gap, all requests)
  TPOT  per request, (E2E - TTFT) / (output tokens - 1)
  E2E   request sent -> last chunk
  throughput: completed requests, output tokens and all tokens over the duration (first
  request sent -> last response done). Offline throughput is output tokens over the
  LLM.generate call.
  server_ready_s: a launched server's start -> /health answers; first_answer_s: that plus
  the warm-up request (8 tokens), the start-up a user waits for.
Engine arguments (--max-num-seqs, --dtype, ...) apply to both the launched server and
--offline, so the two run the same engine.

Serving ceilings: 256 streams at one token per ~5 ms decode step are ~50k SSE events/s.
On one core of the 2-core CPU dev machine, a client that reads pre-built events as fast
as a stand-in server sends them parsed ~28k events/s with httpx (its pure-Python HTTP
parser, one event per read) and ~46k-58k/s with aiohttp, which is why this client uses it.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

try:
    import aiohttp
    import httpx
except ImportError as exc:
    sys.exit(f"bench_serving.py needs the bench extra ({exc.name} is missing): pip install 'nanovllm[bench]'")

from nanovllm.entrypoints.bench import ARCHS, bench_max_model_len, write_dummy_checkpoint
from nanovllm.entrypoints.arguments import add_engine_arguments, engine_arguments
from nanovllm.serving.router import ROUTING
from nanovllm.testing.server import launch_server

STARTUP_TIMEOUT_S = 600
WARMUP_TOKENS = 8
JSON_CONTENT = {"Content-Type": "application/json"}
PROGRESS_EVERY_S = 10.0
# No request finished for this long, with some running: ask the server for its stacks.
STALL_S = 30.0


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    connect: float = 0.0  # seconds opening its connection (0: it took an open one)


DEFAULT_PROMPT_VOCAB = 10_000


def model_vocab_size(model: str | None) -> int | None:
    """The vocabulary size in a checkpoint folder's config.json; None without one."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
    except (TypeError, OSError, ValueError):
        return None
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")


def served_card(base_url: str, api_key: str | None) -> dict:
    """The first model card of a running server's /v1/models (nanovllm's carry vocab_size)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers).json()["data"][0]


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int, shared_prefixes: int = 0,
                 prefix_len: int = 0) -> list[list[int]]:
    """Random prompts of input_len tokens. With shared_prefixes N, each of N prefixes of
    prefix_len tokens begins an equal share of them, in a random order (in the order
    i mod N, round-robin over an even number of replicas would send every prefix to one)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(shared_prefixes)]
    order = [i % shared_prefixes for i in range(num_prompts)] if shared_prefixes else []
    rng.shuffle(order)
    prompts = []
    for i in range(num_prompts):
        prefix = prefixes[order[i]] if shared_prefixes else []
        prompts.append(prefix + [rng.randrange(vocab_size) for _ in range(input_len - len(prefix))])
    return prompts


# The server's counters a run reads before and after itself (/metrics, over all replicas).
SERVER_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "engine_prefill_steps", "engine_decode_steps",
                   "engine_decode_step_tokens")


async def read_server_counters(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    """SERVER_COUNTERS' values so far, from /metrics; those it does not report are left out.
    On a connection of its own: a run's pooled ones may have idled past the server's
    keep-alive and been closed."""
    async with aiohttp.ClientSession(headers=headers) as session, session.get(base_url + "/metrics") as response:
        text = await response.text() if response.status == 200 else ""
    counters = {}
    for name in SERVER_COUNTERS:
        lines = [line for line in text.splitlines() if line.startswith(f"nanovllm:{name}_total")]
        total = [line for line in lines if 'replica="total"' in line] or [line for line in lines if "replica=" not in line]
        if total:
            counters[name] = float(total[0].rsplit(" ", 1)[1])
    return counters


def startup_phases(base_url: str) -> dict[str, float]:
    """The engine's start-up by phase, from the server's `nanovllm:startup_seconds` gauge
    (the first replica's with -dp N), as `startup_<phase>_s`; none if /metrics fails."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(base_url + "/metrics").text
    except httpx.HTTPError:
        return {}
    return {f"startup_{sample.labels['phase']}_s": sample.value
            for family in text_string_to_metric_families(text) if family.name == "nanovllm:startup_seconds"
            for sample in family.samples if sample.labels.get("replica", "0") in ("0", "total")}


def step_figures(prefill_steps: float, decode_steps: float, decode_tokens: float) -> dict[str, float]:
    """A run's engine steps, as offline and HTTP runs both report them."""
    return {"engine_prefill_steps": int(prefill_steps), "engine_decode_steps": int(decode_steps),
            "mean_decode_batch": decode_tokens / decode_steps if decode_steps else 0.0}


def connect_timer() -> aiohttp.TraceConfig:
    """Times each request's new connection (RequestResult.connect): how long a burst's
    connects wait (on the client's event loop, or for a SYN resend when the server's
    listen queue overflows), which --warm-connections takes out of the measurement."""
    async def started(_session, context, _params) -> None:
        context.connect_start = time.perf_counter()

    async def ended(_session, context, _params) -> None:
        if isinstance(context.trace_request_ctx, RequestResult):
            context.trace_request_ctx.connect = time.perf_counter() - context.connect_start

    config = aiohttp.TraceConfig()
    config.on_connection_create_start.append(started)
    config.on_connection_create_end.append(ended)
    return config


async def open_connections(session: aiohttp.ClientSession, base_url: str, count: int) -> None:
    """Leave `count` open connections in the session's pool (/health, at once), which the
    run's requests then take: a server behind a proxy that keeps its connections."""
    async def health() -> None:
        async with session.get(base_url + "/health") as response:
            await response.read()

    await asyncio.gather(*(health() for _ in range(count)))


async def send(session: aiohttp.ClientSession, url: str, body: bytes) -> RequestResult:
    """One streamed request; its JSON body encoded before the run's clock starts."""
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=JSON_CONTENT, trace_request_ctx=result) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            # Server-sent events end with a blank line: split what each read brings on it.
            # Events read together share a timestamp (they arrived together).
            pending = b""
            async for data in response.content.iter_any():
                now = time.perf_counter()
                *events, pending = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[len(b"data: "):])
                    if chunk.get("choices"):
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                    elif chunk.get("usage"):
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                    elif "error" in chunk:
                        result.error = chunk["error"]["message"]
                        return result
        result.e2e = last - start
        result.ok = True
    except aiohttp.ClientError as exc:
        result.error = repr(exc)
    return result


async def run_http(args: argparse.Namespace, base_url: str, model_name: str, prompts: list[list[int]],
                   on_stall: Callable[[], None] | None = None) -> dict:
    url = base_url + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def payload(prompt: list[int], max_tokens: int) -> bytes:
        return json.dumps({"model": model_name, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": args.temperature, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()

    # aiohttp, as in vLLM's benchmark client: its C HTTP parser keeps up with ~256 streams
    # at one token per ~5 ms step, httpx's could not (see "Serving ceilings" above).
    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: --max-concurrency is the cap
    async with aiohttp.ClientSession(connector=connector, headers=headers, trace_configs=[connect_timer()],
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        # A prompt of its own: one from the workload would be cached before the hit rate's baseline.
        warmup_prompt = random.Random(f"warm-up {args.prompt_seed}").choices(range(args.vocab_size), k=args.input_len)
        warmup = await send(session, url, payload(warmup_prompt, WARMUP_TOKENS))
        if not warmup.ok:
            hint = " (prompt ids are drawn from [0, --vocab-size))" if "vocabulary" in str(warmup.error) else ""
            raise SystemExit(f"the warm-up request failed: {warmup.error}{hint}")
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts))
        arrivals = random.Random(args.prompt_seed)

        # Encoded before the clock starts: a client that encodes 1,000 bodies of 1,024 ids
        # in the burst delays its own requests (measured against a stand-in server that
        # answers at once: benchmarks/RESULTS.md, session 18).
        bodies = [payload(prompt, args.output_len) for prompt in prompts]

        async def limited(body: bytes) -> RequestResult:
            async with gate:
                return await send(session, url, body)

        if args.warm_connections:
            await open_connections(session, base_url, min(len(prompts), args.max_concurrency or len(prompts)))
        before = await read_server_counters(base_url, headers)
        start = time.perf_counter()
        tasks = []
        reporter = asyncio.create_task(report_progress(tasks, start, on_stall))
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(arrivals.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        reporter.cancel()
        after = await read_server_counters(base_url, headers)
    summary = summarize(results, duration, args.input_len)
    summary["warmup_request_s"] = warmup.e2e
    delta = {name: after[name] - before[name] for name in SERVER_COUNTERS if name in before and name in after}
    if "prefix_cache_queries" in delta and "prefix_cache_hits" in delta:
        queried = delta["prefix_cache_queries"]
        summary["prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / queried if queried else 0.0
    if "engine_decode_steps" in delta:
        summary.update(step_figures(delta["engine_prefill_steps"], delta["engine_decode_steps"],
                                    delta["engine_decode_step_tokens"]))
    return summary


async def report_progress(tasks: list[asyncio.Task], start: float, on_stall: Callable[[], None] | None = None,
                          every_s: float = PROGRESS_EVERY_S) -> None:
    """Print how many requests have finished every `every_s` seconds (to stderr), so that a
    run cut short still shows how far it got and whether it was moving; call on_stall once
    if none finishes for STALL_S while some are running."""
    last_done, last_change = 0, time.perf_counter()
    while True:
        await asyncio.sleep(every_s)
        done = sum(task.done() for task in tasks)
        now = time.perf_counter()
        print(f"  {now - start:6.1f} s: {done} of {len(tasks)} requests sent so far have finished",
              file=sys.stderr, flush=True)
        if done != last_done or done == len(tasks):
            last_done, last_change = done, now
        elif on_stall is not None and now - last_change >= STALL_S:
            on_stall()
            on_stall = None


def dump_server_stacks(process: subprocess.Popen) -> None:
    print(f"  no request finished in {STALL_S:.0f} s: the server's stacks (SIGUSR1) follow", file=sys.stderr, flush=True)
    process.send_signal(signal.SIGUSR1)


def summarize(results: list[RequestResult], duration: float, input_len: int) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "input_tokens": input_len * len(done),
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_len * len(done) + output_tokens) / duration,
    }
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2e": [r.e2e for r in done],
    }
    for name, values in samples.items():
        values_ms = np.array(values or [0.0]) * 1e3
        summary.update({f"mean_{name}_ms": float(values_ms.mean()), f"median_{name}_ms": float(np.median(values_ms)),
                        f"p99_{name}_ms": float(np.percentile(values_ms, 99))})
    connects = np.array([r.connect for r in results]) * 1e3
    summary.update({"connections_opened": int((connects > 0).sum()), "p99_connect_ms": float(np.percentile(connects, 99)),
                    "max_connect_ms": float(connects.max()), "connects_over_500ms": int((connects > 500).sum())})
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def run_offline(args: argparse.Namespace, model: str, prompt_sets: list[list[list[int]]]) -> list[dict]:
    """Each set of prompts through LLM.generate, one after the other in one engine."""
    from nanovllm import LLM, SamplingParams

    runs = []
    with LLM(model, **engine_arguments(args)) as llm:
        warmup_prompt = random.Random(f"warm-up {args.prompt_seed}").choices(range(args.vocab_size), k=args.input_len)
        llm.generate([warmup_prompt], SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True), use_tqdm=False)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
        steps = ("prefill_steps", "decode_steps", "decode_tokens")
        for prompts in prompt_sets:
            before = llm.stats()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            duration = time.perf_counter() - start
            after = llm.stats()
            output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            runs.append({"completed": len(outputs), "duration_s": duration, "output_tokens": output_tokens,
                         "request_throughput": len(outputs) / duration, "output_throughput": output_tokens / duration})
            if all(key in after for key in steps):  # not summed over data-parallel replicas
                runs[-1].update(step_figures(*(after[key] - before[key] for key in steps)))
    return runs


def median_run(runs: list[dict]) -> dict:
    """The run of median output throughput (the lower middle one of an even count)."""
    return sorted(runs, key=lambda run: run["output_throughput"])[(len(runs) - 1) // 2]


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine arguments given to this script, as `nanovllm serve` flags."""
    flags = []
    for name, value in engine_arguments(args).items():
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags


def cpu_seconds(pid: int) -> dict[int, float]:
    """CPU time (user + system) of pid and each of its descendants, from Linux's /proc;
    {} where there is no /proc."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    seconds, pending = {}, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            seconds[current] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    pending += [int(child) for child in f.read().split()]
        except OSError:
            continue
    return seconds


def print_summary(title: str, summary: dict) -> None:
    print(f"\n== {title} ==")
    for key, value in summary.items():
        print(f"{key:>28}: {value:,.2f}" if isinstance(value, float) else f"{key:>28}: {value}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server (default: launch one on --port with the engine arguments)")
    parser.add_argument("--port", type=int, default=8000, help="port of the launched server (0: a free one)")
    parser.add_argument("--model-name", help="the served model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"))
    parser.add_argument("--arch", choices=list(ARCHS), default="qwen3-0.6b", help="dummy weights of this, without --model")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--shared-prefixes", type=int, default=0,
                        help="prompts share this many prefixes, prompt i the (i mod N)-th (default: 0, none)")
    parser.add_argument("--prefix-len", type=int, help="tokens of each shared prefix (default: half of --input-len)")
    parser.add_argument("--dp-routing", choices=ROUTING, help="the launched server's --dp-routing (with -dp N)")
    parser.add_argument("--vocab-size", type=int,
                        help="prompt token ids are drawn from [0, this) (default: 10,000, or the model's vocabulary "
                             "if smaller: --model's config.json, or with --base-url the server's /v1/models)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: inf)")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    parser.add_argument("--warm-connections", action="store_true",
                        help="open the run's connections before it starts (kept alive), as a proxy in front of the "
                             "server would hold them: a burst then opens none (see connect_timer)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompt-seed", type=int, default=0, help="seeds the prompts and arrival times")
    parser.add_argument("--offline", action="store_true", help="first run the same requests through LLM.generate")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the workload this many times (run r's prompts seeded --prompt-seed + r, so no run "
                             "hits the cache of another), offline in one engine and over HTTP on one server; the "
                             "summaries are of the median run (default: 1)")
    parser.add_argument("--json", help="also write the results to this file")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)

    model = args.model
    if model is None and args.base_url is None:
        model = write_dummy_checkpoint(args.arch, tempfile.mkdtemp(prefix="nanovllm-bench-serving-"))
        args.load_format = "dummy"
    if model is not None and getattr(args, "max_model_len", None) is None:  # bench_offline's, so runs compare
        args.max_model_len = bench_max_model_len(model)
    card = functools.cache(lambda url: served_card(url, args.api_key))  # read at most once, where needed
    vocab = model_vocab_size(model)
    if vocab is None and args.base_url:
        vocab = card(args.base_url.rstrip("/")).get("vocab_size")
    if args.vocab_size is None:
        args.vocab_size = min(DEFAULT_PROMPT_VOCAB, vocab or DEFAULT_PROMPT_VOCAB)
    elif vocab is not None and not 0 < args.vocab_size <= vocab:
        parser.error(f"--vocab-size must be between 1 and the model's vocabulary ({vocab}), got {args.vocab_size}")
    prefix_len = (args.input_len // 2 if args.prefix_len is None else args.prefix_len) if args.shared_prefixes else 0
    if not 0 <= prefix_len <= args.input_len:
        parser.error(f"--prefix-len must be between 0 and --input-len ({args.input_len}), got {prefix_len}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    prompt_sets = [make_prompts(args.num_prompts, args.input_len, args.vocab_size, args.prompt_seed + r,
                                args.shared_prefixes, prefix_len) for r in range(args.repeats)]
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s"
    shared = f", {args.shared_prefixes} shared prefixes of {prefix_len} tokens" if args.shared_prefixes else ""
    print(f"{args.num_prompts} requests of {args.input_len} input and {args.output_len} output tokens{shared}, "
          f"rate {rate}, max concurrency {args.max_concurrency or 'none'}")
    results = {}

    if args.offline:
        runs = run_offline(args, model, prompt_sets)
        results["offline"] = median_run(runs)
        print_summary("offline LLM.generate" + (f" (median of {len(runs)} runs)" if len(runs) > 1 else ""),
                      results["offline"])
        if len(runs) > 1:
            results["offline_runs"] = runs

    def bench(base_url: str, on_stall: Callable[[], None] | None = None) -> dict:
        name = args.model_name or card(base_url)["id"]
        runs = [asyncio.run(run_http(args, base_url, name, prompts, on_stall)) for prompts in prompt_sets]
        if len(runs) > 1:
            results["http_runs"] = runs
        return median_run(runs)

    if args.base_url:
        results["http"] = bench(args.base_url.rstrip("/"))
    else:
        routing = ["--dp-routing", args.dp_routing] if args.dp_routing else []
        log = None if args.port else Path(tempfile.mkdtemp(prefix="nanovllm-bench-serving-")) / "server.log"
        launched = time.perf_counter()
        server = launch_server(model, ["--log-level", "warning", *routing, *engine_flags(args)], port=args.port or None,
                               log=log)
        try:
            server.wait_ready(STARTUP_TIMEOUT_S)
            ready_s = time.perf_counter() - launched
            before, client_before = cpu_seconds(server.process.pid), time.process_time()
            results["http"] = bench(server.base_url, lambda: dump_server_stacks(server.process))
            # Start-up as a user sees it: launch to healthy, and to the first answer (the warm-up's).
            results["http"]["server_ready_s"] = ready_s
            results["http"]["first_answer_s"] = ready_s + results["http"]["warmup_request_s"]
            results["http"].update(startup_phases(server.base_url))
            results["http"]["client_cpu_s"] = time.process_time() - client_before
            # Whether the API process (or the engine's) was the one with no time to spare.
            after = cpu_seconds(server.process.pid)
            used = {pid: after[pid] - before[pid] for pid in after.keys() & before.keys()}
            if server.process.pid in used:
                results["http"]["api_process_cpu_s"] = used.pop(server.process.pid)
            if used:  # the busiest child: the engine process
                results["http"]["engine_process_cpu_s"] = max(used.values())
        finally:
            server.stop()
    print_summary("HTTP (nanovllm serve)" + (f" (median of {args.repeats} runs)" if args.repeats > 1 else ""),
                  results["http"])
    for kind in ("offline", "http"):
        if f"{kind}_runs" in results:
            print(f"{kind} output tok/s per run: " + ", ".join(f"{r['output_throughput']:,.0f}" for r in results[f"{kind}_runs"]))
    for kind in ("offline", "http"):
        for r in results.get(f"{kind}_runs", []):
            if "engine_decode_steps" in r:
                print(f"{kind} run: {r['engine_prefill_steps']:.0f} prefill steps, {r['engine_decode_steps']:.0f} decode "
                      f"steps, mean decode batch {r['mean_decode_batch']:.1f}")
    for r in results.get("http_runs", []):
        print(f"http run: TTFT mean {r['mean_ttft_ms']:.2f} ms, TPOT mean {r['mean_tpot_ms']:.2f} ms, ITL p99 "
              f"{r['p99_itl_ms']:.2f} ms ({r['p99_itl_ms'] / max(r['mean_tpot_ms'], 1e-9):.1f}x the mean TPOT); "
              f"{r['connections_opened']} connections opened, p99 {r['p99_connect_ms']:.1f} ms, max "
              f"{r['max_connect_ms']:.1f} ms, {r['connects_over_500ms']} over 0.5 s")
    if args.offline:
        ratio = results["http"]["output_throughput"] / results["offline"]["output_throughput"]
        print(f"\nHTTP output tok/s is {ratio:.1%} of offline" + (" (medians)" if args.repeats > 1 else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""nanovllm on Ray: Ray Serve (build_app), Ray Data (NanoVLLMPredictor) and `run-batch --ray` (run_batch).

Ray is an optional extra (`pip install 'nanovllm[ray]'`) imported only here, and only
when one of these is used.

Serve. `serve.run(build_app(model, num_replicas=2, **engine_args))` deploys two
deployments. "NanoVLLMEngine" replicas each run one engine (an AsyncLLMEngine, whose
engine process takes the replica's tensor_parallel_size GPUs, or CPU); "NanoVLLMServer"
is the HTTP ingress: the very FastAPI app `nanovllm serve` runs (create_app), over a
RayEngineClient that tokenizes and checks requests itself and sends each generate call to
an engine replica through a Serve handle. The ingress is needed for routing: Serve's
proxy picks a replica before the HTTP body arrives, so only a handle call, whose
arguments are the tokenized requests, can be routed by its prompt. That routing is
PrefixAffinityRouter, a Serve RequestRouter: a prompt prefix (its first full KV blocks)
goes back to the replica that last served it, unless that replica has many more
requests in flight than the least busy one; otherwise, as Serve's default router,
the less busy of two random replicas.

Data. `dataset.map_batches(NanoVLLMPredictor, fn_constructor_kwargs={"model": ...,
"sampling_params": {...}, **engine_args}, compute=ActorPoolStrategy(size=N), num_gpus=...)`: each actor
holds an LLM and generates for a batch's "prompt", "messages" or "prompt_token_ids".

run-batch --ray. Ray Data hands the batch file's lines, in batches, to actors that each
answer them through the server's app (run_batch.BatchAnswerer): the local run-batch's
results and errors, from as many engines as -dp says.
"""
from __future__ import annotations

import functools
import importlib
import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from nanovllm.config import Config
from nanovllm.demo import model_name
from nanovllm.entrypoints.openai.api_server import create_app
from nanovllm.entrypoints.openai.limits import ResponseOptions, ServerLimits
from nanovllm.entrypoints.openai.run_batch import BatchAnswerer, read_lines, write_results
from nanovllm.entrypoints.openai.transport import BodyGuard
from nanovllm.serving.async_engine import AsyncLLMEngine, EngineDeadError
from nanovllm.serving.frontend import RequestFrontend
from nanovllm.serving.messages import EngineRequest, RequestMetrics
from nanovllm.serving.router import AffinityTable, prefix_key, sum_stats

# Generate calls (HTTP requests, at the ingress) a replica takes at once. Serve's default
# (5) would queue requests in front of an engine whose own scheduler batches hundreds.
MAX_ONGOING_REQUESTS = 1024
# A prefix goes back to its replica while that replica has at most this many more calls
# in flight than the least busy one (the local router's 16,384 tokens, at ~512 a request).
AFFINITY_SLACK_REQUESTS = 32
# Lines of a batch file handed to a run-batch actor at once; its engine batches them.
RUN_BATCH_ROWS = 256
# The prompt columns NanoVLLMPredictor reads, the first one present wins.
PROMPT_COLUMNS = ("prompt_token_ids", "messages", "prompt")


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"nanovllm's Ray integration needs Ray ({exc.name} is missing): "
                          f"pip install 'nanovllm[ray]'") from None


def gpus_per_engine(engine_args: dict) -> int:
    """GPUs one engine takes: tensor_parallel_size of them, or none with device="cpu" or,
    with device "auto", on a Ray cluster without GPUs (connecting to Ray if need be)."""
    device = engine_args.get("device", "auto")
    if device == "cpu":
        return 0
    if device == "auto":
        ray = _import("ray")
        if not ray.is_initialized():
            ray.init()
        if not ray.cluster_resources().get("GPU"):
            return 0
    return engine_args.get("tensor_parallel_size", 1)


# -- Ray Serve ----------------------------------------------------------------------------


@dataclass(slots=True)
class EngineReport:
    """What an engine replica sends with each of its outputs: its name, its latest
    statistics and the metrics of the requests it finished since its last report."""

    replica: str
    stats: dict[str, float]
    finished: list[RequestMetrics]


class EngineReplica:
    """One engine as a Serve replica (the "NanoVLLMEngine" deployment)."""

    async def __init__(self, model: str, engine_args: dict):  # async: the engine's outputs go to this event loop
        self.engine = AsyncLLMEngine(model, engine_args)
        self.engine.start()
        self.finished: list[RequestMetrics] = []
        self.engine.on_finished = self.finished.append
        self.name = _import("ray.serve").get_replica_context().replica_id.unique_id

    async def info(self) -> tuple[Config, int]:
        """What the ingress needs to make requests for this engine."""
        return self.engine.config, self.engine.num_kvcache_blocks

    async def generate(self, requests: list[EngineRequest], stream: bool, prefix: int | None = None):
        """AsyncLLMEngine.generate's deltas, each with an EngineReport. prefix: the key
        PrefixAffinityRouter routed the call by."""
        async for deltas in self.engine.generate(requests, stream):
            yield deltas, self._report()
        yield [], self._report()  # what finished with the last deltas

    def _report(self) -> EngineReport:
        finished, self.finished = self.finished, []
        return EngineReport(self.name, self.engine.latest_stats, finished)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine died or stalls is replaced."""
        if not self.engine.is_healthy:
            raise RuntimeError(f"the engine is not healthy: {self.engine.error or 'no heartbeat'}")

    def __del__(self) -> None:
        self.engine.shutdown()


class RayEngineClient(RequestFrontend):
    """What the server's app uses of an engine (as AsyncLLMEngine and ReplicaRouter offer
    it), over the engine deployment: requests are made and checked here, each generate
    call goes to one replica, and /metrics shows every replica that has reported."""

    def __init__(self, handle, config: Config, num_kvcache_blocks: int):
        super().__init__(config, num_kvcache_blocks)
        self.handle = handle.options(stream=True)
        self.on_finished = None
        self.on_stopped = None  # Serve replaces a dead replica; the server goes on
        self.error: str | None = None
        self.stats: dict[str, dict[str, float]] = {}  # replica -> its latest statistics
        self._actor_died = _import("ray.exceptions").RayActorError

    # Serve starts, health-checks and stops the replicas.
    is_running = is_healthy = True

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def abort_all(self) -> None:
        pass

    async def generate(self, requests: list[EngineRequest], stream: bool = False):
        prefix = prefix_key(requests[0].prompt_token_ids, self.config.kvcache_block_size) if requests else None
        responses = self.handle.generate.remote(requests, stream, prefix=prefix)
        done = False
        try:
            async for deltas, report in responses:
                self.stats[report.replica] = report.stats
                for metrics in report.finished if self.on_finished is not None else ():
                    self.on_finished(metrics)
                if deltas:
                    yield deltas
            done = True
        except self._actor_died as exc:
            raise EngineDeadError(f"the engine replica died: {exc}") from None
        finally:
            if not done:  # the client left: the replica's generate aborts the requests
                responses.cancel()

    @property
    def replica_stats(self) -> list[dict[str, float]]:
        return list(self.stats.values())

    @property
    def latest_stats(self) -> dict[str, float]:
        return sum_stats(self.replica_stats)


def _two_of(replicas: list) -> list:
    return random.sample(replicas, min(2, len(replicas)))


@functools.cache
def prefix_affinity_router() -> type:
    """PrefixAffinityRouter, made on first use so that importing this module needs no Ray
    (and found by Serve as this module's attribute, through __getattr__)."""
    request_router = _import("ray.serve.request_router")

    class PrefixAffinityRouter(request_router.RequestRouter):
        """Routes EngineReplica.generate calls by the prompt prefix their `prefix` argument
        names: back to the replica that last got it, unless that one has more than
        `slack` calls in flight beyond the least busy; otherwise (and for prompts shorter
        than a KV block) the less busy of two random replicas, as Serve's default does.
        Each ingress replica keeps its own table."""

        def initialize_state(self, slack: int = AFFINITY_SLACK_REQUESTS) -> None:
            self.slack = slack
            self.affinity = AffinityTable()

        async def choose_replicas(self, candidate_replicas: list, pending_request=None) -> list[list]:
            held = self.affinity.get(_prefix_of(pending_request))
            chosen = next((r for r in candidate_replicas if r.replica_id == held), None)
            if chosen is None:
                return [_two_of(candidate_replicas)]
            in_flight = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas}
            if in_flight[held] - min(in_flight.values()) > self.slack:
                return [_two_of(candidate_replicas)]
            return [[chosen], _two_of([r for r in candidate_replicas if r is not chosen])]

        def on_request_routed(self, pending_request, replica_id, result) -> None:
            self.affinity.remember(_prefix_of(pending_request), replica_id)

    return PrefixAffinityRouter


def __getattr__(name: str) -> Any:
    """Serve finds a router class by its module and name: PrefixAffinityRouter is made here."""
    if name == "PrefixAffinityRouter":
        return prefix_affinity_router()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _prefix_of(pending_request) -> int | None:
    return None if pending_request is None else pending_request.kwargs.get("prefix")


class OpenAIIngress:
    """The HTTP ingress (the "NanoVLLMServer" deployment): `nanovllm serve`'s app over a
    RayEngineClient of the engine deployment."""

    async def __init__(self, engine, served_model_names: list[str], api_key: str | None, responses: ResponseOptions,
                       limits: ServerLimits):
        config, num_kvcache_blocks = await engine.info.remote()
        client = RayEngineClient(engine, config, num_kvcache_blocks)
        app = create_app(client, served_model_names, api_key, limits, responses)
        self.asgi_app = BodyGuard(app, limits.max_request_body_bytes, limits.request_body_timeout)

    def __serve_build_asgi_app__(self):
        return self.asgi_app


def build_app(model: str, *, num_replicas: int = 1, autoscaling_config: dict | None = None,
              served_model_name: str | list[str] | None = None, api_key: str | None = None,
              chat_template: str | None = None, enable_auto_tool_choice: bool = False,
              response_role: str = "assistant", enable_prompt_tokens_details: bool = False,
              limits: ServerLimits | None = None, **engine_args: Any):
    """A Ray Serve application serving `model` over OpenAI's API as `nanovllm serve` does,
    with num_replicas engines (or as many as autoscaling_config says, Serve's dict), each
    on tensor_parallel_size GPUs (none on CPU). Run it with `serve.run(build_app(...))`.

    served_model_name: the name(s) in the API (default: the model folder's name).
    api_key, chat_template (a template's text), enable_auto_tool_choice, response_role,
    enable_prompt_tokens_details, limits: as `nanovllm serve`'s flags. engine_args: LLM's engine arguments."""
    serve = _import("ray.serve")
    if engine_args.get("data_parallel_size", 1) != 1:
        raise ValueError("build_app's engines are Serve replicas: give num_replicas (or autoscaling_config), "
                         "not data_parallel_size")
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty: give a key, or leave api_key out to serve without one")
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [model_name(model)]
    limits = limits or ServerLimits()
    scale = {"autoscaling_config": autoscaling_config} if autoscaling_config else {"num_replicas": num_replicas}
    router = _import("ray.serve.config").RequestRouterConfig(request_router_class=prefix_affinity_router())
    engines = serve.deployment(EngineReplica, name="NanoVLLMEngine", max_ongoing_requests=MAX_ONGOING_REQUESTS,
                               ray_actor_options={"num_gpus": gpus_per_engine(engine_args)},
                               request_router_config=router, **scale)
    ingress = serve.deployment(serve.ingress()(OpenAIIngress), name="NanoVLLMServer",
                               max_ongoing_requests=MAX_ONGOING_REQUESTS)
    responses = ResponseOptions(chat_template, enable_auto_tool_choice, response_role, enable_prompt_tokens_details)
    return ingress.bind(engines.bind(model, engine_args), names, api_key, responses, limits)


# -- Ray Data -----------------------------------------------------------------------------


class NanoVLLMPredictor:
    """A Ray Data callable class: generates for each row of a batch and adds the
    "generated_text", "num_input_tokens", "num_generated_tokens" and "finish_reason"
    columns. The prompt is the row's "prompt_token_ids", else its "messages" (a chat,
    through the chat template), else its "prompt" (text).

        dataset.map_batches(NanoVLLMPredictor, compute=ray.data.ActorPoolStrategy(size=2), num_gpus=1, batch_size=64,
                            fn_constructor_kwargs={"model": path, "sampling_params": {"temperature": 0}})

    sampling_params: SamplingParams' fields (default: the checkpoint's recommended ones);
    one completion per row, so n must be 1. engine_args: LLM's engine arguments."""

    def __init__(self, model: str, sampling_params: dict[str, Any] | None = None, **engine_args: Any):
        from nanovllm import LLM, SamplingParams

        params = None if sampling_params is None else SamplingParams(**sampling_params)
        if params is not None and params.n != 1:
            raise ValueError(f"NanoVLLMPredictor writes one completion per row: n must be 1, got {params.n}")
        self.llm = LLM(model, **engine_args)
        self.params = params or self.llm.get_default_sampling_params()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        column = next((name for name in PROMPT_COLUMNS if name in batch), None)
        if column is None:
            raise ValueError(f"NanoVLLMPredictor needs a column named one of {', '.join(PROMPT_COLUMNS)}; "
                             f"the batch has {', '.join(batch)}")
        if column == "messages":
            outputs = self.llm.chat([[_message(m) for m in chat] for chat in batch[column]], self.params,
                                    use_tqdm=False)
        else:
            prompts = [{"prompt_token_ids": [int(t) for t in p]} if column == "prompt_token_ids" else str(p)
                       for p in batch[column]]
            outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        completions = [out.outputs[0] for out in outputs]
        return {**batch,
                "generated_text": np.array([c.text for c in completions], dtype=object),
                "num_input_tokens": np.array([len(out.prompt_token_ids) for out in outputs]),
                "num_generated_tokens": np.array([len(c.token_ids) for c in completions]),
                "finish_reason": np.array([c.finish_reason for c in completions], dtype=object)}

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def _message(message: dict) -> dict:
    """A message as Arrow gives it back: the fields other messages have are there as None."""
    return {key: value for key, value in message.items() if value is not None}


# -- run-batch --ray ------------------------------------------------------------------------


class _RunBatchWorker(BatchAnswerer):
    """A Ray Data actor answering batches of ("number", "line") rows into JSON "result"s."""

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        results = self.answer(list(zip(map(int, batch["number"]), map(str, batch["line"]))))
        return {"number": batch["number"],
                "result": np.array([json.dumps(r, ensure_ascii=False) for r in results], dtype=object)}


def run_batch(model: str, engine_args: dict, input_path: str, output_path: str, served_model_name: str,
              responses: ResponseOptions = ResponseOptions()) -> tuple[int, int]:
    """run_batch.run_batch through Ray Data: data_parallel_size (-dp) actors, each an
    engine on tensor_parallel_size GPUs, answer the lines; the same output file."""
    ray = _import("ray")
    engine_args = dict(engine_args)
    actors = engine_args.pop("data_parallel_size", 1)
    lines = read_lines(input_path)
    results = []
    if lines:
        answered = ray.data.from_items([{"number": n, "line": line} for n, line in lines]).map_batches(
            _RunBatchWorker, fn_constructor_kwargs={"model": model, "engine_args": engine_args,
                                                    "served_model_name": served_model_name,
                                                    "responses": responses},
            compute=ray.data.ActorPoolStrategy(size=actors), num_gpus=gpus_per_engine(engine_args),
            batch_size=RUN_BATCH_ROWS)
        results = [json.loads(row["result"]) for row in sorted(answered.take_all(), key=lambda row: row["number"])]
    return write_results(output_path, results)

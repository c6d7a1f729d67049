"""EngineClient: what the OpenAI server's app uses of an engine.

Three classes offer it: AsyncLLMEngine (one engine process, async_engine.py), ReplicaRouter
(`serve -dp N`, router.py) and RayEngineClient (a Ray Serve deployment's replicas,
integrations/ray.py). create_app and the endpoints' handlers take any of them; none
inherits from this class (a typing.Protocol), and tests/serving/test_engine_client.py
checks that each has every member.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nanovllm.config import Config
    from nanovllm.engine.request import Prompt, RequestChecker
    from nanovllm.engine.structured import GrammarCompiler
    from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
    from nanovllm.serving.deltas import RequestDelta
    from nanovllm.serving.messages import EngineRequest, RequestMetrics


class EngineClient(Protocol):
    config: Config
    tokenizer: PreTrainedTokenizerBase
    checker: RequestChecker  # the limits every request is checked against
    eos_token_ids: set[int]
    generation_defaults: dict  # the checkpoint's sampling defaults (generation_config.json)
    error: str | None  # why the engine stopped, if it failed
    latest_stats: dict[str, float]  # what /metrics shows
    # Called on the event loop: with each finished request's metrics; with the reason, if the engine dies.
    on_finished: Callable[[RequestMetrics], None] | None
    on_stopped: Callable[[str], None] | None

    @property
    def is_running(self) -> bool:
        """Started, not shut down, and not failed: new requests may be sent."""

    @property
    def is_healthy(self) -> bool:
        """Running, and heard from lately (the server's /health)."""

    def make_request(self, prompt: Prompt, params: SamplingParams, stream: bool = False,
                     request_id: str | None = None, fit: bool = False,
                     checker: RequestChecker | None = None, priority: int = 0,
                     copy_params: bool = True) -> EngineRequest:
        """A tokenized, checked request (ValueError for one that could never run); nothing sent yet."""

    def check_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """ValueError if spec's grammar does not compile (blocking: call it off the event loop)."""

    def grammar_compiler(self) -> GrammarCompiler: ...

    def generate(self, requests: list[EngineRequest], stream: bool = False) -> AsyncIterator[list[RequestDelta]]:
        """Run the requests: their deltas as they come (streams), or their final outputs."""

    def start(self) -> None:
        """Begin delivering outputs on the running event loop."""

    def shutdown(self) -> None: ...

    def abort_all(self) -> None:
        """End every running request before the next step (finish_reason "abort")."""

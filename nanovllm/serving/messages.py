"""Every message between the server's API process and its engine process.

One duplex multiprocessing Pipe of small pickled records:

    API -> engine   list[EngineRequest]    requests to add (tokenized and checked already)
                    AbortRequests          requests to end now (their KV blocks freed)
                    None                   shut down
    engine -> API   EngineReady            once, after the engine is built (or StartupFailed)
                    then lists, in order, of
                    StepOutputs            one per step: new output, refusals, stats
                    EngineFailed           the loop failed; the process exits

After EngineReady the engine process sends whatever has queued up since its last send as
one list, so a busy API process reads fewer, larger messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.outputs import CompletionOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.pickling import pickle_as_arguments


@pickle_as_arguments
@dataclass(slots=True)
class EngineRequest:
    """A checked request, as AsyncLLMEngine.make_request returns it and the engine takes it.
    stream: report new text after every step, rather than the whole output at the end."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    arrival_time: float = 0.0  # time.monotonic(), set by AsyncLLMEngine.generate


@dataclass(slots=True)
class AbortRequests:
    request_ids: list[str] | None  # None: every request


@dataclass(slots=True)
class EngineReady:
    """The engine is built; what the API process needs to check requests without it."""

    num_kvcache_blocks: int
    stats: dict[str, float]  # StepOutputs.stats before the first step


@dataclass(slots=True)
class StartupFailed:
    error: BaseException  # what building the engine raised (a RuntimeError with its text if it does not pickle)


@dataclass(slots=True)
class EngineFailed:
    message: str


@pickle_as_arguments
@dataclass(slots=True)
class RequestMetrics:
    """When a request arrived, got its first token and finished (time.monotonic(), one
    clock for all processes of the machine), and how many tokens it used."""

    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # over all n completions
    longest_completion: int = 0  # tokens of its longest completion
    finish_reasons: list[str] = field(default_factory=list)  # of each completion, once finished

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (None with fewer than two)."""
        if self.finished_time is None or self.first_token_time is None or self.longest_completion < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.longest_completion - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@pickle_as_arguments
@dataclass(slots=True)
class RequestOutputDelta:
    """One request's output of a step: the new pieces of each completion that changed
    (stream), or every completion in full once all are done."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


@pickle_as_arguments
@dataclass(slots=True)
class StepOutputs:
    deltas: list[RequestOutputDelta]
    errors: list[tuple[str, ValueError]]  # requests the engine refused: (request id, why)
    finished: list[RequestMetrics]  # requests that ended this step
    stats: dict[str, float]  # what /metrics shows, after the step

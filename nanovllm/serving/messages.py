"""Every message between the server's API process and its engine process.

One duplex multiprocessing Pipe of small pickled records:

    API -> engine   EngineTokenizer        first, once: the API process's tokenizer, pickled
                    list[EngineRequest]    requests to add (tokenized and checked already)
                    AbortRequests          requests to end now (their KV blocks freed)
                    ResetPrefixCache       forget the cached prefixes, before the next step
                    None                   shut down
    engine -> API   EngineReady            once, after the engine is built (or StartupFailed)
                    then lists, in order, of
                    StepOutputs            one per step (and per heartbeat while idle): new output,
                                           refusals, stats, prefix-cache resets' results
                    EngineFailed           the loop failed; the process exits

After EngineReady the engine process sends whatever has queued up since its last send as
one list, so a busy API process reads fewer, larger messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.outputs import CompletionOutput, Logprob
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.pickling import pickle_as_arguments


def is_plain_stream(params: SamplingParams, stream: bool) -> bool:
    """A stream of one completion without logprobs: its output goes as StreamColumns."""
    return stream and params.n == 1 and params.logprobs is None and params.prompt_logprobs is None


@pickle_as_arguments
@dataclass(slots=True)
class EngineRequest:
    """A checked request, as AsyncLLMEngine.make_request returns it and the engine takes it.
    stream: report new text after every step, rather than the whole output at the end.
    engine_decodes: False for a plain stream without stop strings whose text the API process
    decodes from its tokens (AsyncLLMEngine.generate decides): the engine sends no text."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    arrival_time: float = 0.0  # time.monotonic(), set by AsyncLLMEngine.generate
    engine_decodes: bool = True
    priority: int = 0  # vLLM's: lower first, under scheduling_policy "priority"
    # A grammar past its fill budget fails the request (GrammarOverran: the server's 400);
    # False: its completion ends with "abort", as offline (LLM with data_parallel_size > 1).
    overrun_fails: bool = True

    def cost(self, output_cap: int | None = None) -> int:
        """The tokens it may add to a replica's load: its prompt and its n outputs of
        max_tokens (each counted up to output_cap when given)."""
        max_tokens = self.params.max_tokens if output_cap is None else min(self.params.max_tokens, output_cap)
        return len(self.prompt_token_ids) + max_tokens * self.params.n


@dataclass(slots=True)
class AbortRequests:
    request_ids: list[str] | None  # None: every request


@dataclass(slots=True)
class ResetPrefixCache:
    """Forget the cached prefixes (LLMEngine.reset_prefix_cache); the step's StepOutputs says
    whether it could (prefix_cache_resets)."""


@dataclass(slots=True)
class EngineTokenizer:
    """The API process's tokenizer, pickled, its first message to the engine process: the
    engine process then never imports transformers' AutoTokenizer (seconds of imports,
    most of them transformers' generation code), and builds the model while the API
    process loads the tokenizer. None if it does not pickle: the engine loads its own."""

    pickled: bytes | None


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
    # With the request's first delta: RequestOutput's prompt_logprobs (if it asked for them)
    # and num_cached_tokens.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None


@pickle_as_arguments
@dataclass(slots=True)
class StreamColumns:
    """The step's new output of plain streams (one completion, no logprobs: most of a busy
    server's traffic) as columns, entry i for one request: a list per field pickles and
    unpickles far faster than an object per request. The API process builds each
    request's CompletionOutput from its entry."""

    request_ids: list[str] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)  # None: the API process decodes the tokens
    token_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)  # None while it runs
    stop_reasons: list[int | str | None] = field(default_factory=list)
    # With a request's first entry: the prompt tokens the prefix cache held (RequestOutput's)
    cached_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, request_id: str, text: str | None, token_ids: list[int], finish_reason: str | None,
            stop_reason: int | str | None) -> None:
        self.request_ids.append(request_id)
        self.texts.append(text)
        self.token_ids.append(token_ids)
        self.finish_reasons.append(finish_reason)
        self.stop_reasons.append(stop_reason)


@pickle_as_arguments
@dataclass(slots=True)
class StepOutputs:
    deltas: list[RequestOutputDelta]  # every other request's new output
    errors: list[tuple[str, Exception]]  # requests the engine refused or ended: (request id, why)
    finished: list[RequestMetrics]  # requests that ended this step
    stats: dict[str, float]  # what /metrics shows, after the step
    streams: StreamColumns | None = None  # the plain streams' new output
    prefix_cache_resets: list[bool] | None = None  # each ResetPrefixCache's result, in order

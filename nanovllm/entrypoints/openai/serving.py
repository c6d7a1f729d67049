"""OpenAI requests in, engine requests out, and engine outputs back as OpenAI responses.

OpenAIServing turns a CompletionRequest or ChatCompletionRequest into SamplingParams and
engine requests (all checked before any runs), runs them on the engine (an EngineClient), and
answers with one response body or, for stream=true, server-sent events ending in
`data: [DONE]`. Problems with the request raise APIError, which the app turns into an
OpenAI error body.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from pydantic import BaseModel

from nanovllm.engine.request import vocabulary_error
from nanovllm.engine.structured import COMPILE_THREADS, GrammarOverran
from nanovllm.entrypoints.openai.beam_search import as_stream, beam_params, run_beam_search
from nanovllm.entrypoints.openai.chat import ChatError, ChatRenderer
from nanovllm.entrypoints.openai.lanes import LONG_TEXT_CHARS, TokenizerLane, make_lanes
from nanovllm.entrypoints.openai.limits import ResponseOptions, ServerLimits
from nanovllm.entrypoints.openai.errors import APIError
from nanovllm.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    SamplingRequest,
    random_id,
)
from nanovllm.entrypoints.openai.responses import (
    DONE, CompletionAnswer, UsageCounter, completion_choice, include_usage, sse,
)
from nanovllm.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from nanovllm.entrypoints.openai.transport import unless_client_leaves
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.serving.async_engine import EngineDeadError
from nanovllm.serving.deltas import RequestDelta
from nanovllm.serving.engine_client import EngineClient
from nanovllm.serving.messages import EngineRequest

logger = logging.getLogger(__name__)
# SamplingRequest fields passed to SamplingParams under the same name when set.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
                   "ignore_eos", "min_tokens", "skip_special_tokens", "allowed_token_ids", "bad_words",
                   "truncate_prompt_tokens", "prompt_logprobs")
# vLLM's older spellings of structured_outputs' fields.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The output's constraint, from whichever one of response_format (OpenAI's),
    structured_outputs (vLLM's) and the guided_* fields (vLLM's older ones) is set."""
    given: dict[str, dict] = {}
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        given["response_format"] = {"json_object": True}
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema", param="response_format")
        given["response_format"] = {"json": response_format.json_schema.json_schema}
    if request.structured_outputs is not None:
        unknown = sorted(request.structured_outputs.model_extra or ())
        if unknown:
            raise APIError(400, f"structured_outputs.{unknown[0]} is not supported by this server (it takes json, "
                                f"regex, choice, grammar, json_object and disable_any_whitespace)",
                           param="structured_outputs")
        given["structured_outputs"] = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    given.update((name, {name.removeprefix("guided_"): getattr(request, name)})
                 for name in GUIDED_FIELDS if getattr(request, name) is not None)
    if len(given) > 1:
        raise APIError(400, f"set one of {', '.join(given)}, not several", param=next(iter(given)))
    if not given:
        return None
    (param, fields), = given.items()
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:  # named as the request named it: guided_regex, not structured_outputs.regex
        where = "structured_outputs" + (f".{param.removeprefix('guided_')}" if param in GUIDED_FIELDS else "")
        raise APIError(400, str(exc).replace(where, param, 1), param=param) from None


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as strings of ASCII digits) as SamplingParams takes it,
    each bias clipped to [-100, 100] as OpenAI's and vLLM's are; NaN is refused."""
    bad = [token for token in bias if not (token.isascii() and token.isdigit())]
    if bad:
        raise APIError(400, f"logit_bias keys must be token ids, got {bad[:5]}", param="logit_bias")
    if any(math.isnan(value) for value in bias.values()):
        raise APIError(400, "logit_bias values must be numbers, got NaN", param="logit_bias")
    return {int(token): min(100.0, max(-100.0, float(value))) for token, value in bias.items()}


def longest_token(tokenizer) -> int:
    """Characters of the longest token in the vocabulary (special tokens included): no
    token covers more of a text, so a text has at least len(text) / this many tokens."""
    return max(1, max(map(len, tokenizer.get_vocab())))


class OpenAIServing:
    def __init__(self, engine: EngineClient, served_model_names: list[str], limits: ServerLimits,
                 options: ResponseOptions = ResponseOptions()):
        self.engine = engine
        self.served_model_names = served_model_names
        self.limits = limits
        self.options = options
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.config.hf_config.vocab_size
        self.chat = ChatRenderer(self.tokenizer, limits.trust_request_chat_template, options.chat_template)
        self.longest_token = longest_token(self.tokenizer)
        self.lanes = make_lanes(engine.checker, self.chat)  # tokenizing and templates, off the event loop
        # Grammars compile in threads of their own: a large schema can take seconds, and
        # holds up neither the requests without grammars nor (up to COMPILE_THREADS at
        # once) those with other grammars.
        self.grammar_pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="nanovllm-grammar")

    # -- checks shared by both endpoints ----------------------------------------------------

    def check(self, request: SamplingRequest) -> str:
        """Refuse what no engine request could serve; returns the model name to answer with."""
        if not self.engine.is_running:  # before a stream starts: its status line would say 200
            raise APIError(503, "the engine is not running" + (f": {self.engine.error}" if self.engine.error else ""))
        self.check_model(request.model)
        unsupported = request.unsupported_field()
        if unsupported is not None:
            raise APIError(400, request.unsupported_message(unsupported), param=unsupported)
        ignored = request.ignored_fields()
        if ignored:  # as vLLM: a field no version of the API has is most likely a typo
            # The names as repr (a client's newlines must not forge log lines), 64 characters at most.
            logger.warning("fields of a request that this server does not know, ignored: %s%s",
                           ", ".join(repr(name[:64]) + "..." * (len(name) > 64) for name in ignored[:10]),
                           f" and {len(ignored) - 10} more" if len(ignored) > 10 else "")
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
        if request.stream and request.prompt_logprobs is not None:  # as vLLM's
            raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        limits = self.limits
        if request.n is not None and request.n > limits.max_n:
            self._over_limit("n", request.n, "max_n")
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > limits.max_stop_strings:
            self._over_limit("stop", len(stops), "max_stop_strings", "stop strings")
        if stops and max(map(len, stops)) > limits.max_stop_string_length:
            self._over_limit("stop", max(map(len, stops)), "max_stop_string_length", "characters in a stop string")
        for name in ("logit_bias", "allowed_token_ids", "bad_words"):
            entries = getattr(request, name)
            if entries is not None and len(entries) > limits.max_token_list:
                self._over_limit(name, len(entries), "max_token_list", f"entries in {name}")
        return request.model or self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            shown = model if len(model) <= 100 else model[:100] + "..."  # not a client's megabyte back
            raise APIError(404, f"The model `{shown}` does not exist; this server serves "
                                f"{', '.join(self.served_model_names)}", param="model", code="model_not_found")

    def _over_limit(self, param: str, value: int, limit: str, what: str | None = None) -> None:
        raise APIError(400, f"{what or param} ({value}) exceeds this server's {limit} of {getattr(self.limits, limit)} "
                            f"({ServerLimits.flag(limit)})", param=param)

    def sampling_params(self, request: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        spec: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's sampling fields; the ones it leaves unset take the checkpoint's
        recommendation (generation_config.json), then SamplingParams' defaults, as in vLLM.
        spec: a constraint of the server's own (tool_choice's), which the request may not
        add one to. max_tokens: capped already (capped_max_tokens)."""
        kwargs = dict(self.engine.generation_defaults)
        kwargs.pop("max_tokens", None)
        kwargs.update((name, getattr(request, name)) for name in SAMPLING_FIELDS if getattr(request, name) is not None)
        if request.logit_bias:
            kwargs["logit_bias"] = logit_bias(request.logit_bias)
        if getattr(request, "echo", False) and logprobs is not None and request.prompt_logprobs is None:
            kwargs["prompt_logprobs"] = logprobs  # an echoed prompt's logprobs, as its completions' (vLLM's)
        own = structured_outputs(request)
        if spec is not None and own is not None:
            raise APIError(400, "tool_choice required or a named function constrains the output already; it cannot "
                                "be combined with response_format or structured outputs", param="tool_choice")
        spec = spec or own
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=spec, **kwargs)
        except ValueError as exc:
            raise APIError.bad_value(exc, request) from None

    def capped_max_tokens(self, max_tokens: int | None) -> int | None:
        """A request's max_tokens (None: up to the context's end) under the checkpoint's
        max_new_tokens (generation_config.json), which caps it, as vLLM's server does."""
        limits = (max_tokens, self.engine.generation_defaults.get("max_tokens"))
        return min((limit for limit in limits if limit is not None), default=None)

    def tokens_at_least(self, num_chars: int) -> int:
        """The fewest tokens a text of num_chars characters can take (no token is longer
        than longest_token): known before tokenizing it."""
        return math.ceil(num_chars / self.longest_token)

    def check_length(self, num_chars: int, max_tokens: int, param: str, truncate: int | None,
                     limit: str = "max_tokens") -> None:
        """Refuse a text prompt that cannot fit max_model_len from its length alone, before
        tokenizing it: it has at least num_chars / longest_token tokens, or truncate
        (truncate_prompt_tokens) where that is fewer. limit: the request's name for max_tokens."""
        at_least = self.tokens_at_least(num_chars)
        if truncate is not None:
            at_least = min(at_least, truncate)
        if at_least + max_tokens > self.max_model_len:
            # A prompt that fits on its own leaves max_tokens to be lowered.
            too_long = at_least >= self.max_model_len
            raise APIError(400, f"{param} (at least {at_least} token{'s' * (at_least != 1)}: "
                                f"{num_chars} character{'s' * (num_chars != 1)}) + {limit} ({max_tokens}) "
                                f"exceeds max_model_len ({self.max_model_len}); "
                                + (f"shorten the {param}" if too_long else f"lower {limit}"),
                           param=param if too_long else limit)

    def lane(self, num_chars: int = 0) -> TokenizerLane:
        """The tokenizer thread for a text of num_chars characters (lanes.py)."""
        return self.lanes[num_chars >= LONG_TEXT_CHARS]

    async def make_requests(self, request: SamplingRequest, prompts: list[str | list[int]], params: SamplingParams,
                            request_id: str, stream: bool | None = None,
                            raw_request: Request | None = None) -> list[EngineRequest] | None:
        """One engine request per prompt (streamed as the request is, unless `stream` says),
        every one tokenized and checked (and a grammar compiled) before any runs. Text goes
        to the tokenizer thread; token ids, checked in a few C-level passes, are checked
        here, which spares each request the hops to the thread and back. None: the client of
        raw_request left while its grammar waited to compile (which then never runs)."""
        if params.structured_outputs is not None:
            try:
                await self.lane().run(self.engine.grammar_compiler)
                if not await self._compile(params.structured_outputs, raw_request):
                    return None
            except ValueError as exc:
                param = next((name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
                              if getattr(request, name) is not None), "tools")  # else tool_choice's constraint
                raise APIError(400, str(exc), param=param) from None

        lane = self.lane(sum(len(p) for p in prompts if isinstance(p, str)))

        def make() -> list[EngineRequest]:
            return [self.engine.make_request(prompt, params, stream=request.stream if stream is None else stream,
                                             request_id=f"{request_id}-{i}", checker=lane.checker,
                                             priority=request.priority, copy_params=False)  # (made here)
                    for i, prompt in enumerate(prompts)]

        try:
            # Token ids alone are checked here; bad_words are encoded in the lane where read (with
            # allowed_token_ids or a grammar).
            on_loop = all(isinstance(p, list) for p in prompts) and not (
                params.bad_words and (params.allowed_token_ids or params.structured_outputs is not None))
            return make() if on_loop else await lane.run(make)
        except ValueError as exc:
            raise APIError.bad_value(exc, request) from None

    async def _compile(self, structured: StructuredOutputsParams, raw_request: Request | None) -> bool:
        """Compile the grammar in its thread (ValueError if it cannot be); False if the client
        left first. A compile still queued behind another is then cancelled, so that slow
        schemas of clients that gave up do not hold up the grammars of those still waiting."""
        job = self.grammar_pool.submit(self.engine.check_structured_outputs, structured)
        compiling = asyncio.wrap_future(job)
        if raw_request is not None and not await unless_client_leaves(compiling, raw_request):
            job.cancel()  # now, not from the loop's next turn: a queued compile never starts (one under way runs on)
            return False
        await compiling  # its ValueError, if any
        return True

    async def final_outputs(self, requests: list[EngineRequest], raw_request: Request) -> list[RequestDelta] | None:
        """Run requests to the end; None if the client disconnected first (they are aborted)."""

        async def run() -> list[RequestDelta]:
            finals: dict[int, RequestDelta] = {}
            async for deltas in self.engine.generate(requests):
                finals.update((delta.index, delta) for delta in deltas)
            return [finals[i] for i in range(len(requests))]

        task = asyncio.ensure_future(run())
        if not await unless_client_leaves(task, raw_request):  # the generator's exit aborts the requests
            return None
        if isinstance(task.exception(), EngineDeadError):
            raise APIError(503, str(task.exception()))
        if isinstance(task.exception(), GrammarOverran):
            raise APIError(400, str(task.exception()))
        return task.result()

    async def stream_events(self, requests: list[EngineRequest],
                            chunks: Callable[[list[RequestDelta]], Iterator[BaseModel | str]],
                            usage_chunk: Callable[[], BaseModel] | None) -> AsyncIterator[str]:
        """Server-sent events: `chunks(deltas)` turns each step's deltas into response bodies
        (or ready events), and usage_chunk(), if given, makes the last one
        (stream_options.include_usage). An engine failure mid-stream becomes an error event,
        and so do a grammar past its fill budget (a 400) and a bug of ours (its traceback
        goes to the log). Always ends with [DONE]."""
        try:
            async for deltas in self.engine.generate(requests, stream=True):
                for body in chunks(deltas):
                    yield sse(body)
            if usage_chunk is not None:
                yield sse(usage_chunk())
        except EngineDeadError as exc:
            yield sse(APIError(503, str(exc)).body())
        except GrammarOverran as exc:
            yield sse(APIError(400, str(exc)).body())
        except Exception:
            logger.exception("a stream failed")
            yield sse(APIError(500, "internal server error (the server's log has the details)").body())
        yield DONE

    # -- /v1/completions --------------------------------------------------------------------

    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        """A CompletionResponse, or an iterator of server-sent events for stream=true."""
        model = self.check(request)
        prompts = completion_prompts(request.prompt)
        if len(prompts) > self.limits.max_prompts_per_request:
            self._over_limit("prompt", len(prompts), "max_prompts_per_request", "prompts")
        if request.max_tokens < 1 and not (request.echo and request.max_tokens == 0):
            # (null is 16 here, OpenAI's default: SamplingParams' "None: up to the context's end" would mislead)
            raise APIError(400, f"max_tokens must be an integer >= 1 (0 with echo: the prompt alone), got "
                                f"{request.max_tokens}", param="max_tokens")
        max_tokens = self.capped_max_tokens(request.max_tokens)
        if request.use_beam_search:
            return await self.beam_search_completion(request, prompts, max_tokens, model, raw_request)
        echo_only = request.echo and max_tokens == 0  # the prompt (and its logprobs) alone
        params = self.sampling_params(request, 1 if echo_only else max_tokens, request.logprobs)
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_length(len(prompt), params.max_tokens or 1, "prompt", request.truncate_prompt_tokens)
        request_id = random_id("cmpl")
        requests = await self.make_requests(request, prompts, params, request_id, raw_request=raw_request)
        if requests is None:
            return None
        usage = UsageCounter(sum(len(r.prompt_token_ids) for r in requests), request,
                             self.options.enable_prompt_tokens_details)
        answer = CompletionAnswer(request, prompts, requests, request_id=request_id, model=model, n=params.n,
                                  echo_only=echo_only, usage=usage, tokenizer=self.tokenizer)
        if request.stream:
            return self.stream_events(requests, answer.chunks, answer.usage_chunk if include_usage(request) else None)
        finals = await self.final_outputs(requests, raw_request)
        return None if finals is None else answer.response(finals)

    async def beam_search_completion(self, request: CompletionRequest, prompts: list[str | list[int]], max_tokens: int,
                                     model: str, raw_request: Request
                                     ) -> CompletionResponse | AsyncIterator[str] | None:
        """use_beam_search (entrypoints/openai/beam_search.py): n beams a prompt, each a choice, best first."""
        params = beam_params(request, max_tokens, ("logprobs", "echo"))
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_length(len(prompt), 1, "prompt", None)  # beam search takes no truncate_prompt_tokens
        request_id = random_id("cmpl")
        found = await run_beam_search(self, request, prompts, params, request_id, raw_request)
        if found is None:
            return None
        beams, usage = found
        choices = [completion_choice(out, index * params.beam_width + out.index)
                   for index, outs in enumerate(beams) for out in outs]
        response = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        return as_stream(response, include_usage(request)) if request.stream else response

    # -- /tokenize, /detokenize (vLLM's) -------------------------------------------------------

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """Any length, as vLLM's (a client counts a document's tokens against max_model_len):
        a long text goes to the long texts' lane (lanes.py), where it holds up no short one."""
        self.check_model(request.model)
        chat = isinstance(request, TokenizeChatRequest)
        lane = self.lane(sum(len(m.text()) for m in request.messages) if chat else len(request.prompt))

        def run() -> tuple[list[int], list[str] | None]:
            if chat:
                tokens = lane.chat.render(request, request.add_special_tokens)
            else:
                tokens = lane.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            return tokens, lane.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None

        try:
            if chat:
                self.chat.check(request)
            tokens, token_strs = await lane.run(run)
        except ChatError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Any length, as vLLM's; a long list (about four characters a token) in the long lane."""
        self.check_model(request.model)
        if error := vocabulary_error(request.tokens, self.vocab_size):
            raise APIError(400, error, param="tokens")
        lane = self.lane(4 * len(request.tokens))
        return DetokenizeResponse(prompt=await lane.run(lane.tokenizer.decode, request.tokens))


# -- helpers --------------------------------------------------------------------------------


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompt field as a list of prompts (strings or token-id lists)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return list(prompt)

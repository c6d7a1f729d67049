"""Engine outputs as OpenAI response bodies: choices, logprobs in the completions and chat
formats, vLLM's prompt_logprobs, usage counts, and /v1/completions' answers whole."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel

from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
    unix_time,
)
from nanovllm.outputs import CompletionOutput, Logprob
from nanovllm.serving.deltas import RequestDelta
from nanovllm.serving.messages import EngineRequest


DONE = "data: [DONE]\n\n"  # a stream's last event
# A response with at least this many logprob entries (a token's own and its alternatives',
# prompt logprobs included) is written as JSON off the event loop: 256 prompts'
# prompt_logprobs made bodies of hundreds of MB, and every other request waited meanwhile.
LARGE_RESPONSE_ENTRIES = 4096


async def json_body(response: BaseModel) -> str:
    """A whole (not streamed) response as JSON text; a large one is written by a worker
    thread a choice at a time: pydantic holds the interpreter lock while it writes one,
    and the event loop takes its turns between them."""
    if logprob_entries(response) < LARGE_RESPONSE_ENTRIES:
        return response.model_dump_json()
    return await asyncio.to_thread(_choice_by_choice, response)


def _choice_by_choice(response: BaseModel) -> str:
    """response's JSON (its fields, then `choices`), each choice written on its own."""
    head = response.model_dump_json(exclude={"choices"})
    choices = ",".join(choice.model_dump_json() for choice in response.choices)
    return f'{head[:-1]},"choices":[{choices}]}}'


def logprob_entries(response: BaseModel) -> int:
    """The logprob entries a response carries over its choices: prompt logprobs' and the
    completions' (either format), each token's own and its alternatives'."""
    count = 0
    for choice in getattr(response, "choices", ()):
        count += sum(len(entry) for entry in getattr(choice, "prompt_logprobs", None) or () if entry)
        logprobs = getattr(choice, "logprobs", None)
        if isinstance(logprobs, CompletionLogProbs):
            count += len(logprobs.tokens) + sum(len(top) for top in logprobs.top_logprobs or () if top)
        elif isinstance(logprobs, ChatCompletionLogProbs):
            count += sum(1 + len(token.top_logprobs) for token in logprobs.content or ())
    return count


def sse(body: BaseModel | str) -> str:
    """A server-sent event of a response body (a str is one already written as an event)."""
    return body if isinstance(body, str) else f"data: {body.model_dump_json()}\n\n"


def completion_event_head(request_id: str, created: int, model: str) -> str:
    """What every text_completion_event of one stream starts with."""
    return (f'data: {{"id":{json.dumps(request_id, ensure_ascii=False)},"created":{created},'
            f'"model":{json.dumps(model, ensure_ascii=False)},"object":"text_completion","choices":[')


def text_completion_event(head: str, index: int, out: CompletionOutput) -> str:
    """sse(CompletionStreamResponse(...)) of a one-choice chunk without logprobs, written by hand:
    the same text (keys in the models' order; tests check) at a fraction of pydantic's cost,
    which counts when the event loop writes tens of thousands of chunks a second
    (benchmarks/RESULTS.md, serving)."""
    return (f'{head}{{"index":{index},"finish_reason":{json.dumps(out.finish_reason)},'
            f'"stop_reason":{json.dumps(out.stop_reason, ensure_ascii=False)},'
            f'"text":{json.dumps(out.text, ensure_ascii=False)},"logprobs":null}}],"usage":null}}\n\n')


def without_generation(out: CompletionOutput) -> CompletionOutput:
    """out with what was generated dropped: echo with max_tokens 0, which loglikelihood
    scorers send for a prompt's logprobs alone (one token is generated, as vLLM does)."""
    return CompletionOutput(out.index, "", [], out.finish_reason and "length", None,
                            None if out.logprobs is None else [])


def include_usage(request: SamplingRequest) -> bool:
    return request.stream_options is not None and request.stream_options.include_usage


class UsageCounter:
    """A response's usage, counted as its outputs arrive: the prompts' tokens (after any
    truncation), each output's generated tokens, and with --enable-prompt-tokens-details the
    prompt tokens the prefix cache held (each request's first delta says)."""

    def __init__(self, prompt_tokens: int, request: SamplingRequest, cache_details: bool):
        self.usage = UsageInfo(prompt_tokens=prompt_tokens)
        self.request = request
        self.cache_details = cache_details

    def add_prompt(self, tokens: int) -> None:
        """Count prompt tokens known only once the prompts are made (beam search's first round)."""
        self.usage.prompt_tokens += tokens

    def add_cached(self, delta: RequestDelta) -> None:
        """With --enable-prompt-tokens-details, count the prompt tokens the prefix cache held
        for delta's request (its first delta says)."""
        if self.cache_details and delta.num_cached_tokens is not None:
            details = self.usage.prompt_tokens_details
            held = details.cached_tokens if details is not None else 0
            self.usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=held + delta.num_cached_tokens)

    def add_generated(self, out: CompletionOutput) -> None:
        """Count out's generated tokens."""
        self.usage.completion_tokens += len(out.token_ids)

    def add(self, delta: RequestDelta) -> None:
        """Count a delta whole: its cached prompt tokens and its outputs' tokens."""
        self.add_cached(delta)
        for out in delta.outputs:
            self.add_generated(out)

    def so_far(self) -> UsageInfo | None:
        """The counts so far, for a stream's chunk where the request asks for them (vLLM's
        continuous_usage_stats, with include_usage), else None."""
        if include_usage(self.request) and self.request.stream_options.continuous_usage_stats:
            return self._with_total(self.usage.model_copy())
        return None

    def final(self) -> UsageInfo:
        """The counts, with their total: a response's usage."""
        return self._with_total(self.usage)

    @staticmethod
    def _with_total(usage: UsageInfo) -> UsageInfo:
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return usage


@dataclass(slots=True)
class Echo:
    """A prompt echoed in front of each of its choices (the completions endpoint's echo)."""

    text: str
    logprobs: CompletionLogProbs | None = None  # the prompt tokens', when logprobs are asked for

    @property
    def end_offset(self) -> int:
        """Where the completion's first token's text_offset goes on from: after the echoed
        tokens' texts (which need not add up to the prompt: a BOS token, partial characters)."""
        return next_offset(self.logprobs, len(self.text))


def next_offset(logprobs: CompletionLogProbs | None, otherwise: int) -> int:
    """The text_offset after logprobs' last token (its offset plus its text), or `otherwise`
    when they hold no token."""
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1]) if logprobs is not None and logprobs.tokens \
        else otherwise


def echo_of(text: str, token_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None] | None,
            first_token_text: str) -> Echo:
    """The prompt (text, token ids, their logprobs if computed; its first token's text, which no
    logprob entry holds) as echoed."""
    return Echo(text, completion_logprobs(prompt_logprobs, token_ids, unscored_text=first_token_text))


def completion_choice(out: CompletionOutput, index: int, text_offset: int = 0, echo: Echo | None = None,
                      prompt_logprobs: list[dict[int, Logprob] | None] | None = None) -> CompletionResponseChoice:
    """A choice (or a stream's piece of one, whose tokens' text_offset goes on from
    text_offset), after `echo` when given."""
    text = out.text if echo is None else echo.text + out.text
    logprobs = completion_logprobs(out.logprobs, out.token_ids, text_offset + (echo.end_offset if echo else 0))
    if echo is not None and echo.logprobs is not None and logprobs is not None:
        logprobs = CompletionLogProbs(**{name: getattr(echo.logprobs, name) + getattr(logprobs, name)
                                         for name in CompletionLogProbs.model_fields})
    return CompletionResponseChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                    stop_reason=out.stop_reason, prompt_logprobs=prompt_logprobs_body(prompt_logprobs))


class CompletionAnswer:
    """A /v1/completions request's answer, made from its engine requests' outputs: a stream's
    chunks or one response. With echo, each prompt's choices start with it (echo_only: with
    nothing generated after it)."""

    def __init__(self, request: CompletionRequest, prompts: list[str | list[int]], requests: list[EngineRequest],
                 request_id: str, model: str, n: int, echo_only: bool, usage: UsageCounter, tokenizer):
        self.request, self.prompts, self.requests, self.request_id = request, prompts, requests, request_id
        self.model, self.n, self.echo_only, self.usage, self.tokenizer = model, n, echo_only, usage, tokenizer
        self.echoes: list[Echo | None] = [None] * len(requests)  # per prompt, once its prompt logprobs are in
        # A stream's: when it began, what its hand-written events start with, and per choice
        # where its next token's text_offset goes on from.
        self.created = unix_time()
        self.head = completion_event_head(request_id, self.created, model)
        self.text_lengths: dict[int, int] = {}

    def echo(self, delta: RequestDelta) -> Echo | None:
        """The echo of delta's prompt (None without echo), made from its first delta."""
        if self.request.echo and self.echoes[delta.index] is None:
            engine_request = self.requests[delta.index]
            self.echoes[delta.index] = echo_of(self.prompt_text(delta.index), engine_request.prompt_token_ids,
                                               delta.prompt_logprobs,
                                               self.tokenizer.decode(engine_request.prompt_token_ids[:1]))
        return self.echoes[delta.index]

    def prompt_text(self, index: int) -> str:
        """A prompt's text as echoed: as given, or decoded from its token ids (those it was
        truncated to, if it was)."""
        prompt, request = self.prompts[index], self.requests[index]
        if isinstance(prompt, str) and request.params.truncate_prompt_tokens is None:
            return prompt
        return self.tokenizer.decode(request.prompt_token_ids)

    def chunks(self, deltas: list[RequestDelta]) -> Iterator[BaseModel | str]:
        """A stream step's chunks: a piece of one choice each."""
        usage, text_lengths, n, echo_only = self.usage, self.text_lengths, self.n, self.echo_only
        for delta in deltas:
            usage.add_cached(delta)
            prompt = self.echo(delta)
            for out in delta.outputs:
                out = without_generation(out) if echo_only else out
                usage.add_generated(out)
                index = delta.index * n + out.index
                counts = usage.so_far()
                echoed = prompt if index not in text_lengths else None  # a choice's first piece
                if out.logprobs is None and counts is None and echoed is None:
                    text_lengths[index] = 0
                    yield text_completion_event(self.head, index, out)
                    continue
                choice = completion_choice(out, index, text_lengths.get(index, 0), echoed)
                text_lengths[index] = next_offset(choice.logprobs, text_lengths.get(index, 0))
                yield CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                               choices=[choice], usage=counts)

    def usage_chunk(self) -> BaseModel:
        """A stream's last chunk (stream_options.include_usage): the usage alone."""
        return CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model, choices=[],
                                        usage=self.usage.final())

    def response(self, finals: list[RequestDelta]) -> CompletionResponse:
        """The whole answer, from each prompt's final delta."""
        if self.echo_only:
            for delta in finals:
                delta.outputs = [without_generation(out) for out in delta.outputs]
        choices = [completion_choice(out, delta.index * self.n + out.index, echo=self.echo(delta),
                                     prompt_logprobs=delta.prompt_logprobs)
                   for delta in finals for out in delta.outputs]
        for delta in finals:
            self.usage.add(delta)
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=self.usage.final())


def prompt_logprobs_body(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs field: per prompt token None (the first) or {token id: its logprob,
    rank and text}, the prompt token's own and its alternatives'."""
    if entries is None:
        return None
    return [None if entry is None else {
        token_id: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token_id, lp in entry.items()} for entry in entries]


def completion_logprobs(logprobs: list[dict[int, Logprob] | None] | None, token_ids: list[int],
                        offset: int = 0, unscored_text: str = "") -> CompletionLogProbs | None:
    """The legacy completions format: per token its text, logprob, its alternatives
    {text: logprob} (itself included, as in vLLM; tokens with the same text, such as
    partial UTF-8 bytes, share an entry) and its character offset in the text (the
    first token's is `offset`). An entry None (an echoed prompt's first token, which
    nothing predicts) has unscored_text, a null logprob and null alternatives."""
    if logprobs is None:
        return None
    result = CompletionLogProbs()
    for token_id, entry in zip(token_ids, logprobs):
        if entry is None:
            token_text, logprob, top = unscored_text, None, None
        else:
            chosen = entry[token_id]
            token_text, logprob, top = chosen.decoded_token, chosen.logprob, {}
            for lp in entry.values():  # the chosen token first, then by rank; the first of equal texts wins
                top.setdefault(lp.decoded_token, lp.logprob)
        result.tokens.append(token_text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token_text)
    return result


def _chat_logprob(lp: Logprob) -> ChatCompletionLogProb:
    return ChatCompletionLogProb(token=lp.decoded_token, logprob=lp.logprob,
                                 bytes=list(lp.decoded_token.encode("utf-8", errors="replace")))


def chat_logprobs(logprobs: list[dict[int, Logprob]] | None, token_ids: list[int],
                  top: int | None) -> ChatCompletionLogProbs | None:
    """The chat format: per token its logprob and the `top` most likely alternatives, by rank."""
    if logprobs is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = _chat_logprob(entry[token_id])
        alternatives = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)
        content.append(ChatCompletionLogProbsContent(**chosen.model_dump(),
                                                     top_logprobs=[_chat_logprob(lp) for lp in alternatives]))
    return ChatCompletionLogProbs(content=content)

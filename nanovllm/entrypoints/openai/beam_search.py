"""vLLM's use_beam_search on /v1/completions and /v1/chat/completions: n beams a prompt
(nanovllm/beam_search.py's search, each round's requests through the engine), best first,
answered whole (streamed, as_stream: each choice in one piece once the search ends, as
vLLM streams it). Beam search honours n, max_tokens, temperature (0 unless given),
ignore_eos, length_penalty, include_stop_str_in_output and skip_special_tokens; a request
that also sets a field it would ignore (top_p, stop, logprobs, truncation, ...) gets a 400
naming it, unless the value changes nothing (top_p 1, say). Beams end at the context's end
(max_model_len, or the KV cache where that is less) with finish_reason "length"."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from nanovllm.beam_search import BeamSearch, BeamSearchParams
from nanovllm.entrypoints.openai.errors import APIError
from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    SamplingRequest,
    UsageInfo,
)
from nanovllm.entrypoints.openai.responses import DONE, UsageCounter, sse
from nanovllm.outputs import CompletionOutput

# Sampling fields beam search does not honour, on either endpoint (seed: the draws of
# temperature > 0 are not seeded; at temperature 0 there are none).
IGNORED = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
           "min_tokens", "stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs",
           "truncate_prompt_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar")


# Values of those fields that change nothing (SamplingParams' defaults, and vLLM's -1 for
# top_k), which a client that always sends its settings may give with beam search too.
NEUTRAL = {"top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,),
           "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "min_tokens": (0,), "top_logprobs": (0,)}


def _bad_value(exc: ValueError, request: SamplingRequest) -> APIError:
    """A 400 from BeamSearchParams' or BeamSearch's ValueError, whose beam_width is the request's n."""
    return APIError.bad_value(ValueError(str(exc).replace("beam_width", "n", 1)), request)


def beam_params(request: SamplingRequest, max_tokens: int, also_ignored: tuple[str, ...]) -> BeamSearchParams:
    """The request's beam search (request.n beams), or a 400 for a field it would ignore."""
    for name in (*IGNORED, *also_ignored):
        value = getattr(request, name, None)
        unset = value is None or value is False or value == [] or value == {}  # not 0, which == False
        # Nothing to seed: no draws (temperature 0), or no seed asked for (-1, vLLM's "none").
        neutral = value in NEUTRAL.get(name, ()) or (name == "seed" and (not request.temperature or value == -1))
        if not unset and not neutral:
            raise APIError(400, f"{name} does not go with use_beam_search", param=name)
    try:
        return BeamSearchParams(beam_width=1 if request.n is None else request.n, max_tokens=max_tokens,
                                ignore_eos=bool(request.ignore_eos), temperature=request.temperature or 0.0,
                                length_penalty=request.length_penalty,
                                include_stop_str_in_output=bool(request.include_stop_str_in_output))
    except ValueError as exc:
        raise _bad_value(exc, request) from None


async def run_beam_search(serving: Any, request: SamplingRequest, prompts: list[str | list[int]],
                          params: BeamSearchParams, request_id: str, raw_request: Request
                          ) -> tuple[list[list[CompletionOutput]], UsageInfo] | None:
    """Each prompt's beams as completions (index: the beam's rank) and the usage, the
    rounds run through serving (an OpenAIServing); None if the client left (what runs is
    aborted)."""
    engine = serving.engine
    try:
        search = BeamSearch(prompts, params, engine.eos_token_ids, engine.config.max_logprobs,
                            engine.checker.most_tokens)
    except ValueError as exc:
        raise _bad_value(exc, request) from None
    round_, usage = 0, UsageCounter(0, request, serving.options.enable_prompt_tokens_details)
    while asks := search.asks():
        requests = await serving.make_requests(request, asks, search.step_params, f"{request_id}-{round_}", stream=False)
        finals = await serving.final_outputs(requests, raw_request)
        if finals is None:
            return None
        if round_ == 0:  # the prompts themselves
            usage.add_prompt(sum(len(r.prompt_token_ids) for r in requests))
            for delta in finals:
                usage.add_cached(delta)
        search.take([(r.prompt_token_ids, d.outputs[0].logprobs[0]) for r, d in zip(requests, finals)])
        round_ += 1
    keep_special = request.skip_special_tokens is False  # skipped unless asked to keep, as the other answers do

    def decode(token_ids: list[int]) -> str:
        return serving.tokenizer.decode(token_ids, skip_special_tokens=not keep_special)

    beams = [[CompletionOutput(rank, beam.text, beam.tokens[len(beam.tokens) - len(beam.logprobs):],
                               beam.finish_reason, cumulative_logprob=beam.cum_logprob)
              for rank, beam in enumerate(result.sequences)] for result in search.results(decode, whole=False)]
    for outs in beams:
        for out in outs:
            usage.add_generated(out)
    return beams, usage.final()


async def as_stream(response: CompletionResponse | ChatCompletionResponse, usage: bool) -> AsyncIterator[str]:
    """A finished search's answer as server-sent events: each choice whole in one chunk
    (chat's role in one before it), the usage where asked, then [DONE]."""
    head = dict(id=response.id, created=response.created, model=response.model)
    chat = isinstance(response, ChatCompletionResponse)
    for choice in response.choices:
        if chat:
            role = DeltaMessage(role=choice.message.role, content="")
            yield sse(ChatCompletionStreamResponse(**head, choices=[
                ChatCompletionResponseStreamChoice(index=choice.index, delta=role)]))
            whole = DeltaMessage(content=choice.message.content, reasoning=choice.message.reasoning)
            yield sse(ChatCompletionStreamResponse(**head, choices=[ChatCompletionResponseStreamChoice(
                index=choice.index, delta=whole, finish_reason=choice.finish_reason)]))
        else:
            yield sse(CompletionStreamResponse(**head, choices=[CompletionResponseStreamChoice(
                index=choice.index, text=choice.text, finish_reason=choice.finish_reason)]))
    if usage:
        yield sse((ChatCompletionStreamResponse if chat else CompletionStreamResponse)(**head, choices=[],
                                                                                         usage=response.usage))
    yield DONE

"""/v1/chat/completions: messages through the chat template, and the model's text back as
OpenAI's message, with its reasoning (--reasoning-parser) and tool calls (tools and
tool_choice; tool_calls.py) taken apart from the content, streamed or not."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from pydantic import BaseModel

from nanovllm.engine.reasoning import ReasoningStream, ReasoningTags
from nanovllm.entrypoints.openai.beam_search import as_stream, beam_params, run_beam_search
from nanovllm.entrypoints.openai.chat import ChatError, generation_prompt
from nanovllm.entrypoints.openai.limits import ResponseOptions, ServerLimits
from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    UsageInfo,
    random_id,
    unix_time,
)
from nanovllm.entrypoints.openai.responses import UsageCounter, chat_logprobs, include_usage, prompt_logprobs_body, \
    sse
from nanovllm.entrypoints.openai.errors import APIError
from nanovllm.entrypoints.openai.serving import OpenAIServing
from nanovllm.entrypoints.openai.tool_calls import NAMED, NONE, ToolCallStream, ToolChoiceError, ToolMode, called, \
    resolve_tool_mode
from nanovllm.serving.deltas import RequestDelta
from nanovllm.serving.engine_client import EngineClient
from nanovllm.serving.messages import EngineRequest


def checked_max_tokens(request: ChatCompletionRequest) -> int | None:
    """The request's token limit (max_completion_tokens, else the older max_tokens; None: up
    to the context's end, which the request check fits to the prompt), once its logprobs
    fields and the limit itself are valid."""
    if request.top_logprobs is not None and request.top_logprobs < -1:
        raise APIError(400, f"top_logprobs must be an integer >= 0, or -1 for the whole vocabulary; got "
                       f"{request.top_logprobs}", param="top_logprobs")
    if request.top_logprobs and not request.logprobs:  # 0 asks for nothing, as vLLM reads it
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if max_tokens is not None and max_tokens < 1:
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{field} must be an integer >= 1 or null (up to the context's end), got {max_tokens}",
                       param=field)
    return max_tokens


class ChoiceStream:
    """One choice's text, as it grows, split into reasoning, content and tool calls."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None):
        self.reasoning = reasoning
        self.tools = tools
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """(reasoning, content, tool-call pieces) that `text` adds; finished: it is the last."""
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if finished and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.flush()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.feed(content)
        pieces = [self._piece(call) for call in calls]
        if self.tools.argument_delta:  # a named function's arguments, piece by piece
            pieces.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=self.tools.argument_delta)))
            self.tools.argument_delta = ""
        if finished:
            more_content, calls = self.tools.flush()
            content += more_content
            pieces += [self._piece(call) for call in calls]
        return reasoning, content, pieces

    def message(self, text: str, role: str) -> ChatCompletionMessage:
        """The whole output as one message."""
        reasoning, content, pieces = self.feed(text, finished=True)
        calls = [ToolCall(id=p.id, function={"name": p.function.name, "arguments": p.function.arguments})
                 for p in pieces]
        if not content and (calls or reasoning or self.tools is not None and self.tools.mode.kind == NAMED):
            content = None
        return ChatCompletionMessage(role=role, content=content, reasoning=reasoning or None, tool_calls=calls)

    def _piece(self, call: dict) -> DeltaToolCall:
        self.num_calls += 1
        function = call["function"]
        return DeltaToolCall(index=self.num_calls - 1, id=call["id"], type="function",
                             function=DeltaFunctionCall(name=function["name"], arguments=function["arguments"]))


class ChatAnswer:
    """A chat completion's answer, made from its engine request's outputs: a stream's chunks
    or one response, each choice's text taken apart by its ChoiceStream (streams; None: the
    text goes out as it is)."""

    def __init__(self, request: ChatCompletionRequest, request_id: str, model: str, role: str, mode: ToolMode,
                 streams: list[ChoiceStream] | None, top: int | None, usage: UsageCounter):
        self.request, self.request_id, self.model, self.role = request, request_id, model, role
        self.mode, self.streams, self.top, self.usage = mode, streams, top, usage
        self.created = unix_time()  # for a stream's chunks

    def chunk(self, choices: list[ChatCompletionResponseStreamChoice],
              usage_info: UsageInfo | None = None) -> ChatCompletionStreamResponse:
        """A stream's chunk of these choices' pieces."""
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                            usage=usage_info)

    def role_chunk(self, index: int) -> ChatCompletionStreamResponse:
        """A stream's first chunk of choice `index`: its role."""
        return self.chunk([ChatCompletionResponseStreamChoice(
            index=index, delta=DeltaMessage(role=self.role, content=""))], self.usage.so_far())

    def chunks(self, deltas: list[RequestDelta]) -> Iterator[BaseModel]:
        """A stream step's chunks: a piece of one choice each."""
        usage, streams, mode, top = self.usage, self.streams, self.mode, self.top
        for delta in deltas:
            usage.add_cached(delta)
            for out in delta.outputs:
                usage.add_generated(out)
                logprobs = chat_logprobs(out.logprobs, out.token_ids, top)
                finish_reason = out.finish_reason
                if streams is None:
                    message = DeltaMessage(content=out.text)
                else:
                    stream = streams[out.index]
                    reasoning, content, calls = stream.feed(out.text, finish_reason is not None)
                    if not (reasoning or content or calls or finish_reason or logprobs):
                        continue
                    message = DeltaMessage(content=content or None, reasoning=reasoning or None,
                                           tool_calls=calls or None)
                    finish_reason = called(mode, stream.num_calls, finish_reason)
                yield self.chunk([ChatCompletionResponseStreamChoice(
                    index=out.index, delta=message, logprobs=logprobs, finish_reason=finish_reason,
                    stop_reason=out.stop_reason)], usage.so_far())

    def usage_chunk(self) -> BaseModel:
        """A stream's last chunk (stream_options.include_usage): the usage alone."""
        return self.chunk([], self.usage.final())

    def response(self, final: RequestDelta) -> ChatCompletionResponse:
        """The whole answer, from the request's final delta."""
        choices = []
        for out in final.outputs:
            message = ChatCompletionMessage(role=self.role, content=out.text) if self.streams is None \
                else self.streams[out.index].message(out.text, self.role)
            choices.append(ChatCompletionResponseChoice(
                index=out.index, message=message, logprobs=chat_logprobs(out.logprobs, out.token_ids, self.top),
                finish_reason=called(self.mode, len(message.tool_calls), out.finish_reason),
                stop_reason=out.stop_reason))
        self.usage.add(final)
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=self.usage.final(),
                                      prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs))


class ChatServing(OpenAIServing):
    """OpenAIServing with /v1/chat/completions."""

    def __init__(self, engine: EngineClient, served_model_names: list[str], limits: ServerLimits,
                 options: ResponseOptions = ResponseOptions()):
        super().__init__(engine, served_model_names, limits, options)
        parser = engine.config.reasoning_parser
        self.reasoning = ReasoningTags.load(parser, self.tokenizer) if parser else None

    def choice_streams(self, mode: ToolMode, prompt: list[int], n: int) -> list[ChoiceStream] | None:
        """A ChoiceStream per choice; None when the text goes out as it is."""
        if self.reasoning is None and mode.kind == NONE:
            return None
        state = self.reasoning.state_after(prompt) if self.reasoning is not None else None
        return [ChoiceStream(ReasoningStream(self.reasoning, state) if self.reasoning is not None else None,
                             ToolCallStream(mode) if mode.kind != NONE else None) for _ in range(n)]

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        """A ChatCompletionResponse, or an iterator of server-sent events for stream=true."""
        model = self.check(request)
        max_tokens = self.capped_max_tokens(checked_max_tokens(request))
        mode, prompt = await self._render(request, max_tokens)
        # vLLM's: the answer to a generation prompt takes --response-role; one that goes on
        # with the last message, that message's role
        role = self.options.response_role if generation_prompt(request) else request.messages[-1].role
        if request.use_beam_search:
            return await self.beam_search_chat(request, prompt, max_tokens, model, role, raw_request)
        params = self.sampling_params(request, max_tokens, (request.top_logprobs or 0) if request.logprobs else None,
                                      mode.structured_outputs())
        request_id = random_id("chatcmpl")
        requests = await self.make_requests(request, [prompt], params, request_id, raw_request=raw_request)
        if requests is None:
            return None
        usage = UsageCounter(len(requests[0].prompt_token_ids), request, self.options.enable_prompt_tokens_details)
        answer = ChatAnswer(request, request_id, model, role, mode, self.choice_streams(mode, prompt, params.n),
                            requests[0].params.logprobs, usage)  # as checked: -1 is the vocabulary's size
        if request.stream:
            return self._stream_answer(answer, requests, params.n)
        finals = await self.final_outputs(requests, raw_request)
        return None if finals is None else answer.response(finals[0])

    async def _render(self, request: ChatCompletionRequest, max_tokens: int | None) -> tuple[ToolMode, list[int]]:
        """The request's tool mode and its messages rendered to prompt tokens, both checked."""
        try:
            mode = resolve_tool_mode([t.model_dump() for t in request.tools or []],
                                     request.tool_choice if not isinstance(request.tool_choice, BaseModel)
                                     else request.tool_choice.model_dump(), request.parallel_tool_calls,
                                     self.options.enable_auto_tool_choice)
            self.chat.check(request)
            # The rendered prompt holds at least the messages' texts.
            num_chars = sum(len(m.text()) for m in request.messages)
            self.check_length(num_chars, max_tokens or 1, "messages", request.truncate_prompt_tokens,
                              request.field_name("max_tokens"))
            lane = self.lane(num_chars)
            return mode, await lane.run(lane.chat.render, request)
        except (ChatError, ToolChoiceError) as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    async def _stream_answer(self, answer: ChatAnswer, requests: list[EngineRequest], n: int) -> AsyncIterator[str]:
        """stream=true's server-sent events: first each choice's role (with the prompt's usage,
        as vLLM's), then the choices' pieces."""
        for index in range(n):
            yield sse(answer.role_chunk(index))
        async for event in self.stream_events(requests, answer.chunks,
                                              answer.usage_chunk if include_usage(answer.request) else None):
            yield event

    async def beam_search_chat(self, request: ChatCompletionRequest, prompt: list[int], max_tokens: int | None,
                               model: str, role: str, raw_request: Request
                               ) -> ChatCompletionResponse | AsyncIterator[str] | None:
        """use_beam_search (entrypoints/openai/beam_search.py): n beams, each a choice, best first."""
        room = self.engine.checker.most_tokens - len(prompt)
        if max_tokens is None and room < 1:
            raise APIError(400, f"messages ({len(prompt)} tokens) leave no room for an answer in max_model_len "
                                f"({self.max_model_len}) or the KV cache", param="messages")
        params = beam_params(request, max_tokens or room, ("logprobs", "top_logprobs", "tools"))
        request_id = random_id("chatcmpl")
        found = await run_beam_search(self, request, [prompt], params, request_id, raw_request)
        if found is None:
            return None
        [beams], usage = found
        streams = self.choice_streams(ToolMode(NONE), prompt, len(beams))
        choices = [ChatCompletionResponseChoice(
            index=out.index, finish_reason=out.finish_reason,
            message=ChatCompletionMessage(role=role, content=out.text) if streams is None
            else streams[out.index].message(out.text, role)) for out in beams]
        response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        return as_stream(response, include_usage(request)) if request.stream else response

"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Field names and meanings follow OpenAI's API reference, plus vLLM's sampling extras
(top_k, min_p, repetition_penalty, ignore_eos, ...). Requests are parsed in strict
mode: a mistyped field ("max_tokens": "10", "stream": 1) is an error, not a guess; a
field sent as null takes its default (NullIsUnset).
Ranges (max_tokens >= 1, temperature >= 0, ...) are checked once, by SamplingParams.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, SkipValidation, Tag, computed_field, model_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def unix_time() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (extra="allow") so that unsupported_field() can name them.
    model_config = ConfigDict(strict=True, extra="allow")


class NullIsUnset(OpenAIBaseModel):
    """A request whose fields sent as null take their defaults ("stream": null is false), as
    vLLM's optional fields do: clients send null for what they leave unset.
    Only the models with defaults other than None need it (it costs pydantic's fast path)."""

    @model_validator(mode="before")
    @classmethod
    def null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            return {name: value for name, value in data.items()
                    if value is not None or name not in fields or fields[name].is_required()}
        return data


# Fields that would change the output in ways this server does not implement, with the
# values that change nothing: a request that sets one to anything else gets a 400 naming
# it, instead of a silently different answer.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "echo": (None, False), "best_of": (None, 1),
    "tools": (None, []), "functions": (None, []), "function_call": (None, "none"), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True), "reasoning_effort": (None,),
    "return_tokens_as_token_ids": (None, False), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "logits_processors": (None, []), "vllm_xargs": (None, {}),
    "guided_whitespace_pattern": (None,), "guided_decoding_backend": (None,),
    "spaces_between_special_tokens": (None, True),
}
# Fields of OpenAI's API, or vLLM's, that change nothing here: accepted without a warning.
KNOWN_NEUTRAL = frozenset({"metadata", "store", "service_tier", "request_id", "cache_salt",
                           "kv_transfer_params", "mm_processor_kwargs"})


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
    owned_by: str = "nanovllm"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None  # ours, not OpenAI's: token-id prompts must stay below it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StreamOptions(NullIsUnset):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the counts so far


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache held


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details


class ResponseBase(BaseModel):
    """What every response body and stream chunk of both endpoints starts with."""

    id: str
    created: int = Field(default_factory=unix_time)
    model: str


class ChoiceBase(BaseModel):
    index: int
    finish_reason: str | None = None  # "stop", "length", "tool_calls", or "abort" (ended by a shutdown)
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's structured_outputs field: exactly one of these."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class SamplingRequest(NullIsUnset):
    """The sampling fields that completions and chat share (vLLM's extras included);
    None leaves SamplingParams' default, which matches OpenAI's."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many alternatives (not streamed)
    priority: int = 0  # lower first, under --scheduling-policy priority (else only 0)
    use_beam_search: bool = False  # n beams a prompt instead of n samples (entrypoints/openai/beam_search.py)
    length_penalty: float = Field(1.0, allow_inf_nan=False)  # beam search's (a finite number even without it)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields (one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def field_name(self, engine_name: str) -> str:
        """The field of this request that sets the engine's parameter engine_name (its
        errors name it: APIError.bad_value)."""
        return engine_name

    def unsupported_field(self) -> str | None:
        """The first field set that this server cannot honour, if any."""
        extra = self.model_extra or {}
        return next((name for name, neutral in NOT_IMPLEMENTED.items()
                     if name in extra and not any(type(extra[name]) is type(value) and extra[name] == value
                                                  for value in neutral)), None)  # true is no 1, nor 1.0

    def unsupported_message(self, name: str) -> str:
        """Why field `name` (unsupported_field) is refused: the endpoint, and the other one if that takes it."""
        endpoints = {CompletionRequest: "/v1/completions", ChatCompletionRequest: "/v1/chat/completions"}
        other = next((path for cls, path in endpoints.items() if cls is not type(self) and name in cls.model_fields),
                     None)
        return f"`{name}` is not supported on {endpoints[type(self)]}" + (f"; {other} takes it" if other else "")

    def ignored_fields(self) -> list[str]:
        """Fields this server does not know (typos, most likely), which it ignores: the
        request's own, and those inside stream_options and response_format ("stream_options.x")."""
        names = set(self.model_extra or ()) - NOT_IMPLEMENTED.keys() - KNOWN_NEUTRAL
        for field in ("stream_options", "response_format"):
            names |= {f"{field}.{name}" for name in _unknown_keys(getattr(self, field))}
        return sorted(names)


def _unknown_keys(model: BaseModel | None) -> list[str]:
    """The keys of a nested object that its model does not know, and of the objects inside it."""
    if model is None:
        return []
    names = list(model.model_extra or ())
    for field in type(model).model_fields:
        if isinstance(value := getattr(model, field), BaseModel):
            names += [f"{field}.{name}" for name in _unknown_keys(value)]
    return names


# -- /v1/completions --------------------------------------------------------------------


def _prompt_form(value: Any) -> str | None:
    """Which of the prompt's forms a value is meant as, from its type and its first item."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"


# A completion's prompt: a string, a list of token ids, a list of strings, or a list of
# token-id lists. The form is told from the value (_prompt_form) and only it is validated:
# pydantic's default "smart" union validates a long token-id list against every form, the
# bulk of a request's validation (benchmarks/RESULTS.md, session 17), and a bad item gets
# its own form's error alone. The tags read as types, which error locations leave out.
CompletionPrompt = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[int], Tag("list[int]")] | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[list[int]], Tag("list[list[int]]")],
    Discriminator(_prompt_form, custom_error_type="prompt_form", custom_error_message=(
        "a prompt is a string, a list of token ids, a list of strings, or a list of token-id lists"))]


class CompletionRequest(SamplingRequest):
    prompt: CompletionPrompt
    max_tokens: int = 16  # OpenAI's default, and what null means (as vLLM's)
    logprobs: int | None = None
    echo: bool = False  # the text (and with logprobs, the logprobs) starts with the prompt's


class CompletionLogProbs(BaseModel):
    """Per token; an echoed prompt's first token has no logprob and no alternatives (null)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# vLLM's prompt_logprobs: per prompt token null (the first) or {token id (a string, as JSON's
# keys are): {"logprob", "rank", "decoded_token"}} for it and its alternatives. Built as plain
# dicts and not validated (responses.py): a long prompt's are hundreds of thousands of them.
PromptLogprobs = SkipValidation[list[dict[int, dict[str, Any]] | None] | None]


class CompletionResponseStreamChoice(ChoiceBase):
    text: str
    logprobs: CompletionLogProbs | None = None


class CompletionResponseChoice(CompletionResponseStreamChoice):
    prompt_logprobs: PromptLogprobs = None  # vLLM's


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseBase):
    """Each chunk of a stream (OpenAI's shape: a response's, its choices' pieces)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None  # include_usage: the last chunk's (continuous_usage_stats: every chunk's)


# -- /v1/chat/completions ---------------------------------------------------------------


class ContentPart(OpenAIBaseModel):
    """A part of a message's content; only text parts are served (ChatRenderer.check)."""

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's: the call it answers
    reasoning: str | None = None  # an assistant turn's reasoning, for templates that show it
    reasoning_content: str | None = None  # its older name (vLLM takes both)

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)  # a call must say which function it is
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # arguments are always checked against parameters when decoding is constrained


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's: end the prompt with the assistant's turn
    continue_final_message: bool = False  # vLLM's: the reply continues the last (assistant) message
    chat_template: str | None = None  # vLLM's: a template of the request's own (needs the server's consent)
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template

    def field_name(self, engine_name: str) -> str:
        """Chat's logprobs is a switch and its top_logprobs the engine's logprobs; its token
        limit is max_completion_tokens where that is given."""
        if engine_name == "logprobs":
            return "top_logprobs"
        if engine_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return engine_name


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class Reasoning(BaseModel):
    """With --reasoning-parser, the <think> part: `reasoning`, as vLLM names it, and under
    its older name `reasoning_content` too, for the clients that read that."""

    reasoning: str | None = None

    @computed_field
    @property
    def reasoning_content(self) -> str | None:
        return self.reasoning


class ChatCompletionMessage(Reasoning):
    role: str = "assistant"  # --response-role's (or the last message's, without a generation prompt)
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(ChoiceBase):
    message: ChatCompletionMessage
    logprobs: ChatCompletionLogProbs | None = None


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs = None  # vLLM's


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first carries its id, type and name; the
    arguments text comes in pieces to be joined."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(Reasoning):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(ChoiceBase):
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None


class ChatCompletionStreamResponse(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None  # include_usage: the last chunk's (continuous_usage_stats: every chunk's)

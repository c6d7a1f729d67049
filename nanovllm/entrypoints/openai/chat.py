"""Chat messages -> prompt token ids, through the tokenizer's chat template.

A template is a program (Jinja, run in transformers' sandbox): one from a request could
loop for as long as it likes in the server process, so requests may bring their own only
when the server was started with --trust-request-chat-template. chat_template_kwargs
passes plain values (strings, numbers, booleans, null) to the template as variables,
never apply_chat_template's own arguments.
"""
from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from nanovllm.entrypoints.openai.tokenize_protocol import TokenizeChatRequest
from nanovllm.inputs import render_arguments, render_chat


_PLAIN = (str, int, float, bool, type(None))


class ChatError(ValueError):
    """A conversation the template cannot render, or a template request the server refuses;
    `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ChatRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, trust_request_chat_template: bool,
                 default_template: str | None = None):
        self.tokenizer = tokenizer
        self.trust_request_chat_template = trust_request_chat_template
        self.default_template = default_template  # the server's --chat-template, over the tokenizer's own

    def check(self, request: ChatCompletionRequest | TokenizeChatRequest) -> None:
        """What can be refused before rendering anything (cheap: runs on the event loop)."""
        if not request.messages:
            raise ChatError("messages must hold at least one message", "messages")
        for i, message in enumerate(request.messages):
            for part in message.content if isinstance(message.content, list) else ():
                if part.type != "text":
                    raise ChatError(f"messages[{i}].content: this server takes text parts ({{'type': 'text', "
                                    f"'text': ...}}) only, got one of type {part.type!r}", "messages")
                if part.text is None:
                    raise ChatError(f"messages[{i}].content: a text part needs its `text`", "messages")
        if request.continue_final_message and generation_prompt(request):
            raise ChatError("continue_final_message continues the last message, so add_generation_prompt (which "
                            "starts a new one) cannot be true too", "continue_final_message")
        kwargs = request.chat_template_kwargs or {}
        own_template = request.chat_template is not None or "chat_template" in kwargs
        if own_template and not self.trust_request_chat_template:
            raise ChatError("this server does not run chat templates sent with a request (start it with "
                            "--trust-request-chat-template to allow them)", "chat_template")
        for key, value in kwargs.items():
            if key in render_arguments() - {"chat_template"}:
                raise ChatError(f"chat_template_kwargs may not set `{key}`", "chat_template_kwargs")
            if not isinstance(value, _PLAIN):
                raise ChatError(f"chat_template_kwargs.{key} must be a string, number, boolean or null",
                                "chat_template_kwargs")
        if not own_template and self.default_template is None and not self.tokenizer.chat_template:
            raise ChatError("this model's tokenizer has no chat template, so messages cannot be formatted: send a "
                            "prompt instead (/v1/completions, /tokenize), or give the server one (--chat-template)",
                            "messages")

    def render(self, request: ChatCompletionRequest | TokenizeChatRequest, add_special_tokens: bool = False) -> list[int]:
        """The messages rendered with the chat template, as token ids (the template writes
        any special tokens, BOS included, itself, unless add_special_tokens). Slow for long
        conversations: the server calls it off the event loop."""
        messages = [template_message(m) for m in request.messages]
        tools = getattr(request, "tools", None)
        kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        template = kwargs.pop("chat_template", None) or request.chat_template or self.default_template
        try:
            text, token_ids = render_chat(self.tokenizer, messages, template, generation_prompt(request),
                                          continue_final_message=request.continue_final_message, **kwargs)
            return self.tokenizer.encode(text) if add_special_tokens else token_ids
        except Exception as exc:  # the template rejected the conversation (jinja raise_exception, bad roles)
            raise ChatError(f"the chat template could not format these messages: {exc}", "messages") from None


def generation_prompt(request: ChatCompletionRequest | TokenizeChatRequest) -> bool:
    """add_generation_prompt, which is true unless the request sets it false, or sets
    continue_final_message without it (as vLLM's clients do)."""
    if "add_generation_prompt" in request.model_fields_set:
        return request.add_generation_prompt
    return not request.continue_final_message


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it. A call's arguments go as an object where they
    parse as one (Qwen's templates write them with tojson), else as the text they are."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    for name in ("name", "tool_call_id"):
        if getattr(message, name) is not None:
            rendered[name] = getattr(message, name)
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if reasoning is not None:  # as Qwen's templates read it
        rendered["reasoning_content"] = reasoning
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
            "name": call.function.name, "arguments": _as_object(call.function.arguments)}}
            for call in message.tool_calls]
    return rendered


def _as_object(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return arguments
    return value if isinstance(value, dict) else arguments

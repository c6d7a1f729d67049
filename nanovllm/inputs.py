"""vLLM's prompt forms, as LLM.generate takes them, and chat templates.

    "Hello"                                   text
    [5, 6, 7]                                 token ids
    {"prompt": "Hello"}                       TextPrompt
    {"prompt_token_ids": [5, 6, 7]}           TokensPrompt
    ["Hello", {"prompt_token_ids": [5]}]      a list of any of them, mixed

Anything else is a TypeError that names the item, never a silent reinterpretation.
"""
from __future__ import annotations

import functools
import inspect
import numbers
import os
import reprlib
from typing import Any, TypedDict

from nanovllm.utils import is_int


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt

_FORMS = "a string, a list of token ids, a TextPrompt {'prompt': ...} or a TokensPrompt {'prompt_token_ids': [...]}"


def parse_prompt(prompt: Any, where: str = "the prompt") -> str | list[int]:
    """One prompt as the engine takes it: its text or its token ids (checked further,
    against the vocabulary, when the request is made)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], (list, tuple)):
            return list(prompt["prompt_token_ids"])
        raise TypeError(f"{where} is a dict with keys {sorted(keys)}; a prompt dict holds exactly 'prompt' "
                        f"(a string) or 'prompt_token_ids' (a list of ints)")
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise TypeError(f"{where} is of type {type(prompt).__name__}; a prompt is {_FORMS}")


def parse_prompts(prompts: Any) -> list[str | list[int]]:
    """One prompt, or a list of prompts of any form, as a list of engine prompts. A list
    of ints is one prompt of token ids."""
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be {_FORMS}, or a list of them; got {type(prompts).__name__}")
    if prompts and all(map(is_int, prompts)):
        return [list(prompts)]
    if prompts and (is_int(prompts[0]) or isinstance(prompts[0], numbers.Integral)):  # one prompt of ids, most likely
        raise TypeError(not_all_ints(prompts))
    return [parse_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]


def not_all_ints(token_ids: list[Any]) -> str:
    """What is wrong with a prompt of token ids that holds something other than an int."""
    at, item = next((i, token) for i, token in enumerate(token_ids) if not is_int(token))
    hint = " (an array's ids as Python ints: .tolist())" if type(item).__module__ == "numpy" else ""
    return (f"a prompt of token ids must hold ints only; its item {at} is {type(item).__name__} "
            f"{reprlib.repr(item)}{hint}")


def load_chat_template(value: str | None) -> str | None:
    """A --chat-template flag's value as a template: the text of the file it names, or the
    value itself. A value without a `{` holds no Jinja tag, so it can only be a file's name,
    and a missing file is an error (ValueError, as vLLM's), not a template that renders its
    own name."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"chat_template must be a template or the name of a file holding one, got "
                        f"{type(value).__name__}")
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"no chat template file {value!r} (a template given inline holds Jinja tags)")
    return value


def chat_messages(conversation: Any, where: str = "the conversation") -> list[dict[str, Any]]:
    """A conversation as chat templates take it: a list of messages, each a dict with a
    string `role`, whose `content` (a string, None, or OpenAI's list of text parts) becomes
    one string (parts joined by newlines, as the server joins them); other keys stay."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise TypeError(f"{where} must be a non-empty list of {{'role', 'content'}} messages")
    messages = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TypeError(f"message {i} of {where} must be a dict with a string 'role', got {message!r:.80}")
        content = message.get("content")
        if "content" not in message:  # as an OpenAI message may (an assistant's tool calls alone): None
            message = {**message, "content": None}
        if isinstance(content, list):
            parts = [part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content]
            if any(kind != "text" or not isinstance(part.get("text"), str) for kind, part in zip(parts, content)):
                texts = [type(part.get("text")).__name__ for part in content if isinstance(part, dict)]
                raise TypeError(f"message {i} of {where}: content parts must be {{'type': 'text', 'text': a string}} "
                                f"(text only), got types {parts} with text of types {texts}")
            message = {**message, "content": "\n".join(part["text"] for part in content)}
        elif not isinstance(content, (str, type(None))):
            raise TypeError(f"message {i} of {where}: content must be a string or a list of text parts, "
                            f"got {type(content).__name__}")
        messages.append(message)
    return messages


def check_chat_template(tokenizer, chat_template: str | None) -> None:
    """ValueError where there is no template to render a conversation with."""
    if chat_template is None and not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; give one (chat_template=...) or use generate")


def render_chat(tokenizer, messages: list[dict[str, Any]], chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                **template_kwargs: Any) -> tuple[str, list[int]]:
    """A conversation rendered with the tokenizer's chat template (or `chat_template`):
    its text and token ids. The template writes any special tokens (BOS included) itself,
    so the text is encoded without adding more. continue_final_message: the text ends
    inside the last message (an assistant's reply to go on with), not after it."""
    check_chat_template(tokenizer, chat_template)
    if continue_final_message:
        template_kwargs["continue_final_message"] = True
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)
    return text, tokenizer.encode(text, add_special_tokens=False)


@functools.cache
def render_arguments() -> frozenset[str]:
    """apply_chat_template's and render_chat's own arguments: not template variables, so not
    for chat_template_kwargs to set. Read from their signatures, so that a newer transformers'
    are reserved too (imported here: the command line's --help loads no transformers)."""
    from transformers import PreTrainedTokenizerBase

    return frozenset(name for function in (PreTrainedTokenizerBase.apply_chat_template, render_chat)
                     for name, parameter in inspect.signature(function).parameters.items()
                     if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY))

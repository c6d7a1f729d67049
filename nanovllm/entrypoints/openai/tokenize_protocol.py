"""Request and response bodies of vLLM's /tokenize, /detokenize and /version, as pydantic
models (protocol.py has OpenAI's)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from nanovllm.entrypoints.openai.protocol import ChatMessage, ChatTool, NullIsUnset, OpenAIBaseModel


class TokenizeCompletionRequest(NullIsUnset):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(NullIsUnset):
    model: str | None = None
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes them
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str

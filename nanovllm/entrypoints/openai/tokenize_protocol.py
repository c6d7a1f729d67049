"""Request and response bodies of vLLM's /tokenize, /detokenize and /version, as pydantic
models (protocol.py has OpenAI's)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Tag

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


def _tokenize_form(body: Any) -> str | None:
    if not isinstance(body, dict):
        return None
    chat, text = body.get("messages") is not None, body.get("prompt") is not None
    return None if chat == text else "Chat" if chat else "Completion"


# /tokenize's body: chat messages where it has `messages` (not null), or a prompt, never
# both (one of them would be left out). Told apart by those keys, so that a bad body's errors
# are its own form's only (not the other's missing fields). The tags are capitalized: error
# locations leave such names out.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("Completion")] | Annotated[TokenizeChatRequest, Tag("Chat")],
    Discriminator(_tokenize_form, custom_error_type="tokenize_form",
                  custom_error_message="give one of `prompt` (a text) or `messages` (a chat) to tokenize")]


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

"""The server's errors as OpenAI's API gives them: APIError (status, message, the request
field at fault), and the body it is answered with."""
from __future__ import annotations

import re

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """A request the server refuses, as an OpenAI error: status, message, param, code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> ErrorResponse:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code))

    @classmethod
    def bad_value(cls, exc: ValueError, request: BaseModel) -> APIError:
        """A 400 from an engine or SamplingParams ValueError about request, whose message
        starts with the offending field's name when there is one (the request's name for it:
        field_name); the prompt's field (`messages` in chat) for the engine's PromptError."""
        from nanovllm.engine.request import PromptError

        fields = type(request).model_fields
        if isinstance(exc, PromptError):
            return cls(400, str(exc), param="messages" if "messages" in fields else "prompt")
        message = str(exc)
        first = message.split(" ", 1)[0]
        name = request.field_name(first) if hasattr(request, "field_name") else first  # protocol.py's requests
        if name != first:  # the client's name throughout ("lower max_tokens" too)
            message = re.sub(rf"(?<![\w-]){re.escape(first)}(?![\w-])", name, message)  # not in --max-logprobs
        return cls(400, message, param=name if name in fields else None)

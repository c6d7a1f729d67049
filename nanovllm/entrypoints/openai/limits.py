"""What one request may ask of the server (ServerLimits: each field a `nanovllm serve` flag,
--max-n, ...; a request over a limit gets a 400 that names the limit and its flag), and
what answers hold (ResponseOptions). Needs none of the server's packages, so the command
line can import it."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from nanovllm.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from nanovllm.utils import is_int


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = field(default=16 << 20, metadata={
        "help": "larger request bodies get 413 before they are read"})
    max_n: int = field(default=128, metadata={"help": "most completions (n) one request may ask for"})
    max_prompts_per_request: int = field(default=256, metadata={
        "help": "most prompts in one /v1/completions request"})
    max_stop_strings: int = field(default=16, metadata={"help": "most stop strings one request may give"})
    max_stop_string_length: int = field(default=256, metadata={"help": "longest stop string, in characters"})
    max_token_list: int = field(default=300, metadata={
        "help": "most entries in one request's logit_bias, allowed_token_ids or bad_words (OpenAI caps logit_bias "
                "at 300)"})
    request_header_timeout: float = field(default=10.0, metadata={
        "help": "seconds a connection may take to send a request's headers before it is closed"})
    request_body_timeout: float = field(default=30.0, metadata={
        "help": "seconds a request may take to send its body before it gets 408"})
    trust_request_chat_template: bool = field(default=False, metadata={
        "help": "let requests bring their own chat template (it runs in the server process)"})

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_n", "max_prompts_per_request", "max_stop_strings",
                     "max_stop_string_length", "max_token_list"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} ({self.flag(name)}) must be a positive integer, got {value!r}")
        for name in ("request_header_timeout", "request_body_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"{name} ({self.flag(name)}) must be a positive number of seconds, got {value!r}")

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """`nanovllm serve`'s flags for what answers hold: chat_template (a template's text,
    instead of the tokenizer's), enable_auto_tool_choice (tool_choice "auto"),
    response_role (the role of chat answers to a generation prompt), and
    enable_prompt_tokens_details (usage.prompt_tokens_details: the prompt tokens the
    prefix cache held), as vLLM's."""

    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    response_role: str = "assistant"
    enable_prompt_tokens_details: bool = False


def check_tool_call_parser(responses: ResponseOptions, tool_call_parser: str | None) -> None:
    """--enable-auto-tool-choice needs --tool-call-parser, one of TOOL_CALL_PARSERS."""
    parsers = ", ".join(TOOL_CALL_PARSERS)
    if responses.enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({parsers})")
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {parsers}; got {tool_call_parser!r}")


def check_access_flags(ssl_keyfile: str | None, ssl_certfile: str | None, api_key: str | None) -> None:
    """TLS needs a key file and a certificate file, both there; an API key given is not empty."""
    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
    for path in (ssl_keyfile, ssl_certfile):
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"no such TLS file: {path}")
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty (--api-key or NANOVLLM_API_KEY): give a key, or leave both unset "
                         "to serve without one")

"""Tool calling on /v1/chat/completions: which mode a request asks for, the constraint
that forces a call, and the calls read back out of the model's text.

tool_choice "none" lets the model answer in text. "auto" (the default when the server has
--enable-auto-tool-choice) lets it choose, and its Hermes-format calls (Qwen2.5 and Qwen3
write `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`) are parsed out of
the text. "required" and a named function constrain decoding (structured outputs), as
vLLM does: a named function's output is its arguments, a JSON object that satisfies the
function's parameters schema; "required"'s is a JSON array of {"name", "parameters"}
objects, each naming one of the tools with parameters that satisfy its schema. Both
are JSON in one compact layout (a model cannot run on in whitespace).
"""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.utils.text import partial_tag_length

TOOL_CALL_PARSERS = ("hermes",)
NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
ANY_OBJECT = {"type": "object"}


class ToolChoiceError(ValueError):
    """A tools / tool_choice combination the server refuses; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolMode:
    kind: str  # NONE, AUTO, REQUIRED or NAMED
    name: str | None = None  # NAMED's function
    tools: list[dict] = field(default_factory=list)  # the request's function definitions (name, parameters)
    parallel: bool = True

    def parameters(self, name: str) -> dict:
        return next(t.get("parameters") or ANY_OBJECT for t in self.tools if t["name"] == name)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint that forces REQUIRED's or NAMED's output; None otherwise."""
        if self.kind == NAMED:
            return StructuredOutputsParams(json=self.parameters(self.name), disable_any_whitespace=True)
        if self.kind != REQUIRED:
            return None
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "required": ["name", "parameters"], "properties": {
            "name": {"enum": [t["name"]]}, "parameters": _embedded(self.parameters(t["name"]), f"tool{i}", defs)}}
            for i, t in enumerate(self.tools)]
        array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        if defs:
            array["$defs"] = defs
        return StructuredOutputsParams(json=array, disable_any_whitespace=True)


def _embedded(schema: dict, name: str, defs: dict[str, Any]) -> dict:
    """A tool's parameters schema as a part of "required"'s array schema: one whose $refs
    point into it (its $defs or definitions, or "#" itself: pydantic's nested and recursive
    models) goes into the array's $defs whole, as `name`, its own definitions beside it as
    name_X, every $ref rewritten to match; one without refs stays as it is."""
    try:
        if '"$ref"' not in json.dumps(schema):
            return schema
        own = {key: schema[key] for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)}
        for definitions in own.values():
            for def_name, definition in definitions.items():
                defs[f"{name}_{def_name}"] = _rewritten(definition, name)
        defs[name] = _rewritten({k: v for k, v in schema.items() if k not in own}, name)
    except RecursionError:
        raise ToolChoiceError("a tool's parameters are nested too deeply to constrain a call to", "tools") from None
    return {"$ref": f"#/$defs/{name}"}


def _rewritten(node: Any, name: str) -> Any:
    """node with each local $ref of its tool's schema pointed at where _embedded put it."""
    if isinstance(node, list):
        return [_rewritten(item, name) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _rewritten(value, name) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        parts = ref[2:].split("/", 2) if ref != "#" else []
        if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
            out["$ref"] = "/".join([f"#/$defs/{name}_{parts[1]}", *parts[2:]])
        else:  # into the parameters object itself
            out["$ref"] = f"#/$defs/{name}" + (ref[1:] if ref != "#" else "")
    return out


def resolve_tool_mode(tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None,
                      auto_enabled: bool) -> ToolMode:
    """The request's mode, from `tools` ({"type": "function", "function": {...}} dicts) and
    `tool_choice`; ToolChoiceError for a combination that cannot be served."""
    functions = [tool["function"] for tool in tools or []]
    parallel = parallel_tool_calls is not False
    # No tool_choice: "auto" on a server with --enable-auto-tool-choice, else "none": the tools
    # still reach the template, and whatever call the model writes comes back as content.
    # vLLM defaults to "auto" whenever tools are given, so a server of its without a parser
    # refuses such a request; here a client that always sends its tools is still served.
    if tool_choice is None:
        tool_choice = AUTO if functions and auto_enabled else NONE
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in {f["name"] for f in functions}:
            raise ToolChoiceError(f"tool_choice names the function `{name}`, which is not in tools", "tool_choice")
        return ToolMode(NAMED, name, functions, parallel)
    if tool_choice != NONE and not functions:
        raise ToolChoiceError(f"tool_choice `{tool_choice}` needs tools", "tool_choice")
    if tool_choice == AUTO and not auto_enabled:
        raise ToolChoiceError('tool_choice "auto" needs a server started with --enable-auto-tool-choice '
                              "--tool-call-parser hermes", "tool_choice")
    return ToolMode(tool_choice, None, functions, parallel)


def tool_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call, with a fresh id."""
    return {"id": f"chatcmpl-tool-{secrets.token_hex(16)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _is_utf8(text: str) -> bool:
    """Whether text can be written as UTF-8 (no lone surrogate, which a JSON escape can make)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _arguments(value: Any) -> str:
    """The arguments as JSON text, non-ASCII characters as they are; but where the model
    wrote a lone surrogate's escape (\\ud800), which UTF-8 cannot carry, all escaped."""
    value = value if value is not None else {}
    text = json.dumps(value, ensure_ascii=False)
    return text if _is_utf8(text) else json.dumps(value)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):  # 1e400: written back, it would be Infinity
        raise ValueError(f"{number} is no finite number")
    return value


# Python's json reads NaN and Infinity (and 1e400 as infinity); JSON has neither, and a
# client's parser would refuse the arguments written with them.
_STRICT_JSON = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)


def parse_hermes_call(text: str) -> dict | None:
    """The call in one <tool_call> block's text, or None if it is not one."""
    try:
        call = _STRICT_JSON.decode(text)
    except (ValueError, RecursionError):  # the model's text: not JSON, or nested past the parser's depth
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not _is_utf8(call["name"]):
        return None
    arguments = call.get("arguments", call.get("parameters"))
    if arguments is not None and not isinstance(arguments, dict):
        return None
    return tool_call(call["name"], _arguments(arguments))


class ToolCallStream:
    """One choice's text, as it grows, split into content and tool calls by its mode:
    feed() each new piece and flush() at the end; each returns (content piece, new calls).

    AUTO: content until a <tool_call> block; each block that holds a call becomes one (a
    block that does not stays content). Whitespace around blocks is dropped. NAMED: all
    the text is the call's arguments, streamed as they come: the first feed returns the
    call (its id, its name, the first piece as its arguments), later pieces come back in
    `argument_delta`. REQUIRED: each call of the JSON array once its item is complete.
    """

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.held = ""  # text not yet given out
        self.in_call = False  # inside a <tool_call> block
        self.seen_call = False
        self.after_call = False  # right after a call's block
        self.gap = ""  # the whitespace before the block under way, dropped unless it is no call
        self.argument_delta = ""  # NAMED: the arguments' text of the last feed, after the first
        self.given = 0  # REQUIRED: the array's items given out as calls
        self.next_item: int | None = None  # REQUIRED: where in `held` the next item starts, once "[" came

    def feed(self, text: str) -> tuple[str, list[dict]]:
        kind = self.mode.kind
        if kind == NAMED:
            if not self.seen_call:
                self.seen_call = True
                return "", [tool_call(self.mode.name, text)]
            self.argument_delta = text
            return "", []
        if kind == REQUIRED:
            self.held += text
            return "", self._new_required_calls() if "}" in text else []  # an item ends at a brace
        if kind == NONE:
            return text, []
        return self._feed_auto(text)

    def flush(self) -> tuple[str, list[dict]]:
        kind = self.mode.kind
        if kind == REQUIRED:  # an array cut short (max_tokens) before any item completed is text
            calls = self._new_required_calls()
            held, self.held = self.held, ""
            return ("", calls) if self.given else (held, [])
        held, self.held = self.held, ""
        if kind != AUTO:
            return "", []
        if self.in_call:  # a block the output ended in: a call if its text is whole
            call = parse_hermes_call(held)
            return ("", [call]) if call is not None else (self.gap + CALL_START + held, [])
        return ("" if self.seen_call and not held.strip() else held), []

    def _feed_auto(self, text: str) -> tuple[str, list[dict]]:
        held = self.held + text
        content, calls = [], []
        while True:
            if self.in_call:
                cut = held.find(CALL_END)
                if cut < 0:
                    break
                block, held = held[:cut], held[cut + len(CALL_END):]
                self.in_call = False
                call = parse_hermes_call(block)
                if call is None:  # not a call after all: the block stays text
                    content.append(self.gap + CALL_START + block + CALL_END)
                else:
                    calls.append(call)
                    self.seen_call = self.after_call = True
                continue
            if self.after_call:  # whitespace after a call is dropped
                held = held.lstrip()
                if not held:
                    break
                self.after_call = False
            cut = held.find(CALL_START)
            if cut >= 0:  # whitespace before a call too
                before = held[:cut].rstrip()
                content.append(before)
                self.gap = held[len(before):cut]
                held, self.in_call = held[cut + len(CALL_START):], True
                continue
            # Hold back what could start a tag, and trailing whitespace that may precede one.
            emit = held[: len(held) - partial_tag_length(held, CALL_START)].rstrip()
            content.append(emit)
            held = held[len(emit):]
            break
        self.held = held
        return "".join(content), calls

    def _new_required_calls(self) -> list[dict]:
        """The calls of the array's items completed since the last call: parsing resumes
        where the last whole item ended."""
        if self.next_item is None:
            start = self.held.find("[")
            if start < 0:
                return []
            self.next_item = start + 1
        items, self.next_item = _complete_items(self.held, self.next_item)
        self.given += len(items)
        return [tool_call(item["name"], _arguments(item.get("parameters"))) for item in items]


def _complete_items(text: str, pos: int) -> tuple[list, int]:
    """The whole items of a JSON array's text (which may be cut short) from pos, just past
    the '[' or an item, on; and where the text after the last of them starts."""
    decoder = _STRICT_JSON
    items = []
    while True:
        start = pos
        while start < len(text) and text[start] in " \t\n\r,":
            start += 1
        try:
            item, pos = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):  # cut short (or nested past the parser's depth)
            return items, pos
        items.append(item)


def called(mode: ToolMode, calls: int, finish_reason: str | None) -> str | None:
    """The finish_reason to report: "tool_calls" when the model called tools (OpenAI's "stop"
    for a named function), else the engine's."""
    if calls and finish_reason == "stop" and mode.kind in (AUTO, REQUIRED):
        return "tool_calls"
    return finish_reason


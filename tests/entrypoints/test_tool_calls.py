"""Reading reasoning and tool calls out of a model's text (engine/reasoning.py,
entrypoints/openai/tool_calls.py): the same result however the text is cut into pieces,
and the modes and constraints of tool_choice."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.engine.reasoning import CLOSED, OPEN, UNDECIDED, ReasoningStream, ReasoningTags
from nanovllm.entrypoints.openai.tool_calls import (
    AUTO, NAMED, NONE, REQUIRED, ToolCallStream, ToolChoiceError, ToolMode, called, resolve_tool_mode,
)

TAGS = ReasoningTags("<think>", "</think>", 100, 101)
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}},
                                           "required": ["zone"]}}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def run_reasoning(state: str, chunks: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(TAGS, state)
    reasoning = content = ""
    for chunk in chunks:
        r, c = stream.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = stream.flush()
    return reasoning + r, content + c


@pytest.mark.parametrize(("state", "text", "expected"), [
    (OPEN, "let me see</think>\n\nIt is 4.", ("let me see", "\n\nIt is 4.")),
    (OPEN, "still thinking <", ("still thinking <", "")),  # never closed: all reasoning
    (UNDECIDED, "<think>hmm</think>ok", ("hmm", "ok")),
    (UNDECIDED, "<thin", ("", "<thin")),  # a tag's start that never became one
    (UNDECIDED, "plain answer </think>", ("", "plain answer </think>")),
    (CLOSED, "<think>not reasoning</think>", ("", "<think>not reasoning</think>")),
])
def test_reasoning_split(state, text, expected):
    assert run_reasoning(state, [text]) == expected
    assert ReasoningStream(TAGS, state).split(text) == tuple(part or None for part in expected)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([OPEN, UNDECIDED, CLOSED]),
       st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", " ", "\n", "é"]), max_size=12),
       st.lists(st.integers(0, 200), max_size=6))
def test_reasoning_is_the_same_however_the_text_is_cut(state, parts, cuts):
    text = "".join(parts)
    assert run_reasoning(state, pieces(text, cuts)) == run_reasoning(state, [text])
    assert "".join(run_reasoning(state, [text])) in (text, text.replace("<think>", "", 1).replace("</think>", "", 1),
                                                     text.replace("</think>", "", 1))


def test_reasoning_state_after_a_prompt():
    assert TAGS.state_after([1, 2, 100, 5]) == OPEN
    assert TAGS.state_after([1, 100, 7, 101, 5]) == CLOSED
    assert TAGS.state_after([1, 100, 101, 100]) == OPEN
    assert TAGS.state_after([1, 2, 3]) == UNDECIDED


def run_tools(mode: ToolMode, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolCallStream(mode)
    content, calls = "", []
    for chunk in chunks:
        text, new = stream.feed(chunk)
        content += text
        calls += new
        if calls and stream.argument_delta:
            calls[-1]["function"]["arguments"] += stream.argument_delta
            stream.argument_delta = ""
    text, new = stream.flush()
    return content + text, [(c["function"]["name"], c["function"]["arguments"]) for c in calls + new]


HERMES = ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>')


NOT_A_CALL = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
DEEP = "<tool_call>" + "[" * 5000 + "</tool_call>"  # past the JSON parser's depth: RecursionError
NAN_CALL = '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'
HUGE_CALL = '<tool_call>{"name": "f", "arguments": {"a": 1e400}}</tool_call>'
SURROGATE_NAME = '<tool_call>{"name": "f\\ud800", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(("text", "expected"), [
    (HERMES, ("Let me check.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "utc"}')])),
    ("no calls here  ", ("no calls here  ", [])),
    ('<tool_call>{"name": "f", "parameters": {"a": "é"}}', ("", [("f", '{"a": "é"}')])),  # unclosed at the end
    ("a <tool_call>not json</tool_call> b", ("a <tool_call>not json</tool_call> b", [])),
    (NOT_A_CALL, (NOT_A_CALL, [])),  # arguments must be an object
    (DEEP, (DEEP, [])),
    ('<tool_call>{"name": "f"}</tool_call>\n\n', ("", [("f", "{}")])),
    # a lone surrogate's escape, which UTF-8 cannot carry: the arguments escape every character
    ('<tool_call>{"name": "f", "arguments": {"a": "\\ud800 é"}}</tool_call>',
     ("", [("f", '{"a": "\\ud800 \\u00e9"}')])),
    (NAN_CALL, (NAN_CALL, [])),  # NaN is no JSON: text
    (HUGE_CALL, (HUGE_CALL, [])),  # nor is the Infinity 1e400 would be written as
    (SURROGATE_NAME, (SURROGATE_NAME, [])),  # a name UTF-8 cannot carry
])
def test_hermes_calls(text, expected):
    mode = ToolMode(AUTO, tools=[WEATHER, TIME])
    assert run_tools(mode, [text]) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {}}', "<tool", "_call>",
                                 "x", " ", "\n", "{"]), max_size=10),
       st.lists(st.integers(0, 300), max_size=6))
def test_tool_calls_are_the_same_however_the_text_is_cut(parts, cuts):
    text = "".join(parts)
    mode = ToolMode(AUTO, tools=[{"name": "f"}])
    assert run_tools(mode, pieces(text, cuts)) == run_tools(mode, [text])


def test_named_and_required_modes():
    named = ToolMode(NAMED, "get_weather", [WEATHER, TIME])
    assert named.structured_outputs().json == WEATHER["parameters"]
    assert run_tools(named, ['{"city"', ': "Rome"}']) == ("", [("get_weather", '{"city": "Rome"}')])
    required = ToolMode(REQUIRED, None, [WEATHER, TIME], parallel=False)
    schema = required.structured_outputs().json
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "utc"}}], schema)
    for bad in ([], [{"name": "get_time", "parameters": {"zone": "mars"}}],
                [{"name": "get_weather", "parameters": {"city": "A"}}] * 2):  # maxItems 1: parallel_tool_calls false
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    assert run_tools(required, list(text)) == ("", [("get_weather", '{"city": "Oslo"}')])
    assert run_tools(required, ['[{"name": "get_w']) == ('[{"name": "get_w', [])  # cut short: text
    cut = '[{"name": "get_time", "parameters": {"zone": "utc"}}, {"name": "get_w'  # the calls it completed
    assert run_tools(required, [cut]) == ("", [("get_time", '{"zone": "utc"}')])
    assert run_tools(required, ["[" * 5000]) == ("[" * 5000, [])  # nested past the parser's depth: text
    surrogate = '[{"name": "get_weather", "parameters": {"city": "\\udc00"}}]'
    assert run_tools(required, [surrogate]) == ("", [("get_weather", '{"city": "\\udc00"}')])
    infinite = '[{"name": "get_weather", "parameters": {"city": 1e400}}]'
    assert run_tools(required, [infinite]) == (infinite, [])  # no JSON arguments: the text as it is
    assert called(required, 1, "stop") == "tool_calls" and called(named, 1, "stop") == "stop"
    assert called(ToolMode(AUTO), 0, "stop") == "stop" and called(ToolMode(AUTO), 2, "length") == "length"


def test_required_calls_keep_the_definitions_their_parameters_refer_to():
    """Parameters with $defs and $refs (pydantic's nested and recursive models: "#/$defs/X",
    and "#" itself) go into "required"'s schema with their definitions, refs rewritten:
    the grammar compiles (it could not find '$defs' before) and holds each call to its tool."""
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    node = {"type": "object", "properties": {"name": {"type": "string"},
                                             "kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["name"]}
    ship = {"$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
            "type": "object", "properties": {"to": {"$ref": "#/$defs/Addr"}}, "required": ["to"]}
    tools = [{"name": "ship", "parameters": ship}, {"name": "tree", "parameters": node}, WEATHER]
    schema = ToolMode(REQUIRED, None, tools).structured_outputs().json
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    good = [{"name": "ship", "parameters": {"to": {"city": "Oslo"}}},
            {"name": "tree", "parameters": {"name": "a", "kids": [{"name": "b", "kids": []}]}},
            {"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(good, schema)
    assert _is_grammar_accept_string(grammar, json.dumps(good))
    for bad in ([{"name": "ship", "parameters": {"to": {"town": "Oslo"}}}],
                [{"name": "tree", "parameters": {"name": "a", "kids": [{"nam": "b"}]}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        assert not _is_grammar_accept_string(grammar, json.dumps(bad))


def test_required_calls_stream_as_their_items_complete():
    """Each call of "required"'s array comes out of the feed that completes its item, not at
    the end; a cut-short array keeps what it gave (its partial item dropped)."""
    stream = ToolCallStream(ToolMode(REQUIRED, None, [WEATHER, TIME]))
    assert stream.feed('[{"name": "get_time", "parameters": {"zone": "utc"}') == ("", [])
    text, calls = stream.feed('}, {"name": "get_weather", ')
    assert text == "" and [c["function"]["name"] for c in calls] == ["get_time"]
    assert stream.feed('"parameters": {"city": "Oslo"}}')[1][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert stream.feed("]") == ("", []) and stream.flush() == ("", [])
    cut = ToolCallStream(ToolMode(REQUIRED, None, [WEATHER, TIME]))
    assert len(cut.feed('[{"name": "get_time", "parameters": {}}, {"na')[1]) == 1
    assert cut.flush() == ("", [])


@pytest.mark.parametrize(("tools", "choice", "auto", "expected"), [
    (TOOLS, None, True, AUTO), (TOOLS, None, False, NONE), (None, None, True, NONE), (TOOLS, "none", True, NONE),
    (TOOLS, "required", False, REQUIRED), (TOOLS, {"type": "function", "function": {"name": "get_time"}}, False, NAMED),
])
def test_tool_mode(tools, choice, auto, expected):
    assert resolve_tool_mode(tools, choice, None, auto).kind == expected


@pytest.mark.parametrize(("tools", "choice", "auto", "message"), [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, True, "`nope`, which is not in tools"),
    (None, "required", True, "tool_choice `required` needs tools"),
    (TOOLS, "auto", False, "--enable-auto-tool-choice"),
])
def test_tool_mode_refusals(tools, choice, auto, message):
    with pytest.raises(ToolChoiceError, match=message) as error:
        resolve_tool_mode(tools, choice, None, auto)
    assert error.value.param == "tool_choice"


def test_a_messages_tool_call_arguments_go_as_text_where_they_are_no_json_object():
    from nanovllm.entrypoints.openai.chat import template_message
    from nanovllm.entrypoints.openai.protocol import ChatMessage

    def arguments(text: str):
        message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}]})
        return template_message(message)["tool_calls"][0]["function"]["arguments"]

    assert arguments('{"a": 1}') == {"a": 1}
    for text in ("[1]", "not json", "[" * 5000):  # the last nested past the parser's depth
        assert arguments(text) == text


def test_an_assistant_turns_reasoning_reaches_the_template_under_either_name():
    """vLLM's `reasoning`, or its older `reasoning_content`: templates read the latter."""
    from nanovllm.entrypoints.openai.chat import template_message
    from nanovllm.entrypoints.openai.protocol import ChatMessage

    for name in ("reasoning", "reasoning_content"):
        message = ChatMessage.model_validate({"role": "assistant", "content": "4", name: "2 + 2", "name": None})
        assert template_message(message) == {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}

"""The hand-written stream events of serving.py against the pydantic models they stand in for."""
from __future__ import annotations

import pytest

from nanovllm.entrypoints.openai.protocol import CompletionResponse
from nanovllm.entrypoints.openai.serving import (
    completion_choice,
    completion_event_head,
    sse,
    text_completion_event,
)
from nanovllm.outputs import CompletionOutput

TEXTS = ["", " hello", 'quote " backslash \\ slash /', "new\nline\ttab\r\x00\x1f\x7f", "héllo 你好 🙂",
         "\u2028\u2029", "\ufffd"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("finish_reason", "stop_reason"),
                         [(None, None), ("length", None), ("stop", 151645), ("stop", "</s>"), ("stop", "é\n")])
def test_text_completion_event_matches_pydantic(text, finish_reason, stop_reason):
    request_id, created, model = "cmpl-0123abcd", 1700000000, "Qwen/Qwen3-0.6B é"
    out = CompletionOutput(index=1, text=text, token_ids=[1, 2], finish_reason=finish_reason, stop_reason=stop_reason)
    expected = sse(CompletionResponse(id=request_id, created=created, model=model,
                                      choices=[completion_choice(out, index=3)]))
    assert text_completion_event(completion_event_head(request_id, created, model), 3, out) == expected

"""Reasoning output (Qwen3's `<think> ... </think>`): where it starts and ends, in token
ids (for the engine, whose structured-output grammar applies only after the reasoning)
and in text (for the server, which returns it as `reasoning` and `reasoning_content`).

Whether an output starts inside its reasoning depends on the prompt: one whose chat
template opened `<think>` (its last `<think>` after its last `</think>`) does; one that
closed it (Qwen3 with enable_thinking=False writes an empty `<think>\n\n</think>`) does
not; one with neither does only if the output opens with `<think>` itself. The reasoning
then runs to `</think>` or, if that never comes, to the end.
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanovllm.utils.text import partial_tag_length

# --reasoning-parser NAME -> the tags around the reasoning.
REASONING_PARSERS = {"qwen3": ("<think>", "</think>")}

# Where an output starts, given its prompt.
OPEN, CLOSED, UNDECIDED = "open", "closed", "undecided"


@dataclass(frozen=True, slots=True)
class ReasoningTags:
    start: str
    end: str
    start_id: int
    end_id: int

    @classmethod
    def load(cls, parser: str, tokenizer: PreTrainedTokenizerBase) -> ReasoningTags:
        """The parser's tags, each of which must be one token of the tokenizer."""
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {parser!r}")
        start, end = REASONING_PARSERS[parser]
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (start, end) if tag not in vocab]
        if missing:
            raise ValueError(f"the {parser} reasoning parser needs {' and '.join(missing)} as tokens of the "
                             f"tokenizer, which has none")
        return cls(start, end, vocab[start], vocab[end])

    def state_after(self, prompt_token_ids: list[int]) -> str:
        """OPEN, CLOSED or UNDECIDED: where an output of this prompt starts."""
        last_start = last_end = -1
        for i in range(len(prompt_token_ids) - 1, -1, -1):
            token = prompt_token_ids[i]
            if token == self.start_id and last_start < 0:
                last_start = i
            elif token == self.end_id and last_end < 0:
                last_end = i
            if last_start >= 0 and last_end >= 0:
                break
        if last_start < 0 and last_end < 0:
            return UNDECIDED
        return OPEN if last_start > last_end else CLOSED


class ReasoningStream:
    """Splits an output's text, as it grows, into reasoning and content: feed() each new
    piece, flush() at the end; each returns (reasoning, content) pieces ("" for none).
    Text that could still be the start of a tag is held back until it can be told apart."""

    def __init__(self, tags: ReasoningTags, state: str):
        self.tags = tags
        self.state = state  # OPEN: in the reasoning; CLOSED: in the content; UNDECIDED: not yet known
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        held = self.held + text
        self.held = ""
        if self.state == UNDECIDED:
            start = self.tags.start
            if held.startswith(start):
                self.state, held = OPEN, held[len(start):]
            elif start.startswith(held):
                self.held = held  # maybe the start tag, not all here yet
                return "", ""
            else:
                self.state = CLOSED
        if self.state == CLOSED:
            return "", held
        end = self.tags.end
        cut = held.find(end)
        if cut >= 0:
            self.state = CLOSED
            return held[:cut], held[cut + len(end):]
        keep = partial_tag_length(held, end)
        self.held = held[len(held) - keep:]
        return held[: len(held) - keep], ""

    def flush(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        return (held, "") if self.state == OPEN else ("", held)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's (reasoning, content), None for an empty part."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.flush()
        return (reasoning + more_reasoning) or None, (content + more_content) or None


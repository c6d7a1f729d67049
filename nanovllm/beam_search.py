"""Beam search, as vLLM's `LLM.beam_search` runs it: over the engine's ordinary requests
(offline.py drives it over generate, entrypoints/openai/beam_search.py over the server's
engine).

Each round asks for one token of every live beam (its whole sequence as the prompt, which
the prefix cache mostly holds) with the top 2 * beam_width log-probabilities; a beam's
candidates are its tokens among those, scored by their sum of log-probabilities. Per
prompt the beam_width best candidates that do not end the sequence live on; those that end
it (an end-of-sequence token, unless ignore_eos) are kept aside, as are those that fill
the most tokens a request may hold (max_model_len, or the KV cache where that is less).
After max_tokens rounds (or once no beam lives), the kept and the live ones are ranked by

    score = cum_logprob / len(tokens) ** length_penalty

(tokens: the prompt's and the beam's, less a final end-of-sequence token) and the best
beam_width returned, best first.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nanovllm.outputs import Logprob
from nanovllm.sampling_params import FLOAT32_MAX, SamplingParams, is_number
from nanovllm.utils import is_int


# length ** length_penalty stays a finite, nonzero float for any length a context holds.
MAX_LENGTH_PENALTY = 16


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's: beam_width beams a prompt, each up to max_tokens new tokens. temperature
    applies to the token each round also draws (0: the most likely), which joins the
    candidates when it is not among the top ones."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # the end-of-sequence token's text in `text`

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (is_number(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX):
            raise ValueError(f"temperature must be a number >= 0 (0: the most likely) within float32's range, "
                             f"got {self.temperature!r}")
        if not (is_number(self.length_penalty) and abs(self.length_penalty) <= MAX_LENGTH_PENALTY):
            raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
                             f"got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: tokens (the prompt's, then the beam's), each new token's log-probabilities
    (its top alternatives among them), their sum, and once returned its text (of all the
    tokens, as vLLM's) and why it ended ("stop": end of sequence, "length": max_tokens)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's best beam_width beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, length_penalty: float, eos_token_ids: set[int]) -> float:
    length = len(beam.tokens) - (beam.finish_reason == "stop" and beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length ** length_penalty


@dataclass(slots=True)
class _Prompt:
    """One prompt's beams: those alive, those ended, and this round's candidates."""

    prompt: str | list[int]
    beams: list[BeamSearchSequence] = field(default_factory=list)
    ended: list[BeamSearchSequence] = field(default_factory=list)
    candidates: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """The search over any engine: `asks()` gives the round's prompts (empty once it is
    over), each to be run with `step_params` (one token, its top alternatives), and
    `take()` their outputs; then `results()`. LLM.beam_search drives it over generate, the
    server over its engine client."""

    def __init__(self, prompts: list[str | list[int]], params: BeamSearchParams, eos_token_ids: set[int],
                 max_logprobs: int, most_tokens: int):
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if 2 * params.beam_width > max_logprobs:
            raise ValueError(f"beam_width {params.beam_width} needs the top {2 * params.beam_width} "
                             f"log-probabilities of each step; the engine gives at most max_logprobs={max_logprobs}")
        self.params, self.eos_token_ids, self.most_tokens = params, eos_token_ids, most_tokens
        self.step_params = SamplingParams(max_tokens=1, temperature=params.temperature,
                                          logprobs=2 * params.beam_width, ignore_eos=True, detokenize=False)
        self._prompts = [_Prompt(p) for p in prompts]
        self._rounds = 0
        self._asked: list[tuple[_Prompt, BeamSearchSequence | None]] = []

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.params.length_penalty, self.eos_token_ids)

    def asks(self) -> list[str | list[int]]:
        """This round's prompts: each prompt at first, then each live beam's tokens."""
        if self._rounds == self.params.max_tokens:
            return []
        first = self._rounds == 0
        self._asked = [(p, beam) for p in self._prompts for beam in ([None] if first else p.beams)]
        return [p.prompt if beam is None else beam.tokens for p, beam in self._asked]

    def take(self, outputs: list[tuple[list[int], dict[int, Logprob]]]) -> None:
        """The asks' outputs in their order: (prompt token ids, the new token's alternatives)."""
        for (p, beam), (prompt_token_ids, alternatives) in zip(self._asked, outputs, strict=True):
            beam = beam or BeamSearchSequence(list(prompt_token_ids))
            for token_id, logprob in alternatives.items():
                ends = token_id in self.eos_token_ids and not self.params.ignore_eos
                p.candidates.append(BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [alternatives],
                                                       beam.cum_logprob + logprob.logprob,
                                                       finish_reason="stop" if ends else None))
        for p in self._prompts:
            ranked = sorted(p.candidates, key=self.score, reverse=True)
            p.ended += [beam for beam in ranked if beam.finish_reason == "stop"]
            p.beams = [beam for beam in ranked if beam.finish_reason is None][: self.params.beam_width]
            for beam in p.beams:  # a beam that fills the context ends there
                if len(beam.tokens) >= self.most_tokens:
                    beam.finish_reason = "length"
                    p.ended.append(beam)
            p.beams = [beam for beam in p.beams if beam.finish_reason is None]
            p.candidates = []
        self._rounds += 1

    def results(self, decode: Callable[[list[int]], str], whole: bool = True) -> list[BeamSearchOutput]:
        """Each prompt's best beams, best first, their text decoded (whole: the prompt's
        tokens too, as vLLM's offline call gives it; else the beam's own)."""
        outputs = []
        for p in self._prompts:
            for beam in p.beams:
                beam.finish_reason = "length"
            best = sorted(p.ended + p.beams, key=self.score, reverse=True)[: self.params.beam_width]
            for beam in best:
                end = -1 if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output else None
                start = 0 if whole else len(beam.tokens) - len(beam.logprobs)
                beam.text = decode(beam.tokens[start:end])
            outputs.append(BeamSearchOutput(best))
        return outputs

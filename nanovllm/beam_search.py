"""Beam search, as vLLM's `LLM.beam_search` runs it: over the engine's ordinary requests.

Each round asks for one token of every live beam (its whole sequence as the prompt, which
the prefix cache mostly holds) with the top 2 * beam_width log-probabilities; a beam's
candidates are its tokens among those, scored by their sum of log-probabilities. Per
prompt the beam_width best candidates that do not end the sequence live on; those that end
it (an end-of-sequence token, unless ignore_eos) are kept aside. After max_tokens rounds
(or once no beam lives), the kept and the live ones are ranked by

    score = cum_logprob / len(tokens) ** length_penalty

(tokens: the prompt's and the beam's, less a final end-of-sequence token) and the best
beam_width returned, best first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanovllm.inputs import parse_prompts
from nanovllm.outputs import Logprob
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.offline import OfflineAPI


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
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


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
class _Search:
    """One prompt's beams: those alive, those ended, and this round's candidates."""

    prompt: str | list[int]
    beams: list[BeamSearchSequence] = field(default_factory=list)
    ended: list[BeamSearchSequence] = field(default_factory=list)
    candidates: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(llm: OfflineAPI, prompts: Any, params: BeamSearchParams, eos_token_ids: set[int],
                use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """LLM.beam_search's work over llm.generate (one engine or data-parallel replicas)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
    if 2 * params.beam_width > llm.config.max_logprobs:
        raise ValueError(f"beam_width {params.beam_width} needs the top {2 * params.beam_width} log-probabilities "
                         f"of each step; the engine gives at most max_logprobs={llm.config.max_logprobs}")
    searches = [_Search(p) for p in parse_prompts(prompts)]
    step = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True, detokenize=False)

    def score(beam: BeamSearchSequence) -> float:
        return beam_score(beam, params.length_penalty, eos_token_ids)

    for round_ in range(params.max_tokens):
        asking = [(s, beam) for s in searches for beam in (s.beams if round_ else [None])]
        if not asking:  # every beam has ended
            break
        outputs = llm.generate([s.prompt if beam is None else beam.tokens for s, beam in asking], step,
                               use_tqdm=use_tqdm)
        for (s, beam), output in zip(asking, outputs):
            beam = beam or BeamSearchSequence(list(output.prompt_token_ids))
            alternatives = output.outputs[0].logprobs[0]
            for token_id, logprob in alternatives.items():
                ends = token_id in eos_token_ids and not params.ignore_eos
                s.candidates.append(BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [alternatives],
                                                       beam.cum_logprob + logprob.logprob,
                                                       finish_reason="stop" if ends else None))
        for s in searches:
            ranked = sorted(s.candidates, key=score, reverse=True)
            s.ended += [beam for beam in ranked if beam.finish_reason == "stop"]
            s.beams = [beam for beam in ranked if beam.finish_reason is None][: params.beam_width]
            s.candidates = []
    tokenizer = llm.get_tokenizer()
    results = []
    for s in searches:
        for beam in s.beams:
            beam.finish_reason = "length"
        best = sorted(s.ended + s.beams, key=score, reverse=True)[: params.beam_width]
        for beam in best:
            ends_in_eos = beam.finish_reason == "stop" and not params.include_stop_str_in_output
            beam.text = tokenizer.decode(beam.tokens[:-1] if ends_in_eos else beam.tokens)
        results.append(BeamSearchOutput(best))
    return results

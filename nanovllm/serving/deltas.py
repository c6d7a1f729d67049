"""What a generate() call of an AsyncLLMEngine (or a replica router) hands its caller: a
RequestDelta per request that produced something, and merge_deltas, which folds those
that piled up while the caller was busy."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanovllm.outputs import CompletionOutput, Logprob


@dataclass(slots=True)
class RequestDelta:
    """What one request of a generate() call produced since its consumer last looked.

    index: the request's position in generate()'s list. outputs: for a streamed request,
    the new text / tokens / logprobs of each completion that changed (its finish_reason
    set once it has finished); otherwise every completion in full, once all are done.
    """

    index: int
    outputs: list[CompletionOutput]
    finished: bool = False
    # In the request's first delta: its prompt logprobs (if asked for) and prompt tokens the
    # prefix cache held (RequestOutput's).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None


def _merge_outputs(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    """Two consecutive stream deltas of one completion as one."""
    logprobs = None if old.logprobs is None and new.logprobs is None else (old.logprobs or []) + (new.logprobs or [])
    return CompletionOutput(old.index, old.text + new.text, old.token_ids + new.token_ids, new.finish_reason,
                            new.stop_reason, logprobs, new.cumulative_logprob)


def merge_deltas(deltas: list[RequestDelta]) -> list[RequestDelta]:
    """Fold the deltas that piled up while the consumer was busy: one per request, each
    completion's pieces joined in order. Fewer, larger chunks when a client lags."""
    merged: dict[int, RequestDelta] = {}
    for delta in deltas:
        into = merged.get(delta.index)
        if into is None:
            merged[delta.index] = dataclasses.replace(delta, outputs=list(delta.outputs))
            continue
        by_index = {out.index: i for i, out in enumerate(into.outputs)}
        for out in delta.outputs:
            if out.index in by_index:
                into.outputs[by_index[out.index]] = _merge_outputs(into.outputs[by_index[out.index]], out)
            else:
                into.outputs.append(out)
        into.finished = into.finished or delta.finished
    return list(merged.values())

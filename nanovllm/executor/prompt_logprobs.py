"""Prompt logprobs: the log-probability of each prompt token given the ones before it (and
the most likely alternatives there), for the requests that ask (SamplingParams.prompt_logprobs).

A prefill step computes hidden states for every scheduled token but the LM head only for
each sequence's last one. For a sequence that wants prompt logprobs, the rows of its
scheduled tokens that predict prompt tokens (a chunk's positions up to the prompt's next
to last) also go through the LM head, a slice of rows at a time so that the [rows, vocab]
logits stay small, and rank 0 reduces each slice to what is returned: the predicted prompt
token's logprob and rank, and the top-k, which are copied to the host with the step.
"""
from __future__ import annotations

import torch

from nanovllm.executor.inputs import ScheduledSeqs
from nanovllm.executor.step import PromptLogprobs
from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.sampling.sampler import logprobs_around
from nanovllm.utils.buffers import host_values

# Float32 log-softmax values per LM-head slice: at most this many bytes (rows = this / (4 *
# vocab)). With the slice's logits, out of the memory the KV cache leaves.
SLICE_BYTES = 1 << 26


def compute_prompt_logprobs(seqs: ScheduledSeqs, hidden: torch.Tensor, lm_head: ParallelLMHead
                            ) -> PromptLogprobs | None:
    """The prompt logprobs of the step's sequences that want them (None if none does; on a
    worker rank, after taking its part in rank 0's gathers). hidden: [tokens, hidden size],
    the step's scheduled tokens packed as its inputs are."""
    spans, states, targets, top = [], [], [], 0
    offset = 0
    for i, seq in enumerate(seqs):
        if (wanted := seq.prompt_logprob_rows) is not None:
            num, predicted = wanted
            spans.append((i, seq.num_cached_tokens, len(predicted)))
            states.append(hidden[offset : offset + len(predicted)])
            targets += predicted
            top = max(top, num)
        offset += seq.num_scheduled_tokens
    if not spans:
        return None
    device = hidden.device
    pin = device.type == "cuda"
    states = torch.cat(states) if len(states) > 1 else states[0]
    targets = host_values(targets, torch.int64, device)  # pinned: a pageable copy would wait for the step
    per_slice = max(1, SLICE_BYTES // (4 * lm_head.num_embeddings))
    parts = []
    for start in range(0, len(targets), per_slice):
        logits = lm_head.project(states[start : start + per_slice])
        if logits is not None:  # rank 0
            logprobs = torch.log_softmax(logits, -1, dtype=torch.float32)
            del logits
            parts.append(logprobs_around(logprobs, targets[start : start + per_slice], top))
    if not parts:
        return None
    host = []
    for field in ("chosen", "rank", "top_ids", "top_values"):
        value = torch.cat([getattr(part, field) for part in parts])
        host.append(torch.empty(value.shape, dtype=value.dtype, pin_memory=pin).copy_(value, non_blocking=True))
    return PromptLogprobs(spans, tuple(host))

"""The forward context: per-step attention metadata that every attention layer reads.

The model's forward signature stays `forward(input_ids, positions)`; the ModelRunner
calls `set_context` before each forward and `reset_context` after it (the graph runners
put their static contexts in place with `using_context`), and the attention layers call
`get_context()` to find where to store K/V and what to attend to.
"""
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Rotary:
    """What a fused rotary kernel (kernels/rotary_store.py, decode_attention_rotary) needs besides
    the projection: q/k RMSNorm weights (both or neither) and the rotary embedding's table."""

    positions: torch.Tensor  # [tokens] integer positions, rows of cos_sin_cache
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] fp32, [cos | sin]
    q_norm_weight: torch.Tensor | None = None  # [head_dim]
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


@dataclass(slots=True)
class Context:
    """Attention metadata of one engine step.

    Prefill packs the scheduled tokens of every sequence along one axis:
    - cu_seqlens_q: [num_seqs + 1] int32, prefix sums of the new (scheduled) tokens.
    - cu_seqlens_k: [num_seqs + 1] int32, prefix sums of cached + new tokens.
    - max_seqlen_q: the most new tokens of one sequence, as a Python int; None in a
      prefill graph's static context (executor/piecewise.py), whose kernels size their
      grids from the shapes alone: there num_seqs ([1] int32 on the device) says how many
      of cu_seqlens' sequences the step has.
    - block_tables: [num_seqs, max_blocks] int32, -1 padded; None only in the start-up
      memory-profiling run, before the cache exists. The paged prefill kernel reads every
      sequence's K/V through them; the torch backend only for sequences with a cached prefix.
    - logit_rows: [rows] int64, the packed tokens whose logits the LM head computes: each
      sequence's last, and the rows of drafts to verify (speculative decoding); None: each
      sequence's last alone.
    Decode has one token per sequence:
    - context_lens: [batch] int32, tokens of history including the new one (0 on padding rows).
    - block_tables: [batch, max_blocks] int32, padded with -1.
    Both:
    - slot_mapping: [num_tokens] int64, where each new token's K/V goes in the flat cache
      (block_id * block_size + offset); -1 marks a CUDA-graph padding row: the Triton store
      skips it, the torch store writes it into the cache's scratch block.
    """

    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    num_seqs: torch.Tensor | None = None
    logit_rows: torch.Tensor | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(context: Context) -> None:
    global _CONTEXT
    _CONTEXT = context


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()


@contextmanager
def using_context(context: Context) -> Iterator[None]:
    """`context` inside the block, and the one before it again after it."""
    previous = get_context()
    set_context(context)
    try:
        yield
    finally:
        set_context(previous)

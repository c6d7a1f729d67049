"""Decode steps in parts that overlap: the rows cut into a few parts, each part's decoder
on its own stream inside the decode CUDA graph.

At small decode batches (a few to a few dozen rows) every kernel of a step is bound by
latency, not by bandwidth or tensor cores: a projection runs at most one wave of CTAs and
reads its weights at 14-39% of DRAM bandwidth whatever the rows (RESULTS.md session 28,
`gpu_check.sh ncu-gemm`), and decode attention over a few rows leaves most SMs idle. Two
or four such chains of kernels can run side by side; parts of up to 8 rows also take the
GEMV kernels (kernels/gemv.py) instead of cuBLAS. The parts read the same weights, the
later ones mostly from L2.

With turns on, the parts take turns at attention (part 0's layer L, then part 1's, ...,
then part 0's layer L + 1), so that one part attends while the others run their
projections and MLPs (NanoFlow's nano-batches and SGLang's two-batch overlap order their
work this way). With turns off the parts only join at the end.

Each part attends under its own forward context (its rows' slices of the step's) and
counts its split kernels in its own counter lane (kernels/split_counters.py), since the
parts' kernels run at the same time. On CPU (no streams) the parts run one after the
other in the same order: the same tokens as the whole batch, which the tests check.

NANOVLLM_DECODE_OVERLAP_ROWS="LO-HI" runs decode buckets of LO to HI rows this way (unset:
none; measured on the GPU by `gpu_check.sh overlap`), in NANOVLLM_DECODE_OVERLAP_PARTS
parts (2 to 4; default 2), NANOVLLM_DECODE_OVERLAP_TURNS=0 without turns. Measured at 128 rows and up
with two parts and turns, it lost (session 27: attention there streams the cache near
copy bandwidth, which the other part's work then shares). One GPU only: under tensor
parallelism the parts' all-reduces could be issued in different orders on different ranks.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels.split_counters import counter_lane
from nanovllm.utils.context import Context, get_context, set_context
from nanovllm.utils.env import env_int

MAX_PARTS = 4  # streams per decode step


@dataclass(frozen=True)
class Overlap:
    """Which decode buckets run in parts (lo <= rows <= hi), in how many, with turns or not."""

    lo: int
    hi: int
    parts: int = 2
    turns: bool = True

    def applies(self, rows: int) -> bool:
        return self.lo <= rows <= self.hi and rows >= self.parts


def overlap_from_env() -> Overlap | None:
    """NANOVLLM_DECODE_OVERLAP_ROWS ("LO-HI"), _PARTS and _TURNS; None when ROWS is unset."""
    raw = os.environ.get("NANOVLLM_DECODE_OVERLAP_ROWS", "")
    if not raw:
        return None
    try:
        lo, hi = (int(end) for end in raw.split("-"))
    except ValueError:
        raise ValueError(f"NANOVLLM_DECODE_OVERLAP_ROWS must be LO-HI (rows), got {raw!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"NANOVLLM_DECODE_OVERLAP_ROWS needs 1 <= LO <= HI, got {raw!r}")
    parts = env_int("NANOVLLM_DECODE_OVERLAP_PARTS", 2, least=2)
    if parts > MAX_PARTS:
        raise ValueError(f"NANOVLLM_DECODE_OVERLAP_PARTS must be at most {MAX_PARTS}, got {parts}")
    return Overlap(lo, hi, parts, env_int("NANOVLLM_DECODE_OVERLAP_TURNS", 1, least=0) > 0)


def runs_in_parts(model: nn.Module) -> bool:
    """Whether the model's decoder is the one overlapped_forward retraces (LlamaModel's
    embedding, layers and norm)."""
    from nanovllm.models.llama import LlamaModel

    return isinstance(getattr(model, "model", None), LlamaModel)


def row_parts(rows: int, parts: int) -> list[slice]:
    """rows cut into `parts` contiguous slices whose lengths differ by one at most. Padding
    rows are a bucket's last, so the last parts hold most of them (and still run)."""
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]


def parts_of(context: Context, parts: list[slice]) -> list[Context]:
    """The decode context of each part's rows."""
    return [Context(is_prefill=False, slot_mapping=context.slot_mapping[part],
                    context_lens=context.context_lens[part], block_tables=context.block_tables[part])
            for part in parts]


def overlapped_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, overlap: Overlap,
                       side_streams: list[torch.cuda.Stream] | None) -> torch.Tensor:
    """The decoder's hidden states [rows, hidden] for one decode step, as model(input_ids,
    positions) gives them, computed in overlap.parts parts; part p > 0 on side_streams[p - 1]
    (on CUDA: always the same streams, so that their memory is reused from capture to capture)."""
    decoder = model.model
    parts = row_parts(input_ids.shape[0], overlap.parts)
    whole = get_context()
    contexts = parts_of(whole, parts)
    cuda = input_ids.is_cuda
    main = torch.cuda.current_stream() if cuda else None
    streams = [main, *side_streams] if cuda else [None] * len(parts)
    if cuda:
        for stream in streams[1:]:
            stream.wait_stream(main)
    attended: list[torch.cuda.Event | None] = [None] * len(parts)  # each part's latest attention

    @contextlib.contextmanager
    def on(p: int):
        set_context(contexts[p])
        with torch.cuda.stream(streams[p]) if cuda else contextlib.nullcontext(), counter_lane(p):
            yield

    def attend(p: int, layer: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
        before = attended[p - 1]  # the part before in the turn: this layer's (or, for part 0, the last layer's)
        if overlap.turns and before is not None:
            streams[p].wait_event(before)
        out = layer.self_attn.attend(positions[parts[p]], qkv)
        if cuda and overlap.turns:
            attended[p] = torch.cuda.Event()
            attended[p].record(streams[p])
        return out

    hidden, residual = [None] * len(parts), [None] * len(parts)
    try:
        for p in range(len(parts)):
            with on(p):
                hidden[p] = decoder.embed_tokens(input_ids[parts[p]])
        for layer in decoder.layers:
            for p in range(len(parts)):
                with on(p):
                    qkv, residual[p] = layer.pre_attention(hidden[p], residual[p])
                    hidden[p], residual[p] = layer.post_attention(attend(p, layer, qkv), residual[p])
        for p in range(len(parts)):
            with on(p):
                hidden[p] = decoder.norm(hidden[p], residual[p])[0]
    finally:
        set_context(whole)
    if cuda:
        for stream in streams[1:]:
            main.wait_stream(stream)
    return torch.cat(hidden)

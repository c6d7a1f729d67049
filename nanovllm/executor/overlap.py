"""Two-batch overlap for large decode steps: the rows in two halves, each layer's attention
of one half running beside the other half's projections and MLP.

At decode batch sizes attention streams the KV cache (bound by memory bandwidth) while
the projections are GEMMs over the weights (bound by tensor-core time at a few hundred
rows); one after the other, each leaves the other's resource idle. Split the batch in two
and let the halves take turns at attention, A0 B0 A1 B1 ..., and while one half's layer L
attends, the other runs its projections, its norms and its MLP between two attentions.
NanoFlow (nano-batches) and SGLang (two-batch overlap) do this; here it is one function
over the decoder's own layer pieces (pre_attention, attend, post_attention), run inside the
decode CUDA graph: half 0 on the capture stream, half 1 on a side stream, events for the
turns. The weights are read once per half, the price of the overlap. The kernels after a
turn's wait may be launched with PDL: if capture makes that wait programmatic too, they
start early but stop at their gdc_wait until the other half's attention has ended.

Each half attends under its own forward context, the rows' slices of the step's. On CPU
(no streams) the halves run one after the other in the same order: the same tokens as the
whole batch, which is what the tests check.

NANOVLLM_DECODE_OVERLAP_MIN_BATCH sets the smallest decode batch split this way (0, the
default: none, until measured on the GPU: gpu_check.sh overlap). One GPU only: under
tensor parallelism the halves' all-reduces could be issued in different orders on
different ranks.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from nanovllm.kernels.split_counters import counter_lane
from nanovllm.utils.context import Context, get_context, set_context
from nanovllm.utils.env import env_int

OVERLAP_MIN_BATCH = env_int("NANOVLLM_DECODE_OVERLAP_MIN_BATCH", 0, least=0)


def splits_in_halves(model: nn.Module) -> bool:
    """Whether the model's decoder exposes the layer pieces the overlap schedules."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    return bool(layers) and all(hasattr(layer, name) for layer in layers[:1]
                                for name in ("pre_attention", "post_attention", "self_attn"))


def halves_of(context: Context, parts: tuple[slice, slice]) -> list[Context]:
    """The decode context of each part's rows."""
    return [Context(is_prefill=False, slot_mapping=context.slot_mapping[part],
                    context_lens=context.context_lens[part], block_tables=context.block_tables[part])
            for part in parts]


def overlapped_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                       side_stream: torch.cuda.Stream | None) -> torch.Tensor:
    """The decoder's hidden states [rows, hidden] for one decode step, as model(input_ids,
    positions) gives them, computed in two halves whose attentions take turns; half 1 on
    side_stream (on CUDA: always the same one, so that its memory is reused from step to
    step and capture to capture)."""
    decoder, rows = model.model, input_ids.shape[0]
    parts = (slice(0, rows // 2), slice(rows // 2, rows))
    whole = get_context()
    contexts = halves_of(whole, parts)
    cuda = input_ids.is_cuda
    main = torch.cuda.current_stream() if cuda else None
    streams = [main, side_stream]
    if cuda:
        streams[1].wait_stream(main)
    attended = [None, None]  # each half's last attention, as an event the other half waits for

    @contextlib.contextmanager
    def on(half: int):
        """Half `half`'s context, stream and split-kernel counters (the halves' GEMMs, and
        one half's GEMMs beside the other's attention, run at the same time)."""
        set_context(contexts[half])
        with torch.cuda.stream(streams[half]) if cuda else contextlib.nullcontext(), counter_lane(half):
            yield

    def attend(half: int, layer: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
        other = attended[1 - half]
        if other is not None:  # the other half's attention before this one has ended
            streams[half].wait_event(other)
        out = layer.self_attn.attend(positions[parts[half]], qkv)
        if cuda:
            attended[half] = torch.cuda.Event()
            attended[half].record(streams[half])
        return out

    hidden, residual = [None, None], [None, None]
    try:
        for half in (0, 1):
            with on(half):
                hidden[half] = decoder.embed_tokens(input_ids[parts[half]])
        for layer in decoder.layers:
            for half in (0, 1):
                with on(half):
                    qkv, residual[half] = layer.pre_attention(hidden[half], residual[half])
                    out = attend(half, layer, qkv)
                    hidden[half], residual[half] = layer.post_attention(out, residual[half])
        for half in (0, 1):
            with on(half):
                hidden[half] = decoder.norm(hidden[half], residual[half])[0]
    finally:
        set_context(whole)
    if cuda:
        main.wait_stream(streams[1])
    return torch.cat(hidden)

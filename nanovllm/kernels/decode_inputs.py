"""A decode step's inputs, unpacked on the device from one packed copy.

The decode CUDA graphs read fixed buffers (executor/cuda_graph.py). Filling them one by
one took a copy per field and a fill per padding range, and taking a pending last token
from the previous step's output four small kernels more: ~24 stream operations before a
graph of ~225 kernels at batch 1. Instead the host packs the step into one int64 array
(executor/inputs.py's pack_decode), one copy sends it, and this kernel, captured as the
graph's first, writes every buffer. It reads the batch size and the block tables' width
from the array itself, so one capture serves every step of its bucket:

    packed = [rows, width,
              tokens[rows], prev_rows[rows], positions[rows], slots[rows],
              keys[rows], temperature bits[rows],
              block_tables[rows, width]]

A row whose prev_row is >= 0 takes its token from prev_tokens[prev_row] (the previous
step's sampled tokens, still on the device). Rows past `rows` are padding: slot -1 (no
K/V stored), context length 0 (nothing attended), block table all -1, the other fields 0.
A row sees position + 1 tokens and draws its token at that position (the sampler's
`positions`). executor/cuda_graph.py's unpack_torch does the same with torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch

_BLOCK_COLUMNS = 256  # block-table columns per step of a row's copy loop


@triton.jit
def _unpack_kernel(packed_ptr, prev_tokens_ptr, input_ids_ptr, positions_ptr, slot_mapping_ptr, context_lens_ptr,
                   block_tables_ptr, temperatures_ptr, keys_ptr, draw_positions_ptr, max_blocks, table_stride,
                   BLOCK_COLUMNS: tl.constexpr):
    row = tl.program_id(0)
    rows = tl.load(packed_ptr).to(tl.int32)
    width = tl.load(packed_ptr + 1).to(tl.int32)
    real = row < rows
    # Every address below lies inside the buffer (it holds the largest bucket's step), so
    # padding rows load whatever is there, unmasked, and keep their padding values instead.
    field = packed_ptr + 2 + row  # this row's first field; field f is f * rows further
    prev_row = tl.where(real, tl.load(field + rows), -1)
    token = tl.where(prev_row >= 0, tl.load(prev_tokens_ptr + tl.maximum(prev_row, 0)), tl.load(field))
    position = tl.where(real, tl.load(field + 2 * rows), 0)
    tl.store(input_ids_ptr + row, tl.where(real, token, 0))
    tl.store(positions_ptr + row, position)
    tl.store(slot_mapping_ptr + row, tl.where(real, tl.load(field + 3 * rows), -1))
    tl.store(context_lens_ptr + row, tl.where(real, position + 1, 0).to(tl.int32))
    tl.store(draw_positions_ptr + row, tl.where(real, position + 1, 0))
    tl.store(keys_ptr + row, tl.where(real, tl.load(field + 4 * rows), 0))
    bits = tl.where(real, tl.load(field + 5 * rows), 0).to(tl.int32)
    tl.store(temperatures_ptr + row, bits.to(tl.float32, bitcast=True))
    table = packed_ptr + 2 + 6 * rows + row * width
    columns = tl.arange(0, BLOCK_COLUMNS)
    for start in range(0, max_blocks, BLOCK_COLUMNS):
        column = start + columns
        ids = tl.load(table + column, mask=column < tl.where(real, width, 0), other=-1)
        tl.store(block_tables_ptr + row * table_stride + column, ids.to(tl.int32), mask=column < max_blocks)


def unpack_decode_inputs(packed: torch.Tensor, prev_tokens: torch.Tensor, input_ids: torch.Tensor,
                         positions: torch.Tensor, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                         block_tables: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                         draw_positions: torch.Tensor) -> None:
    """Fill the [bucket] buffers (block_tables [bucket, max_blocks], unit column stride)
    from `packed` (the module's layout, rows <= bucket)."""
    bucket, max_blocks = block_tables.shape
    if block_tables.stride(1) != 1 or packed.numel() < 2 + 6 * bucket:
        raise ValueError(f"unpack_decode_inputs takes block tables with unit column stride and a packed buffer of "
                         f"at least {2 + 6 * bucket} words for {bucket} rows; got {packed.numel()}")
    launch(_unpack_kernel, (bucket,), packed, prev_tokens, input_ids, positions, slot_mapping, context_lens,
           block_tables, temperatures, keys, draw_positions, max_blocks, block_tables.stride(0),
           BLOCK_COLUMNS=_BLOCK_COLUMNS, num_warps=1)

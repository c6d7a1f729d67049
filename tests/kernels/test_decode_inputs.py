"""kernels/decode_inputs.py's unpack kernel against executor/cuda_graph.py's torch ops, on
packed steps that InputBuilder.pack_decode wrote: pending tokens taken from the previous
step's output, padding rows, block tables narrower than the buffers (the interpreter on
CPU; on CUDA also captured in a graph and replayed over a new step)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.executor.cuda_graph import unpack_torch
from nanovllm.executor.inputs import InputBuilder, packed_size
from nanovllm.executor.step import SharedTokens, StepSeq
from nanovllm.kernels.decode_inputs import unpack_decode_inputs
from nanovllm.sequence import PENDING_TOKEN

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE, MAX_BLOCKS, BUCKET = 4, 300, 8  # 300 columns: more than one 256-column step


def buffers() -> list[torch.Tensor]:
    """The graph's buffers in unpack's order, full of values no step writes."""
    def full(dtype, *shape):
        return torch.full(shape, 77, dtype=dtype, device=DEVICE)

    return [full(torch.int64, BUCKET), full(torch.int64, BUCKET), full(torch.int64, BUCKET),
            full(torch.int32, BUCKET), full(torch.int32, BUCKET, MAX_BLOCKS), full(torch.float32, BUCKET),
            full(torch.int64, BUCKET), full(torch.int64, BUCKET)]


def packed_step(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[StepSeq], np.ndarray, np.ndarray]:
    """A decode step of `rows` sequences, some with their last token pending (from rows of
    a previous step of the bucket's size, past this step's rows too), packed; with each
    row's temperature and key."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(rows):
        length = int(rng.integers(1, 40))
        blocks = [int(b) for b in rng.permutation(500)[: -(-length // BLOCK_SIZE)]]
        last = PENDING_TOKEN if i % 2 else int(rng.integers(0, 1000))
        seqs.append(StepSeq([last], length - 1, blocks, prev_row=BUCKET - 1 - i if last == PENDING_TOKEN else -1))
    prev_tokens = torch.arange(1000, 1000 + BUCKET, device=DEVICE)
    builder = InputBuilder(64, BUCKET, MAX_BLOCKS, BLOCK_SIZE, torch.device("cpu"))
    packed = np.zeros(packed_size(BUCKET, MAX_BLOCKS), dtype=np.int64)
    temperatures = rng.random(rows, dtype=np.float32) * 2
    temperatures[::3] = 0.0  # greedy rows
    keys = rng.integers(0, 2**62, rows)
    size, pending = builder.pack_decode(seqs, SharedTokens(prev_tokens), packed, (temperatures, keys))
    assert pending == (rows > 1) and size == packed_size(rows, max(len(s.block_table) for s in seqs))
    return torch.from_numpy(packed).to(DEVICE), prev_tokens, seqs, temperatures, keys


@pytest.mark.parametrize("rows", [1, 5, BUCKET])
def test_unpack_kernel_equals_the_torch_ops_on_cpu_and_cuda(rows):
    packed, prev_tokens, seqs, temperatures, keys = packed_step(rows, seed=rows)
    kernel, reference = buffers(), buffers()
    unpack_decode_inputs(packed, prev_tokens, *kernel)
    unpack_torch(packed, prev_tokens, *reference)
    for got, want in zip(kernel, reference, strict=True):
        assert torch.equal(got, want)
    input_ids, positions, slots, context_lens, tables, row_temperatures, row_keys, draw_positions = reference
    assert row_temperatures[:rows].cpu().numpy().tolist() == temperatures.tolist()
    assert row_keys[:rows].tolist() == keys.tolist() and (row_temperatures[rows:] == 0).all()
    assert draw_positions[:rows].tolist() == [len(seq) for seq in seqs]
    for i, seq in enumerate(seqs):  # what the step says, row by row
        token = prev_tokens[seq.prev_row] if seq.last_token == PENDING_TOKEN else seq.last_token
        assert input_ids[i] == token and positions[i] == len(seq) - 1 and context_lens[i] == len(seq)
        pos = len(seq) - 1
        assert slots[i] == seq.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        assert tables[i, : len(seq.block_table)].tolist() == seq.block_table
        assert (tables[i, len(seq.block_table):] == -1).all()
    assert (slots[rows:] == -1).all() and (context_lens[rows:] == 0).all() and (tables[rows:] == -1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unpack_kernel_graph_replay_takes_each_new_step():
    """Captured once with an empty step, the kernel unpacks whatever the packed buffer holds
    at each replay: its header, not the capture, says the rows and width."""
    packed = torch.zeros(packed_size(BUCKET, MAX_BLOCKS), dtype=torch.int64, device=DEVICE)
    prev_tokens = torch.zeros(BUCKET, dtype=torch.int64, device=DEVICE)
    out = buffers()
    unpack_decode_inputs(packed, prev_tokens, *out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        unpack_decode_inputs(packed, prev_tokens, *out)
    for rows in (3, BUCKET, 1):
        step, step_prev, *_ = packed_step(rows, seed=10 + rows)
        packed.copy_(step)
        prev_tokens.copy_(step_prev)
        graph.replay()
        reference = buffers()
        unpack_torch(step, step_prev, *reference)
        assert all(torch.equal(got, want) for got, want in zip(out, reference, strict=True))

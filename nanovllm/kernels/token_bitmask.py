"""Structured outputs' token bitmask applied to the logits, in place.

Row r of the bitmask ([rows, words] int32, xgrammar's layout) belongs to logits row
rows[r]; bit b of its word w allows token 32 w + b, and every token whose bit is 0 gets
-inf, as does every token past the bitmask's 32 * words (a model's vocabulary may be
padded past its tokenizer's, which the grammar then never allows). Program (r, block)
reads BLOCK logits' bits and writes -inf where a bit is clear: the rows without a grammar
are not touched at all.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch

_BLOCK = 4096
_NUM_WARPS = 8


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # [batch, vocab], row stride stride_logits
    bitmask_ptr,  # [rows, words] int32, row stride stride_bitmask
    rows_ptr,  # [rows] int64: each bitmask row's logits row
    vocab,
    num_words,
    stride_logits,
    stride_bitmask,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = ids < vocab
    words = tl.load(bitmask_ptr + r.to(tl.int64) * stride_bitmask + ids // 32, mask=valid & (ids // 32 < num_words),
                    other=0)
    allowed = (words >> (ids % 32)) & 1
    row = tl.load(rows_ptr + r)
    tl.store(logits_ptr + row * stride_logits + ids, tl.full((BLOCK,), float("-inf"), tl.float32).to(
        logits_ptr.dtype.element_ty), mask=valid & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Set logits[rows[r], t] to -inf wherever bit t of bitmask[r] is 0; returns logits.

    Args:
        logits: [batch, vocab], any float dtype, contiguous in vocab.
        bitmask: [len(rows), words] int32; tokens from 32 * words on are disallowed.
        rows: [len(rows)] int64 row indices into logits.
    """
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask must be contiguous in their last dimension")
    if bitmask.size(0) != rows.size(0):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not have {rows.size(0)} rows")
    vocab = logits.size(1)
    if rows.numel():
        launch(_apply_bitmask_kernel, (rows.size(0), triton.cdiv(vocab, _BLOCK)),
            logits, bitmask, rows, vocab, bitmask.size(1), logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK,
            num_warps=_NUM_WARPS)
    return logits

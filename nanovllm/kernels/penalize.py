"""Repetition, frequency and presence penalties in one pass over the logits.

sampling/ops.py's `penalize` in torch gathers each row's two tables ([slots, vocab]
output counts and prompt membership), then takes a handful of element-wise passes over
[batch, vocab]; compiled, it fused into each sampling path, at the price of compiling
every path twice (with penalties and without) at start-up. Here program (row, chunk)
reads CHUNK logits and the matching entries of the row's table slot once and writes the
penalized logits in float32, with the same operations in the same order (IEEE division,
no fused multiply-adds), so the two give the same values. Every sampling path then runs
on those logits.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch

_CHUNK = 4096
_NUM_WARPS = 8


@triton.jit
def _penalize_kernel(
    logits_ptr,  # [batch, vocab], row stride stride_logits
    counts_ptr,  # [slots, vocab] int32: times each token was generated
    in_prompt_ptr,  # [slots, vocab] bool: the token is in the prompt
    rows_ptr,  # [batch] int64: each row's slot in the two tables
    repetition_ptr,  # [batch] float32 (1 = off)
    frequency_ptr,  # [batch] float32
    presence_ptr,  # [batch] float32
    out_ptr,  # [batch, vocab] float32, contiguous
    vocab,
    stride_logits,
    stride_counts,
    stride_in_prompt,
    CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    ids = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    valid = ids < vocab
    slot = tl.load(rows_ptr + b).to(tl.int64)
    x = tl.load(logits_ptr + b.to(tl.int64) * stride_logits + ids, mask=valid, other=0.0).to(tl.float32)
    counts = tl.load(counts_ptr + slot * stride_counts + ids, mask=valid, other=0)
    in_prompt = tl.load(in_prompt_ptr + slot * stride_in_prompt + ids, mask=valid, other=0)
    repetition = tl.load(repetition_ptr + b)
    generated = counts > 0
    # transformers' repetition rule on prompt and output tokens, then OpenAI's two.
    repeated = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
    x = tl.where(generated | (in_prompt != 0), repeated, x)
    x = x - tl.load(frequency_ptr + b) * counts.to(tl.float32) - tl.load(presence_ptr + b) * generated.to(tl.float32)
    tl.store(out_ptr + b.to(tl.int64) * vocab + ids, x, mask=valid)


def penalize_logits(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, rows: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """sampling/ops.py's penalize(logits.float(), ...) in one kernel.

    Args:
        logits: [batch, vocab], any float dtype, contiguous in vocab.
        counts: [slots, vocab] int32; in_prompt: [slots, vocab] bool; both contiguous in vocab.
        rows: [batch] int64, each row's slot; repetition, frequency, presence: [batch] float32.

    Returns:
        [batch, vocab] float32 penalized logits.
    """
    batch, vocab = logits.shape
    if logits.stride(1) != 1 or counts.stride(1) != 1 or in_prompt.stride(1) != 1:
        raise ValueError("logits and the penalty tables must be contiguous in the vocabulary")
    if counts.shape[1] != vocab or in_prompt.shape != counts.shape:
        raise ValueError(f"the penalty tables must be [slots, {vocab}], got {tuple(counts.shape)} and "
                         f"{tuple(in_prompt.shape)}")
    out = torch.empty(batch, vocab, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out
    launch(_penalize_kernel, (batch, triton.cdiv(vocab, _CHUNK)),
        logits, counts, in_prompt, rows, repetition, frequency, presence, out,
        vocab, logits.stride(0), counts.stride(0), in_prompt.stride(0),
        CHUNK=_CHUNK, num_warps=_NUM_WARPS,
        enable_fp_fusion=False,  # no multiply-add contraction: torch rounds each product apart
    )
    return out

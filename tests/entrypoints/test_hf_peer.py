"""The benchmark's peer, transformers' continuous batching, on a tiny checkpoint (CPU)."""
from __future__ import annotations

from nanovllm.entrypoints.hf_peer import run_hf_continuous_batching


def test_hf_continuous_batching_generates_every_requested_token(qwen3_ckpt):
    tokens, seconds = run_hf_continuous_batching(str(qwen3_ckpt), [[5, 6, 7] * 10, [8, 9] * 20], [7, 12], 0.6,
                                                 dtype="float32", device="cpu")
    assert tokens == 19 and seconds > 0

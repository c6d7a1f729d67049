"""Hugging Face transformers' own continuous batching engine, run as a peer of nanovllm.

Uses the manager API of transformers 5 (`model.init_continuous_batching(...)`, then
`add_request` / `get_result`), which lets every request carry its own `max_new_tokens`.
Works with transformers 5.17 and 5.24; the differences handled here are:
  - attention: 5.17 registers "paged|sdpa"; 5.23+ drop the "paged|" prefix for sdpa (it is
    stripped with a FutureWarning) and run plain "sdpa" on the paged cache.
  - `ContinuousBatchingConfig.auto_switch_to_flash` exists only in newer versions (5.24); left on,
    it silently swaps sdpa for flash-attention when flash-attn is installed. We turn it off.
EOS is disabled by passing eos_token_id=-1 to every request (RequestState ignores ids < 0).
tests/entrypoints/test_hf_peer.py runs it on CPU, on a tiny random Qwen3 checkpoint.
"""
import dataclasses
import gc
import logging
import time

import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

logger = logging.getLogger(__name__)

NO_EOS = -1  # RequestState only keeps eos ids >= 0, so -1 means "never stop early"


def _attn_implementation() -> str:
    """'paged|sdpa' where transformers still registers it (5.17), else plain 'sdpa' (5.23+)."""
    return "paged|sdpa" if "paged|sdpa" in ALL_ATTENTION_FUNCTIONS else "sdpa"


def _cb_config(prompts: list[list[int]], max_tokens: list[int], device: str) -> ContinuousBatchingConfig:
    """Default CB config, minus the automatic switch to flash-attention (only where it exists).
    On CPU the paged cache and the batch are sized to the workload: sized from the machine's
    memory instead, the manager spends most of a small run filling its attention-mask
    buffers."""
    wanted = {"auto_switch_to_flash": False}
    if device == "cpu":
        defaults = ContinuousBatchingConfig()
        page = getattr(defaults, "page_size", None) or getattr(defaults, "block_size", None) or 256
        per_request = -(-(max(map(len, prompts)) + max(max_tokens)) // page)
        wanted.update(num_blocks=per_request * len(prompts) + 1, max_batch_tokens=sum(map(len, prompts)))
    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in known})


def _workload_hints(prompts: list[list[int]], max_tokens: list[int]) -> object | None:
    """WorkloadHints sizing the paged cache for this workload, or None if this version lacks them."""
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(max_tokens),
                         num_requests=len(prompts))


def _serve(manager, prompts: list[list[int]], max_tokens: list[int], tag: str) -> list[list[int]]:
    """Submit every request, block until all are finished; return generated tokens in input order."""
    ids = [manager.add_request(input_ids=list(p), request_id=f"{tag}_{i}", max_new_tokens=n, eos_token_id=NO_EOS)
           for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    if any(rid is None for rid in ids):
        raise RuntimeError("the continuous batching manager refused a request")
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        out = manager.get_result(timeout=1.0)
        if out is None:
            if not manager.is_running():
                raise RuntimeError(f"HF generation thread stopped with {len(ids) - len(done)} requests pending")
            continue
        if out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            done[out.request_id] = list(out.generated_tokens)
    return [done[rid] for rid in ids]


def run_hf_continuous_batching(model_path: str, prompts: list[list[int]], max_tokens: list[int], temperature: float,
                               dtype: str = "bfloat16", device: str = "cuda") -> tuple[int, float]:
    """Run Hugging Face transformers' own continuous batching engine on the workload; returns (total output tokens, wall seconds, prefill included)."""
    if len(prompts) != len(max_tokens) or not prompts:
        raise ValueError("prompts and max_tokens must be non-empty and of the same length")
    attn = _attn_implementation()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype), attn_implementation=attn)
    model = model.to(device).eval()
    sample = temperature > 0
    gen_config = GenerationConfig(do_sample=sample, temperature=temperature if sample else None,
                                  top_k=0 if sample else None, top_p=1.0 if sample else None,
                                  eos_token_id=NO_EOS, max_new_tokens=max(max_tokens))
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=_cb_config(prompts, max_tokens, device),
                                             workload_hints=_workload_hints(prompts, max_tokens))
    logger.info("HF CB: attn=%s (model reports %s), sampling=%s", attn, model.config._attn_implementation, sample)
    try:
        manager.warmup()  # allocates the paged cache, captures CUDA graphs where enabled
        manager.start()
        _serve(manager, [prompts[0][:8], prompts[-1][:4]], [4, 2], tag="warmup")  # untimed warm-up
        start = time.perf_counter()
        outputs = _serve(manager, prompts, max_tokens, tag="bench")  # tokens are on the host: work is done
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
        manager.destroy()
        del manager, model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if short := [(i, len(o), n) for i, (o, n) in enumerate(zip(outputs, max_tokens)) if len(o) != n]:
        logger.warning("HF CB: wrong token count in %d requests (index, got, wanted): %s", len(short), short[:5])
    total = sum(map(len, outputs))
    logger.info("HF CB: %d requests, %d output tokens in %.3fs (%.1f tok/s)", len(prompts), total, elapsed,
                total / elapsed)
    return total, elapsed


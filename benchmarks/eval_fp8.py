"""Perplexity of the bundled demo model on held-out text with each FP8 mode, through the
engine itself (its attention over the paged cache, its FP8 matmuls), beside the unquantized
engine's. The issue's bar: within 2% of bf16.

    python benchmarks/eval_fp8.py                          # CPU, bf16, every held-out module
    python benchmarks/eval_fp8.py --device cuda --max-files 4 --json

The text is the held-out modules (nanovllm.demo.corpus.HELD_OUT_MODULES), each after an
<|endoftext|>, cut into windows of the context length; each window is one prefill of a
fresh sequence whose K/V go through the cache (an FP8 cache quantizes and reads them
back; with --decode, every position is computed by teacher-forced decode steps instead,
through decode attention), and the next-token loss is summed over every position;
agreement is the share of positions where a mode's greedy next token is the unquantized
engine's (teacher-forced: every position sees the same text). Modes: the KV cache in FP8
(e4m3, e5m2), FP8 weights (online per-channel, and the same model written as a block-scaled
FP8 checkpoint), and FP8 weights with an FP8 cache.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.demo import DEMO_MODEL_DIR
from nanovllm.demo.corpus import held_out_sources
from nanovllm.sequence import Sequence
from nanovllm.testing.fp8_checkpoint import write_fp8_checkpoint
from nanovllm.utils.context import reset_context, set_context

MODES = {
    "unquantized": {},
    "kv fp8 (e4m3)": {"kv_cache_dtype": "fp8"},
    "kv fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "weights fp8 (online)": {"quantization": "fp8"},
    "weights fp8 (checkpoint)": {"checkpoint": True},
    "weights + kv fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


@torch.no_grad()
def window_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 logits of every position of one window, computed as a prefill
    of a fresh sequence holding the cache's first blocks (the LM head applied to every
    position, not only the last)."""
    runner = llm.executor.runner
    seq = Sequence(-1, ids, SamplingParams(), runner.block_size)
    seq.block_table = list(range(seq.num_blocks))
    seq.num_scheduled_tokens = len(ids)
    inputs = runner.inputs.prefill([seq])
    set_context(inputs.context)
    try:
        hidden = runner.model(inputs.input_ids, inputs.positions)
    finally:
        reset_context()
    return F.linear(hidden, runner.model.lm_head.weight).float()


def window_nats(llm: LLM, ids: list[int]) -> float:
    """Summed next-token loss over one window."""
    logits = window_logits(llm, ids)
    return F.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device), reduction="sum").item()


@torch.no_grad()
def decoded_logits(llm: LLM, windows: list[list[int]]) -> list[torch.Tensor]:
    """Each window's [len - 1, vocab] fp32 logits as decode steps compute them: its first
    token prefilled, then every next token of the window fed in (teacher-forced), all the
    windows of a batch in one step, so every score comes from decode attention over the
    paged cache. The windows of one call have the same length."""
    assert len({len(window) for window in windows}) == 1, "decoded_logits takes windows of one length"
    runner = llm.executor.runner
    blocks_each = -(-len(windows[0]) // runner.block_size)
    seqs = []
    for i, window in enumerate(windows):
        seq = Sequence(-1, window[:1], SamplingParams(), runner.block_size)
        seq.block_table = list(range(i * blocks_each, (i + 1) * blocks_each))
        seq.num_scheduled_tokens = 1
        seqs.append(seq)
    steps = [runner.forward(seqs, True)[0].float()]
    for t in range(1, len(windows[0]) - 1):
        for seq, window in zip(seqs, windows, strict=True):
            seq.token_ids.append(window[t])
            seq.num_cached_tokens, seq.num_scheduled_tokens = t, 1
        steps.append(runner.forward(seqs, False)[0].float())
        if steps[-1].is_cuda:  # the step after next refills the pinned inputs that this one's copies read
            torch.cuda.synchronize()
    logits = torch.stack(steps, dim=1)  # [windows, len - 1, vocab]
    return list(logits.unbind(0))


def window_batches(llm: LLM, windows: list[list[int]], decode: bool) -> list[list[list[int]]]:
    """The windows one at a time (prefill), or in batches of one length that the cache holds
    (decode)."""
    if not decode:
        return [[window] for window in windows]
    runner = llm.executor.runner
    batches = []
    for length in sorted({len(window) for window in windows if len(window) > 1}, reverse=True):
        same = [window for window in windows if len(window) == length]
        per_batch = max(1, min(llm.config.max_num_seqs, runner.num_kvcache_blocks // -(-length // runner.block_size)))
        batches += [same[i : i + per_batch] for i in range(0, len(same), per_batch)]
    return batches


def evaluate(device: str, dtype: str, max_files: int | None, max_chars: int | None, modes: list[str],
             decode: bool) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    texts = [source[:max_chars] for source in list(held_out_sources().values())[:max_files]]
    sequences = [[tokenizer.eos_token_id] + tokenizer.encode(text) for text in texts]
    results, reference_argmax = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        fp8_checkpoint = str(write_fp8_checkpoint(DEMO_MODEL_DIR, f"{tmp}/fp8"))
        for mode in ["unquantized"] + [mode for mode in modes if mode != "unquantized"]:
            args = dict(MODES[mode])
            model = fp8_checkpoint if args.pop("checkpoint", False) else DEMO_MODEL_DIR
            with LLM(model, device=device, dtype=dtype, enforce_eager=True, **args) as llm:
                context = llm.config.max_model_len
                nats = positions = agree = 0
                windows = [ids[start : start + context] for ids in sequences
                           for start in range(0, len(ids) - 1, context - 1)]
                batches = window_batches(llm, windows, decode)
                batch_logits = (decoded_logits(llm, batch) if decode else [window_logits(llm, batch[0])[:-1]]
                                for batch in batches)
                pairs = ((window, logits) for batch, logits_of in zip(batches, batch_logits, strict=True)
                         for window, logits in zip(batch, logits_of, strict=True))
                for i, (window, logits) in enumerate(pairs):
                    labels = torch.tensor(window[1:], device=logits.device)
                    nats += F.cross_entropy(logits, labels, reduction="sum").item()
                    positions += len(labels)
                    argmax = logits.argmax(-1).cpu()
                    if mode == "unquantized":
                        reference_argmax.append(argmax)
                    agree += (argmax == reference_argmax[i]).sum().item()
            results[mode] = {"nats_per_token": nats / positions, "perplexity": math.exp(nats / positions),
                             "argmax_agreement": agree / positions, "positions": positions}
    base = results["unquantized"]["perplexity"]
    for result in results.values():
        result["vs_unquantized"] = result["perplexity"] / base - 1
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The demo model's perplexity and greedy agreement on held-out "
                                     "text with each FP8 mode, through the engine, beside the unquantized engine's.")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (the unquantized reference)")
    parser.add_argument("--max-files", type=int, default=None, help="the first N held-out modules (default: all 20)")
    parser.add_argument("--max-chars", type=int, default=None, help="the first N characters of each")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="the modes to run (the unquantized reference always runs)")
    parser.add_argument("--decode", action="store_true",
                        help="compute every position with decode steps (teacher-forced), through decode "
                        "attention, instead of one prefill per window")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    results = evaluate(args.device, args.dtype, args.max_files, args.max_chars, args.modes, args.decode)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    positions = results["unquantized"]["positions"]
    how = "decode steps" if args.decode else "one prefill per window"
    print(f"demo model, {args.dtype} on {args.device}, {positions:,} held-out positions ({how})")
    for mode, r in results.items():
        print(f"  {mode:26s} perplexity {r['perplexity']:.4f}  ({r['vs_unquantized']:+.2%}), "
              f"greedy next token = unquantized at {r['argmax_agreement']:.2%} of positions")


if __name__ == "__main__":
    main()

"""Speculative decoding (n-gram prompt lookup, or a draft model) against plain decoding, on
code a model can continue: prompts cut from the standard-library modules the demo models
never saw (nanovllm.demo.corpus.HELD_OUT_MODULES), run a few at a time (the latency case).

    python benchmarks/bench_speculative.py                          # the demo model, n-gram lookup
    python benchmarks/bench_speculative.py --batch 1 4 --num-speculative-tokens 4 --prompt-lookup-max 3
    python benchmarks/bench_speculative.py --draft demo             # the demo model and the demo draft
    python benchmarks/bench_speculative.py --arch qwen3-0.6b        # dummy weights of that shape (GPU)
    python benchmarks/bench_speculative.py --arch qwen3-8b --draft qwen3-0.6b   # dummy draft of that shape

The model: the demo model, --model FOLDER, or --arch's dummy weights. For each batch size,
the prompts go in groups of that many, one generate each, without speculation and with
speculative_config={"method": "ngram", ...} (the --num-speculative-tokens and
--prompt-lookup-* flags), --draft's model, or --speculative-config's JSON as given. Printed
per line: ms per output token of a request (a group's time over its longest output),
output tok/s, and with speculation the share of drafted tokens kept, the tokens a
sequence gets per verification, and how often the j-th draft of a verification stands.
Greedy outputs (the default) are compared (in bf16 the batch's shapes may flip a
near-tie). Dummy weights give whatever acceptance random weights give: their figures say
what a verification step costs, not what speculation gains on a real model.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.demo import DEMO_DRAFT_MODEL_DIR, DEMO_MODEL_DIR
from nanovllm.demo.corpus import held_out_sources
from nanovllm.entrypoints.arguments import add_engine_arguments, engine_arguments
from nanovllm.entrypoints.bench import ARCHS, write_dummy_checkpoint
from nanovllm.speculative_config import SpeculativeConfig


def code_prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, cut from the middle of the held-out modules in turn."""
    sources = list(held_out_sources().values())
    prompts = []
    for i in range(count):
        ids = llm.get_tokenizer().encode(sources[i % len(sources)])
        start = max(0, len(ids) // 2 - length + (i // len(sources)) * length)
        prompts.append(ids[start : start + length])
    return prompts


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple[list, float, float]:
    """(token ids of each output, seconds in all, ms per output token of a request)."""
    llm.reset_stats()
    outputs, seconds, per_token = [], 0.0, []
    for start in range(0, len(prompts), batch):
        began = time.perf_counter()
        group = llm.generate(prompts[start : start + batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - began
        seconds += elapsed
        per_token.append(elapsed / max(len(o.outputs[0].token_ids) for o in group) * 1e3)
        outputs += [o.outputs[0].token_ids for o in group]
    return outputs, seconds, sum(per_token) / len(per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--arch", choices=list(ARCHS), help="dummy weights of this shape (default: the demo model)")
    bench.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="requests at a time (default: 1 4)")
    bench.add_argument("--num-prompts", type=int, default=8, help="prompts (default: 8)")
    bench.add_argument("--prompt-tokens", type=int, default=256, help="tokens of each prompt (default: 256)")
    bench.add_argument("--max-tokens", type=int, default=256, help="output tokens of each (default: 256)")
    bench.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy: outputs compared)")
    bench.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts a step (default: 4)")
    bench.add_argument("--prompt-lookup-max", type=int, default=4,
                       help="(default: 4; the engine's, as vLLM's, is 5 and 5)")
    bench.add_argument("--prompt-lookup-min", type=int, default=1, help="(default: 1)")
    bench.add_argument("--draft", help="draft with a model instead of n-gram lookup: 'demo' (the demo draft), "
                                       "'self' (the model itself: every draft kept, the cost of drafting), "
                                       f"an --arch shape ({', '.join(ARCHS)}: dummy weights) or a checkpoint folder")
    add_engine_arguments(parser)
    args = parser.parse_args()
    engine_args = engine_arguments(args)
    # --speculative-config, where given, instead of the flags
    speculative = engine_args.pop("speculative_config", None)
    if speculative is not None and args.draft:
        parser.error("give --draft or --speculative-config, not both")
    if speculative is None and args.draft:
        speculative = {"model": DEMO_DRAFT_MODEL_DIR if args.draft == "demo" else args.draft,
                       "num_speculative_tokens": args.num_speculative_tokens}
    elif speculative is None:
        speculative = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                       "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if args.arch and engine_args.get("model"):
        parser.error("give --arch (dummy weights) or --model, not both")
    try:  # before the plain runs: a bad setting fails at once
        method = "draft" if SpeculativeConfig.parse(speculative).method == "draft_model" else "ngram"
    except ValueError as exc:
        parser.error(str(exc))
    if args.num_prompts < 1 or min(args.batch) < 1:
        parser.error("--num-prompts and --batch take positive numbers")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    with tempfile.TemporaryDirectory(prefix="nanovllm-bench-") as tmp:
        folder = engine_args.pop("model", None) or DEMO_MODEL_DIR
        if args.arch:
            folder = write_dummy_checkpoint(args.arch, tmp)
            engine_args.setdefault("load_format", "dummy")
        if args.draft == "self" or args.draft in ARCHS:
            speculative["model"] = folder if args.draft == "self" else write_dummy_checkpoint(
                args.draft, tempfile.mkdtemp(dir=tmp))
        engine_args.setdefault("max_model_len", 4096 if args.arch else None)
        results = {}
        for label, extra in (("plain", {}), (method, {"speculative_config": speculative})):
            try:
                llm = LLM(folder, **{k: v for k, v in engine_args.items() if v is not None}, **extra)
            except ValueError as exc:  # a bad folder, a draft that does not fit the model
                parser.error(str(exc))
            with llm:
                prompts = code_prompts(llm, args.num_prompts, args.prompt_tokens)
                llm.generate(prompts[:2], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
                for batch in args.batch:
                    outputs, seconds, ms = timed(llm, prompts, params, batch)
                    tokens = sum(map(len, outputs))
                    line = f"{label} batch {batch}: {ms:.3f} ms per output token, {tokens / seconds:,.0f} output tok/s"
                    if label == method:
                        s = llm.stats()
                        kept = s["spec_decode_num_accepted_tokens"] / max(s["spec_decode_num_draft_tokens"], 1)
                        per_step = 1 + s["spec_decode_num_accepted_tokens"] / max(s["spec_decode_num_drafts"], 1)
                        plain_outputs, _, plain_ms = results[batch]
                        line += (f" ({plain_ms / ms:.2f}x plain); kept {kept:.0%} of "
                                 f"{s['spec_decode_num_draft_tokens']} drafted tokens, {per_step:.2f} tokens a "
                                 f"verification")
                        by_place = [n / max(s["spec_decode_num_drafts"], 1)
                                    for n in s["spec_decode_num_accepted_tokens_per_pos"]]
                        line += f" (the j-th kept in {', '.join(f'{r:.0%}' for r in by_place)})"
                        if args.temperature == 0:  # in bf16 a batch's shapes can flip a near-tie
                            same = sum(a == b for a, b in zip(outputs, plain_outputs))
                            line += f"; {same} of {len(outputs)} outputs the same as plain"
                    results[batch] = outputs, seconds, ms
                    print(line, flush=True)
        device = "cuda" if torch.cuda.is_available() and engine_args.get("device", "auto") != "cpu" else "cpu"
        name = f"{args.arch} (dummy weights)" if args.arch else "the demo model" if folder == DEMO_MODEL_DIR else folder
        print(f"model: {name}, device {device}, "
              f"{args.num_prompts} prompts of {args.prompt_tokens} tokens, {args.max_tokens} out, "
              f"temperature {args.temperature}, speculative_config {speculative}")


if __name__ == "__main__":
    main()

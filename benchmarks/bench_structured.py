"""Structured outputs' cost: nano-vllm's offline workload with every request constrained
by a JSON schema (one schema for all, then a mix of eight), against the same requests
unconstrained.

A grammar ends its output where its JSON is complete, earlier than the workload's
max_tokens, so the unconstrained run gets each request's constrained output length as
its max_tokens: both runs generate the same tokens per request (from prompts already in
the prefix cache for both), and the ratio of their throughputs is the cost of the
constraint. The schemas bound every string and array, so
that even dummy weights (random choices, the matcher's hard case) end. Also reported:
each schema's compile time (cold, xgrammar, in the engine's compile thread) and the host
time per step and per constrained row of filling the bitmask.

    python benchmarks/bench_structured.py                    # GPU: Qwen3-0.6B architecture, dummy weights
    python benchmarks/bench_structured.py --num-seqs 8       # CPU: the demo model
"""
from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.demo import DEMO_MODEL_DIR
from nanovllm.entrypoints.arguments import add_engine_arguments, engine_arguments
from nanovllm.entrypoints.bench import GPU_WORKLOAD, make_workload, write_dummy_checkpoint
from nanovllm.sampling.logits_processors import GrammarBitmaskProcessor
from nanovllm.utils.log import configure_logging

CPU_WORKLOAD = (8, 16, 64)


def schema(i: int) -> dict:
    """The i-th of eight bounded schemas: flat, nested, arrays, enums, numbers."""
    text = {"type": "string", "maxLength": 8 + 4 * i}
    kinds = [
        {"name": text, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        {"id": {"type": "integer"}, "tags": {"type": "array", "items": text, "maxItems": 3}},
        {"ok": {"type": "boolean"}, "level": {"enum": ["low", "medium", "high"]}, "note": text},
        {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                   "required": ["x", "y"], "additionalProperties": False}},
        {"title": text, "year": {"type": "integer"}, "authors": {"type": "array", "items": text, "maxItems": 2}},
        {"city": text, "country": text, "population": {"type": "integer"}},
        {"items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": text, "qty": {"type": "integer"}}, "required": ["sku", "qty"],
            "additionalProperties": False}}},
        {"status": {"enum": ["active", "inactive"]}, "score": {"type": "number"}, "label": text},
    ]
    properties = kinds[i % len(kinds)]
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


class MaskTimer:
    """Host time of GrammarBitmaskProcessor.prepare (filling and copying the bitmask)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0
        self.rows = 0
        self._prepare = GrammarBitmaskProcessor.prepare

    def __enter__(self) -> MaskTimer:
        timer = self

        def prepare(processor, seqs, params):
            start = time.perf_counter()
            result = timer._prepare(processor, seqs, params)
            if result is not None:
                timer.seconds += time.perf_counter() - start
                timer.steps += 1
                timer.rows += len(result[0])
            return result

        GrammarBitmaskProcessor.prepare = prepare
        return self

    def __exit__(self, *exc) -> None:
        GrammarBitmaskProcessor.prepare = self._prepare


class PhaseTimer:
    """Host seconds inside each engine phase (patched methods), to say where a run's time goes."""

    PHASES = {"schedule": ("scheduler", "schedule"), "launch": ("executor", "launch"),
              "forward": ("executor", "forward"), "sample": ("executor", "sample"),
              "process": ("output_processor", "process"), "read tokens": (None, "token_ids")}

    def __init__(self, llm: LLM) -> None:
        self.llm, self.seconds, self.undo = llm, dict.fromkeys(self.PHASES, 0.0), []

    def __enter__(self) -> PhaseTimer:
        from nanovllm.executor.step import LaunchedStep

        for name, (owner, attr) in self.PHASES.items():
            target = LaunchedStep if owner is None else getattr(self.llm, owner)
            original = getattr(target, attr)

            def timed(*args, _original=original, _name=name, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.seconds[_name] += time.perf_counter() - start

            setattr(target, attr, timed)
            self.undo.append((target, attr, original))
        return self

    def __exit__(self, *exc) -> None:
        for target, attr, original in reversed(self.undo):
            setattr(target, attr, original)

    def line(self) -> str:
        return ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in self.seconds.items())


def run_one(llm: LLM, prompts, params) -> tuple[list[int], float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


def compare(llm: LLM, name: str, prompts, max_tokens, schemas: list[dict], temperature: float) -> None:
    specs = [StructuredOutputsParams(json=schemas[i % len(schemas)]) for i in range(len(prompts))]
    constrained = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, structured_outputs=s)
                   for n, s in zip(max_tokens, specs)]
    run_one(llm, prompts[:4], constrained[:4])  # warm-up: the schemas compile here, not in the timed runs
    # Both timed runs find the prompts in the prefix cache, not only the second.
    run_one(llm, prompts, SamplingParams(max_tokens=1))
    llm.reset_stats()
    with MaskTimer() as timer, PhaseTimer(llm) as phases:
        lengths, constrained_s = run_one(llm, prompts, constrained)
    constrained_stats = llm.stats()
    free = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.reset_stats()
    with PhaseTimer(llm) as free_phases:
        free_lengths, free_s = run_one(llm, prompts, free)
    free_stats = llm.stats()
    assert free_lengths == lengths
    tokens = sum(lengths)
    print(f"{name}: {tokens} output tokens; constrained {constrained_s:.2f} s ({tokens / constrained_s:,.0f} tok/s), "
          f"unconstrained {free_s:.2f} s ({tokens / free_s:,.0f} tok/s): {free_s / constrained_s:.1%} of unconstrained")
    print(f"  bitmask on the host: {timer.seconds * 1e3 / max(timer.steps, 1):.2f} ms per step over {timer.steps} steps, "
          f"{timer.seconds * 1e6 / max(timer.rows, 1):.1f} us per row")
    for label, stats, timed in (("constrained", constrained_stats, phases), ("unconstrained", free_stats, free_phases)):
        print(f"  {label}: {stats['prefill_steps']} prefill steps in {stats['prefill_time_s']:.2f} s, "
              f"{stats['decode_steps']} decode steps in {stats['decode_time_s']:.2f} s; host: {timed.line()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--min-len", type=int)
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--temperature", type=float, default=0.6)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(logging.WARNING)
    engine_args = engine_arguments(args)
    cuda = torch.cuda.is_available() and engine_args.get("device", "auto") != "cpu"
    with tempfile.TemporaryDirectory(prefix="nanovllm-bench-") as tmp:
        if args.model:
            folder = args.model
        elif cuda:
            folder = write_dummy_checkpoint("qwen3-0.6b", tmp)
            engine_args.setdefault("load_format", "dummy")
        else:
            folder = DEMO_MODEL_DIR
        default_seqs, default_min, default_max = GPU_WORKLOAD if cuda else CPU_WORKLOAD
        llm = LLM(folder, **engine_args)
        prompts, max_tokens = make_workload(args.num_seqs or default_seqs, args.min_len or default_min,
                                            args.max_len or default_max, llm.vocab_size)
        schemas = [schema(i) for i in range(8)]
        start = time.perf_counter()
        llm.generate([[1]], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=schemas[0])),
                     use_tqdm=False)  # builds the compiler (the tokenizer's vocabulary) and compiles the first
        print(f"first structured request (compiler set-up + compile + 1 token): {time.perf_counter() - start:.2f} s")
        for i, s in enumerate(schemas[1:], 1):
            start = time.perf_counter()
            llm.grammars.compile(StructuredOutputsParams(json=s)).result()
            print(f"  schema {i} compiled in {(time.perf_counter() - start) * 1e3:.1f} ms")
        compare(llm, "one schema", prompts, max_tokens, schemas[:1], args.temperature)
        compare(llm, "eight schemas", prompts, max_tokens, schemas, args.temperature)
        llm.shutdown()


if __name__ == "__main__":
    main()

"""How many variants of each Triton kernel an engine compiles: Triton compiles a kernel once
per specialization (dtypes, constexprs, and each integer argument's value class: 1,
divisible by 16, other), and on a machine's first start every variant costs a compile.

    python benchmarks/kernel_variants.py [--arch qwen3-0.6b] [--top 30]

Builds the engine on dummy weights (CUDA graphs captured), generates a few requests with
temperature and with top-k/top-p, then prints each kernel's variants, most first, and
which of its arguments' specializations told them apart (their values, one per variant).
"""
from __future__ import annotations

import argparse
import ast
import gc
import tempfile
import time

from triton.runtime.jit import JITFunction

from nanovllm.entrypoints.bench import ARCHS, write_dummy_checkpoint
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams


def variants(fn: JITFunction) -> list:
    keys = []
    for cache in fn.device_caches.values():
        keys.extend(cache[0].keys())
    return keys


def differences(fn: JITFunction) -> list[tuple[str, list[str]]]:
    """The arguments (and launch options) whose specialization differs between fn's
    variants, each with its value per variant. A key is the specialization list's repr,
    then the options dict's."""
    parsed = []
    for key in variants(fn):
        text = str(key)
        cut = text.find("]{")
        try:
            spec = ast.literal_eval(text[:cut + 1]) if cut >= 0 else ast.literal_eval(text)
            options = ast.literal_eval(text[cut + 1:]) if cut >= 0 else {}
        except (ValueError, SyntaxError):
            return [("key", [text[:200] for text in map(str, variants(fn))])]
        names = list(fn.arg_names) + [f"option {name}" for name in options]
        parsed.append(dict(zip(names, [str(v) for v in spec] + [str(v) for v in options.values()])))
    names = dict.fromkeys(name for variant in parsed for name in variant)
    return [(name, [variant.get(name, "-") for variant in parsed]) for name in names
            if len({variant.get(name) for variant in parsed}) > 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=list(ARCHS), default="qwen3-0.6b")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        llm = LLM(write_dummy_checkpoint(args.arch, tmp), load_format="dummy")
        print(f"engine built in {time.perf_counter() - start:.1f} s")
        prompts = [[(i * 7 + j) % 1000 + 1 for j in range(64 + 16 * i)] for i in range(8)]
        for params in (SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True),
                       SamplingParams(temperature=0.6, top_k=50, top_p=0.9, max_tokens=16, ignore_eos=True)):
            llm.generate(prompts, params, use_tqdm=False)
        kernels = [obj for obj in gc.get_objects() if isinstance(obj, JITFunction)]
        rows = sorted(((len(variants(fn)), fn) for fn in kernels), key=lambda row: -row[0])
        print(f"{sum(n for n, _ in rows)} variants of {sum(1 for n, _ in rows if n)} kernels")
        for n, fn in rows[:args.top]:
            if n == 0:
                break
            print(f"{n:4d}  {fn.fn.__module__}.{fn.fn.__name__}")
            for name, values in differences(fn):
                print(f"        {name}: {', '.join(values)}")

if __name__ == "__main__":
    main()

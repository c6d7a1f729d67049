"""Offline generation with nanovllm.

    python examples/generate.py                      # a tiny random checkpoint made on the spot
    python examples/generate.py --model ~/Qwen3-0.6B # a real Hugging Face checkpoint folder

Without --model the output is noise (random weights); the point is the whole path:
checkpoint folder -> tokenizer -> scheduler -> paged KV cache -> sampler -> text.
"""
import argparse
import tempfile

from nanovllm import LLM, SamplingParams
from nanovllm.testing.checkpoints import make_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local Hugging Face checkpoint folder (default: a tiny random Qwen3)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args()

    model = args.model or str(make_tiny_checkpoint(tempfile.mkdtemp(prefix="nanovllm-tiny-"), "qwen3"))
    prompts = ["Introduce yourself.", "List all prime numbers within 100.", "def fibonacci(n):"]
    with LLM(model, enforce_eager=True) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    for out in outputs:
        print(f"\nPrompt: {out.prompt!r}\nCompletion: {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()

"""Offline generation with nanovllm's Python API.

    python examples/generate.py                      # the bundled demo model
    python examples/generate.py --model ~/Qwen3-0.6B # a real Hugging Face checkpoint folder
"""
import argparse

from nanovllm import LLM, SamplingParams
from nanovllm.demo import demo_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local Hugging Face checkpoint folder (default: the bundled demo model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args()

    prompts = ["def fibonacci(n):", "import os", "class Stack:"]
    with LLM(args.model or demo_model_path()) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    for out in outputs:
        print(f"\nPrompt: {out.prompt!r}\nCompletion: {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()

"""How well the bundled demo models know Python they never saw, on CPU.

    python benchmarks/eval_demo.py                                   # every held-out module, 20 headers
    python benchmarks/eval_demo.py --max-files 2 --max-chars 4000 --headers 2 --json

The text is the held-out modules (nanovllm.demo.corpus.HELD_OUT_MODULES), read from this
Python's standard library and never part of training. Each file, after an <|endoftext|>
as the training stream has, is cut into windows of the context length. Printed:
  - bits per byte of the target and of the draft: their summed next-token loss over the
    file's UTF-8 bytes;
  - agreement: how often the draft's greedy next token is the target's, over the same
    positions (what speculative decoding's acceptance builds on);
  - headers: of `--headers` function headers spread over those files, how many the target
    continues greedily (nanovllm on CPU) into code that `ast.parse` accepts once the
    completion is cut at its last complete line and what is left open at its end (a
    string, brackets, a block with no body yet) is closed.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import math
import sys
import tokenize

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.demo import DEMO_DRAFT_MODEL_DIR, DEMO_MODEL_DIR
from nanovllm.demo.corpus import held_out_sources

HEADERS = 20
MAX_TOKENS = 96
BRACKETS = {"(": ")", "[": "]", "{": "}"}
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
# Rounds of closing: each closes one string left open (a string's text can hide brackets).
MAX_ROUNDS = 3


@torch.no_grad()
def score(target: torch.nn.Module, draft: torch.nn.Module, sequences: list[list[int]],
          context_len: int) -> tuple[float, float, float, int]:
    """(target nats, draft nats, share of positions where the two greedy tokens agree,
    positions) over every next-token position of the sequences, each cut into windows of
    context_len inputs (a window's last label is the next window's first input)."""
    target_nats = draft_nats = 0.0
    agree = positions = 0
    for ids in sequences:
        for start in range(0, len(ids) - 1, context_len):
            window = torch.tensor([ids[start : start + context_len + 1]])
            inputs, labels = window[:, :-1], window[0, 1:]
            target_logits, draft_logits = target(inputs).logits[0].float(), draft(inputs).logits[0].float()
            target_nats += F.cross_entropy(target_logits, labels, reduction="sum").item()
            draft_nats += F.cross_entropy(draft_logits, labels, reduction="sum").item()
            agree += (target_logits.argmax(-1) == draft_logits.argmax(-1)).sum().item()
            positions += len(labels)
    return target_nats, draft_nats, agree / positions, positions


def header(lines: list[str], node: ast.FunctionDef | ast.ClassDef) -> str | None:
    """A def or class statement's header, up to its colon; None where something else
    follows the colon on its line (a one-line body, a comment)."""
    text = "\n".join(lines[node.lineno - 1 : node.body[0].lineno - 1]).rstrip()
    return text if text.endswith(":") else None


def function_headers(sources: list[str], count: int) -> list[str]:
    """`count` headers spread evenly over the files' top-level functions and methods. A
    method's comes after its class's header, which sets its indentation; each ends at its
    colon (the body, newline included, is the model's to write)."""
    headers = []
    for source in sources:
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                headers.append(header(lines, node))
            elif isinstance(node, ast.ClassDef) and (class_header := header(lines, node)):
                headers.extend(class_header + "\n" + method for item in node.body
                               if isinstance(item, ast.FunctionDef) and (method := header(lines, item)))
    headers = [text for text in headers if text]
    if len(headers) <= count or count < 2:
        return headers[:count]
    return [headers[round(i * (len(headers) - 1) / (count - 1))] for i in range(count)]


def close_open_blocks(source: str) -> str:
    """The source with what is open at its end closed: a string, then brackets, then a
    block that has no statement yet (given `pass`)."""
    for _ in range(MAX_ROUNDS):
        closers: list[str] = []
        last = None  # the last token that is code (not a comment, newline or indentation)
        try:
            for token in tokenize.generate_tokens(io.StringIO(source).readline):
                if token.type == tokenize.OP and token.string in BRACKETS:
                    closers.append(BRACKETS[token.string])
                elif token.type == tokenize.OP and token.string in BRACKETS.values() and closers:
                    closers.pop()
                if token.type not in NOT_CODE:
                    last = token
        except tokenize.TokenError as error:
            if "string" in error.args[0]:  # EOF in multi-line string: close it with its own quotes
                row, col = error.args[1]
                opening = source.splitlines()[row - 1][col:].lstrip("rRbBuUfF")[:3]
                source = source.rstrip("\n") + opening + "\n"
                continue
        except (IndentationError, SyntaxError):
            return source
        break
    if closers:
        return source.rstrip("\n") + "".join(reversed(closers)) + "\n"
    if last is not None and last.string == ":":
        indent = len(last.line) - len(last.line.lstrip())
        return source.rstrip("\n") + "\n" + " " * (indent + 4) + "pass\n"
    return source


def parses(prompt: str, completion: str, finished: bool) -> bool:
    """Whether prompt + completion parses, cut at its last complete line (unless the model
    ended it) and closed."""
    text = prompt + completion
    if not finished:
        text = text[: text.rfind("\n") + 1]
    try:
        ast.parse(close_open_blocks(text))
    except SyntaxError:
        return False
    return True


def evaluate(max_files: int | None, max_chars: int | None, headers: int, max_tokens: int) -> dict:
    sources = list(held_out_sources().values())[:max_files]
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    target, draft = (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
                     for folder in (DEMO_MODEL_DIR, DEMO_DRAFT_MODEL_DIR))
    texts = [source[:max_chars] for source in sources]
    sequences = [[tokenizer.eos_token_id] + tokenizer.encode(text) for text in texts]  # as in the training stream
    target_nats, draft_nats, agreement, positions = score(target, draft, sequences,
                                                          target.config.max_position_embeddings)
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)

    prompts = function_headers(sources, headers)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    with LLM(DEMO_MODEL_DIR, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=512) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    parsed = [parses(out.prompt, out.outputs[0].text, out.outputs[0].finish_reason == "stop") for out in outputs]
    return {
        "files": len(sources),
        "bytes": num_bytes,
        "tokens": positions,
        "target_bits_per_byte": target_nats / math.log(2) / num_bytes,
        "draft_bits_per_byte": draft_nats / math.log(2) / num_bytes,
        "agreement": agreement,
        "headers": len(prompts),
        "headers_parsed": sum(parsed),
        "samples": [{"prompt": out.prompt, "completion": out.outputs[0].text, "parses": ok}
                    for out, ok in zip(outputs, parsed)],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-files", type=int, help="the first N held-out modules (default: all)")
    parser.add_argument("--max-chars", type=int, help="score the first N characters of each (default: all)")
    parser.add_argument("--headers", type=int, default=HEADERS, help=f"function headers to continue (default: {HEADERS})")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"tokens per continuation (default: {MAX_TOKENS})")
    parser.add_argument("--show", action="store_true", help="print every continuation")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    result = evaluate(args.max_files, args.max_chars, args.headers, args.max_tokens)
    if args.json:
        json.dump(result, sys.stdout)
        print()
        return
    if args.show:
        for sample in result["samples"]:
            print(f"--- parses: {sample['parses']}\n{sample['prompt']}{sample['completion']}\n")
    print(f"held-out: {result['files']} files, {result['bytes']:,} bytes, {result['tokens']:,} tokens "
          f"({result['bytes'] / result['tokens']:.2f} bytes/token)")
    print(f"target bits/byte {result['target_bits_per_byte']:.3f}   draft bits/byte {result['draft_bits_per_byte']:.3f}   "
          f"draft/target greedy agreement {result['agreement']:.1%}")
    print(f"function headers continued into code that parses: {result['headers_parsed']} of {result['headers']} "
          f"(greedy, {args.max_tokens} tokens)")


if __name__ == "__main__":
    main()

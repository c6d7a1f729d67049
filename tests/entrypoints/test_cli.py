"""The `nanovllm` command, run as a user would: a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nanovllm.entrypoints.cli import build_parser, engine_fields


def nanovllm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanovllm", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_generate_with_the_demo_model_and_no_flags():
    result = nanovllm("generate", "def fibonacci(", "--max-tokens", "12", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def fibonacci(")
    assert len(result.stdout.strip()) > len("def fibonacci(")


def test_generate_json_from_stdin(qwen3_ckpt):
    result = nanovllm("generate", "--model", str(qwen3_ckpt), "--json", "--max-tokens", "5", "--ignore-eos",
                      "--device", "cpu", "--num-kvcache-blocks", "16", stdin="Hello\nworld\n")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "world"]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in rows)


def test_sampling_flags_penalties_and_stop(qwen3_ckpt):
    """--seed (the engine's) repeats a sampled completion; --stop cuts it at a string."""
    common = ["generate", "--model", str(qwen3_ckpt), "--json", "--max-tokens", "12", "--ignore-eos", "--device",
              "cpu", "--num-kvcache-blocks", "16", "--temperature", "1.0", "--seed", "3", "--repetition-penalty", "1.3",
              "--presence-penalty", "0.5", "Hello"]
    first, again = (json.loads(nanovllm(*common).stdout) for _ in range(2))
    assert first["token_ids"] == again["token_ids"] and len(first["token_ids"]) == 12
    stop = first["text"][3:6]
    cut = json.loads(nanovllm(*common, "--stop", stop).stdout)
    assert cut["text"] == first["text"][: first["text"].find(stop)]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    bad = nanovllm("generate", "x", "--top-p", "0")
    assert bad.returncode != 0 and "top_p" in bad.stderr


def test_chat_streams_a_reply(qwen3_ckpt):
    result = nanovllm("chat", "--model", str(qwen3_ckpt), "--max-tokens", "6", "--device", "cpu",
                      "--num-kvcache-blocks", "16", stdin="hi there\n\n")
    assert result.returncode == 0, result.stderr
    assert "> " in result.stdout


def test_bad_engine_flag_is_reported():
    result = nanovllm("generate", "x", "--dtype", "int3")
    assert result.returncode != 0 and "invalid choice" in result.stderr


def test_every_engine_argument_is_a_flag():
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]  # noqa: SLF001
    flags = {opt for action in generate._actions for opt in action.option_strings}  # noqa: SLF001
    for f in engine_fields():
        assert "--" + f.name.replace("_", "-") in flags
        assert f.metadata.get("help"), f"engine argument {f.name} has no help text"


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_help(command):
    result = nanovllm(command, "--help")
    assert result.returncode == 0 and "usage: nanovllm" in result.stdout

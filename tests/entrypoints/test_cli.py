"""The `nanovllm` command, run as a user would: a subprocess."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nanovllm.entrypoints.arguments import engine_arguments, engine_fields
from nanovllm.entrypoints.cli import build_parser
from parity import fail_at_call


def nanovllm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanovllm", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_generate_with_the_demo_model_and_no_flags():
    """Completions alone by default; --echo shows each prompt, marked, and its completion
    going on from it."""
    result = nanovllm("generate", "def fibonacci(", "--max-tokens", "12", "--device", "cpu")
    assert result.returncode == 0 and result.stderr == "", result.stderr  # a quiet run and exit
    completion = result.stdout
    assert completion.strip() and not completion.startswith("def fibonacci(")
    echoed = nanovllm("generate", "def fibonacci(", "import os", "--max-tokens", "12", "--device", "cpu", "--echo")
    assert echoed.stdout.startswith(">>> def fibonacci(" + completion) and "\n>>> import os" in echoed.stdout


def test_generate_json_from_stdin(qwen3_ckpt):
    result = nanovllm("generate", "--model", str(qwen3_ckpt), "--json", "--max-tokens", "5", "--ignore-eos",
                      "--device", "cpu", "--num-kvcache-blocks", "16", stdin="Hello\nworld\n")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "world"]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in rows)


def test_fp8_flags(qwen3_ckpt):
    """--kv-cache-dtype and --quantization reach the engine (every command takes them);
    a bad value is one line."""
    result = nanovllm("generate", "--model", str(qwen3_ckpt), "--json", "--max-tokens", "4", "--ignore-eos",
                      "--device", "cpu", "--num-kvcache-blocks", "16", "--kv-cache-dtype", "fp8",
                      "--calculate-kv-scales", "--quantization", "fp8", stdin="Hello\n")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) == 4
    bad = nanovllm("generate", "--model", str(qwen3_ckpt), "--device", "cpu", "--kv-cache-dtype", "int8", "x")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "kv_cache_dtype must be one of" in bad.stderr


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


def test_chat_with_a_system_prompt_replies_as_llm_chat(qwen3_ckpt):
    system = "You answer in one word."
    result = nanovllm("chat", "--model", str(qwen3_ckpt), "--max-tokens", "6", "--temperature", "0", "--device", "cpu",
                      "--system-prompt", system, stdin="hi there\n\n")
    assert result.returncode == 0, result.stderr
    from nanovllm import LLM, SamplingParams

    with LLM(str(qwen3_ckpt), device="cpu") as llm:
        [out] = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": "hi there"}],
                         SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert "> " + out.outputs[0].text + "\n" in result.stdout


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
def test_help_answers_without_loading_torch(command):
    start = time.monotonic()
    result = nanovllm(command, "--help")
    assert result.returncode == 0 and "usage: nanovllm" in result.stdout
    assert time.monotonic() - start < HELP_BOUND_S  # generous: torch alone takes seconds to import
    loaded = subprocess.run([sys.executable, "-c", "import sys; from nanovllm.entrypoints.cli import build_parser; "
                             "build_parser(); print('torch' in sys.modules, 'transformers' in sys.modules)"],
                            capture_output=True, text=True, timeout=60)
    assert loaded.stdout.split() == ["False", "False"], loaded.stderr


HELP_BOUND_S = 3.0


def test_the_package_lists_llm_before_loading_it():
    """dir(nanovllm) names LLM (for tab completion) although LLM loads on first use."""
    listed = subprocess.run([sys.executable, "-c", "import sys, nanovllm; "
                             "print('LLM' in dir(nanovllm), 'torch' in sys.modules)"],
                            capture_output=True, text=True, timeout=60)
    assert listed.stdout.split() == ["True", "False"], listed.stderr


def test_version():
    from nanovllm import __version__

    result = nanovllm("--version")
    assert result.returncode == 0 and result.stdout.strip() == __version__


@pytest.mark.parametrize(("args", "prefix", "fragment"), [
    (["generate", "x", "--model", "Qwen/Qwen3-0.6B"], "nanovllm", "hf download Qwen/Qwen3-0.6B"),
    (["generate", "x", "--model", "/no/such/folder"], "nanovllm", "local Hugging Face checkpoint folder"),
    (["generate", "x", "--max-tokens", "0", "--device", "cpu"], "nanovllm", "max_tokens must be an integer >= 1"),
    (["chat", "--model", "/no/such/folder"], "nanovllm", "config.json"),
    (["serve", "--model", "Qwen/Qwen3-0.6B", "--port", "0"], "nanovllm", "hf download"),
    # A template file that is not there is not taken for a template that renders its own name.
    (["serve", "--chat-template", "./no/such/template.jinja", "--port", "0", "--device", "cpu"], "nanovllm",
     "no chat template file './no/such/template.jinja'"),
    # Mistakes in the flags themselves: the command's name and what is wrong, not its usage.
    (["generate", "x", "--no-such-flag", "1"], "nanovllm generate", "unrecognized arguments: --no-such-flag"),
    (["bench", "--num-seqs", "many"], "nanovllm bench", "--num-seqs"),
    (["serve", "--port", "99999"], "nanovllm serve", "an integer between 0 and 65535, got '99999'"),
    (["serve", "--port", "http"], "nanovllm serve", "an integer between 0 and 65535, got 'http'"),
    (["no-such-command"], "nanovllm", "invalid choice"),
    (["serve", "--allowed-origins", "*"], "nanovllm serve", "a JSON list of strings"),
    # Refused before the engine process starts: no line of its log follows (nor its build's wait).
    (["serve", "--ssl-keyfile", "key.pem", "--port", "0", "--device", "cpu"], "nanovllm",
     "TLS needs both --ssl-keyfile and --ssl-certfile"),
    (["serve", "--ssl-keyfile", "key.pem", "--ssl-certfile", "cert.pem", "--port", "0", "--device", "cpu"],
     "nanovllm", "no such TLS file: key.pem"),
    (["serve", "--max-n", "0", "--port", "0", "--device", "cpu"], "nanovllm",
     "max_n (--max-n) must be a positive integer, got 0"),
    (["generate", "x", "--no-enable-chunked-prefill", "--device", "cpu"], "nanovllm",
     "enable_chunked_prefill=False is not supported"),
])
def test_errors_are_one_line_and_exit_2(args, prefix, fragment):
    result = nanovllm(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{prefix}: error: "), result.stderr
    assert fragment in lines[0]


def test_vllms_older_server_module_serves():
    """`python -m nanovllm.entrypoints.openai.api_server FLAGS` is `nanovllm serve FLAGS`, as
    vLLM's module is `vllm serve`."""
    module = [sys.executable, "-m", "nanovllm.entrypoints.openai.api_server"]
    result = subprocess.run([*module, "--model", "/no/such/folder", "--port", "0"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "local Hugging Face checkpoint folder" in result.stderr, result.stderr
    result = subprocess.run([*module, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: nanovllm serve")


def test_vllm_flag_aliases():
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "-tp", "2", "--block-size", "16", "--dtype", "half",
                              "--served-model-name", "a", "b", "--uvicorn-log-level", "warning",
                              "--generation-config", "vllm", "--disable-log-requests", "--max-logprobs", "5"])
    assert (args.tensor_parallel_size, args.kvcache_block_size, args.dtype) == (2, 16, "half")
    assert args.served_model_name == ["a", "b"] and args.log_level == "warning"
    assert args.generation_config == "vllm" and args.disable_log_requests and args.max_logprobs == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--no-such-flag"])


def test_only_the_flags_given_reach_the_engine_and_seed_none_is_one():
    parser = build_parser()
    assert engine_arguments(parser.parse_args(["serve", "m"])) == {}
    args = parser.parse_args(["generate", "x", "--seed", "none", "--no-enable-prefix-caching"])
    assert engine_arguments(args) == {"seed": None, "enable_prefix_caching": False}
    assert engine_arguments(parser.parse_args(["generate", "x", "--seed", "7"])) == {"seed": 7}


def test_chat_survives_ctrl_c_in_a_reply_and_ends_on_ctrl_d():
    """Ctrl-C stops the reply where it is and the chat goes on; end of input ends it."""
    chat = subprocess.Popen([sys.executable, "-m", "nanovllm", "chat", "--device", "cpu", "--max-tokens", "300",
                             "--ignore-eos"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=0)
    try:
        assert "Ctrl-C" in chat.stdout.readline()
        chat.stdin.write("def f(x):\n")
        assert chat.stdout.read(3).startswith("> ")  # the prompt, then the reply streams
        chat.stdout.read(20)
        chat.send_signal(signal.SIGINT)
        chat.stdin.write("again\n")
        chat.stdin.close()  # Ctrl-D after the second reply
        rest = chat.stdout.read()
        assert chat.wait(timeout=120) == 0, chat.stderr.read()
    finally:
        chat.kill()
    assert "[stopped]" in rest and rest.count("> ") >= 1


def test_chat_replies_within_max_model_len_and_says_when_a_turn_cannot_fit():
    """A reply ends where max_model_len does, not in an error; a turn that cannot fit any
    more is one line on stderr, and the chat goes on to its end."""
    result = nanovllm("chat", "--device", "cpu", "--max-model-len", "64", "--max-tokens", "900", "--ignore-eos",
                      stdin="def f(x):\nagain\nand again\n")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("nanovllm: the conversation (") for line in lines), lines
    assert "fills the 64 tokens a sequence may hold (max_model_len, the KV cache); end the chat" in lines[0]
    assert result.stdout.count("> ") == 4 and result.stdout.split("> ")[1].strip()  # the one reply


def test_bench_on_cpu_with_the_demo_model(tmp_path):
    """A small workload that ends in seconds, ids inside the demo vocabulary, no files left;
    with Hugging Face's continuous batching beside it (--peer hf), on the CPU too."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "nanovllm", "bench", "--device", "cpu", "--num-seqs", "4",
                             "--max-len", "24", "--peer", "hf"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "model: the demo model" in result.stdout and "output tok/s" in result.stdout
    assert "workload: 4 requests, prompt and output lengths 16-24 tokens\n" in result.stdout
    assert "hf continuous batching: " in result.stdout and "nanovllm is " in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_a_step_is_read_stops_the_reply_and_the_next_one_is_whole(qwen3_ckpt, monkeypatch):
    """chat's Ctrl-C landing while the engine records a step's tokens (here raised by the
    output processor at its third read): the reply stops, nothing is left running or
    held, and the next reply is the one the prompt gets alone."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.entrypoints.cli import stream_tokens

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(qwen3_ckpt), device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        whole = "".join(stream_tokens(llm, [5] * 20, params))
        fail_at_call(monkeypatch, llm.output_processor, "process", 3, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            for _ in stream_tokens(llm, [5] * 20, params):
                pass
        monkeypatch.undo()
        assert llm.is_finished() and llm.scheduler.block_manager.num_used_blocks == 0
        assert "".join(stream_tokens(llm, [5] * 20, params)) == whole

"""`nanovllm run-batch`: OpenAI's batch file format through the server's own handling."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.openai.run_batch import parse_line

COMPLETION = {"prompt": "The quick brown", "max_tokens": 6, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0}


def request(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_file_of_completions_chats_and_bad_lines(qwen3_ckpt, tmp_path):
    """Results come in input order; completions and chats equal offline greedy output; a
    line that is no request gets an error result naming its line in the input, a request
    the server refuses its 400; "-" reads standard input and writes standard output."""
    lines = [
        request("first", "/v1/completions", COMPLETION),
        request("second", "/v1/chat/completions", CHAT),
        "{not json",
        request("bad-url", "/v1/embeddings", {"input": "x"}),
        request("refused", "/v1/completions", {**COMPLETION, "temperature": -1}),
        request("third", "/v1/completions", {**COMPLETION, "prompt": "Once upon a time", "n": 2}),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines[:2] + [" "] + lines[2:]) + "\n\n")  # blank lines are skipped
    outputs = []
    for path, flags in ((target, []), ("-", ["-dp", "2"])):  # a file by one engine, standard output by two
        done = subprocess.run([sys.executable, "-m", "nanovllm", "run-batch", "-i", "-", "-o", str(path),
                               "--model", str(qwen3_ckpt), "--device", "cpu", "--dtype", "float32",
                               "--response-role", "helper", "--enable-prompt-tokens-details", *flags],
                              input=source.read_text(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        where = "standard output" if path == "-" else path
        assert done.stderr.strip().endswith(f"6 requests, 3 answered with 200, 3 with an error: {where}")
        outputs.append(target.read_text() if path == target else done.stdout)
    results = [json.loads(line) for line in outputs[0].splitlines()]

    def comparable(result: dict) -> tuple:  # what does not depend on ids and clocks
        body = (result["response"] or {}).get("body", {})
        return result["custom_id"], result["error"], [c.get("text") or c.get("message") for c in body.get("choices", [])]

    assert [comparable(json.loads(line)) for line in outputs[1].splitlines()] == list(map(comparable, results))
    assert [r["custom_id"] for r in results] == ["first", "second", None, "bad-url", "refused", "third"]
    assert len({r["id"] for r in results}) == 6

    with LLM(str(qwen3_ckpt), device="cpu", dtype="float32") as llm:
        greedy = SamplingParams(temperature=0, max_tokens=6)
        offline = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].text for p in ("The quick brown", "Once upon a time")]
        chat = llm.chat(CHAT["messages"], greedy, use_tqdm=False)[0].outputs[0].text
    first, second, not_json, bad_url, refused, third = results
    assert first["response"]["status_code"] == 200 and first["error"] is None
    assert first["response"]["body"]["choices"][0]["text"] == offline[0]
    assert first["response"]["body"]["model"] == qwen3_ckpt.name
    assert second["response"]["body"]["choices"][0]["message"]["content"] == chat
    assert second["response"]["body"]["choices"][0]["message"]["role"] == "helper"  # --response-role
    for answered in (first, second, third):  # --enable-prompt-tokens-details
        assert answered["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert [c["text"] for c in third["response"]["body"]["choices"]] == [offline[1]] * 2
    assert not_json["response"] is None and "line 4 is not JSON" in not_json["error"]["message"]
    assert bad_url["response"] is None and "/v1/embeddings" in bad_url["error"]["message"]
    assert refused["response"]["status_code"] == 400 and refused["error"] is None
    assert "temperature" in refused["response"]["body"]["error"]["message"]


def test_the_readmes_example_file_runs_on_the_demo_model(tmp_path):
    """README's `nanovllm run-batch -i examples/requests.jsonl`: every request answered."""
    source = Path(__file__).parents[2] / "examples" / "requests.jsonl"
    done = subprocess.run([sys.executable, "-m", "nanovllm", "run-batch", "-i", str(source), "-o", str(tmp_path / "o"),
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in (tmp_path / "o").read_text().splitlines()]
    assert [r["response"]["status_code"] for r in results] == [200, 200]
    assert all(r["response"]["body"]["choices"] for r in results)


@pytest.mark.parametrize("line,fragment", [
    ("[1, 2]", "not a JSON object"),
    ("[" * 5000, "line 7 is nested too deeply"),
    (request("x", "/v1/completions", {"prompt": "a"}).replace('"POST"', '"GET"'), "method must be POST"),
    (json.dumps({"custom_id": "x", "url": "/v1/completions", "body": "text"}), "body must be a JSON object"),
    (request("x", "/v1/completions", {"prompt": "a", "stream": True}), "cannot stream"),
])
def test_lines_that_are_not_requests(line, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_line(line, 7)


def test_auto_tool_choice_without_a_parser_is_one_line(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(request("x", "/v1/completions", COMPLETION) + "\n")
    done = subprocess.run([sys.executable, "-m", "nanovllm", "run-batch", "-i", str(source), "-o", str(tmp_path / "o"),
                           "--enable-auto-tool-choice"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "nanovllm: error: --enable-auto-tool-choice needs --tool-call-parser (hermes)"


def test_a_missing_input_file_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "nanovllm", "run-batch", "-i", str(tmp_path / "none.jsonl"),
                           "-o", str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == f"nanovllm: error: no input file {str(tmp_path / 'none.jsonl')!r}"


def test_an_output_file_that_cannot_be_written_is_one_line_before_any_work(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(request("x", "/v1/completions", COMPLETION) + "\n")
    for output, why in ((tmp_path / "nowhere" / "out.jsonl", f"no folder {str(tmp_path / 'nowhere')!r}"),
                        (tmp_path, "it is a folder")):
        done = subprocess.run([sys.executable, "-m", "nanovllm", "run-batch", "-i", str(source), "-o", str(output)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2
        assert done.stderr.strip() == f"nanovllm: error: cannot write the output file {str(output)!r}: {why}"


def test_which_output_paths_count_as_writable(tmp_path, monkeypatch):
    """An existing file's own permission decides (a read-only folder does not matter: it is
    written in place), a new file's folder's; links are followed."""
    from nanovllm.entrypoints.cli import unwritable

    tmp_path = tmp_path.resolve()  # the paths as unwritable sees them, links followed
    folder, existing = tmp_path / "ro", tmp_path / "ro" / "kept.jsonl"
    folder.mkdir()
    existing.write_text("")
    dangling = tmp_path / "link.jsonl"
    dangling.symlink_to(tmp_path / "gone" / "out.jsonl")
    read_only = {str(folder)}  # as a user without root would see it
    monkeypatch.setattr("os.access", lambda p, mode: str(p) not in read_only)
    assert unwritable(str(existing)) is None
    assert unwritable(str(folder / "new.jsonl")) == f"{str(folder)!r} is not writable"
    assert unwritable(str(dangling)) == f"no folder {str(tmp_path / 'gone')!r}"
    assert unwritable(str(tmp_path / "new.jsonl")) is None
    read_only.add(str(existing))
    assert unwritable(str(existing)) == "permission denied"


def test_files_are_utf8_whatever_the_locale(tmp_path):
    """The input is read and the results written as UTF-8 where the locale says ASCII (a C
    locale, UTF-8 mode off): a non-ASCII line is no error, and its results are not lost when
    they are written at the end; input that is not UTF-8 is one clear line."""
    source, target, latin1 = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "latin1.jsonl"
    line = json.dumps({"custom_id": "café", "method": "POST", "url": "/v1/completions",
                       "body": {**COMPLETION, "prompt": "Größe 你好"}}, ensure_ascii=False)
    source.write_text(line + "\n", encoding="utf-8")
    latin1.write_text(line.replace("你好", "") + "\n", encoding="latin-1")
    script = ("import sys\n"
              "from nanovllm.entrypoints.openai.run_batch import read_lines, result, write_results\n"
              "[(number, line)] = read_lines(sys.argv[1])\n"
              "write_results(sys.argv[2], [result('caf\\u00e9', error=line)])\n"  # ASCII: the C locale's argv
              "try:\n"
              "    read_lines(sys.argv[3])\n"
              "except ValueError as exc:\n"
              "    print(exc)\n")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    done = subprocess.run([sys.executable, "-c", script, str(source), str(target), str(latin1)], env=env,
                          capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(target.read_text(encoding="utf-8"))["error"]["message"] == line + "\n"
    assert done.stdout.startswith(f"the input file {str(latin1)!r} is not UTF-8 text")


def test_standard_streams_replaced_by_a_caller(capsys, monkeypatch):
    """run_batch called from code whose standard streams are streams of its own (a capture,
    a notebook): "-" reads and writes those, numbering lines as in the input."""
    import io

    from nanovllm.entrypoints.openai.run_batch import read_lines, result, write_results

    monkeypatch.setattr(sys, "stdin", io.StringIO('{"a": 1}\n\n{"b": 2}\n'))
    assert read_lines("-") == [(1, '{"a": 1}\n'), (3, '{"b": 2}\n')]
    assert write_results("-", [result("x", error="bad line")]) == (1, 1)
    assert json.loads(capsys.readouterr().out)["custom_id"] == "x"


def test_a_chat_template_file(qwen3_ckpt, tmp_path):
    """--chat-template names a file: its text renders the chats (not its name)."""
    template, source, target = tmp_path / "template.jinja", tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    template.write_text("{% for m in messages %}TEMPLATED:{{ m['content'] }}{% endfor %}")
    source.write_text(request("chat", "/v1/chat/completions", {**CHAT, "max_tokens": 1}) + "\n")
    done = subprocess.run([sys.executable, "-m", "nanovllm", "run-batch", "-i", str(source), "-o", str(target),
                           "--model", str(qwen3_ckpt), "--device", "cpu", "--chat-template", str(template)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [answer] = [json.loads(line) for line in target.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(qwen3_ckpt)
    expected = tokenizer.encode("TEMPLATED:Hello there", add_special_tokens=False)
    assert answer["response"]["body"]["usage"]["prompt_tokens"] == len(expected)

"""The `nanovllm` command: generate, chat, serve, run-batch and bench.

    nanovllm generate "def fibonacci(" "import os"     # prompts as arguments
    echo "class Stack:" | nanovllm generate --json      # or one per line on stdin
    nanovllm chat                                       # an interactive, streaming chat
    nanovllm serve MODEL --port 8000                    # the OpenAI-compatible server
    nanovllm bench --num-seqs 64                        # the offline benchmark

Without --model every command uses the small demo model shipped in the package. Engine
arguments (--max-num-seqs, --dtype, ...) come from the fields of nanovllm.config.Config,
so the command line always offers exactly what LLM(...) accepts. torch and transformers
load only once a command runs, so --help answers at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import nanovllm
from nanovllm.demo import model_name
from nanovllm.entrypoints.arguments import add_engine_arguments, engine_arguments
from nanovllm.entrypoints.openai import DEFAULT_SHUTDOWN_TIMEOUT_S
from nanovllm.entrypoints.openai.limits import (
    ResponseOptions, ServerLimits, check_access_flags, check_tool_call_parser,
)
from nanovllm.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from nanovllm.inputs import load_chat_template
from nanovllm.sampling_params import SamplingParams
from nanovllm.serving.router import ROUTING
from nanovllm.utils.log import configure_logging

if TYPE_CHECKING:
    from nanovllm.llm import LLM

LOG_LEVELS = ["trace", "debug", "info", "warning", "error", "critical"]  # uvicorn's


def make_llm(args: argparse.Namespace) -> LLM:
    from nanovllm.llm import LLM

    return LLM(args.model or default_model(), **engine_arguments(args))


def default_model() -> str:
    from nanovllm.demo import demo_model_path

    return demo_model_path()


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default: {max_tokens})")
    group.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set reaching this probability")
    group.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the top one")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, on generated tokens (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, on generated tokens (default: 0)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="transformers', on prompt and generated tokens (default: 1 = off)")
    group.add_argument("--stop", action="append", help="a string that ends the completion (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty, stop=args.stop)


def one_engine(args: argparse.Namespace) -> None:
    """chat runs one engine: -dp N is refused in one line."""
    if (getattr(args, "data_parallel_size", None) or 1) != 1:
        raise ValueError(f"`nanovllm {args.command}` runs one engine; --data-parallel-size (-dp) is for "
                         f"`nanovllm generate`, `serve`, `run-batch`, `bench` and LLM(..., data_parallel_size=N) so far")


def cmd_generate(args: argparse.Namespace) -> None:
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompts: give them as arguments or one per line on stdin")
    params = sampling_params(args)  # checked before the model loads
    with make_llm(args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}))
            continue
        if i:
            print()
        if args.echo:  # the completion goes on from the prompt's last character, as the model read it
            print(PROMPT_MARK + out.prompt, end="")
        print(completion.text)


# Marks where an echoed prompt starts, so that each prompt's text reads apart from the last output.
PROMPT_MARK = ">>> "


def stream_tokens(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
    """Yield the completion's text as it grows, one engine step at a time. Leaving early
    (Ctrl-C, break) aborts the request and frees its KV blocks."""
    request = llm.make_request(prompt_ids, params, stream=True)
    llm.add_request(request)
    try:
        while not request.finished:
            llm.step()
            text = llm.stream_delta(request.seqs[0]).text
            if text:
                yield text
    finally:
        llm.drain()
        llm.abort_request(request)


def cmd_chat(args: argparse.Namespace) -> None:
    one_engine(args)
    from nanovllm.inputs import render_chat

    params = sampling_params(args)
    with make_llm(args) as llm:
        if not llm.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use `nanovllm generate`")
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        print("Chat with the model. Ctrl-C stops a reply; an empty line or Ctrl-D ends the chat.")
        while True:
            try:
                user = input("> ")
            except EOFError:
                print()
                break
            except KeyboardInterrupt:  # at the prompt: a fresh line, the chat goes on
                print()
                continue
            if not user.strip():
                break
            messages.append({"role": "user", "content": user})
            _, prompt_ids = render_chat(llm.tokenizer, messages)
            most = llm.checker.most_tokens
            room = most - len(prompt_ids)
            if room <= 0:  # the turn is dropped; the chat goes on (an empty line or Ctrl-D ends it)
                print(f"nanovllm: the conversation ({len(prompt_ids)} tokens) fills the {most} tokens a sequence "
                      "may hold (max_model_len, the KV cache); end the chat and start a new one", file=sys.stderr)
                messages.pop()
                continue
            reply = ""
            try:  # a reply as long as max_tokens, or as max_model_len leaves room for (make_request fits it)
                for piece in stream_tokens(llm, prompt_ids, params):
                    print(piece, end="", flush=True)
                    reply += piece
            except KeyboardInterrupt:  # the reply stops where it is; the chat keeps it
                print(" [stopped]", end="")
            print()
            messages.append({"role": "assistant", "content": reply})


def json_list(value: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form: '["*"]')."""
    try:
        items = json.loads(value)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"a JSON list of strings, such as '[\"*\"]', got {value!r}")
    return items


def needs_server_packages(command: str, exc: ImportError) -> RuntimeError:
    """The error for a command that needs the serve extra, which is not installed."""
    return RuntimeError(f"`nanovllm {command}` needs the server's packages ({exc.name} is missing): "
                        f"pip install 'nanovllm[serve]' (in a source checkout: bash scripts/setup.sh serve)")


def cmd_serve(args: argparse.Namespace) -> None:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
    args.model = args.model_tag or args.model
    model, engine_args = args.model or default_model(), engine_arguments(args)
    # Bad flags (a mistyped template file, a limit of 0) are refused before the engine process starts.
    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
    load_chat_template(args.chat_template)
    responses = response_options(args, args.chat_template)  # serve() reads it: a template or a file holding one
    check_tool_call_parser(responses, args.tool_call_parser)
    check_access_flags(args.ssl_keyfile, args.ssl_certfile, args.api_key)
    engine_process = None
    if engine_args.get("data_parallel_size", 1) == 1:
        # Started before this process imports the server (torch, transformers, FastAPI): the
        # engine process imports and builds the engine meanwhile.
        from nanovllm.serving.spawn import spawn_engine

        engine_process = spawn_engine(model, engine_args)
    try:
        from nanovllm.entrypoints.openai.api_server import HTTPOptions, serve
    except ImportError as exc:
        if engine_process is not None:
            engine_process.kill()
        raise needs_server_packages("serve", exc) from None
    http = HTTPOptions(args.root_path, args.ssl_keyfile, args.ssl_certfile, tuple(args.allowed_origins),
                       tuple(args.allowed_methods), tuple(args.allowed_headers), args.allow_credentials)
    serve(model, engine_args, args.host, args.port, api_key=args.api_key,
          served_model_names=args.served_model_name, log_level=args.log_level,
          shutdown_timeout=args.shutdown_timeout, limits=limits, responses=responses,
          access_log=not args.disable_log_requests,
          log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
          tool_call_parser=args.tool_call_parser, dp_routing=args.dp_routing, engine_process=engine_process, http=http)


def unwritable(path: str) -> str | None:
    """Why `open(path, "w")` would fail; None if it would not. Where path (through its links)
    exists, that file's own permission decides; a new file needs its folder's."""
    real = os.path.realpath(path)
    if os.path.isdir(real):
        return "it is a folder"
    if os.path.exists(real):
        return None if os.access(real, os.W_OK) else "permission denied"
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        return f"no folder {folder!r}"
    return None if os.access(folder, os.W_OK | os.X_OK) else f"{folder!r} is not writable"


def cmd_run_batch(args: argparse.Namespace) -> None:
    try:
        from nanovllm.entrypoints.openai.run_batch import run_batch
    except ImportError as exc:
        raise needs_server_packages("run-batch", exc) from None
    if args.input_file != "-" and not os.path.isfile(args.input_file):
        raise FileNotFoundError(f"no input file {args.input_file!r}")
    why = None if args.output_file == "-" else unwritable(args.output_file)  # before any request is answered
    if why:
        raise ValueError(f"cannot write the output file {args.output_file!r}: {why}")
    model = args.model or default_model()
    name = args.served_model_name or model_name(model)
    responses = response_options(args, load_chat_template(args.chat_template))  # the template's text
    check_tool_call_parser(responses, args.tool_call_parser)
    if args.ray:  # the same answers, from engines that Ray Data runs on a cluster
        from nanovllm.integrations.ray import run_batch
    total, failed = run_batch(model, engine_arguments(args), args.input_file, args.output_file, name, responses)
    where = "standard output" if args.output_file == "-" else args.output_file
    print(f"{total} requests, {total - failed} answered with 200, {failed} with an error: {where}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> None:
    from nanovllm.entrypoints.bench import run

    run(args)


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = None
    if port is None or not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer between 0 and 65535, got {text!r}")
    return port


def add_response_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of what answers hold (ResponseOptions), for `serve` and `run-batch`."""
    parser.add_argument("--chat-template", help="a chat template, or a file holding one, instead of the tokenizer's")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model call tools when it chooses (tool_choice "auto", the default with tools)')
    parser.add_argument("--response-role", default="assistant",
                        help="the role of chat answers to a generation prompt (default: assistant)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                        help="the format of the model's tool calls: hermes (<tool_call> blocks, as Qwen2.5 and Qwen3 "
                             "write)")


def response_options(args: argparse.Namespace, chat_template: str | None) -> ResponseOptions:
    return ResponseOptions(chat_template, args.enable_auto_tool_choice, args.response_role,
                           args.enable_prompt_tokens_details)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="checkpoint folder (same as --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=port_number, default=8000,
                       help="0 picks a free one, logged at start-up (default: 8000)")
    serve.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"),
                       help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                            "(default: $NANOVLLM_API_KEY, else none)")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="the model's names in the API, the first one reported (default: the model folder's "
                            "name; demo for the demo model)")
    add_response_arguments(serve)
    serve.add_argument("--dp-routing", choices=ROUTING, default=ROUTING[0],
                       help="with -dp N: the replica each request goes to: prefix-affinity (the least busy, unless "
                            "one that served the prompt's first blocks is not much busier), least-loaded (the fewest "
                            "outstanding tokens) or round-robin (default: prefix-affinity)")
    serve.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                       help="on SIGINT/SIGTERM, seconds running requests may take to finish before they are "
                            f"aborted (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    serve.add_argument("--log-level", "--uvicorn-log-level", default="info", choices=LOG_LEVELS,
                       help="uvicorn's log level: info logs every request; debug also shows the traceback of "
                            "a start-up error (default: info)")
    serve.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    serve.add_argument("--log-stats-interval", type=float, default=5.0,
                       help="seconds between the statistics lines logged while busy (default: 5)")
    serve.add_argument("--disable-log-stats", action="store_true", help="no statistics lines")
    http = serve.add_argument_group("HTTP (vLLM's flags)")
    http.add_argument("--root-path", default="", help="the path prefix a proxy serves this server under")
    http.add_argument("--ssl-keyfile", help="TLS: the private key file (with --ssl-certfile)")
    http.add_argument("--ssl-certfile", help="TLS: the certificate file (with --ssl-keyfile)")
    http.add_argument("--allowed-origins", type=json_list, default=[],
                      help='CORS: origins browsers may call from, as JSON (e.g. \'["*"]\'); default: none')
    http.add_argument("--allowed-methods", type=json_list, default=["*"], help='CORS: methods (default: ["*"])')
    http.add_argument("--allowed-headers", type=json_list, default=["*"], help='CORS: headers (default: ["*"])')
    http.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    limits = serve.add_argument_group("request limits")
    for f in dataclasses.fields(ServerLimits):
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if isinstance(f.default, bool):
            limits.add_argument(ServerLimits.flag(f.name), action="store_true", help=help_text)
        else:
            limits.add_argument(ServerLimits.flag(f.name), type=type(f.default), default=f.default, help=help_text)
    add_engine_arguments(serve)


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose mistakes are one line (`nanovllm generate: error: ...`), as the
    commands' own errors are, not its usage first; --help still gives the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="nanovllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=nanovllm.__version__)  # as vllm --version prints it
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="complete prompts (arguments or stdin)",
                                   description="Complete each prompt and print the completions, one per prompt.")
    generate.add_argument("prompts", nargs="*", help="prompts; without any, one per line from stdin")
    generate.add_argument("--json", action="store_true", help="one JSON object per prompt")
    generate.add_argument("--echo", action="store_true",
                          help=f"print each prompt before its completion, after {PROMPT_MARK!r}")
    add_sampling_arguments(generate, max_tokens=64)
    add_engine_arguments(generate)
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="interactive chat that streams tokens",
                               description="Chat through the model's chat template, streaming each reply.")
    chat.add_argument("--system-prompt", help="the conversation's system message (as vllm chat's)")
    add_sampling_arguments(chat, max_tokens=256)
    add_engine_arguments(chat)
    chat.set_defaults(func=cmd_chat)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server",
                                description="Serve the model over OpenAI's HTTP API (/v1/completions, "
                                            "/v1/chat/completions, /v1/models), vLLM's /tokenize and "
                                            "/detokenize, plus /health, /metrics and /version.")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    run_batch = commands.add_parser(
        "run-batch", help="answer a file of requests in OpenAI's batch format",
        description="Answer each line of an OpenAI batch file ({custom_id, method, url, body} for "
                    "/v1/completions or /v1/chat/completions) with the server's handling, in process; "
                    "write one result line per request, in order.")
    run_batch.add_argument("-i", "--input-file", required=True,
                           help="the requests, one JSON object per line (-: standard input)")
    run_batch.add_argument("-o", "--output-file", required=True,
                           help="where the results go, one per line (-: standard output)")
    run_batch.add_argument("--served-model-name", help="the model's name in the requests and results "
                                                       "(default: the model folder's name; demo for the demo model)")
    add_response_arguments(run_batch)
    run_batch.add_argument("--ray", action="store_true",
                           help="answer through Ray Data on the Ray cluster (RAY_ADDRESS, else a local one), with "
                                "-dp engines (needs the ray extra)")
    add_engine_arguments(run_batch)
    run_batch.set_defaults(func=cmd_run_batch)

    from nanovllm.entrypoints import bench

    bench_parser = commands.add_parser("bench", help="nano-vllm's offline throughput benchmark",
                                       description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=cmd_bench)
    for command in commands.choices.values():  # whose flags main() names in a mistake
        command.set_defaults(parser=command)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run a command. What goes wrong reaches the user as one line: `nanovllm: error: ...`,
    exit status 2 for bad input (a missing folder, a wrong value), 1 for anything else
    (a port in use, a dead engine). The traceback is logged at debug level."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's mistake, not the top-level parser's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "serve":  # its log is the operator's view (uvicorn's lines follow --log-level)
        configure_logging(logging.DEBUG if args.log_level in ("trace", "debug") else logging.INFO)
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        logging.getLogger("nanovllm").debug("the command failed", exc_info=True)
        print(f"nanovllm: error: {exc}", file=sys.stderr)
        sys.exit(2 if isinstance(exc, (ValueError, TypeError, FileNotFoundError)) else 1)


if __name__ == "__main__":
    main()

"""nano-vllm's offline throughput benchmark, with the memory-bandwidth floor beside it.

Workload (nano-vllm's bench.py): random.seed(0); 256 requests; prompt lengths
randint(100, 1024) of random token ids randint(0, 10000); max_tokens randint(100, 1024);
temperature 0.6; ignore_eos; one warm-up generate before timing. Throughput is output
tokens over wall time, prefill included.

    nanovllm bench                      # GPU: Qwen3-0.6B architecture, dummy weights
    nanovllm bench --model ~/Qwen3-0.6B # a real checkpoint
    nanovllm bench --peer hf            # also transformers continuous batching
(benchmarks/bench_offline.py runs the same.) On CPU, without --model, it runs the demo
model on a small workload (16 requests of 16-64 tokens) that ends within a minute. Token
ids are drawn below the model's vocabulary size. Every engine argument is a flag.

The floor: decode must stream every sequence's KV history once per generated token and
the weights once per decode step; prefill must do 2 * params FLOPs per prompt token.
Bandwidth is measured in the same run with a large device copy (CUDA only: on CPU the
floor is not computed).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from nanovllm.demo import DEMO_MODEL_DIR, TOKENIZER_FILES
from nanovllm.entrypoints.arguments import add_engine_arguments, engine_arguments
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.log import configure_logging

if TYPE_CHECKING:  # torch and the engine load when the benchmark runs, not for --help
    import torch

    from nanovllm.llm import LLM

# Architectures for --arch, with their Hugging Face config fields (bf16).
ARCHS = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                          tie_word_embeddings=False),
}
# bf16 matmul rate of an H200 (cuBLAS reaches ~790 TFLOP/s in a long prefill step:
# docs/performance.md); used only for the small prefill term.
MATMUL_FLOPS = 800e12
# nano-vllm's workload draws token ids below this.
MAX_TOKEN_ID = 10000
# (requests, shortest, longest) of the workload: nano-vllm's on a GPU, a small one on CPU.
# nano-vllm's benchmark runs its engine with max_model_len 4096 (not the model's whole
# context, the engine's default): the decode graphs' block tables and attention's splits
# follow from it, so figures compare across runs and with nano-vllm's. --max-model-len moves it.
BENCH_MAX_MODEL_LEN = 4096
GPU_WORKLOAD = (256, 100, 1024)
CPU_WORKLOAD = (16, 16, 64)


def write_dummy_checkpoint(arch: str, folder: str) -> str:
    """A config.json for load_format="dummy", with the demo model's tokenizer (the
    workload's prompts are token ids; the tokenizer only decodes)."""
    config = dict(
        max_position_embeddings=40960,
        rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **ARCHS[arch],
    )
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(DEMO_MODEL_DIR, name), folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's: random prompts and output lengths in [min_len, max_len], ids below
    MAX_TOKEN_ID (and the vocabulary), seeded."""
    top = min(MAX_TOKEN_ID, vocab_size - 1)
    random.seed(0)
    prompts = [[random.randint(0, top) for _ in range(random.randint(min_len, max_len))] for _ in range(num_seqs)]
    max_tokens = [random.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20)."""
    import torch

    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / sorted(times[5:])[len(times[5:]) // 2]


def floor_seconds(llm: LLM, prompts: list[list[int]], max_tokens: list[int], bandwidth: float,
                  kv_per_token: float | None = None) -> dict[str, float]:
    """Decode step j (j >= 1) reads the dense weights once and, of an MoE model, the experts
    its batch's routing touches: with B_j sequences still decoding and each token choosing
    top_k of E experts uniformly, a share 1 - (1 - top_k / E)^B_j of them (dummy weights
    route close to uniformly). Prefill counts the active parameters' FLOPs. kv_per_token:
    the cache's bytes per token, if not this engine's (a bf16 cache's, beside an FP8 one)."""
    kv_per_token = kv_per_token or llm.executor.kv_bytes_per_token()
    params, weight_bytes = llm.executor.weights()
    expert_params, expert_bytes, share = llm.executor.experts()
    # Generating token j of a request (j = 0..n-1) reads the KV of its len(prompt) + j predecessors;
    # the first comes from prefill, so decode reads for j >= 1.
    kv_bytes = sum(kv_per_token * (n * len(p) + n * (n - 1) / 2 - len(p)) for p, n in zip(prompts, max_tokens))
    dense_bytes = weight_bytes - expert_bytes
    step_bytes = 0.0
    for step in range(1, max(max_tokens)):
        batch = sum(n > step for n in max_tokens)
        step_bytes += dense_bytes + expert_bytes * (1 - (1 - share) ** batch)
    active_params = params - expert_params * (1 - share)
    terms = {
        "kv_s": kv_bytes / bandwidth,
        "weights_s": step_bytes / bandwidth,
        "prefill_s": 2 * active_params * sum(map(len, prompts)) / MATMUL_FLOPS,
    }
    terms["floor_s"] = sum(terms.values())
    return terms


def timed_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[int, float, dict]:
    """(output tokens, seconds, engine stats) of one generate over the workload."""
    llm.reset_stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs), seconds, llm.stats()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--arch", choices=list(ARCHS), default="qwen3-0.6b",
                       help="the architecture of the dummy weights without --model (default: qwen3-0.6b)")
    bench.add_argument("--num-seqs", type=int, help=f"requests (default: {GPU_WORKLOAD[0]}, on CPU {CPU_WORKLOAD[0]})")
    bench.add_argument("--min-len", type=int,
                       help=f"shortest prompt and output (default: {GPU_WORKLOAD[1]}, on CPU {CPU_WORKLOAD[1]})")
    bench.add_argument("--max-len", type=int,
                       help=f"longest prompt and output (default: {GPU_WORKLOAD[2]}, on CPU {CPU_WORKLOAD[2]})")
    bench.add_argument("--temperature", type=float, default=0.6, help="every request's temperature (default: 0.6)")
    bench.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default: 1)")
    bench.add_argument("--top-k", type=int, default=0, help="every request's top_k (default: 0, off)")
    bench.add_argument("--repetition-penalty", type=float, default=1.0, help="every request's (default: 1, off)")
    bench.add_argument("--compare-sampling", action="store_true",
                       help="also time the workload with top_p 0.9, top_k 50 and repetition_penalty 1.1 on every request")
    bench.add_argument("--single", action="store_true", help="also time one request: 128-token prompt, 512 outputs")
    bench.add_argument("--peer", choices=["hf"], help="also run Hugging Face transformers continuous batching")
    add_engine_arguments(parser)


def bench_max_model_len(folder: str) -> int:
    """BENCH_MAX_MODEL_LEN, or the model's whole context where that is shorter (a folder
    without a config.json is left to the engine, which says what is wrong)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return BENCH_MAX_MODEL_LEN
    with open(path) as f:
        limit = json.load(f).get("max_position_embeddings")
    return min(BENCH_MAX_MODEL_LEN, limit or BENCH_MAX_MODEL_LEN)


def warm_up(llm: LLM, params: SamplingParams) -> float:
    """Run a few short requests with `params` (several at once, then one alone) so that
    the first-time torch.compile of their sampling path happens before the timed run;
    returns the seconds it took."""
    start = time.perf_counter()
    short = dataclasses.replace(params, max_tokens=8)
    top = min(MAX_TOKEN_ID, llm.vocab_size - 1)
    for batch in (4, 1):
        llm.generate([[random.Random(i).randint(0, top) for _ in range(16)] for i in range(batch)], short,
                     use_tqdm=False)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> None:
    """The benchmark, with a dummy checkpoint in a temporary folder (removed at the end)
    when no --model is given on a GPU."""
    with tempfile.TemporaryDirectory(prefix="nanovllm-bench-") as tmp:
        _run(args, tmp)


def _print_floor(llm, prompts: list[list[int]], max_tokens: list[int], out_tokens: int, seconds: float) -> None:
    """The run against its memory-bandwidth floor (one engine on CUDA), and against the floor
    of a KV cache in the model's dtype where the cache's is narrower."""
    import torch

    bandwidth = copy_bandwidth(torch.device("cuda"))
    floor = floor_seconds(llm, prompts, max_tokens, bandwidth)
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s; floor {floor['floor_s']:.2f} s "
          f"(kv {floor['kv_s']:.2f} + weights {floor['weights_s']:.2f} + prefill {floor['prefill_s']:.2f}); "
          f"floor tok/s {out_tokens / floor['floor_s']:,.0f}; achieved {floor['floor_s'] / seconds:.0%} of floor")
    config = llm.config
    if config.kv_cache_torch_dtype != config.torch_dtype:  # what a cache in the model's dtype would allow
        widen = config.torch_dtype.itemsize / config.kv_cache_torch_dtype.itemsize
        model_floor = floor_seconds(llm, prompts, max_tokens, bandwidth, llm.executor.kv_bytes_per_token() * widen)
        print(f"with the KV cache in {str(config.torch_dtype).removeprefix('torch.')}: floor "
              f"{model_floor['floor_s']:.2f} s, floor tok/s {out_tokens / model_floor['floor_s']:,.0f}; "
              f"achieved {model_floor['floor_s'] / seconds:.0%} of it")


def _compare_sampling(llm, temperature: float, prompts: list[list[int]], max_tokens: list[int],
                      tokens_per_s: float) -> None:
    """The same workload with top-p, top-k and a repetition penalty on every request, as a
    share of the run above (tokens_per_s)."""
    filtered = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n, top_p=0.9, top_k=50,
                               repetition_penalty=1.1) for n in max_tokens]
    warm_up_s = warm_up(llm, filtered[0])
    filtered_tokens, filtered_s, _ = timed_generate(llm, prompts, filtered)
    print(f"first use of the filtered sampling path (compiles it, not timed below): {warm_up_s:.1f} s")
    print(f"with top_p 0.9, top_k 50, repetition_penalty 1.1: {filtered_s:.2f} s, "
          f"{filtered_tokens / filtered_s:,.0f} output tok/s ({filtered_tokens / filtered_s / tokens_per_s:.1%} "
          f"of the run above)")


def _single_request(llm, temperature: float) -> None:
    """One request alone (128 prompt tokens, 512 outputs): time per output token."""
    single = [random.Random(1).randint(0, min(MAX_TOKEN_ID, llm.vocab_size - 1)) for _ in range(128)]
    llm.generate([single], SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    llm.generate([single], SamplingParams(temperature=temperature, max_tokens=512, ignore_eos=True), use_tqdm=False)
    single_s = time.perf_counter() - start
    print(f"single request (128 in, 512 out): {single_s:.2f} s, {single_s / 512 * 1e3:.2f} ms per output token")


def _run(args: argparse.Namespace, tmp: str) -> None:
    import torch

    from nanovllm.llm import LLM

    configure_logging(logging.INFO)
    engine_args = engine_arguments(args)
    cuda = torch.cuda.is_available() and engine_args.get("device", "auto") != "cpu"
    if args.model:
        folder, label = args.model, args.model
    elif cuda:
        folder, label = write_dummy_checkpoint(args.arch, tmp), f"{args.arch} (dummy weights)"
        engine_args.setdefault("load_format", "dummy")
    else:
        folder, label = DEMO_MODEL_DIR, "the demo model"
    engine_args.setdefault("max_model_len", bench_max_model_len(folder))
    default_seqs, default_min, default_max = GPU_WORKLOAD if cuda else CPU_WORKLOAD
    num_seqs, min_len, max_len = args.num_seqs or default_seqs, args.min_len or default_min, args.max_len or default_max

    peer = None
    if args.peer == "hf":  # first, so that our engine's KV cache does not hold the memory
        from transformers import AutoConfig, AutoModelForCausalLM

        from nanovllm.entrypoints.hf_peer import run_hf_continuous_batching

        hf_config = AutoConfig.from_pretrained(folder)
        prompts, max_tokens = make_workload(num_seqs, min_len, max_len, hf_config.vocab_size)
        if engine_args.get("load_format") == "dummy":  # transformers needs weights on disk: random ones
            AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).save_pretrained(folder)
        peer = run_hf_continuous_batching(folder, prompts, max_tokens, args.temperature,
                                          device="cuda" if cuda else "cpu")

    start = time.perf_counter()
    with LLM(folder, **engine_args) as llm:
        startup = time.perf_counter() - start
        prompts, max_tokens = make_workload(num_seqs, min_len, max_len, llm.vocab_size)
        params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n, top_p=args.top_p,
                                 top_k=args.top_k, repetition_penalty=args.repetition_penalty) for n in max_tokens]
        warm_up(llm, params[0])
        out_tokens, seconds, stats = timed_generate(llm, prompts, params)

        replicas = getattr(llm, "data_parallel_size", 1)
        if not cuda:
            graphs = "off"
        else:
            graphs = "per replica" if replicas > 1 else "on" if llm.executor.uses_cuda_graphs else "off"
        print(f"model: {label}, device {llm.config.torch_device}, tensor parallel {llm.config.tensor_parallel_size}, "
              f"data parallel {replicas}, backend {llm.config.attention_backend_name}, cuda graphs {graphs}")
        parts = "  ".join(f"{k[len('startup_'):]} {v:.1f}" for k, v in stats.items()
                          if k.startswith("startup_") and k != "startup_s")
        print(f"startup: {startup:.1f} s" + (f"  ({parts})" if parts else ""))
        chosen = cuda or any(v is not None for v in (args.num_seqs, args.min_len, args.max_len))
        print(f"workload: {num_seqs} requests, prompt and output lengths {min_len}-{max_len} tokens"
              + ("" if chosen else " (a CPU's default; --num-seqs, --min-len and --max-len set it)"))
        print(f"input tokens: {sum(map(len, prompts))}, output tokens: {out_tokens}")
        print(f"time: {seconds:.2f} s, throughput: {out_tokens / seconds:,.0f} output tok/s")
        if cuda and replicas == 1:  # the floor is one engine's: replicas each compute their own
            _print_floor(llm, prompts, max_tokens, out_tokens, seconds)
        print("stats: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in stats.items() if not k.startswith("startup")))
        if args.compare_sampling:
            _compare_sampling(llm, args.temperature, prompts, max_tokens, out_tokens / seconds)
        if args.single:
            _single_request(llm, args.temperature)

    if peer is not None:
        hf_tokens, hf_seconds = peer
        print(f"hf continuous batching: {hf_tokens} output tokens in {hf_seconds:.2f} s, "
              f"{hf_tokens / hf_seconds:,.0f} tok/s; nanovllm is {out_tokens / seconds / (hf_tokens / hf_seconds):.1f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()

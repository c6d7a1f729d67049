#!/usr/bin/env bash
# One call on a GPU machine: the test suite (GPU tests included), the kernel and sampler
# benchmarks and the offline benchmark. Logs go to $OUT (default ./out). Uses the machine's own
# torch/triton/transformers; nanovllm runs from this checkout.
#   bash scripts/gpu_check.sh [tests|kernels|offline|peer|profile|all] [extra bench_offline args...]
#   bash scripts/gpu_check.sh gpu-tests  # only the CUDA tests, in four processes at once (a few minutes)
#   bash scripts/gpu_check.sh session    # one GPU: gpu-tests, kernels, offline: about nine minutes in all
#   bash scripts/gpu_check.sh tp       # on two GPUs: TP=2 parity, Qwen3-8B at TP 2, then one TP=1 engine per GPU at once
#   bash scripts/gpu_check.sh tp-parity  # on two GPUs: only tp's TP=2 parity test
#   bash scripts/gpu_check.sh serving  # the HTTP benchmark (carry .whl from scripts/fetch_gpu_wheels.sh)
#   bash scripts/gpu_check.sh serving-inf  # only its infinite-rate runs against offline (three of each), then
#                                          # the HTTP runs again with their connections opened beforehand
#   bash scripts/gpu_check.sh both     # on two GPUs: CUDA tests, offline benchmark and profiles on GPU 0;
#                                      # serving and the sampler benchmark on GPU 1 (carry .whl)
#   bash scripts/gpu_check.sh structured  # structured outputs' CUDA tests and benchmark (carry .whl)
#   bash scripts/gpu_check.sh moe      # MoE: CUDA tests, the kernel against torch with a config sweep and
#                                      # the offline benchmark at Qwen3-30B-A3B's dimensions, bf16 and FP8
#   bash scripts/gpu_check.sh moe-tp   # on two GPUs: MoE parity, then Qwen3-30B-A3B at TP 2 and at EP 2
#   bash scripts/gpu_check.sh dp       # on two GPUs: one engine against -dp 2, offline and HTTP; then
#                                      # prefix-affinity routing against round-robin (carry .whl)
#   bash scripts/gpu_check.sh fp8      # FP8: CUDA tests, decode over an FP8 cache and the FP8 GEMMs, perplexity
#   bash scripts/gpu_check.sh fp8-attention  # FP8-cache decode attention's sweep (register caps included) at
#                                            # Qwen3-0.6B's B=256 x 1,024 and Qwen3-8B's B=128 x 512
#   bash scripts/gpu_check.sh fp8-bench  # FP8: the offline benchmark, Qwen3-0.6B bf16 vs FP8 cache, Qwen3-8B bf16 vs FP8
#   bash scripts/gpu_check.sh pair "A B" "C"  # on two GPUs: modes A then B on GPU 0 while C runs on GPU 1
#   bash scripts/gpu_check.sh fp8-both   # on two GPUs: fp8 on GPU 0 while GPU 1 runs fp8-bench
#   bash scripts/gpu_check.sh decode-gemm  # bf16 decode batches of 9-64 rows: decode_gemm against cuBLAS
#                                        # (kernels; SWEEP=1: every tile)
#   bash scripts/gpu_check.sh fp8-gemm   # FP8 weights at decode sizes: channel_gemm against cuBLAS (kernels,
#                                        # with SWEEP=1 every tile), Qwen3-8B FP8 with and without channel_gemm
#                                        # (A B B A; the wide FP8 form stays on), then
#                                        # 32 requests and one request; Qwen3-8B bf16 for the ratio
#   bash scripts/gpu_check.sh lowlat   # issue 23: a kernel boundary's cost, batch-1 layers taken apart (bench_pdl.py
#                                      # --hops, --layers), batch-1 and batch-32 steps' profiles and GPU timelines
#   bash scripts/gpu_check.sh prefill-shapes # prefill attention (16 x 1,024 and 4 x 4,096 tokens, fresh and half
#                                           # cached) in other tiles, key tiles by loads and TMA (NANOVLLM_PREFILL_TMA)
#   bash scripts/gpu_check.sh large-rows # issue 19's 65-256-row steps: decode attention's shapes at 64-256 rows,
#                                        # decode_gemm's tiles against cuBLAS at 128 and 256 rows (Qwen3-0.6B)
#   bash scripts/gpu_check.sh contexts # decode attention at 32 and 256 rows over contexts of 256-2,048 tokens (the
#                                      # engine's 4,096-token tables), and over an FP8 cache at 256 rows: where short
#                                      # rows' per-program costs show
#   bash scripts/gpu_check.sh jointail # NANOVLLM_DECODE_JOIN_TAIL 0 1 1 0 (a row's short last split of decode
#                                      # attention joins the others): parity first, then the engine at 32 and 256
#                                      # requests and the batch-256 step (its attention per layer)
#   bash scripts/gpu_check.sh midbatch # issue 23's 32 requests: decode attention's configs swept at 8, 16 and 32
#                                      # rows (context 512 in tables of 4,096 tokens, as the engine launches it),
#                                      # the offline 32-request run and its step profile, then 32 requests with
#                                      # rotary_store inside decode attention up to 8 rows (default) or 32
#   bash scripts/gpu_check.sh steps    # where steps go: batch 1 with and without PDL, a 1,024-token prompt joining 8 decodes
#   bash scripts/gpu_check.sh itl      # steps with prompt tokens in whole graphs (attention captured): the
#                                      # CUDA tests, a 1,024-token prompt joining 8 decodes (eager too), ITL at
#                                      # 20 requests/s (carry .whl)
#   bash scripts/gpu_check.sh sampler  # the sampler at batch 256 and 1, compiled paths vs the filtered Triton kernel
#   bash scripts/gpu_check.sh variants # each Triton kernel's compiled variants (benchmarks/kernel_variants.py),
#                                      # and whether Triton compiles in parallel threads (parallel_compile.py)
#   bash scripts/gpu_check.sh precompile-ab  # NANOVLLM_PRECOMPILE 0 1 1 0, each engine with an empty Triton cache
#   bash scripts/gpu_check.sh imports  # the engine process's imports (-X importtime) and CUDA's start
#   bash scripts/gpu_check.sh startup  # `nanovllm serve` start-up, cold (page cache dropped, empty compile
#                                      # caches) and warm, in turns (carry .whl-transformers and a .whl
#                                      # from fetch_gpu_wheels.sh --serve-only: both fit in a call's 64 MiB)
#   bash scripts/gpu_check.sh ncu-decode  # Nsight Compute on one decode-attention launch, bf16 and FP8 caches
#                                       # (extra args to ncu_decode.py, e.g. --batch 32 --context 512 --table-tokens 4096)
#   bash scripts/gpu_check.sh ncu-gemm  # Nsight Compute on a decode step's four cuBLAS projections at 16, 32 and
#                                     # 128 rows (Qwen3-0.6B's shapes): duration, DRAM throughput, grid, waves
#   bash scripts/gpu_check.sh split    # issues 19, 23: 2-64-row projections as split-K tiles summed by their readers:
#                                      # the kernels' CUDA tests and HF parity with graphs, then the engine at 32
#                                      # requests with NANOVLLM_SPLIT_GEMM_MAX_ROWS 0 64 64 0, one request and 256,
#                                      # profile_step.py --batch 32 with 64 and 0
#   bash scripts/gpu_check.sh rows     # issue 23: where the split tiles take over from the GEMV and the fused
#                                      # rotary_store stops: 32 requests with NANOVLLM_SPLIT_GEMM_MIN_ROWS x
#                                      # NANOVLLM_ROTARY_MAX_BATCH 9x8 5x8 3x8 5x4, then reversed; 256 requests
#                                      # with the tiles from 9 / 5 / 5 / 9 rows
#   bash scripts/gpu_check.sh tiles    # issues 19, 23: batch-32 and -16 steps with the split tiles at 256 / 512
#                                      # bf16 columns (NANOVLLM_SPLIT_GEMM_ROW_BYTES 512 1024 1024 512); batch 2 and 4
#                                      # and 32 requests with the tiles from 3 or 2 rows (NANOVLLM_SPLIT_GEMM_MIN_ROWS)
#   bash scripts/gpu_check.sh draft    # speculative decoding with a draft model: HF parity with graphs (the model
#                                      # as its own draft), plain against drafting on the demo pair, on Qwen3-0.6B
#                                      # as its own draft, and on Qwen3-8B with a Qwen3-0.6B draft (dummy weights),
#                                      # then profile_step.py --speculative 4 --draft self at one request
#   bash scripts/gpu_check.sh spec     # speculative decoding (n-gram): HF parity with graphs, then plain against
#                                      # speculating on the demo model (1 and 4 requests at a time) and on Qwen3-0.6B
#                                      # dummy weights (what a verification step costs), and profile_step.py
#                                      # --speculative 4 against 0 at one request
#   bash scripts/gpu_check.sh ab DIR   # the offline benchmark of DIR/nanovllm (A, e.g. an older commit's
#                                      # `git archive`, carried) and of this tree (B), in the order A B B A;
#                                      # DIR from `bash scripts/gpu_check.sh tree COMMIT DIR` on this machine
# The A/B modes of questions already settled (gemv-ab, gemv-rows, rotary, splits, split-tiles,
# compile-ab, transformers-ab, itl-offline, rerooming; RESULTS.md names them where it used
# them) were removed at session 19; `git show 7e22b29:scripts/gpu_check.sh` has them; `layout`
# (session 26, settled: the cache is head-major) is in `git show fcd2c94:scripts/gpu_check.sh`,
# `tma-x` (session 32, settled: x by loads) in `git show 79de194:scripts/gpu_check.sh`; `qkv-split`
# (session 34, settled: the split tiles) in `git show 15ce052:scripts/gpu_check.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
what=${1:-all}
shift || true
status=0
MODES=" spec draft ab all both contexts decode-gemm dp fp8 fp8-attention fp8-bench fp8-both fp8-gemm gpu-tests imports itl jointail kernels large-rows lowlat midbatch moe moe-tp ncu-decode ncu-gemm offline pair prefill-shapes
        peer precompile-ab profile rows sampler serving serving-inf session split startup steps structured tests tiles tp
        tp-parity variants "
if [[ $what == tree ]]; then  # on the CPU machine: COMMIT's nanovllm/ in DIR, small enough to carry
    commit=${1:?usage: gpu_check.sh tree COMMIT DIR}
    dir=${2:?usage: gpu_check.sh tree COMMIT DIR}
    rm -rf "$dir" && mkdir -p "$dir"
    git archive "$commit" nanovllm | tar -x -C "$dir"
    find "$dir" -name "*.safetensors" -delete  # the demo weights: the benchmark writes dummy ones (tokenizers kept)
    du -sh "$dir"
    exit 0
fi
if [[ ! $MODES =~ [[:space:]]$what[[:space:]] ]]; then  # a misspelt or removed mode would run nothing and pass
    echo "gpu_check.sh: unknown mode '$what' (removed modes: git show 7e22b29:scripts/gpu_check.sh)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
if [[ $what == session ]]; then
    # What the open issues need measured, each part capped so the whole fits one call.
    GPU_TESTS_TIMEOUT=280 bash "$0" gpu-tests || status=1
    timeout 100 bash "$0" kernels || status=1
    timeout 160 bash "$0" offline "$@" || status=1
    exit $status
fi
if [[ $what == both ]]; then
    # Eight logs come back from $OUT at most: the two halves' summaries stay in /tmp and print here.
    (export CUDA_VISIBLE_DEVICES=0; GPU_TESTS_TIMEOUT=280 bash "$0" gpu-tests; timeout 170 bash "$0" offline "$@"
     timeout 120 bash "$0" profile) >/tmp/gpu0.txt 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; timeout 400 bash "$0" serving
     timeout 60 python3 benchmarks/bench_sampler.py 2>&1 | tee "$OUT/bench_sampler.log" | grep -v Warning | tail -10) >/tmp/gpu1.txt 2>&1 &
    wait || status=1
    cat /tmp/gpu0.txt /tmp/gpu1.txt | grep -v -E "Warning|warn|^$|Online softmax|split the reduction|important use case|softmax\.$"
    exit $status
fi
if [[ $what == pair ]]; then
    # Two GPUs, two lists of modes at once, e.g. pair "gpu-tests steps" "itl imports" (modes that
    # launch a server on one side only: they share port 8000). Each side logs under $OUT/gpuN; a device
    # call brings back 8 files at most, so the logs also come packed in $OUT/logs.tgz.
    lists=("${1:-}" "${2:-}")
    for gpu in 0 1; do
        (export CUDA_VISIBLE_DEVICES=$gpu OUT=$OUT/gpu$gpu
         for mode in ${lists[$gpu]}; do echo "=== $mode on GPU $gpu"; bash "$0" "$mode" || echo "=== $mode failed"; done
        ) >"/tmp/pair$gpu.txt" 2>&1 &
    done
    wait
    grep -h -v -E "Warning|warn|^$" /tmp/pair0.txt /tmp/pair1.txt
    grep -q "failed$" /tmp/pair0.txt /tmp/pair1.txt && status=1
    tar czf "$OUT/logs.tgz" -C "$OUT" gpu0 gpu1
    exit $status
fi
if [[ $what == fp8-both ]]; then  # two GPUs: fp8 on GPU 0 while GPU 1 runs fp8-bench
    (export CUDA_VISIBLE_DEVICES=0; bash "$0" fp8) >/tmp/gpu0.txt 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; bash "$0" fp8-bench "$@") >/tmp/gpu1.txt 2>&1 &
    wait || status=1
    cat /tmp/gpu0.txt /tmp/gpu1.txt | grep -v -E "Warning|warn|^$"
    exit $status
fi
if [[ $what == ab ]]; then
    other=${1:?usage: gpu_check.sh ab DIR [bench_offline args]}
    shift
    for side in A B B A; do
        tree=$PWD
        [[ $side == A ]] && tree=$other
        echo "== $side: $tree"
        PYTHONPATH=$tree timeout 170 python3 benchmarks/bench_offline.py --single "$@" 2>&1 | tee -a "$OUT/ab_$side.log" \
            | grep -E "^startup|throughput|floor|single request" || status=1
    done
fi
if [[ $what == gpu-tests ]]; then
    # The tests that only run on CUDA, in a few minutes: sampling, the engine with graphs
    # (Triton in bf16), graph replay, the kernels in bf16, and on two GPUs the tensor-parallel one.
    # Four pytest processes share the GPU: on a fresh machine most of the time is Triton and ptxas
    # compiling on the CPU (one process took over 400 s cold). The engine tests stay in one
    # process, since each engine sizes its KV cache from the memory the device has free; the test of
    # two engines sharing the device by those sizes runs alone, after the others.
    export NCCL_NVLS_ENABLE=0
    select="cuda or (triton and bfloat16 and preemption) or graph_replay or side_by_side_share or two_gpus or bf16"
    mkdir -p "$OUT/gpu_tests"  # one log a part, written as it runs (a call brings back 8 files at most)
    part() {  # part NAME [-k EXTRA] FILES...
        local name=$1 extra=""
        shift
        if [[ $1 == -k ]]; then extra=" and ($2)"; shift 2; fi
        timeout -s ABRT "${GPU_TESTS_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=150 \
            "$@" -k "($select)$extra" >"$OUT/gpu_tests/$name.log" 2>&1
    }
    names=(engine decode-attention kernels sampling-gemv-moe)
    part engine -k "not side_by_side_share" tests/sampling/test_sampling_params.py tests/executor/test_gpu.py \
        tests/engine/test_prompt_logprobs.py \
        tests/executor/test_tensor_parallel.py &
    pids=($!)
    part decode-attention -k decode tests/kernels/test_kernels.py &
    pids+=($!)
    part kernels -k "not decode" tests/kernels/test_kernels.py &
    pids+=($!)
    part sampling-gemv-moe tests/kernels/test_sample.py tests/kernels/test_sample_filtered.py tests/kernels/test_fused_moe.py \
        tests/kernels/test_gemv.py tests/kernels/test_decode_inputs.py tests/kernels/test_split_gemm.py \
        tests/kernels/test_wide_gemm.py &
    pids+=($!)
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        rc=$?
        [[ $rc == 0 ]] || status=1
        echo "=== ${names[$i]} (exit $rc): $(tail -n 1 "$OUT/gpu_tests/${names[$i]}.log")"
        grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests/${names[$i]}.log"
    done
    part side-by-side -k side_by_side_share tests/executor/test_gpu.py || status=1
    echo "=== side-by-side: $(tail -n 1 "$OUT/gpu_tests/side-by-side.log")"
fi
if [[ $what == all || $what == tests ]]; then
    python3 -m pytest -q -x -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1
fi
if [[ $what == all || $what == kernels ]]; then
    python3 benchmarks/bench_kernels.py 2>&1 | tee "$OUT/bench_kernels.log" | tail -25 || status=1
    python3 benchmarks/bench_sampler.py 2>&1 | tee "$OUT/bench_sampler.log" | grep -v Warning | tail -10 || status=1
fi
if [[ $what == all || $what == offline ]]; then
    python3 benchmarks/bench_offline.py --single --compare-sampling "$@" 2>&1 | tee "$OUT/bench_offline.log" | grep -v Warning | tail -15 || status=1
fi
if [[ $what == all || $what == peer ]]; then
    # transformers' continuous batching is ~30x slower: a 32-request slice of the workload.
    python3 benchmarks/bench_offline.py --num-seqs 32 --peer hf 2>&1 | tee "$OUT/bench_peer.log" | grep -v Warning | tail -8 || status=1
fi
if [[ $what == all || $what == profile ]]; then
    for batch in 1 256; do
        python3 benchmarks/profile_step.py --batch "$batch" 2>&1 | tee -a "$OUT/profile.log" | grep -E "ms per decode step|per step:|Self CUDA time total|Self CPU time total" || status=1
    done
fi
if [[ $what == steps ]]; then  # issues 19 and 23: kernels of a batch-1 step (without PDL: each kernel's own time); a mixed step's host time
    for pdl in 1 0; do
        NANOVLLM_PDL=$pdl timeout 120 python3 benchmarks/profile_step.py --batch 1 2>&1 | tee "$OUT/profile_b1_pdl$pdl.log" \
            | grep -E "ms per decode step|per step:" || status=1
    done
    timeout 200 python3 benchmarks/profile_step.py --batch 8 --mixed 1024 2>&1 | tee "$OUT/profile_mixed.log" \
        | grep -E "mixed step|Self CUDA time total|Self CPU time total" || status=1
fi
if [[ $what == sampler ]]; then  # the sampler at batch 256 and 1: compiled paths, then the filtered Triton kernel
    for kernel in 0 1; do
        for batch in 256 1; do
            echo "== NANOVLLM_SAMPLER_KERNEL=$kernel"
            NANOVLLM_SAMPLER_KERNEL=$kernel timeout 100 python3 benchmarks/bench_sampler.py --batch $batch 2>&1 \
                | tee -a "$OUT/bench_sampler.log" | grep -v Warning || status=1
        done
    done
    exit $status
fi
if [[ $what == variants ]]; then  # issue 19 item 4: the Triton variants a cold start compiles, and what tells them apart
    timeout 200 python3 benchmarks/kernel_variants.py --top 40 2>&1 | grep -v Warning | tee "$OUT/variants.log" | tail -80 \
        || status=1
    # Whether those compiles could overlap: Triton compiling on 8 threads against one after another.
    timeout 150 python3 benchmarks/parallel_compile.py --kernels 16 --threads 8 2>&1 | grep -v -i warn || status=1
    exit $status
fi
if [[ $what == precompile-ab ]]; then  # issue 19 item 4: NANOVLLM_PRECOMPILE 0 1 1 0, each with an empty Triton cache
    for flag in 0 1 1 0; do
        echo "== NANOVLLM_PRECOMPILE=$flag, Triton cache empty"
        TRITON_CACHE_DIR=$(mktemp -d) NANOVLLM_PRECOMPILE=$flag timeout 150 python3 benchmarks/bench_offline.py "$@" 2>&1 \
            | tee -a "$OUT/precompile_ab.log" | grep -E "^startup|throughput" || status=1
    done
    exit $status
fi
if [[ $what == ncu-decode ]]; then  # issue 20: hardware counters of decode attention over bf16 and FP8 caches
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    [[ -n $ncu ]] || { echo "no ncu on this machine"; exit 1; }
    for cache in bf16 fp8; do
        echo "== $cache cache"
        PYTHONPATH=$PWD/benchmarks:$PYTHONPATH timeout 240 "$ncu" --clock-control none \
            --kernel-name regex:_decode_split_kernel --launch-skip 3 --launch-count 1 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
            --section WarpStateStats --section SchedulerStats --section SourceCounters \
            python3 benchmarks/ncu_decode.py --cache $cache "$@" > "$OUT/ncu_decode_$cache.txt" 2>&1 || status=1
        grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles|Issued Ipc|L2 Hit|Shared Memory" \
            "$OUT/ncu_decode_$cache.txt" | head -40
    done
    exit $status
fi
if [[ $what == ncu-gemm ]]; then  # issues 19, 23: why a small projection takes ~5.5 us whatever its weights
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    [[ -n $ncu ]] || { echo "no ncu on this machine"; exit 1; }
    for rows in 16 32 128; do
        echo "== $rows rows"
        timeout 120 "$ncu" --clock-control none --nvtx --nvtx-include "measure/" \
            --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
            python3 benchmarks/ncu_gemm.py --rows $rows > "$OUT/ncu_gemm_$rows.txt" 2>&1 || status=1
        grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Grid Size|Block Size|Waves Per SM|Achieved Occupancy|Registers Per" \
            "$OUT/ncu_gemm_$rows.txt" | head -60
    done
    exit $status
fi
if [[ $what == imports ]]; then  # issue 19 item 4: the engine process's imports, and those its build adds
    for run in 1 2; do
        /usr/bin/time -f "import nanovllm.serving.engine_process: %e s wall" \
            python3 -c "import nanovllm.serving.engine_process" 2>&1 | tail -1
    done
    python3 -X importtime -c "import nanovllm.serving.engine_process" 2> "$OUT/importtime.log"
    sort -t'|' -k2 -n "$OUT/importtime.log" | tail -25
    python3 -c "import time, torch; t = time.perf_counter(); torch.zeros(1, device='cuda'); print(f'CUDA init {time.perf_counter() - t:.2f} s')"
    # What building a server's engine imports on top (the build's time outside its named
    # phases): the modules imported after the engine process's own, largest first. The
    # tokenizer comes as the API process sends it, not through AutoTokenizer.
    python3 -X importtime -c "import sys, tempfile, nanovllm.serving.engine_process; print('BUILD', file=sys.stderr)
from transformers.tokenization_utils_tokenizers import TokenizersBackend
from nanovllm.entrypoints.bench import write_dummy_checkpoint
from nanovllm.engine.llm_engine import LLMEngine
folder = write_dummy_checkpoint('qwen3-0.6b', tempfile.mkdtemp())
LLMEngine(folder, lambda: TokenizersBackend.from_pretrained(folder), load_format='dummy').shutdown()" \
        2> "$OUT/importtime_build.log" >/dev/null
    sed -n '/^BUILD/,$p' "$OUT/importtime_build.log" | grep "import time" | sort -t'|' -k2 -n | tail -20
    exit $status
fi
if [[ $what == lowlat ]]; then  # issue 23: what a kernel boundary costs, where a batch-1 layer and step go
    timeout 60 python3 benchmarks/bench_pdl.py --hops 2>&1 | tee "$OUT/bench_hops.log" | grep "per launch" || status=1
    timeout 300 python3 benchmarks/bench_pdl.py --layers 2>&1 | tee "$OUT/bench_pdl.log" \
        | grep -E "whole layers|us per pass" || status=1
    for batch in 1 32; do  # one request; and the batch that issue 23's 32-request target is about
        timeout 120 python3 benchmarks/profile_step.py --batch $batch 2>&1 | tee "$OUT/profile_$batch.log" \
            | grep -E "ms per decode step|per step:|GPU timeline|Self CUDA time total" || status=1
    done
fi
if [[ $what == prefill-shapes ]]; then  # prefill attention: 64 x 64 tiles by TMA copies won in session 37
    for tma in 0 1; do  # whole key tiles by loads, then by TMA copies (NANOVLLM_PREFILL_TMA)
        echo "== NANOVLLM_PREFILL_TMA=$tma" | tee -a "$OUT/prefill_shapes.log"
        NANOVLLM_PREFILL_TMA=$tma timeout 200 python3 benchmarks/bench_kernels.py --prefill-only \
            --prefill-config 128:64:8:3 --prefill-config 64:64:4:2 --prefill-config 64:64:4:4 \
            --prefill-config 64:32:4:3 --prefill-config 64:64:8:3 --prefill-config 32:64:4:3 \
            2>&1 | tee -a "$OUT/prefill_shapes.log" | grep -E "^prefill|failed" || status=1
    done
    echo "== 4 prompts x 4,096 tokens, TMA tiles" | tee -a "$OUT/prefill_shapes.log"  # more key tiles per query tile
    NANOVLLM_PREFILL_TMA=1 timeout 200 python3 benchmarks/bench_kernels.py --prefill-only --prefill-seqs 4 --prefill-len 4096 \
        --prefill-config 128:64:8:3 --prefill-config 64:64:4:2 --prefill-config 64:64:4:4 \
        2>&1 | tee -a "$OUT/prefill_shapes.log" | grep -E "^prefill|failed" || status=1
fi
if [[ $what == large-rows ]]; then  # issue 19: the offline workload's 65-256-row steps
    # Decode attention's shapes at 64-256 rows x 512 tokens (programs of two warps, two stages were
    # 2-5% faster than the default's four warps at 64-128 rows in session 36), then decode_gemm's
    # tiles against cuBLAS on Qwen3-0.6B's projections at 128 and 256 rows.
    for rows in 64 128 256; do
        echo "== decode attention, $rows rows x 512 in 4,096-token tables"
        timeout 120 python3 benchmarks/bench_kernels.py --decode-only --decode-batch $rows --decode-context 512 \
            --table-tokens 4096 --decode-config 64:2:2 --decode-config 64:2:3 --decode-config 32:1:2 \
            --decode-config 32:2:3 2>&1 | tee -a "$OUT/large_rows.log" | grep -E "^decode.*CUDA graph|^  sweep" || status=1
    done
    timeout 300 python3 benchmarks/bench_kernels.py --decode-gemm-only --decode-gemm-tokens 128 256 --decode-gemm-model 0.6B \
        --decode-gemm-sweep 2>&1 | tee -a "$OUT/large_rows.log" | grep -E "^linear|^  decode_gemm sweep" || status=1
fi
if [[ $what == contexts ]]; then  # issues 19, 20, 23: decode attention's share of copy bandwidth by context length
    for batch in 32 256; do
        for context in 256 512 1024 2048; do
            echo "== batch $batch, context $context in 4,096-token tables"
            timeout 60 python3 benchmarks/bench_kernels.py --decode-only --decode-batch $batch --decode-context $context \
                --table-tokens 4096 2>&1 | tee -a "$OUT/contexts.log" | grep -E "^decode.*CUDA graph" || status=1
        done
    done
    for context in 256 512 1024 2048; do  # the FP8 cache at 256 rows (its GEMM lines are not printed)
        echo "== FP8 cache, batch 256, context $context in 4,096-token tables"
        timeout 90 python3 benchmarks/bench_kernels.py --fp8-only --decode-batch 256 --decode-context $context \
            --table-tokens 4096 2>&1 | tee -a "$OUT/contexts_fp8.log" | grep -E "^decode fp8.*CUDA graph" || status=1
    done
fi
if [[ $what == jointail ]]; then  # issues 19, 23: a row's short last split of decode attention joins the others
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/executor/test_gpu.py tests/kernels/test_kernels.py \
        -k "(triton and bfloat16 and roomy) or (decode_attention and join)" 2>&1 | tail -3 || status=1
    for join in 0 1 1 0; do  # NANOVLLM_DECODE_JOIN_TAIL
        echo "== NANOVLLM_DECODE_JOIN_TAIL=$join"
        for seqs in 32 256; do
            NANOVLLM_DECODE_JOIN_TAIL=$join timeout 90 python3 benchmarks/bench_offline.py --num-seqs $seqs \
                2>&1 | tee -a "$OUT/jointail_engine.log" | grep -E "throughput|achieved" || status=1
        done
        NANOVLLM_DECODE_JOIN_TAIL=$join timeout 90 python3 benchmarks/profile_step.py --batch 256 2>&1 \
            | tee -a "$OUT/jointail_profile.log" | grep -E "ms per decode step|GPU timeline|_decode_split" || status=1
    done
fi
if [[ $what == split ]]; then  # issues 19, 23: kernels/split_gemm.py against the GEMV and cuBLAS at 2-64 rows
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_split_gemm.py tests/kernels/test_gemv.py \
        2>&1 | tee "$OUT/split_tests.log" | tail -2 || status=1
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/executor/test_gpu.py -x \
        -k "matches_hf and triton and not compiled" 2>&1 \
        | tee "$OUT/split_parity.log" | tail -2 || status=1
    for rows in 0 64 64 0; do  # NANOVLLM_SPLIT_GEMM_MAX_ROWS
        echo "== NANOVLLM_SPLIT_GEMM_MAX_ROWS=$rows"
        NANOVLLM_SPLIT_GEMM_MAX_ROWS=$rows timeout 90 python3 benchmarks/bench_offline.py --num-seqs 32 2>&1 \
            | tee -a "$OUT/split_32.log" | grep -E "throughput|achieved" || status=1
    done
    for rows in 64 0; do
        echo "== NANOVLLM_SPLIT_GEMM_MAX_ROWS=$rows"
        NANOVLLM_SPLIT_GEMM_MAX_ROWS=$rows timeout 120 python3 benchmarks/bench_offline.py --single 2>&1 \
            | tee -a "$OUT/split_256.log" | grep -E "throughput|achieved|single request" || status=1
    done
    for rows in 64 0; do  # where a 32-row step's time goes, with and without the tiles
        echo "== profile_step.py --batch 32, NANOVLLM_SPLIT_GEMM_MAX_ROWS=$rows"
        NANOVLLM_SPLIT_GEMM_MAX_ROWS=$rows timeout 80 python3 benchmarks/profile_step.py --batch 32 \
            > "$OUT/split_profile_$rows.log" 2>&1 || status=1
        grep -iE "per (decode )?step|busy|idle" "$OUT/split_profile_$rows.log" | head -6
    done
    exit $status
fi
if [[ $what == rows ]]; then  # issue 23: where the split tiles take over from the GEMV, and rotary_store stops
    for limits in 9x8 5x8 3x8 5x4 5x4 3x8 5x8 9x8; do  # NANOVLLM_SPLIT_GEMM_MIN_ROWS x NANOVLLM_ROTARY_MAX_BATCH
        echo "== NANOVLLM_SPLIT_GEMM_MIN_ROWS x NANOVLLM_ROTARY_MAX_BATCH = $limits"
        NANOVLLM_SPLIT_GEMM_MIN_ROWS=${limits%x*} NANOVLLM_ROTARY_MAX_BATCH=${limits#*x} timeout 80 \
            python3 benchmarks/bench_offline.py --num-seqs 32 2>&1 | tee -a "$OUT/rows_32.log" \
            | grep -E "throughput|achieved" || status=1
    done
    for min_rows in 9 5 5 9; do  # the offline workload: only its last ~30 steps have 8 rows or fewer
        echo "== NANOVLLM_SPLIT_GEMM_MIN_ROWS=$min_rows, 256 requests"
        NANOVLLM_SPLIT_GEMM_MIN_ROWS=$min_rows timeout 90 python3 benchmarks/bench_offline.py 2>&1 \
            | tee -a "$OUT/rows_256.log" | grep -E "throughput|achieved" || status=1
    done
    exit $status
fi
if [[ $what == tiles ]]; then  # issues 19, 23: the split tiles' depth, and where they take over from the GEMV
    for batch in 32 16; do
        for row_bytes in 512 1024 1024 512; do  # 64 x 256 (sessions 30-55) against 64 x 512 tiles in bf16
            echo "== NANOVLLM_SPLIT_GEMM_ROW_BYTES=$row_bytes, batch $batch"
            NANOVLLM_SPLIT_GEMM_ROW_BYTES=$row_bytes timeout 80 python3 benchmarks/profile_step.py --batch $batch \
                --steps 40 2>&1 | tee -a "$OUT/tiles_depth.log" | grep -E "ms per decode step" || status=1
        done
    done
    for batch in 2 4; do
        for min_rows in 3 2 2 3; do
            echo "== NANOVLLM_SPLIT_GEMM_MIN_ROWS=$min_rows, batch $batch"
            NANOVLLM_SPLIT_GEMM_MIN_ROWS=$min_rows timeout 80 python3 benchmarks/profile_step.py --batch $batch \
                --steps 40 2>&1 | tee -a "$OUT/tiles_rows.log" | grep -E "ms per decode step" || status=1
        done
    done
    for min_rows in 3 2 2 3; do
        echo "== NANOVLLM_SPLIT_GEMM_MIN_ROWS=$min_rows, 32 requests"
        NANOVLLM_SPLIT_GEMM_MIN_ROWS=$min_rows timeout 80 python3 benchmarks/bench_offline.py --num-seqs 32 2>&1 \
            | tee -a "$OUT/tiles_32.log" | grep -E "throughput|achieved" || status=1
    done
    exit $status
fi
if [[ $what == midbatch ]]; then  # issue 23: where 8-32 rows lose to the floor
    for batch in 8 16 32; do
        timeout 240 python3 benchmarks/bench_kernels.py --decode-only --sweep --sweep-top 5 --decode-batch $batch \
            --decode-context 512 --table-tokens 4096 2>&1 | tee "$OUT/sweep_$batch.log" | grep -A6 -E "fastest first|^kernel" || status=1
    done
    timeout 100 python3 benchmarks/bench_offline.py --num-seqs 32 --single 2>&1 | tee "$OUT/bench_32.log" \
        | grep -E "throughput|achieved|single request" || status=1
    timeout 120 python3 benchmarks/profile_step.py --batch 32 2>&1 | tee "$OUT/profile_32.log" \
        | grep -E "ms per decode step|per step:|GPU timeline|_kernel|nvjet" | head -20 || status=1
    for rows in 8 32 32 8; do  # rotary_store inside decode attention up to 8 rows (the default) or 32
        echo "== NANOVLLM_ROTARY_MAX_BATCH=$rows"
        NANOVLLM_ROTARY_MAX_BATCH=$rows timeout 90 python3 benchmarks/bench_offline.py --num-seqs 32 2>&1 \
            | tee -a "$OUT/rotary_32.log" | grep -E "throughput" || status=1
    done
    exit $status
fi
if [[ $what == spec ]]; then  # speculative decoding by n-gram lookup (engine/speculative.py)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/executor/test_gpu.py \
        -k "speculative and triton and not compiled and not precompiled" 2>&1 | tee "$OUT/spec_tests.log" | tail -3
    timeout 150 python3 benchmarks/bench_speculative.py --batch 1 4 --num-prompts 8 2>&1 | tee "$OUT/spec_demo.log" \
        | grep -E "^(plain|ngram|model)" || status=1
    timeout 150 python3 benchmarks/bench_speculative.py --arch qwen3-0.6b --batch 1 8 --num-prompts 8 --max-tokens 200 \
        2>&1 | tee "$OUT/spec_06b.log" | grep -E "^(plain|ngram|model)" || status=1
    for k in 0 4; do  # a verification step taken apart against a decode step, one request (0.6B dummy weights)
        timeout 100 python3 benchmarks/profile_step.py --batch 1 --speculative $k 2>&1 | tee "$OUT/spec_profile_$k.log" \
            | grep -E "ms per decode step|per step:|GPU timeline|speculative:" || status=1
    done
    exit $status
fi
if [[ $what == draft ]]; then  # speculative decoding with a draft model (executor/draft.py)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/executor/test_gpu.py \
        -k "draft_model and triton and not compiled and not precompiled" 2>&1 | tee "$OUT/draft_tests.log" | tail -3
    timeout 150 python3 benchmarks/bench_speculative.py --draft demo --batch 1 4 --num-prompts 8 2>&1 \
        | tee "$OUT/draft_demo.log" | grep -E "^(plain|draft|model)" || status=1
    timeout 200 python3 benchmarks/bench_speculative.py --arch qwen3-0.6b --draft self --batch 1 8 --num-prompts 8 \
        --max-tokens 200 2>&1 | tee "$OUT/draft_06b_self.log" | grep -E "^(plain|draft|model)" || status=1
    timeout 240 python3 benchmarks/bench_speculative.py --arch qwen3-8b --draft qwen3-0.6b --batch 1 8 --num-prompts 8 \
        --max-tokens 200 2>&1 | tee "$OUT/draft_8b.log" | grep -E "^(plain|draft|model)" || status=1
    timeout 100 python3 benchmarks/profile_step.py --batch 1 --speculative 4 --draft self 2>&1 \
        | tee "$OUT/draft_profile.log" | grep -E "ms per decode step|per step:|GPU timeline|speculative:" || status=1
    exit $status
fi
install_wheels() {  # the packages the machine's image lacks, from .whl (scripts/fetch_gpu_wheels.sh)
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
}
if [[ $what == startup ]]; then  # issue 19 item 4: `nanovllm serve`, launch to first answer, cold and warm
    # Cold: the page cache dropped and empty compile caches (on a fresh machine the first round
    # is cold as well); warm: the caches of the round before. The newest transformers (what a
    # fresh install gets) when .whl-transformers is carried, the image's otherwise.
    install_wheels
    if compgen -G ".whl-transformers/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-transformers \
            .whl-transformers/*.whl && export PYTHONPATH=/tmp/site-transformers:$PYTHONPATH
    fi
    echo "transformers $(python3 -c 'import transformers; print(transformers.__version__)')"
    for round in ${STARTUP_ROUNDS:-cold warm cold warm cold}; do
        if [[ $round == cold ]]; then
            export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
            sync; echo 3 >/proc/sys/vm/drop_caches || echo "(page cache not dropped)"
        fi
        echo "== $round"
        timeout 150 python3 benchmarks/bench_serving.py --port 0 --num-prompts 16 --input-len 128 --output-len 16 2>&1 \
            | tee -a "$OUT/startup.log" | grep -E "server_ready_s|first_answer_s|startup_" || status=1
    done
    exit $status
fi
if [[ $what == itl ]]; then  # issue 19 item 2: steps with prompt tokens, piecewise graphs vs whole graphs (A/B)
    install_wheels
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/executor/test_gpu.py tests/kernels/test_kernels.py \
        -k "prefill_graph or without_max_seqlen" 2>&1 | tee "$OUT/itl_tests.log" | tail -3 || status=1
    for tokens in 0 2048; do  # eager, whole graphs
        timeout 90 python3 benchmarks/profile_step.py --batch 8 --mixed 1024 --max-prefill-graph-tokens $tokens 2>&1 \
            | tee "$OUT/profile_mixed_$tokens.log" | grep -E "mixed step" || status=1
    done
    echo "== 20 requests/s"
    timeout 120 python3 benchmarks/bench_serving.py --num-prompts 200 --input-len 1024 --output-len 128 \
        --request-rate 20 2>&1 | tee "$OUT/bench_serving_rate20.log" | grep -E -i "ttft|tpot|itl|server_ready|startup" \
        || status=1
    exit $status
fi
if [[ $what == structured ]]; then
    install_wheels
    python3 -c "import xgrammar" || { echo "xgrammar is missing: carry .whl"; exit 1; }
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_structured.py -k "cuda or bf16" 2>&1 \
        | tee "$OUT/structured_tests.log" | tail -8 || status=1
    timeout 300 python3 benchmarks/bench_structured.py 2>&1 | tee "$OUT/bench_structured.log" | grep -v Warning | tail -16 || status=1
    exit $status
fi
if [[ $what == moe ]]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py tests/executor/test_gpu.py \
        -k "fused_moe or (qwen3_moe and triton)" 2>&1 | tee "$OUT/moe_tests.log" | tail -8 || status=1
    for fp8 in "" --moe-fp8; do
        timeout 200 python3 benchmarks/bench_kernels.py --moe-only --moe-sweep --sweep-top 3 $fp8 2>&1 \
            | tee -a "$OUT/bench_moe.log" | grep -v Warning | tail -30 || status=1
    done
    for quant in "" "--quantization fp8"; do  # bf16, then FP8 experts (and linear layers)
        timeout 200 python3 benchmarks/bench_offline.py --arch qwen3-30b-a3b $quant "$@" 2>&1 \
            | tee -a "$OUT/bench_moe_offline.log" | grep -v Warning | tail -8 || status=1
    done
    exit $status
fi
if [[ $what == moe-tp ]]; then
    export NCCL_NVLS_ENABLE=0
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/executor/test_tensor_parallel.py -k "moe and two_gpus" 2>&1 \
        | tee "$OUT/moe_tp_tests.log" | tail -5 || status=1
    for ep in "" --enable-expert-parallel; do
        timeout 200 python3 benchmarks/bench_offline.py --arch qwen3-30b-a3b --tensor-parallel-size 2 $ep "$@" 2>&1 \
            | tee -a "$OUT/bench_moe_tp2.log" | grep -v Warning | tail -8 || status=1
    done
    exit $status
fi
if [[ $what == fp8 ]]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kv.py tests/kernels/test_fp8_gemm.py \
        tests/engine/test_fp8_accuracy.py -k "not cpu" 2>&1 | tee "$OUT/fp8_tests.log" | tail -8 || status=1
    timeout 220 python3 benchmarks/bench_kernels.py --fp8-only --sweep --sweep-top 6 2>&1 | tee "$OUT/bench_fp8_kernels.log" \
        | grep -v Warning | tail -45 || status=1
    timeout 120 python3 benchmarks/eval_fp8.py --device cuda --max-files 4 2>&1 | tee "$OUT/eval_fp8.log" | tail -8 || status=1
    # The same text scored through decode steps, so through decode attention over the FP8 cache.
    timeout 120 python3 benchmarks/eval_fp8.py --device cuda --max-files 4 --decode --modes "kv fp8 (e4m3)" \
        "kv fp8_e5m2" "weights + kv fp8" 2>&1 | tee "$OUT/eval_fp8_decode.log" | tail -5 || status=1
    exit $status
fi
if [[ $what == fp8-attention ]]; then
    timeout 270 python3 benchmarks/bench_kernels.py --fp8-only --sweep --sweep-top 10 --fp8-tokens 64 2>&1 \
        | tee "$OUT/bench_fp8_attention_06b.log" | grep -v Warning | grep -E "sweep|us  |decode fp8" || status=1
    timeout 270 python3 benchmarks/bench_kernels.py --fp8-only --sweep --sweep-top 10 --fp8-tokens 64 --num-heads 32 \
        --decode-batch 128 --decode-context 512 --table-tokens 4096 2>&1 | tee "$OUT/bench_fp8_attention_8b.log" \
        | grep -v Warning | grep -E "sweep|us  |decode fp8" || status=1
    exit $status
fi
if [[ $what == fp8-bench ]]; then
    for run in "--kv-cache-dtype auto" "--kv-cache-dtype fp8" "--arch qwen3-8b" "--arch qwen3-8b --quantization fp8 --kv-cache-dtype fp8"; do
        echo "== $run"
        timeout 140 python3 benchmarks/bench_offline.py $run "$@" 2>&1 | tee -a "$OUT/bench_fp8_offline.log" \
            | grep -E "^model|^startup|throughput|floor" || status=1
    done
    exit $status
fi
if [[ $what == decode-gemm ]]; then
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_gemm.py 2>&1 | tail -2 || status=1
    timeout 240 python3 benchmarks/bench_kernels.py --decode-gemm-only ${SWEEP:+--decode-gemm-sweep --sweep-top 3} 2>&1 \
        | tee "$OUT/bench_decode_gemm.log" | grep -E "^linear|sweep" || status=1
    exit $status
fi
if [[ $what == fp8-gemm ]]; then
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm.py -k "not cpu" 2>&1 \
        | tee "$OUT/fp8_gemm_tests.log" | tail -3 || status=1
    timeout 300 python3 benchmarks/bench_kernels.py --fp8-gemm-only --fp8-tokens 1 16 32 64 128 256 \
        ${SWEEP:+--fp8-gemm-sweep --sweep-top 3} 2>&1 | tee "$OUT/bench_fp8_gemm.log" | grep -E "^linear|sweep" || status=1
    fp8="--arch qwen3-8b --quantization fp8 --kv-cache-dtype fp8"
    for side in channel cublas cublas channel; do  # NANOVLLM_FP8_CHANNEL_GEMM_MAX_ROWS=0: cuBLAS where channel_gemm ran (the wide FP8 form keeps its rows)
        echo "== $side"
        NANOVLLM_FP8_CHANNEL_GEMM_MAX_ROWS=$([[ $side == cublas ]] && echo 0 || echo 128) timeout 120 \
            python3 benchmarks/bench_offline.py $fp8 "$@" 2>&1 | tee -a "$OUT/fp8_gemm_$side.log" | grep -E "throughput|floor" || status=1
    done
    for run in "$fp8" "--arch qwen3-8b"; do
        echo "== $run, 32 requests and one"
        timeout 120 python3 benchmarks/bench_offline.py $run --num-seqs 32 --single "$@" 2>&1 \
            | tee -a "$OUT/fp8_gemm_small.log" | grep -E "throughput|floor|single request" || status=1
    done
    echo "== --arch qwen3-8b (bf16)"
    timeout 120 python3 benchmarks/bench_offline.py --arch qwen3-8b "$@" 2>&1 | tee -a "$OUT/fp8_gemm_bf16.log" \
        | grep -E "throughput|floor" || status=1
    exit $status
fi
if [[ $what == dp ]]; then
    # Offline and HTTP, one engine against two replicas; then the shared-prefix workload
    # (64 prefixes of 2,048 tokens x 16 requests, in random order) on two replicas with
    # prefix-affinity routing against round-robin, each replica's cache 448 blocks of 256
    # tokens (114,688 tokens, less than a 32B model leaves on an H200): the 64 prefixes
    # take 512 blocks, so a replica holds about half of them next to its running requests.
    install_wheels
    for dp in 1 2; do
        echo "== offline -dp $dp"
        timeout 120 python3 benchmarks/bench_offline.py --data-parallel-size $dp "$@" 2>&1 | tee "$OUT/bench_dp$dp.log" \
            | grep -E "^startup|throughput" || status=1
    done
    for dp in 1 2; do
        echo "== HTTP -dp $dp"
        timeout 150 python3 benchmarks/bench_serving.py --num-prompts 1000 --data-parallel-size $dp "$@" 2>&1 \
            | tee "$OUT/bench_serving_dp$dp.log" | grep -E "completed|failed|output_throughput|first_error" || status=1
    done
    for routing in prefix-affinity round-robin; do
        echo "== shared prefixes, -dp 2 --dp-routing $routing"
        timeout 150 python3 benchmarks/bench_serving.py --num-prompts 1024 --shared-prefixes 64 --input-len 2304 \
            --prefix-len 2048 --output-len 128 --num-kvcache-blocks 448 --data-parallel-size 2 --dp-routing $routing \
            "$@" 2>&1 | tee -a "$OUT/bench_serving_prefixes.log" \
            | grep -E "completed|failed|output_throughput|prefix_cache_hit_rate|first_error" || status=1
    done
    exit $status
fi
if [[ $what == serving || $what == serving-inf ]]; then
    install_wheels
    python3 -c "import fastapi, uvicorn, pydantic" || { echo "the server's packages are missing: carry .whl"; exit 1; }
    if [[ $what == serving ]]; then
        # First, so that on a fresh machine its server starts with cold compile caches
        # (server_ready_s, first_answer_s); ITL against TPOT at 20 requests/s, medians of three runs.
        python3 benchmarks/bench_serving.py --repeats 3 --num-prompts 200 --input-len 1024 --output-len 128 --request-rate 20 2>&1 \
            | tee "$OUT/bench_serving_rate20.log" | grep -v Warning | tail -24 || status=1
    fi
    # HTTP against offline on the same requests, the median of three runs of each (a warm start).
    python3 benchmarks/bench_serving.py --offline --repeats 3 --num-prompts 1000 --input-len 1024 --output-len 128 2>&1 \
        | tee "$OUT/bench_serving.log" | grep -v Warning | tail -44 || status=1
    # The same HTTP runs with their connections opened beforehand, so that the burst's
    # connects (and a listen queue of net.core.somaxconn, printed) are out of the measurement.
    echo "net.core.somaxconn $(cat /proc/sys/net/core/somaxconn), tcp_max_syn_backlog $(cat /proc/sys/net/ipv4/tcp_max_syn_backlog)"
    python3 benchmarks/bench_serving.py --warm-connections --repeats 3 --num-prompts 1000 --input-len 1024 \
        --output-len 128 2>&1 | tee "$OUT/bench_serving_warm.log" | grep -E "tok/s per run|http run|output_throughput" \
        || status=1
fi
if [[ $what == tp || $what == tp-parity ]]; then
    # On two GPUs: the TP=2 parity test; Qwen3-8B at TP 2; then one TP=1 engine per GPU at
    # once (two engines side by side, i.e. data parallel), each also the TP=1 figure.
    export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these machines (the device notes say why)
    # If the parity test stalls, its workers print their stacks (SIGUSR1) before pytest's faulthandler fires.
    (sleep 170; pkill -USR1 -f multiprocessing.spawn) &
    timeout -s ABRT 240 python3 -m pytest -s -v -p no:cacheprovider -o faulthandler_timeout=200 tests/executor/test_tensor_parallel.py \
        -k two_gpus 2>&1 | tee "$OUT/tp_test.log" | grep -E "PASS|FAIL|Error|error|passed|failed" | tail -30 || status=1
    [[ $what == tp-parity ]] && exit $status
    timeout 170 python3 benchmarks/bench_offline.py --arch qwen3-8b --tensor-parallel-size 2 "$@" 2>&1 \
        | tee "$OUT/bench_tp2.log" | grep -v Warning | tail -8 || status=1
    for gpu in 0 1; do
        CUDA_VISIBLE_DEVICES=$gpu timeout 170 python3 benchmarks/bench_offline.py --arch qwen3-8b "$@" >"$OUT/bench_tp1_gpu$gpu.log" 2>&1 &
    done
    wait || status=1
    tail -n 6 "$OUT"/bench_tp1_gpu*.log
fi
exit $status

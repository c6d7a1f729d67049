"""ModelRunner: one rank's model shard, KV cache and CUDA graphs.

A step is a pipeline: build the inputs from the scheduled sequences (inputs.py), publish
the attention metadata as the forward context, run the model (or replay a captured CUDA
graph for decode, cuda_graph.py), take the logits of each sequence's last token, sample
(sampling/). `launch` runs the whole of it for a step this rank computes alone (one GPU, or
a start-up run); for tensor-parallel steps the TPExecutor (executor.py) drives the same
pieces on rank 0 and the workers (worker.py) run `forward` on theirs.

Nothing waits for the GPU: `sample` returns a LaunchedStep whose tokens are copied to the
host asynchronously, so the engine can schedule and launch the next step meanwhile.

The entry points run under torch.no_grad(), not inference_mode(): inference mode makes
inference tensors, the buffers built at start-up are not, and torch.compile guards on
that difference, so the sampler would compile its paths twice over.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nanovllm.config import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_PREFILL_GRAPH_TOKENS, Config
from nanovllm.executor.cuda_graph import CUDAGraphRunner
from nanovllm.executor.draft import DraftRunner
from nanovllm.executor.graphs import GraphPlan, graph_plan
from nanovllm.executor.inputs import InputBuilder, ScheduledSeqs
from nanovllm.executor.loading import bind_attention, build_model
from nanovllm.executor.kv_cache import allocate_kv_cache, blocks_from_memory_profile, kv_bytes_per_block
from nanovllm.executor.piecewise import PrefillGraphRunner
from nanovllm.executor.prompt_logprobs import compute_prompt_logprobs
from nanovllm.executor.step import ForwardOutput, LaunchedStep, PreviousTokens, SharedTokens, StepSeq
from nanovllm.kernels.launch import precompile_wanted, precompiling
from nanovllm.sampling.sampler import FILTERED_KERNEL, Sampler, SamplingTensors
from nanovllm.sampling.state import SamplingState
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence
from nanovllm.utils.compile import compile_enabled, compile_needed, set_compile_enabled
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.distributed import SINGLE_RANK, TPGroup

logger = logging.getLogger(__name__)

# Prompt lengths of the start-up prefills that compile the paged prefill path: one per query
# tile the kernel picks (kernels/prefill_config.py: 16 to 64 rows), and 128, whose projections
# of 65-256 rows take the wide tiles (kernels/wide_gemm.py) and compile them.
PREFILL_WARMUP_LENGTHS = (16, 32, 64, 128)


def rank_device(config: Config, rank: int) -> torch.device:
    """cuda:rank on GPUs (made the current device), the configured device otherwise."""
    device = config.torch_device
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    return device


def decodes_rows(seq: Sequence | StepSeq) -> bool:
    """Whether seq's scheduled tokens can each be a decode row whose logits are sampled: its
    last token alone or with its drafts (speculative decoding), or a prompt chunk of one
    token, without prompt logprobs. Read the same on every rank (a StepSeq there)."""
    return seq.num_scheduled_tokens == 1 + seq.num_draft_tokens and seq.prompt_logprob_rows is None


class ModelRunner:
    """One rank of an engine (rank 0 of 1 unless given a tensor-parallel group). Every rank
    computes each step; rank 0 also samples."""

    def __init__(self, config: Config, group: TPGroup = SINGLE_RANK):
        start = time.perf_counter()
        hf_config = config.hf_config
        self.config = config
        self.tp_group = group
        self.rank = group.rank
        self.device = rank_device(config, self.rank)
        self.dtype = config.torch_dtype
        self.kv_cache_dtype = config.kv_cache_torch_dtype
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
        self.timings: dict[str, float] = {}
        torch.manual_seed(config.seed)
        if self.device.type == "cpu" and (threads := config.cpu_thread_count()) is not None:
            torch.set_num_threads(threads)

        memory_used_before = self._memory_in_use()
        with self._timed("load_weights_s"):
            self.model = build_model(config, self.device, group)
            # Speculative decoding's draft model (method "draft_model"): a KV cache beside this one's,
            # on every rank, or whole on rank 0 (draft_tensor_parallel_size 1).
            whole = config.draft is not None and config.draft.tensor_parallel_size == 1
            self.drafter = None if config.draft is None or whole and self.rank else DraftRunner(
                config, SINGLE_RANK if whole else group, self.device, self.max_blocks_per_seq)
        self.attention_layers, backend = bind_attention(self.model, config)
        self.attention_backend = backend
        self.inputs = InputBuilder(config.max_num_batched_tokens, config.max_num_seqs, self.max_blocks_per_seq,
                                   self.block_size, self.device)
        if self.rank == 0:  # rank 0 samples; the other ranks receive its tokens here (share_sampled)
            self.sampler = Sampler()
            drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
            self.sampling = SamplingState(hf_config.vocab_size, config.max_num_seqs, self.device, config.max_logprobs,
                                          drafts)
        else:
            self.shared_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        plan = graph_plan(config, self.device, DEFAULT_PREFILL_GRAPH_TOKENS)
        set_compile_enabled(compile_needed(plan.graphs, backend.fuses_rotary_store(), FILTERED_KERNEL))
        # Built after the KV cache and captured last (_build_graphs, _warm_up_and_capture): until
        # then (the start-up prefills) every step runs eagerly.
        self.graph_runner: CUDAGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        # The rest of the set-up before the KV cache: CUDA's start, the attention backend
        # (Triton's import), the sampler's and the inputs' buffers.
        self.timings["setup_s"] = time.perf_counter() - start - self.timings["load_weights_s"]
        self.num_kvcache_blocks = self._allocate_kv_cache(memory_used_before)
        self._build_graphs(plan, backend.captures_prefill())
        self._warm_up_and_capture(plan.graphs)
        if config.calculate_kv_scales:  # from the first real batch on
            for layer in self.attention_layers:
                layer.calculate_kv_scales()

    def _memory_in_use(self) -> int:
        """Bytes of the device's memory other processes (and live engines) hold already; 0 on CPU."""
        if self.device.type != "cuda":
            return 0
        gc.collect()  # not what engines of this process that have shut down still hold
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _build_graphs(self, plan: GraphPlan, capture_attention: bool) -> None:
        """The decode graphs and the prefill graphs that `plan` asks for, not captured yet: until
        _warm_up_and_capture captures them every step runs eagerly (their can_run)."""
        if plan.decode:
            self.graph_runner = self.decode_graph_runner(graphs=plan.graphs)
        if plan.prefill_tokens:
            # On CUDA they share the decode graphs' memory pool (neither keeps a tensor in it).
            # Whole graphs, attention captured, where the backend can: no Python between the
            # layers (a lower ITL p99 than the pieces', benchmarks/RESULTS.md, session 14).
            self.prefill_graphs = PrefillGraphRunner(
                self.model, plan.prefill_tokens, self.dtype, self.device, graphs=plan.graphs,
                capture_attention=capture_attention, max_seqs=self.config.max_num_seqs,
                max_blocks=self.max_blocks_per_seq)

    def _warm_up_and_capture(self, use_graphs: bool) -> None:
        """Compile the kernels the graphs will hold (CUDA), then capture the graphs, each
        phase timed in self.timings."""
        if use_graphs and self.config.kernels == "triton" and precompile_wanted():
            with self._timed("precompile_s"):
                self._precompile()
        if self.device.type == "cuda":
            with self._timed("compile_warmup_s"):  # on top of the memory profile's first prefill
                self._warm_up_paged_prefill()
        if self.graph_runner is not None:
            with self._timed("cuda_graph_capture_s"):
                self.graph_runner.capture()
        if self.prefill_graphs is not None:
            with self._timed("prefill_graph_capture_s"):
                self.prefill_graphs.capture(pool=self.graph_runner.pool if self.graph_runner else None)
        if self.drafter is not None:
            with self._timed("cuda_graph_capture_s"):
                self.drafter.capture(self.graph_runner.pool if self.graph_runner else None)

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        """Add the block's wall time to self.timings[name] (start-up's phases)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def decode_graph_runner(self, graphs: bool = True) -> CUDAGraphRunner:
        """The decode steps' graphs, to capture (graphs=False: as plain calls over the same
        buffers, which tests run on CPU). On one GPU they also compute the logits and
        sample (temperature-only batches); under tensor parallelism they stop at the hidden
        states."""
        hf_config = self.config.hf_config
        # Steps that verify drafts replay them too, a row per token.
        spec = self.config.speculative
        sees = self.attention_backend.decode_sees_step_rows if spec is not None else None
        drafts = spec.num_speculative_tokens if spec is not None else 0
        return CUDAGraphRunner(self.model, self.config.max_num_seqs, self.max_blocks_per_seq, hf_config.hidden_size,
                               self.dtype, self.device, samples=self.tp_group.size == 1,
                               vocab_size=hf_config.vocab_size, graphs=graphs,
                               unpack_kernel=self.config.kernels == "triton", rows_per_seq=1 + drafts,
                               sees_step_rows=sees)

    # -- KV cache and start-up runs ---------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.attention_layers, self.block_size, self.kv_cache_dtype)

    def _allocate_kv_cache(self, memory_used_before: int) -> int:
        """Size the cache (GPU: from a memory profile; CPU: from configuration), allocate it
        and bind each attention layer's views of it; returns the number of blocks."""
        config = self.config
        block_bytes = self.kv_bytes_per_block() + (self.drafter.kv_bytes_per_block() if self.drafter else 0)
        if config.num_kvcache_blocks > 0:
            num_blocks = config.num_kvcache_blocks
        elif self.device.type == "cuda":
            self._profile_largest_prefill()
            num_blocks = blocks_from_memory_profile(self.device, config.gpu_memory_utilization, memory_used_before,
                                                    block_bytes)
        else:  # at most what max_num_seqs sequences of max_model_len fill: zeroing fresh pages takes time
            num_blocks = min(DEFAULT_CPU_KV_CACHE_BYTES // block_bytes, config.max_num_seqs * self.max_blocks_per_seq)
        # Ranks hold the same shapes, but their memory profiles may differ: all take the least.
        if self.tp_group.size > 1:
            num_blocks_t = torch.tensor([num_blocks], device=self.device)
            self.tp_group.all_reduce(num_blocks_t, torch.distributed.ReduceOp.MIN)
            num_blocks = int(num_blocks_t.item())
        if num_blocks <= 0:
            raise ValueError(
                "no memory is left for the KV cache after loading the model; raise gpu_memory_utilization "
                "or lower max_num_batched_tokens"
            )
        self.kv_cache = allocate_kv_cache(self.attention_layers, num_blocks, self.block_size, self.kv_cache_dtype,
                                          self.device)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)
        return num_blocks

    def _profile_largest_prefill(self) -> None:
        """Run the largest prefill twice: the first run also compiles (the Triton
        kernels, torch.compile where it is on) and is timed apart; the second,
        steady-state one sets the peak memory the KV cache is sized from."""
        config = self.config
        seq_len = min(config.max_model_len, config.max_num_batched_tokens)
        num_seqs = min(config.max_num_batched_tokens // seq_len, config.max_num_seqs)
        dummy = [Sequence(-1, [0] * seq_len, SamplingParams(temperature=0.0), self.block_size) for _ in range(num_seqs)]
        for seq in dummy:
            seq.num_scheduled_tokens = seq_len
        with self._timed("compile_warmup_s"):
            self._local_prefill(dummy)
            torch.cuda.synchronize()
        with self._timed("memory_profile_s"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self._local_prefill(dummy)
            torch.cuda.synchronize()

    def _precompile(self) -> None:
        """NANOVLLM_PRECOMPILE=1: walk what start-up is about to capture (every decode and
        prefill graph bucket) with the Triton kernels compiling side by side instead of
        running (kernels/launch.py); the captures after it find them compiled. Captured
        code reads nothing back to the host, so the walk's other work on unwritten outputs
        is harmless."""
        with precompiling():
            if self.graph_runner is not None:
                self.graph_runner.precompile()
            if self.prefill_graphs is not None:
                self.prefill_graphs.precompile()

    def _warm_up_paged_prefill(self) -> None:
        """Compile the paged prefill path now rather than on a user's first request: one
        sequence of each PREFILL_WARMUP_LENGTHS length. Writes K/V into the first blocks,
        which hold nothing yet."""
        limit = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        for n in PREFILL_WARMUP_LENGTHS:
            seq = Sequence(-1, [0] * n, SamplingParams(temperature=0.0), self.block_size)
            if n > limit or seq.num_blocks > self.num_kvcache_blocks:
                break
            seq.block_table = list(range(seq.num_blocks))
            seq.num_scheduled_tokens = n
            self._local_prefill([seq])
            if self.drafter is not None and (n + self.block_size) // self.block_size <= self.num_kvcache_blocks:
                self.drafter.propose([StepSeq([0] * n, 0, list(range((n + self.block_size) // self.block_size)))], [2])

    @torch.no_grad()
    def _local_prefill(self, seqs: list[Sequence]) -> None:
        """A start-up prefill on this rank alone, sampled on rank 0 (to compile the sampler
        too). Every rank runs the same ones while it is built, so the collectives pair up."""
        if self.rank == 0:
            self.launch(seqs, True).token_ids()
        else:
            self.forward(seqs, True)

    @torch.no_grad()
    def warm_up_sampler(self) -> float:
        """Compile the sampler's filtered paths now (a server does this at start-up, so that
        the first request with top-k/p, min-p or a penalty does not hold up everyone's
        step while they compile): the Triton kernels on CUDA, torch.compile's paths where
        they run. Returns the seconds it took; nothing to do on CPU uncompiled."""
        if not compile_enabled() and self.device.type != "cuda":
            return 0.0
        start = time.perf_counter()
        if self.device.type == "cuda" and self.config.kernels == "triton" and precompile_wanted():
            with precompiling():  # its kernels' variants side by side first (kernels/launch.py)
                self.sampler.warm_up(self.config.hf_config.vocab_size, self.device, self.dtype)
        self.sampler.warm_up(self.config.hf_config.vocab_size, self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    # -- one step ---------------------------------------------------------------------------

    @torch.no_grad()
    def launch(self, seqs: list[Sequence], is_prefill: bool, prev: PreviousTokens | None = None) -> LaunchedStep:
        """Queue one step for seqs, computed by this rank alone, and the copy of its tokens
        to the host. Without a decode graph (which samples inside it) the model goes first,
        so that the GPU starts on it while the host prepares the sampling."""
        graphs = self._decode_graphs(seqs, is_prefill)
        if graphs is None:
            output = self._run_model(seqs, is_prefill, prev)
            return self.sample(seqs, self.prepare_sampling(seqs), output)
        sampling = self.prepare_sampling(seqs, graph_samples=graphs.samples)
        return self.sample(seqs, sampling, self._replay_decode(graphs, seqs, prev, sampling, multi_row=is_prefill))

    def prepare_sampling(self, seqs: list[Sequence], defer_late: bool = False, graph_samples: bool = False
                         ) -> SamplingTensors:
        """The sampler's inputs for a step's sequences (rank 0; see SamplingState.prepare)."""
        return self.sampling.prepare(seqs, defer_late, graph_samples)

    def _decode_graphs(self, seqs: ScheduledSeqs, is_prefill: bool) -> CUDAGraphRunner | None:
        """The decode graphs, where they run this step: a decode batch no larger than their
        largest bucket, or a step that verifies drafts and computes nothing else (its rows:
        every scheduled token, as pack_rows packs them) no larger than their multi_row buckets."""
        graphs = self.graph_runner
        if graphs is None:
            return None
        if not is_prefill:
            return graphs if graphs.can_run(len(seqs)) else None
        # (Not while FP8 cache scales wait for a prefill's K/V: one-token prompts could be the first step.)
        if not graphs.multi_row_buckets or self.attention_layers[0].scales_pending or not all(map(decodes_rows, seqs)):
            return None
        return graphs if graphs.can_run(sum(seq.num_scheduled_tokens for seq in seqs), multi_row=True) else None

    @torch.no_grad()
    def forward(self, seqs: ScheduledSeqs, is_prefill: bool, prev: PreviousTokens | None = None,
                sampling: SamplingTensors | None = None) -> ForwardOutput:
        """Run the model over the scheduled tokens: [num_seqs, vocab] logits of each last
        token on rank 0 (None on the other ranks), the sampled tokens when a decode graph
        sampled them with `sampling`, and the prompt logprobs of the sequences that want them."""
        if (graphs := self._decode_graphs(seqs, is_prefill)) is not None:
            return self._replay_decode(graphs, seqs, prev, sampling, multi_row=is_prefill)
        return self._run_model(seqs, is_prefill, prev)

    def _run_model(self, seqs: ScheduledSeqs, is_prefill: bool, prev: PreviousTokens | None) -> ForwardOutput:
        """forward's step where no decode graph runs it: the model's call (or the prefill's pieces)."""
        inputs = self.inputs.prefill(seqs, prev) if is_prefill else self.inputs.decode(seqs, prev)
        input_ids, positions, context = inputs.input_ids, inputs.positions, inputs.context
        set_context(context)
        try:
            pieces = self.prefill_graphs
            # (No block tables: the memory-profiling run, before the cache exists.)
            if (is_prefill and pieces is not None and pieces.can_run(input_ids.size(0))
                    and context.block_tables is not None):
                hidden = pieces.run(input_ids, positions)
            else:
                hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden)
        finally:
            reset_context()
        prompt = compute_prompt_logprobs(seqs, hidden, self.model.lm_head) if is_prefill else None
        return ForwardOutput(logits, None, prompt)

    def _replay_decode(self, graphs: CUDAGraphRunner, seqs: ScheduledSeqs, prev: PreviousTokens | None,
                       sampling: SamplingTensors | None, multi_row: bool = False) -> ForwardOutput:
        """A decode step as one packed copy and a graph replay (forward's return values);
        multi_row: a step that verifies drafts, a row per scheduled token."""
        packed = graphs.next_host_buffer()
        in_graph = sampling is not None and sampling.in_graph  # from the packed temperatures and keys
        pack = self.inputs.pack_rows if multi_row else self.inputs.pack_decode
        size, pending = pack(seqs, prev, packed.numpy(),
                             (sampling.host_temperatures, sampling.host_keys) if in_graph else None)
        rows = sum(seq.num_scheduled_tokens for seq in seqs) if multi_row else len(seqs)
        out, tokens = graphs.replay(packed[:size], rows, prev.tokens if pending else None, in_graph, multi_row)
        return ForwardOutput(out, tokens) if graphs.samples else ForwardOutput(self.model.compute_logits(out))

    def sample(self, seqs: list[Sequence], sampling: SamplingTensors, output: ForwardOutput) -> LaunchedStep:
        """Sample (unless a decode graph already did) and queue the tokens' copy to the host."""
        tokens, logprobs = output.tokens, None
        if tokens is None:
            if sampling.in_graph:  # prepared for a decode graph's sampling, for a step that did not replay one
                raise ValueError("these sampling tensors are for a decode graph that samples; this step ran without "
                                 "one (prepare them with graph_samples=False)")
            assert sampling.seq_rows is None or output.logits.size(0) == sum(sampling.seq_rows), "a row per draft"
            tokens, logprobs = self.sampler(output.logits, sampling)
        self.sampling.count(tokens, sampling)
        host_tokens, host_logprobs = sampling.outputs.copy(tokens, logprobs)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(seqs, tokens, host_tokens, done, host_logprobs, output.prompt_logprobs, sampling.seq_rows)

    def share_sampled(self, num_prev: int, sampled: torch.Tensor | None = None) -> SharedTokens | None:
        """The previous step's sampled tokens on every rank, for a step whose inputs include
        some still pending on the host (num_prev > 0: that step's number of sequences).
        Every rank calls it, in step order: rank 0 passes its sampled tokens and sends them,
        the workers receive them into a buffer of their own."""
        if not num_prev:
            return None
        tokens = sampled if self.rank == 0 else self.shared_tokens[:num_prev]
        self.tp_group.broadcast(tokens)
        return SharedTokens(tokens)

    def _graph_runners(self) -> list[CUDAGraphRunner | PrefillGraphRunner]:
        return [graphs for graphs in (self.graph_runner, self.prefill_graphs) if graphs is not None]

    def graph_stats(self) -> dict[str, int]:
        """CUDA-graph replays and their real and padded rows (decode), and tokens (prefill)."""
        stats = dict(graph_replays=0, graph_real_rows=0, graph_padded_rows=0, prefill_graph_replays=0,
                     prefill_graph_real_tokens=0, prefill_graph_padded_tokens=0)
        for graphs in self._graph_runners():
            stats.update(graphs.stats())
        return stats

    def reset_graph_stats(self) -> None:
        for graphs in self._graph_runners():
            graphs.reset_stats()

    def shutdown(self) -> None:
        """Free the CUDA graphs (a graph that captured NCCL calls holds its communicator);
        the runner is unusable afterwards."""
        for graphs in self._graph_runners():
            graphs.release()
        if self.drafter is not None:
            self.drafter.release()
        self.graph_runner = self.prefill_graphs = None

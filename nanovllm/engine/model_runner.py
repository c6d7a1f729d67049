"""ModelRunner: turns the scheduler's sequences into tensors, runs the model, samples.

One step: prepare_prefill / prepare_decode fill reusable host buffers (input_ids,
positions, slot_mapping, cu_seqlens, context_lens, block_tables), copy them to the
device, publish the attention metadata through the forward context, run the model,
take the logits of each sequence's last token and sample. Decode steps on CUDA replay
a captured CUDA graph (see cuda_graph.py).

`launch` does not wait for the GPU: it returns a LaunchedStep whose sampled tokens are
copied back asynchronously, so the engine can schedule and launch the next step while
this one runs. A token that is still pending on the host is read from the previous
step's device output when the next step's inputs are built. Two sets of host buffers
alternate, so filling one never races the copy still reading the other.

With tensor_parallel_size > 1, the rank-0 ModelRunner starts the other ranks (see
tensor_parallel.py) and sends each step to them before computing its own part; every
rank runs the same `execute` on the same StepSeq records, and only rank 0 samples. A
token still pending on the host reaches the other ranks through a broadcast of rank 0's
sampled tokens at the start of the next step (`share_sampled`).
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from nanovllm.config import DEFAULT_CPU_KV_CACHE_BYTES, Config
from nanovllm.engine.cuda_graph import CUDAGraphRunner
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence
from nanovllm.engine.tensor_parallel import StepSeq, TPWorkers, rank_device
from nanovllm.layers.attention import Attention, AttentionBackend, TorchAttentionBackend
from nanovllm.engine.sampling_state import SamplingState, sampling_buffer_shapes
from nanovllm.layers.sampler import SampledLogprobs, Sampler, SamplingTensors, StepLogprobs
from nanovllm.models import get_model_class
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.compile import compile_enabled, set_compile_enabled
from nanovllm.utils.context import Context, reset_context, set_context
from nanovllm.utils.distributed import SINGLE_RANK, TPGroup, use_tp_group
from nanovllm.utils.loader import init_dummy_weights, load_model

logger = logging.getLogger(__name__)


class HostBuffers:
    """Step inputs built on the host in preallocated (pinned, on CUDA) arrays, copied to
    preallocated device tensors: nothing is allocated per step but the slices."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        pin = device.type == "cuda"
        shapes = {
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "slot_mapping": ((max_tokens,), torch.int64),
            "cu_seqlens_q": ((max_seqs + 1,), torch.int32),
            "cu_seqlens_k": ((max_seqs + 1,), torch.int32),
            "context_lens": ((max_seqs,), torch.int32),
            "block_tables": ((max_seqs, max_blocks), torch.int32),
            "prev_rows": ((max_seqs,), torch.int64),
            "sampled": ((max_seqs,), torch.int64),
        } | sampling_buffer_shapes(max_seqs)
        self.host = {k: torch.empty(s, dtype=d, pin_memory=pin) for k, (s, d) in shapes.items()}
        self.np = {k: t.numpy() for k, t in self.host.items()}
        self.device = self.host if device.type == "cpu" else {k: torch.empty_like(t, device=device) for k, t in self.host.items()}

    def to_device(self, name: str, *shape: int) -> torch.Tensor:
        """The first `shape` elements of buffer `name`, on the device."""
        index = tuple(slice(0, n) for n in shape)
        host, dev = self.host[name][index], self.device[name][index]
        if dev is not host:
            dev.copy_(host, non_blocking=True)
        return dev


def make_attention_backend(config: Config, head_dim: int) -> AttentionBackend:
    """The configured backend. "auto" picks Triton on CUDA unless the kernels cannot
    tile this head_dim, then the torch reference; an explicit "triton" must fit."""
    if config.attention_backend_name == "triton":
        from nanovllm.kernels.store_kvcache import check_head_dim  # imports triton
        from nanovllm.layers.triton_attention import TritonAttentionBackend

        try:
            check_head_dim(head_dim)
        except ValueError as e:
            if config.attention_backend == "triton":
                raise ValueError(f"attention_backend='triton' cannot run this model: {e}") from None
            logger.warning("Triton attention cannot run this model (%s); using the torch backend", e)
            return TorchAttentionBackend()
        return TritonAttentionBackend()
    return TorchAttentionBackend()


@dataclass(slots=True)
class LaunchedStep:
    """A step whose kernels are queued; its sampled tokens arrive in `host_tokens`."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [num_seqs] int64 on the device
    host_tokens: torch.Tensor  # [num_seqs] int64 host copy, complete once `done` has passed
    done: torch.cuda.Event | None  # None on CPU, where the copy is synchronous
    host_logprobs: tuple[torch.Tensor, ...] | None = None  # SampledLogprobs' fields, host copies
    rows: dict[int, int] = field(default_factory=dict)  # seq_id -> row, filled on demand

    def token_ids(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host_tokens.tolist()

    def logprobs(self) -> StepLogprobs | None:
        """The sampled tokens' logprobs (after token_ids()), if any request asked."""
        if self.host_logprobs is None:
            return None
        return StepLogprobs(*(t.tolist() for t in self.host_logprobs))

    def row_of(self, seq: Sequence) -> int:
        if not self.rows:
            self.rows.update((s.seq_id, i) for i, s in enumerate(self.seqs))
        return self.rows[seq.seq_id]


@dataclass(slots=True)
class SharedTokens:
    """The previous step's sampled tokens as a tensor-parallel rank holds them (rank 0's
    own, a worker's broadcast copy); each StepSeq record names its row."""

    tokens: torch.Tensor  # [previous step's num_seqs] int64 on the device

    def row_of(self, seq: StepSeq) -> int:
        return seq.prev_row


class ModelRunner:
    """One rank's model shard and KV cache. Built without a group, it is rank 0 and starts
    the other ranks' workers itself when config.tensor_parallel_size > 1; a worker passes
    the group it joined.

    Its entry points run under torch.no_grad(), not inference_mode(): inference mode makes
    inference tensors, the buffers built at start-up are not, and torch.compile guards on
    that difference, so the sampler compiled its paths twice over and the start-up warm-up
    compiled the wrong ones (the first filtered decode batch compiled again on the H200).
    """

    def __init__(self, config: Config, group: TPGroup | None = None, eos_token_ids: frozenset[int] = frozenset()):
        self.workers: TPWorkers | None = None
        if group is None and config.tensor_parallel_size > 1:
            self.workers = TPWorkers(config, rank_device(config, 0))
            group = self.workers.group
        self.tp_group = group or SINGLE_RANK
        try:
            self._build(config, eos_token_ids)
        except BaseException as e:
            if self.workers is not None:
                self.workers.fail(e)
            raise

    def _build(self, config: Config, eos_token_ids: frozenset[int]) -> None:
        self.config = config
        hf_config = config.hf_config
        self.rank = self.tp_group.rank
        self.device = rank_device(config, self.rank)
        self.dtype = config.torch_dtype
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
        self.timings: dict[str, float] = {}
        torch.manual_seed(config.seed)

        if self.device.type == "cuda":  # what other processes (and live engines) hold already
            gc.collect()  # not what engines of this process that have shut down still hold
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            self._memory_used_before = total - free
        start = time.perf_counter()
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), use_tp_group(self.tp_group):
                self.model = get_model_class(hf_config)(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            # Every rank fills its own shard from the same seed: consistent shapes, but not
            # the shards of the tensor_parallel_size 1 model's random weights.
            init_dummy_weights(self.model, config.seed)
        else:
            load_model(self.model, config.model)
        self.timings["load_weights_s"] = time.perf_counter() - start

        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = make_attention_backend(config, self.attention_layers[0].head_dim)
        for layer in self.attention_layers:
            layer.backend = backend
        self.sampler = Sampler()
        self.sampling = SamplingState(hf_config.vocab_size, config.max_num_seqs, self.device, eos_token_ids)
        self._buffer_sets = [
            HostBuffers(config.max_num_batched_tokens, config.max_num_seqs, self.max_blocks_per_seq, self.device)
            for _ in range(2)
        ]
        self.buffers = self._buffer_sets[0]
        # Workers receive rank 0's sampled tokens here (share_sampled).
        self.shared_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self._num_launches = 0
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        set_compile_enabled(use_graphs)

        self.graph_runner: CUDAGraphRunner | None = None  # captured last, after the KV cache
        self.num_kvcache_blocks = self._allocate_kv_cache()
        if self.device.type == "cuda":
            start = time.perf_counter()
            self._warmup_paged_prefill()
            self.timings["compile_warmup_s"] = self.timings.get("compile_warmup_s", 0.0) + time.perf_counter() - start
        if use_graphs:
            start = time.perf_counter()
            # On one GPU the graphs also compute the logits and sample (temperature-only
            # batches); under tensor parallelism they stop at the hidden states.
            self.graph_runner = CUDAGraphRunner(
                self.model, config.max_num_seqs, self.max_blocks_per_seq, hf_config.hidden_size, self.dtype,
                self.device, samples=config.tensor_parallel_size == 1, vocab_size=hf_config.vocab_size,
            )
            self.graph_runner.capture()
            self.timings["cuda_graph_capture_s"] = time.perf_counter() - start

    # -- KV cache ---------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _allocate_kv_cache(self) -> int:
        """Size the cache (GPU: from a memory profile; CPU: from configuration) and bind
        each attention layer's views of it."""
        config = self.config
        block_bytes = self.kv_bytes_per_block()
        if config.num_kvcache_blocks > 0:
            num_blocks = config.num_kvcache_blocks
        elif self.device.type == "cuda":
            num_blocks = self._profile_num_blocks(block_bytes)
        else:
            num_blocks = DEFAULT_CPU_KV_CACHE_BYTES // block_bytes
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
        layer = self.attention_layers[0]
        # [2 (K, V), num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim]. The extra
        # last block is scratch, never handed out: slot -1 (a CUDA-graph padding row) indexes
        # its last slot, so the torch backend can store without a data-dependent mask.
        # Zeroed once: attention reads masked-out slots too, and 0 * NaN from never-written
        # memory is NaN.
        self.kv_cache = torch.zeros(
            2, len(self.attention_layers), num_blocks + 1, self.block_size, layer.num_kv_heads, layer.head_dim,
            dtype=self.dtype, device=self.device,
        )
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info(
            "KV cache: %d blocks of %d tokens, %.2f GiB, up to %d tokens at once",
            num_blocks, self.block_size, num_blocks * block_bytes / 2**30, num_blocks * self.block_size,
        )
        return num_blocks

    def _profile_num_blocks(self, block_bytes: int) -> int:
        """Run the largest prefill, then give the KV cache what is left of
        total * gpu_memory_utilization after this engine's weights and that run's peak.

        The first run also compiles (torch.compile, Triton); it is timed apart, and the
        memory is measured on a second, steady-state run.
        """
        config = self.config
        seq_len = min(config.max_model_len, config.max_num_batched_tokens)
        num_seqs = min(config.max_num_batched_tokens // seq_len, config.max_num_seqs)
        dummy = [Sequence(-1, [0] * seq_len, SamplingParams(temperature=0.0), self.block_size) for _ in range(num_seqs)]
        for seq in dummy:
            seq.num_scheduled_tokens = seq_len
        start = time.perf_counter()
        self._local_prefill(dummy)
        torch.cuda.synchronize()
        self.timings["compile_warmup_s"] = time.perf_counter() - start
        start = time.perf_counter()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._local_prefill(dummy)
        torch.cuda.synchronize()
        self.timings["memory_profile_s"] = time.perf_counter() - start
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        used = total - free - self._memory_used_before  # by this engine's rank
        peak_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        # This engine's share of the whole device, as in vLLM: engines side by side each
        # take their gpu_memory_utilization of it; never more than is free now.
        budget = min(total * config.gpu_memory_utilization - used, free) - peak_extra
        return int(budget) // block_bytes - 1  # less the scratch block

    @torch.no_grad()
    def warm_up_sampler(self) -> float:
        """Compile the sampler's filtered paths now (a server does this at start-up, so that
        the first request with top-k/p, min-p or a penalty does not hold up everyone's
        step while they compile). Returns the seconds it took; nothing to do uncompiled."""
        if not compile_enabled():
            return 0.0
        start = time.perf_counter()
        self.sampler.warm_up(self.config.hf_config.vocab_size, self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _warmup_paged_prefill(self) -> None:
        """Compile the paged prefill path now rather than on a user's first request: one
        sequence per query-tile size the prefill kernel picks (16 to 128 tokens). Writes
        K/V into the first blocks, which hold nothing yet."""
        limit = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        for n in (16, 32, 64, 128):
            seq = Sequence(-1, [0] * n, SamplingParams(temperature=0.0), self.block_size)
            if n > limit or seq.num_blocks > self.num_kvcache_blocks:
                break
            seq.block_table = list(range(seq.num_blocks))
            seq.num_scheduled_tokens = n
            self._local_prefill([seq])

    # -- step inputs --------------------------------------------------------------------

    def prepare_prefill(self, seqs: list[Sequence] | list[StepSeq]) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """Pack each sequence's scheduled tokens (after its cached prefix) along one axis."""
        b = self.buffers.np
        num_tokens, max_q, max_k = 0, 0, 0
        b["cu_seqlens_q"][0] = b["cu_seqlens_k"][0] = 0
        for i, seq in enumerate(seqs):
            start, n = seq.num_cached_tokens, seq.num_scheduled_tokens
            end = start + n
            b["input_ids"][num_tokens : num_tokens + n] = seq.scheduled_token_ids
            b["positions"][num_tokens : num_tokens + n] = np.arange(start, end)
            b["slot_mapping"][num_tokens : num_tokens + n] = self._slots(seq, start, end)
            b["cu_seqlens_q"][i + 1] = b["cu_seqlens_q"][i] + n
            b["cu_seqlens_k"][i + 1] = b["cu_seqlens_k"][i] + end
            num_tokens += n
            max_q, max_k = max(max_q, n), max(max_k, end)
        buf = self.buffers
        # The paged kernels read through block tables; the profiling run holds no blocks.
        block_tables = self._fill_block_tables(seqs) if seqs[0].block_table else None
        context = Context(
            is_prefill=True,
            cu_seqlens_q=buf.to_device("cu_seqlens_q", len(seqs) + 1),
            cu_seqlens_k=buf.to_device("cu_seqlens_k", len(seqs) + 1),
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            slot_mapping=buf.to_device("slot_mapping", num_tokens),
            block_tables=block_tables,
        )
        return buf.to_device("input_ids", num_tokens), buf.to_device("positions", num_tokens), context

    def prepare_decode(
        self, seqs: list[Sequence] | list[StepSeq], prev: LaunchedStep | SharedTokens | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """One token per sequence: its last, at position len - 1, seeing len tokens. A last
        token still pending on the host is taken from `prev`'s sampled tokens on the device."""
        b = self.buffers.np
        block_size = self.block_size
        any_pending = False
        for i, seq in enumerate(seqs):
            pos = len(seq) - 1
            token = seq.last_token
            b["input_ids"][i] = token
            b["positions"][i] = pos
            b["context_lens"][i] = pos + 1
            b["slot_mapping"][i] = seq.block_table[pos // block_size] * block_size + pos % block_size
            if token == PENDING_TOKEN:
                assert prev is not None, "a pending token needs the step that samples it"
                b["prev_rows"][i] = prev.row_of(seq)
                any_pending = True
            else:
                b["prev_rows"][i] = -1
        buf, n = self.buffers, len(seqs)
        context = Context(
            is_prefill=False,
            slot_mapping=buf.to_device("slot_mapping", n),
            context_lens=buf.to_device("context_lens", n),
            block_tables=self._fill_block_tables(seqs),
        )
        input_ids = buf.to_device("input_ids", n)
        if any_pending:
            rows = buf.to_device("prev_rows", n)
            input_ids = torch.where(rows >= 0, prev.tokens[rows.clamp(min=0)], input_ids)
        return input_ids, buf.to_device("positions", n), context

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Flat cache slots of tokens start..end-1 of seq (-1 when it holds no blocks: profiling)."""
        if not seq.block_table:
            return np.full(end - start, -1)
        positions = np.arange(start, end)
        table = np.asarray(seq.block_table)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _fill_block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        tables = self.buffers.np["block_tables"]
        tables[: len(seqs), :width] = -1
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        return self.buffers.to_device("block_tables", len(seqs), width)

    # -- running ------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logits(
        self, seqs: list[Sequence] | list[StepSeq], is_prefill: bool, prev: LaunchedStep | SharedTokens | None = None,
        sampling: SamplingTensors | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run the model over the scheduled tokens: ([num_seqs, vocab] logits of each last
        token on rank 0, None on the other ranks; the sampled tokens when a decode graph
        sampled them with `sampling`, else None)."""
        if is_prefill:
            input_ids, positions, context = self.prepare_prefill(seqs)
        else:
            input_ids, positions, context = self.prepare_decode(seqs, prev)
        set_context(context)
        try:
            graphs = self.graph_runner
            if not is_prefill and graphs is not None and graphs.can_run(len(seqs)):
                if graphs.samples:
                    return graphs.run_and_sample(input_ids, positions, context, sampling)
                return self.model.compute_logits(graphs.run(input_ids, positions, context)), None
            return self.model.compute_logits(self.model(input_ids, positions)), None
        finally:
            reset_context()

    def _next_buffers(self) -> None:
        """Build the next step in the other buffer set (the last one may still be copying)."""
        self.buffers = self._buffer_sets[self._num_launches % 2]
        self._num_launches += 1

    def execute(
        self, seqs: list[Sequence] | list[StepSeq], is_prefill: bool, prev: SharedTokens | None = None
    ) -> torch.Tensor | None:
        """This rank's part of one step, built in the next buffer set: what a worker runs
        for each call, and rank 0 for each tensor-parallel step."""
        self._next_buffers()
        return self.compute_logits(seqs, is_prefill, prev)[0]

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

    @torch.no_grad()
    def launch(self, seqs: list[Sequence], is_prefill: bool, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step for seqs (on every rank) and the copy of its sampled tokens to the host.

        With workers, the step goes to them as StepSeq records, and rank 0 computes from
        the very same records; tokens still pending come from `prev` through share_sampled.
        """
        if self.workers is None:
            self._next_buffers()
            inputs = self.sampling.prepare(seqs, self.buffers)
            logits, tokens = self.compute_logits(seqs, is_prefill, prev, inputs)
            return self._sample(seqs, logits, inputs, tokens)
        prev_rows = [prev.row_of(seq) if seq.scheduled_token_ids[-1] == PENDING_TOKEN else -1 for seq in seqs]
        records = [StepSeq.pack(seq, row) for seq, row in zip(seqs, prev_rows)]
        num_prev = len(prev.seqs) if max(prev_rows, default=-1) >= 0 else 0
        try:  # a failure part-way leaves the ranks out of step: stop them all
            self.workers.call("execute", is_prefill, records, num_prev)
            shared = self.share_sampled(num_prev, prev.tokens if num_prev else None)
            logits = self.execute([StepSeq(*r) for r in records], is_prefill, shared)
        except BaseException as e:
            self.workers.fail(e)
            raise
        return self._sample(seqs, logits, self.sampling.prepare(seqs, self.buffers))

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, inputs: SamplingTensors,
                tokens: torch.Tensor | None = None) -> LaunchedStep:
        """Sample (unless a decode graph already did) and queue the tokens' copy to the host."""
        logprobs = None
        if tokens is None:
            tokens, logprobs = self.sampler(logits, inputs)
        self.sampling.count(tokens, inputs)
        n = len(seqs)
        host_tokens = self.buffers.host["sampled"][:n]
        host_tokens.copy_(tokens, non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            host_logprobs = self._copy_logprobs(logprobs, n)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(seqs, tokens, host_tokens, done, host_logprobs)

    def _copy_logprobs(self, logprobs: SampledLogprobs, n: int) -> tuple[torch.Tensor, ...]:
        host = self.buffers.host
        width = logprobs.top_ids.size(1)
        copies = []
        for name, value in (("lp_chosen", logprobs.chosen), ("lp_rank", logprobs.rank),
                            ("lp_top_ids", logprobs.top_ids), ("lp_top_values", logprobs.top_values)):
            target = host[name][:n] if value.dim() == 1 else host[name][:n, :width]
            target.copy_(value, non_blocking=True)
            copies.append(target)
        return tuple(copies)

    @torch.no_grad()
    def _local_prefill(self, seqs: list[Sequence]) -> None:
        """A start-up prefill on this rank alone, sampled on rank 0 (to compile the sampler
        too). Every rank runs the same ones while it is built, so the collectives pair up."""
        logits = self.execute(seqs, True)
        if logits is not None:
            self._sample(seqs, logits, self.sampling.prepare(seqs, self.buffers)).token_ids()

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """Compute one step for seqs and wait for it; returns one sampled token id per sequence."""
        return self.launch(seqs, is_prefill).token_ids()

    def shutdown(self) -> None:
        """Free the CUDA graphs, then stop the other ranks' workers, if any (rank 0); the
        runner is unusable afterwards."""
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = None
        if self.workers is not None:
            self.workers.shutdown()

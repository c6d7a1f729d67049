"""ReplicaRouter: `nanovllm serve -dp N`, N engine replicas behind one API process.

It offers what the server uses of an AsyncLLMEngine (make_request, generate, start,
shutdown, health, statistics), and sends each generate call (one request, or the prompts
of one /v1/completions call) to one replica: the one with the fewest outstanding tokens
(prompt + max_tokens x n of the calls it runs), unless a replica already served the same
prompt prefix (the hash of its first full KV blocks) and is not much busier: there the
prefix is likely still cached. That is routing "prefix-affinity" (the default); with
"least-loaded" it goes by load alone, with "round-robin" to each replica in turn (the
baselines affinity is measured against). Requests are checked once, by replica 0's
checker (every replica has the same model and limits). One replica dying stops the
server, as one engine dying does.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable
from typing import TYPE_CHECKING

from nanovllm.utils import sum_lists

if TYPE_CHECKING:  # the CLI reads ROUTING without loading the engine
    from nanovllm.serving.async_engine import AsyncLLMEngine
    from nanovllm.serving.deltas import RequestDelta
    from nanovllm.serving.messages import EngineRequest, RequestMetrics

# A prefix's replica is kept while it has at most this many more outstanding tokens than
# the least busy one; beyond, the request goes where the work is least.
AFFINITY_SLACK_TOKENS = 16384
# A request's output counts at most this many tokens of its replica's load: max_tokens may
# reach the context's end (chat's default), tens of thousands that most requests never make.
OUTPUT_COST_CAP = 4096
# The prompt prefix routed by: up to this many full KV blocks.
AFFINITY_BLOCKS = 4
# Prefixes remembered (the least recently routed go first).
AFFINITY_ENTRIES = 65536
ROUTING = ("prefix-affinity", "least-loaded", "round-robin")
# Statistics that add up over replicas; sum_stats derives the shares from them.
SUMMED_STATS = ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_total",
                "prompt_tokens_total", "generation_tokens_total", "preemptions", "prefix_cache_queries",
                "prefix_cache_hits", "prefill_steps", "decode_steps", "decode_tokens", "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PER_POS = "spec_decode_num_accepted_tokens_per_pos"  # a list: summed place by place


class ReplicaRouter:
    def __init__(self, replicas: list[AsyncLLMEngine], block_size: int, routing: str = "prefix-affinity"):
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {', '.join(ROUTING)}; got {routing!r}")
        self.replicas = replicas
        self.block_size = block_size
        self.routing = routing
        self.turns = 0  # round-robin's count of calls routed
        self.outstanding = [0] * len(replicas)  # tokens of the generate calls each replica runs
        self.affinity = AffinityTable()  # prefix -> the replica it went to
        first = replicas[0]
        self.config, self.tokenizer, self.checker = first.config, first.tokenizer, first.checker
        self.eos_token_ids = first.eos_token_ids
        self.generation_defaults = first.generation_defaults

    # -- what the server calls --------------------------------------------------------

    def make_request(self, *args, **kwargs) -> EngineRequest:
        return self.replicas[0].make_request(*args, **kwargs)

    def check_structured_outputs(self, spec) -> None:
        self.replicas[0].check_structured_outputs(spec)

    def grammar_compiler(self):
        return self.replicas[0].grammar_compiler()

    async def generate(self, requests: list[EngineRequest], stream: bool = False) -> AsyncIterator[list[RequestDelta]]:
        cost = sum(r.cost(OUTPUT_COST_CAP) for r in requests)
        index = self.choose(requests[0].prompt_token_ids if requests else [])
        self.outstanding[index] += cost
        try:
            async for deltas in self.replicas[index].generate(requests, stream):
                yield deltas
        finally:
            self.outstanding[index] -= cost

    def choose(self, prompt_token_ids: list[int]) -> int:
        """The replica for a call whose first prompt is prompt_token_ids (see the module's doc)."""
        if self.routing == "round-robin":
            self.turns += 1
            return (self.turns - 1) % len(self.replicas)
        least = min(range(len(self.replicas)), key=self.outstanding.__getitem__)
        if self.routing == "least-loaded":
            return least
        key = prefix_key(prompt_token_ids, self.block_size)
        held = self.affinity.get(key)
        chosen = held if held is not None and self.outstanding[held] - self.outstanding[least] <= AFFINITY_SLACK_TOKENS \
            else least
        self.affinity.remember(key, chosen)
        return chosen

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    @property
    def is_running(self) -> bool:
        return all(replica.is_running for replica in self.replicas)

    @property
    def is_healthy(self) -> bool:
        return all(replica.is_healthy for replica in self.replicas)

    @property
    def error(self) -> str | None:
        errors = [f"replica {i}: {r.error}" for i, r in enumerate(self.replicas) if r.error]
        return "; ".join(errors) or None

    @property
    def on_finished(self) -> Callable[[RequestMetrics], None] | None:
        return self.replicas[0].on_finished

    @on_finished.setter
    def on_finished(self, callback: Callable[[RequestMetrics], None] | None) -> None:
        for replica in self.replicas:
            replica.on_finished = callback

    @property
    def on_stopped(self) -> Callable[[str], None] | None:
        return self.replicas[0].on_stopped

    @on_stopped.setter
    def on_stopped(self, callback: Callable[[str], None] | None) -> None:
        for i, replica in enumerate(self.replicas):
            replica.on_stopped = None if callback is None else (
                lambda reason, i=i: callback(f"replica {i}: {reason}"))

    @property
    def replica_stats(self) -> list[dict[str, float]]:
        return [replica.latest_stats for replica in self.replicas]

    @property
    def latest_stats(self) -> dict[str, float]:
        """Every replica's latest statistics together (sum_stats)."""
        return sum_stats(self.replica_stats)


def prefix_key(prompt_token_ids: list[int], block_size: int) -> int | None:
    """What a prompt is routed by: the hash of its first full KV blocks (up to
    AFFINITY_BLOCKS), the part a replica's prefix cache may hold; None below one block."""
    blocks = min(len(prompt_token_ids) // block_size, AFFINITY_BLOCKS)
    return hash(tuple(prompt_token_ids[: blocks * block_size])) if blocks else None


class AffinityTable:
    """Which replica each prompt prefix was last routed to; the least recently routed are
    forgotten first. Replicas are whatever the router names them by."""

    def __init__(self, entries: int = AFFINITY_ENTRIES):
        self.entries = entries
        self.held: OrderedDict[int, Hashable] = OrderedDict()

    def get(self, key: int | None) -> Hashable | None:
        return None if key is None else self.held.get(key)

    def remember(self, key: int | None, replica: Hashable) -> None:
        if key is None:
            return
        self.held[key] = replica
        self.held.move_to_end(key)
        if len(self.held) > self.entries:
            self.held.popitem(last=False)


def sum_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """Several engines' latest statistics as one: counts summed, shares of the sums."""
    total = {key: sum(s.get(key, 0) for s in stats) for key in SUMMED_STATS}
    total[PER_POS] = sum_lists(s.get(PER_POS, []) for s in stats)
    total["kv_cache_usage"] = total["kv_blocks_used"] / (total["kv_blocks_total"] or 1)
    total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / (total["prefix_cache_queries"] or 1)
    return total

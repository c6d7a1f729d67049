"""BlockManager: the paged KV cache's block pool, with reference counts and prefix caching.

Prefix caching: every full block whose K/V has been computed is registered under a
chained hash of (previous block's hash, its token ids). A new sequence walks its blocks
from the start and reuses each registered block whose hash and tokens match, until the
first miss. Freed blocks keep their hash and go to the back of an LRU free list, so a
later request can still hit them until they are handed out again.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from nanovllm.sequence import Sequence

NO_HASH = -1


def chain_hash(token_ids: list[int], prev_hash: int) -> int:
    """xxh64 over the previous block's hash and this block's token ids."""
    h = xxhash.xxh64()
    if prev_hash != NO_HASH:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Free blocks in LRU order (least recently freed first); values unused.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.reset_stats()

    def reset_stats(self) -> None:
        """Prefix-cache statistics, in tokens, from zero."""
        self.num_prompt_tokens_queried = 0
        self.num_prompt_tokens_hit = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # -- prefix lookup -------------------------------------------------------------

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that can serve seq's leading full blocks from cache.

        Only blocks that end before the last token count: at least one token is
        always computed, so the step has a query to produce logits from. None serve a
        sequence whose prompt logprobs are still to compute: every prompt token's logits.
        """
        hits: list[int] = []
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return hits
        for i in range(min(len(seq) - 1, seq.num_known_tokens) // self.block_size):
            block_id = self.hash_to_block_id.get(self.block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != seq.block(i):
                break
            hits.append(block_id)
        return hits

    @staticmethod
    def block_hash(seq: Sequence, i: int) -> int:
        """The chained hash of seq's block i (full, of known tokens), and of the blocks before
        it: each computed once per sequence (seq.block_hashes), since the scheduler looks up a
        waiting sequence's prefix at every step it cannot be admitted."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            hashes.append(chain_hash(seq.block(len(hashes)), hashes[-1] if hashes else NO_HASH))
        return hashes[i]

    # -- allocation ----------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        # A hit on a block nobody holds still takes it off the free list.
        needed = seq.num_blocks - sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free_block() for _ in range(seq.num_blocks - len(hits))]
        seq.num_cached_tokens = len(hits) * self.block_size
        # A recompute finding its own freed blocks is no prompt hit; a sequence computing its
        # prompt logprobs does not look.
        if not seq.num_preemptions and not seq.wants_prompt_logprobs:
            self.num_prompt_tokens_queried += len(seq)
            self.num_prompt_tokens_hit += seq.num_cached_tokens
            seq.num_prefix_hit_tokens = seq.num_cached_tokens

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash = NO_HASH
        block.token_ids = []
        block.ref_count = 1
        return block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache: for benchmarks, or after the
        weights change). Only while no sequence holds a block: False, and nothing done, if
        one does. The hit statistics keep counting."""
        if any(block.ref_count for block in self.blocks):
            return False
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash = NO_HASH
            block.token_ids = []
        return True

    def deallocate(self, seq: Sequence) -> None:
        """Release seq's blocks, its last block first: its tail is handed out again before
        the leading blocks, which later requests are likelier to hit."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0

    def can_append_slot(self, seq: Sequence) -> bool:
        """Whether seq's new tokens (its next, and any drafts) have slots: in its last block,
        or in free ones."""
        return seq.num_blocks - len(seq.block_table) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        """Give seq's new tokens their slots: new blocks where they start ones."""
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block())

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past seq's tokens: those its rejected drafts took (never
        registered, held by seq alone)."""
        while len(seq.block_table) > seq.num_blocks:
            block_id = seq.block_table.pop()
            self.blocks[block_id].ref_count -= 1
            assert self.blocks[block_id].ref_count == 0
            self.free_block_ids[block_id] = None

    # -- prefix registration ----------------------------------------------------------

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash seq's full blocks whose K/V is now computed, so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_cached_tokens, seq.num_known_tokens) // self.block_size
        # Blocks are registered in order: walk back to the last one already hashed.
        first = num_full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash == NO_HASH:
            first -= 1
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            block.token_ids = seq.block(i)
            block.hash = self.block_hash(seq, i)
            self.hash_to_block_id[block.hash] = block.block_id

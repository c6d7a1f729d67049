"""BlockManager: reference counts, prefix caching, LRU reuse, no leaks."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.engine.block_manager import BlockManager
from nanovllm.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BLOCK = 4


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(temperature=0), BLOCK)


def compute_all(manager: BlockManager, s: Sequence) -> None:
    """What a prefill step does: every token's K/V is now computed and registered."""
    s.num_cached_tokens = len(s)
    manager.register_computed_blocks(s)


def test_allocate_and_free_return_every_block():
    manager = BlockManager(8, BLOCK)
    s = seq(0, list(range(10)))
    assert manager.can_allocate(s)
    manager.allocate(s)
    assert len(s.block_table) == 3 and manager.num_free_blocks == 5
    manager.deallocate(s)
    assert manager.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in manager.blocks)


def test_prefix_hit_shares_blocks_and_counts_references():
    manager = BlockManager(8, BLOCK)
    a = seq(0, list(range(10)))
    manager.allocate(a)
    compute_all(manager, a)
    b = seq(1, list(range(8)) + [99, 98, 97])
    manager.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == 8
    assert [manager.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    manager.deallocate(a)
    manager.deallocate(b)
    assert manager.num_free_blocks == 8


def test_at_least_one_token_is_computed_on_a_full_hit():
    manager = BlockManager(8, BLOCK)
    a = seq(0, list(range(8)))  # exactly two blocks
    manager.allocate(a)
    compute_all(manager, a)
    manager.deallocate(a)
    b = seq(1, list(range(8)))
    manager.allocate(b)
    assert b.num_cached_tokens == 4  # the second block holds the last token: recomputed
    assert b.num_uncomputed_tokens == 4


def test_reset_prefix_cache_forgets_prefixes_only_when_no_block_is_held():
    manager = BlockManager(8, BLOCK)
    a = seq(0, list(range(10)))
    manager.allocate(a)
    compute_all(manager, a)
    assert not manager.reset_prefix_cache()  # a holds its blocks: nothing forgotten
    b = seq(1, list(range(10)))
    manager.allocate(b)
    assert b.num_cached_tokens == 8
    manager.deallocate(a)
    manager.deallocate(b)
    assert manager.reset_prefix_cache()
    assert not manager.hash_to_block_id and manager.num_free_blocks == 8
    c = seq(2, list(range(10)))
    manager.allocate(c)
    assert c.num_cached_tokens == 0
    compute_all(manager, c)  # and the cache fills again
    manager.deallocate(c)
    d = seq(3, list(range(10)))
    manager.allocate(d)
    assert d.num_cached_tokens == 8


def test_hash_collision_is_caught_by_token_check():
    manager = BlockManager(8, BLOCK)
    a = seq(0, list(range(9)))
    manager.allocate(a)
    compute_all(manager, a)
    # Corrupt the stored tokens as if another prefix had produced the same hash.
    manager.blocks[a.block_table[0]].token_ids = [7, 7, 7, 7]
    b = seq(1, list(range(9)))
    manager.allocate(b)
    assert b.num_cached_tokens == 0


def test_a_sequences_block_hashes_are_computed_once(monkeypatch):
    """A waiting sequence is looked up at every step it cannot be admitted, then on its
    allocation and registration: each block is hashed once, and the hits are the same."""
    from nanovllm.engine import block_manager

    manager = BlockManager(16, BLOCK)
    a = seq(0, list(range(20)))
    manager.allocate(a)
    compute_all(manager, a)
    hashed = []
    monkeypatch.setattr(block_manager, "chain_hash",
                        lambda tokens, prev, _hash=block_manager.chain_hash: hashed.append(1) or _hash(tokens, prev))
    b = seq(1, list(range(20)) + [7, 7, 7, 7, 7])
    for _ in range(3):
        assert manager.can_allocate(b)
    manager.allocate(b)
    assert b.block_table[:5] == a.block_table and b.num_cached_tokens == 20
    compute_all(manager, b)
    assert len(hashed) == 6  # b's six full blocks once each: five hits, and a miss whose hash registering it reuses


def test_freed_cached_blocks_are_reused_in_lru_order():
    manager = BlockManager(4, BLOCK)
    a = seq(0, [1, 2, 3, 4, 5])
    manager.allocate(a)
    compute_all(manager, a)
    cached_block = a.block_table[0]
    manager.deallocate(a)  # a's full block stays cached while free
    b = seq(1, [1, 2, 3, 4, 9])
    manager.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == cached_block
    manager.deallocate(b)
    # Fill the pool: the cached block is handed out last, and then forgotten.
    c = seq(2, list(range(100, 115)))
    manager.allocate(c)
    assert c.block_table[-1] == cached_block
    manager.deallocate(c)
    d = seq(3, [1, 2, 3, 4, 9])
    manager.allocate(d)
    assert d.num_cached_tokens == 0


def test_prefix_caching_off_never_hits():
    manager = BlockManager(8, BLOCK, enable_prefix_caching=False)
    a = seq(0, list(range(9)))
    manager.allocate(a)
    compute_all(manager, a)
    b = seq(1, list(range(9)))
    manager.allocate(b)
    assert b.num_cached_tokens == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 14), st.booleans()), min_size=1, max_size=40))
def test_random_mixes_never_leak(ops):
    """Allocate sequences over a small alphabet (many shared prefixes), grow some,
    free them in any order: reference counts always equal the number of holders."""
    manager = BlockManager(12, BLOCK)
    live: list[Sequence] = []
    for i, (prefix, length, free_one) in enumerate(ops):
        if free_one and live:
            manager.deallocate(live.pop(prefix % len(live)))
        s = seq(i, [prefix] * 3 + list(range(length)))
        if manager.can_allocate(s):
            manager.allocate(s)
            assert s.num_cached_tokens < len(s)
            compute_all(manager, s)
            s.append_pending_token()  # a decode step's new token may need a new block
            s.resolve_pending_token(5)
            if manager.can_append_slot(s):
                manager.append_slot(s)
                assert len(s.block_table) == s.num_blocks
                live.append(s)
            else:  # preempted
                manager.deallocate(s)
        holders = [0] * manager.num_blocks
        for x in live:
            for b in x.block_table:
                holders[b] += 1
        assert [b.ref_count for b in manager.blocks] == holders
        assert manager.num_free_blocks == holders.count(0)
    for s in live:
        manager.deallocate(s)
    assert manager.num_free_blocks == manager.num_blocks

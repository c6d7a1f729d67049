"""Replicas' statistics summed (serve -dp N's /metrics, LLM(..., data_parallel_size=N).stats()):
counts add up, and so do lists of counts, place by place."""
from __future__ import annotations

from nanovllm.serving.router import PER_POS, SUMMED_STATS, sum_stats
from nanovllm.utils import sum_lists


def test_lists_add_up_place_by_place():
    assert sum_lists([]) == []
    assert sum_lists([[1, 2], [], [3, 4, 5]]) == [4, 6, 5]
    assert sum_lists(iter([[1], [-1, 2]])) == [0, 2]


def test_replicas_stats_sum_with_the_kept_drafts_by_place():
    one = {key: 1 for key in SUMMED_STATS} | {PER_POS: [5, 3, 1]}
    two = {key: 2 for key in SUMMED_STATS} | {PER_POS: [4, 2]}
    total = sum_stats([one, two, {}])  # a replica that has sent no statistics yet
    assert all(total[key] == 3 for key in SUMMED_STATS)
    assert total[PER_POS] == [9, 5, 1]
    assert total["kv_cache_usage"] == 1.0 and total["prefix_cache_hit_rate"] == 1.0

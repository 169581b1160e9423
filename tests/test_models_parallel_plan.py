"""The hit and miss accounting of a batch under parallel encoding
(:func:`rag_opt.models.parallel_features.plan_blocks`), without the model: a block encoded once for a batch is a
miss once, for the first context that needs it."""

from __future__ import annotations

from collections.abc import Callable

from rag_opt.models.parallel_features import plan_blocks


def _cache(cached: set[str], keys: list[list[str]], asked: list[str]) -> Callable[[int, int], bool]:
    def found(c: int, b: int) -> bool:
        asked.append(keys[c][b])
        return keys[c][b] in cached

    return found


def test_a_block_shared_within_a_batch_is_one_miss_for_the_first_context_and_a_hit_for_the_others():
    keys = [["a", "b"], ["b", "c"], ["a", "b", "c"]]
    asked: list[str] = []
    todo, hits, misses = plan_blocks(keys, _cache(set(), keys, asked))
    assert todo == {"a": (0, 0), "b": (0, 1), "c": (1, 1)}  # each distinct block once, where first needed
    assert misses == [2, 1, 0] and hits == [0, 1, 3]
    assert sum(misses) == len(todo)  # a batch's misses are the blocks it encodes
    assert asked == ["a", "b", "c"]  # the cache is asked once per block, not for those already to be encoded


def test_cached_blocks_are_hits_for_every_context():
    keys = [["a", "b"], ["b", "a"], ["x"]]
    todo, hits, misses = plan_blocks(keys, _cache({"a", "b"}, keys, []))
    assert todo == {"x": (2, 0)}
    assert (hits, misses) == ([2, 2, 0], [0, 0, 1])


def test_a_block_twice_in_one_context_is_encoded_once_and_counted_once_as_a_miss():
    keys = [["a", "a", "b"]]
    todo, hits, misses = plan_blocks(keys, _cache({"b"}, keys, []))
    assert todo == {"a": (0, 0)} and (hits, misses) == ([2], [1])


def test_one_context_alone_counts_as_before():
    keys = [["a", "b", "c", "d"]]
    assert plan_blocks(keys, _cache(set(), keys, []))[1:] == ([0], [4])
    assert plan_blocks(keys, _cache(set("abcd"), keys, []))[1:] == ([4], [0])
    assert plan_blocks([], _cache(set(), [], [])) == ({}, [], [])

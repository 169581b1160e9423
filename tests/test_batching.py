"""Micro-batching: requests submitted together share one optimize_batch call; a bad one fails alone."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rag_opt.batching import MicroBatcher
from rag_opt.compressors.baselines import BM25Scorer
from rag_opt.pipeline import ContextOptimizer
from tests.helpers import hotpot_dev, hotpot_docs


def _opt() -> ContextOptimizer:
    return ContextOptimizer(scorer=BM25Scorer())


@pytest.mark.data
def test_concurrent_coroutines_are_batched_and_match_single_calls() -> None:
    examples = hotpot_dev(4)
    opt = _opt()
    batcher = MicroBatcher(opt, max_wait_ms=200.0)  # long enough that all four are queued together

    async def main() -> list:
        return await asyncio.gather(
            *(batcher.optimize(ex["question"], hotpot_docs(ex), ratio=1 / 3) for ex in examples)
        )

    results = asyncio.run(main())
    assert sum(batcher.batches) == 4 and len(batcher.batches) < 4  # at least two shared a batch
    for ex, res in zip(examples, results, strict=True):
        single = opt.optimize(ex["question"], hotpot_docs(ex), ratio=1 / 3)
        assert res.context() == single.context() and res.tokens_after == single.tokens_after


def test_different_settings_never_share_a_batch_and_a_bad_request_fails_alone() -> None:
    opt = _opt()
    batcher = MicroBatcher(opt, max_wait_ms=200.0)
    gate = threading.Event()
    futures = []

    def submit() -> None:
        futures.append(batcher.submit("Who wrote it?", ["Ann wrote it. Bob read it."], ratio=0.5))
        futures.append(batcher.submit("Who wrote it?", ["Ann wrote it. Bob read it."], target_tokens=3))
        futures.append(batcher.submit("   ", ["Ann wrote it."], ratio=0.5))  # an empty question
        gate.set()

    threading.Thread(target=submit).start()
    gate.wait()
    good, other, bad = (f.exception(timeout=60) or f.result() for f in futures)
    assert good.tokens_after <= good.token_budget and other.token_budget == 3
    assert isinstance(bad, ValueError) and "query is empty" in str(bad)
    assert sorted(batcher.batches) in ([1, 2], [1, 1, 1])  # ratio=0.5 pair together (or alone), never with 3


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_wait_ms"):
        MicroBatcher(_opt(), max_wait_ms=-1)
    assert _opt().batcher() is not None

"""Attention features under parallel encoding: cached (or freshly computed) document encodings, then question passes.

For a batch of contexts: every context is cut into blocks (:func:`rag_opt.models.parallel.parallel_prompt`);
blocks found in the :class:`~rag_opt.models.encoding_cache.EncodingCache` are reused, the others (each distinct
block once, whatever context it comes from) go through batched document passes
(:mod:`rag_opt.models.document_pass`) and into the cache; then question passes over the blocks' concatenated
states read the attention rows, several contexts per pass (padded, with a 4D mask). The features have the same
meaning as the joint encoding's (:class:`~rag_opt.models.extract.AttentionFeatures`), with ``windows == 1``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.models.document_pass import encode_blocks, encode_blocks_with_sources
from rag_opt.models.encoding_cache import EncodingCache, encoding_key, sources_kind
from rag_opt.models.extract import AttentionFeatures
from rag_opt.models.kv_codec import DEFAULT_FORMAT, EncodedStates, encode_states
from rag_opt.models.parallel import Block, ParallelPrompt, parallel_prompt
from rag_opt.models.parallel_cross import cross_reads
from rag_opt.models.prompt import PARALLEL_TEMPLATE_ID, VIEWS
from rag_opt.models.question_pass import QuestionPass, run_question_passes
from rag_opt.work import check_proxy_tokens, checkpoint

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.loader import ProxyModel

__all__ = ["CROSS_READS", "QUESTION_BATCH_TOKENS", "QUESTION_ROOM", "block_limit", "extract_parallel", "plan_blocks"]

QUESTION_BATCH_TOKENS = 65536  # cached tokens (padded) per question pass
QUESTION_ROOM = 256  # positions kept free for the question pass after the longest block


def extract_parallel(
    proxy: ProxyModel,
    contexts: Sequence[tuple[Sequence[Sequence[str]], str]],
    *,
    layers: int,
    max_tokens: int,
    cache: EncodingCache | None = None,
    batch_tokens: int = 6144,
    cross: bool = False,
) -> list[AttentionFeatures]:
    """Features of the first ``layers`` layers for each ``(docs, question)`` context (see the module doc).

    ``cross``: also the cross-document reading (:mod:`rag_opt.models.parallel_cross`): each block's source
    queries are cached with it (their own entry); a block cached without them is encoded again."""

    prompts: list[ParallelPrompt] = []
    limit = block_limit(proxy, max_tokens)
    for docs, question in contexts:
        prompt = parallel_prompt(
            proxy.tokenizer, docs, question, max_block_tokens=limit, max_positions=proxy.max_positions
        )
        # before any forward pass (rag_opt.work): the blocks and the question pass
        check_proxy_tokens(sum(len(b.ids) for b in prompt.blocks) + len(prompt.question_ids))
        prompts.append(prompt)
    prefix = prompts[0].prefix
    model, dtype = proxy.name, proxy.precision

    def key(ids: Sequence[int], kind: str = "block") -> str:
        return encoding_key(ids, model=model, dtype=dtype, depth=layers, template=PARALLEL_TEMPLATE_ID, kind=kind)

    states: dict[str, EncodedStates] = {}
    queries: dict[str, EncodedStates] = {}  # cross: each block's source queries, by its sources key
    keys = [[key(block.ids) for block in prompt.blocks] for prompt in prompts]  # each block's, hashed once
    # with cross, a block's encoding is wanted with its source queries, which are read at each unit's last token:
    # keyed by the tokens and the units' ends (the same tokens cut into other units are another entry)
    source_keys = [[key(b.ids, sources_kind(b.ends)) for b in prompt.blocks] for prompt in prompts] if cross else []

    def found(c: int, b: int) -> bool:
        """Whether block ``b`` of context ``c`` is cached (its states, and with cross its source queries): kept."""
        k = keys[c][b]
        tk = source_keys[c][b] if cross else k
        got = states[k] if k in states else cache.get(k) if cache is not None else None
        got_q = None
        if cross and got is not None:
            got_q = queries[tk] if tk in queries else cache.get(tk) if cache is not None else None
        if got is None or (cross and got_q is None):
            return False
        states[k] = got
        if got_q is not None:
            queries[tk] = got_q
        return True

    wanted, hits, misses = plan_blocks(source_keys if cross else keys, found)
    # the blocks to encode, by their sources key (cross) or block key
    todo: dict[str, Block] = {tk: prompts[c].blocks[b] for tk, (c, b) in wanted.items()}
    prefix_key = key(prefix, "prefix")
    prefix_states = cache.get(prefix_key) if cache is not None else None
    if todo:
        blocks = list(todo.values())
        ids = [b.ids for b in blocks]
        if cross:
            pre, computed, kept = encode_blocks_with_sources(
                proxy, prefix, ids, [b.ends for b in blocks], layers, batch_tokens=batch_tokens
            )
        else:
            (pre, computed), kept = encode_blocks(proxy, prefix, ids, layers, batch_tokens=batch_tokens), []
        if prefix_states is None:
            prefix_states = _stored(cache, prefix_key, pre)
        for i, (tk, block) in enumerate(todo.items()):
            # the entry as the cache stores it (a quantized format changes the states): a cold request reads what
            # a warm one will, so both give the same answer
            k = key(block.ids)
            states[k] = _stored(cache, k, computed[i])
            if cross:
                queries[tk] = _stored(cache, tk, kept[i])
    if prefix_states is None:  # every block was cached, the prefix was not: its own pass
        _, (pre_alone,) = encode_blocks(proxy, [], [prefix], layers, batch_tokens=batch_tokens)
        prefix_states = _stored(cache, prefix_key, pre_alone)
    fmt = cache.format.name if cache is not None else DEFAULT_FORMAT
    rows = [QuestionPass(p, [prefix_states, *(states[k] for k in keys[c])]) for c, p in enumerate(prompts)]
    out: list[AttentionFeatures | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: rows[i].length)
    batch: list[int] = []
    for i in [*order, -1]:
        width = rows[i].length if i >= 0 else 0
        if batch and (i < 0 or width * (len(batch) + 1) > QUESTION_BATCH_TOKENS):
            checkpoint()
            with proxy.lock:
                capture = run_question_passes(proxy, [rows[j] for j in batch], layers)
            for b, j in enumerate(batch):
                feats = _features(prompts[j], [capture.sums[layer][b] for layer in range(layers)])
                feats.cache_hits, feats.cache_misses = hits[j], misses[j]
                if cross:
                    feats.cross, feats.cross_sources = CROSS_READS.get_or_compute(
                        # the tokens and the units of each block, and the format their states were read in
                        (fmt, *source_keys[j], prompts[j].question_start),
                        lambda j=j: cross_reads(  # type: ignore[misc]
                            proxy, prompts[j], rows[j].parts, [queries[k] for k in source_keys[j]], layers
                        ),
                    )
                out[j] = feats
            batch = []
        if i >= 0:
            batch.append(i)
    return [f for f in out if f is not None]


class _CrossReads:
    """The cross-document readings of recent document sets (thread-safe, bounded): a reading depends on the set's
    blocks (their content-addressed keys, which name the model, precision and depth) and on where the question pass
    starts, not on the question, so questions over the same documents — a batch, a conversation, repeated
    retrievals — compute it once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[object, ...], tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def get_or_compute(
        self, key: tuple[object, ...], compute: Callable[[], tuple[np.ndarray, np.ndarray]]
    ) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
        if hit is None:
            hit = compute()
            with self._lock:
                self._entries[key] = hit
                while len(self._entries) > self.size:
                    self._entries.popitem(last=False)
        return hit[0].copy(), hit[1].copy()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


CROSS_READS = _CrossReads(256)  # a reading of 50 sentences at 16 layers is ~30 KB


def _stored(cache: EncodingCache | None, key: str, value: torch.Tensor) -> EncodedStates:
    """``value`` kept in ``cache`` under ``key`` and read back as stored, or, with no cache, as the default format
    stores it (so a result does not depend on whether a cache was given)."""
    return cache.put(key, value) if cache is not None else encode_states(value, DEFAULT_FORMAT)


def plan_blocks(
    keys: Sequence[Sequence[str]], found: Callable[[int, int], bool]
) -> tuple[dict[str, tuple[int, int]], list[int], list[int]]:
    """Which blocks of a batch to encode, and each context's cache hits and misses.

    ``keys[c][b]``: the key of block ``b`` of context ``c``; ``found(c, b)``: whether that block is in the cache
    (asked once per distinct key not already to be encoded). Returns the blocks to encode (each distinct key once,
    in order: ``key -> (c, b)`` of its first occurrence) and, per context, its hits and misses. A block is a miss
    once per batch: for the context whose occurrence is encoded (the first that needs it); every other occurrence,
    in that context or another one, reads the states encoded once and is a hit, as a cached block is. So the
    misses of a batch add up to the blocks it encodes, and a context's ``cache_misses`` are the blocks encoded for
    it.
    """
    todo: dict[str, tuple[int, int]] = {}
    hits = [0] * len(keys)
    misses = [0] * len(keys)
    for c, row in enumerate(keys):
        for b, k in enumerate(row):
            if k in todo:  # encoded once in this batch, for an earlier occurrence
                hits[c] += 1
            elif found(c, b):
                hits[c] += 1
            else:
                todo[k] = (c, b)
                misses[c] += 1
    return todo, hits, misses


def block_limit(proxy: ProxyModel, max_tokens: int) -> int:
    """The most tokens one block may have, whatever the question (so a document cuts into the same blocks, and
    hits the same cache entries, for every question): the model's positions (and ``max_tokens``) less the prefix
    and :data:`QUESTION_ROOM` positions for the question pass."""
    from rag_opt.models.parallel import prefix_tokens

    room = min(max_tokens, proxy.max_positions) - len(prefix_tokens(proxy.tokenizer)) - QUESTION_ROOM
    return max(room, 16)


def _features(prompt: ParallelPrompt, per_layer: Sequence[torch.Tensor]) -> AttentionFeatures:
    """AttentionFeatures from one context's captured sums (per layer: views × heads × units)."""
    import torch

    sums = torch.stack(list(per_layer)).permute(3, 1, 0, 2).cpu().numpy()  # (U, V, L, H)
    unit_of = np.asarray([u for b in prompt.blocks for u in b.unit_of if u >= 0], dtype=np.int64)
    counts = np.bincount(unit_of, minlength=prompt.n_units)
    n_ctx = int(len(unit_of))
    unit = np.zeros_like(sums, dtype=np.float32)
    has = counts > 0
    unit[has] = sums[has] / counts[has, None, None, None] * n_ctx
    doc_of_unit = np.zeros(prompt.n_units, dtype=np.int64)
    for b in prompt.blocks:
        for u in b.unit_of:
            if u >= 0:
                doc_of_unit[u] = b.doc
    doc_mass = np.zeros((prompt.n_docs, len(VIEWS), sums.shape[2], sums.shape[3]), dtype=np.float32)
    np.add.at(doc_mass, doc_of_unit[has], sums[has])
    return AttentionFeatures(unit, doc_mass, counts.astype(np.int64), n_ctx, 1, encoding="parallel")

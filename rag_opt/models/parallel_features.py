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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.models.document_pass import encode_blocks, encode_blocks_with_sources
from rag_opt.models.encoding_cache import EncodingCache, block_key, sources_kind
from rag_opt.models.extract import AttentionFeatures
from rag_opt.models.kv_codec import DEFAULT_FORMAT, EncodedStates, encode_states
from rag_opt.models.parallel import ParallelPrompt, parallel_prompt
from rag_opt.models.parallel_cross import cross_reads
from rag_opt.models.prompt import VIEWS
from rag_opt.models.question_pass import QuestionPass, run_question_passes
from rag_opt.work import checkpoint

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
    prompts = _cut_contexts(proxy, contexts, max_tokens)
    found = _Encodings(cache, _ContextKeys.of(proxy, prompts, layers, cross))
    hits, misses = _encode_missing(proxy, prompts, found, layers, batch_tokens)
    rows = [QuestionPass(p, found.parts(c)) for c, p in enumerate(prompts)]
    return _read_questions(proxy, rows, found, hits, misses, layers)


def _cut_contexts(
    proxy: ProxyModel, contexts: Sequence[tuple[Sequence[Sequence[str]], str]], max_tokens: int
) -> list[ParallelPrompt]:
    """Each context cut into blocks, as every request cuts it (:func:`block_limit`), each checked against the
    limits of :mod:`rag_opt.work` before any forward pass."""
    prompts: list[ParallelPrompt] = []
    limit = block_limit(proxy, max_tokens)
    for docs, question in contexts:
        prompt = parallel_prompt(
            proxy.tokenizer, docs, question, max_block_tokens=limit, max_positions=proxy.max_positions
        )
        # (parallel_prompt checked the proxy-token limit in force, document by document: before any forward pass)
        prompts.append(prompt)
    return prompts


@dataclass
class _ContextKeys:
    """The cache keys of a batch's entries (:func:`~rag_opt.models.encoding_cache.block_key`), each hashed once:
    ``blocks[c][b]`` block ``b`` of context ``c``'s states; with cross, ``sources[c][b]`` its source queries, read at
    each unit's last token (keyed by the tokens and the units' ends: the same tokens cut into other units are another
    entry); ``prefix`` the shared prefix's states."""

    blocks: list[list[str]]
    sources: list[list[str]]
    prefix: str
    cross: bool

    @classmethod
    def of(cls, proxy: ProxyModel, prompts: Sequence[ParallelPrompt], depth: int, cross: bool) -> _ContextKeys:
        blocks = [[block_key(b.ids, proxy, depth=depth) for b in prompt.blocks] for prompt in prompts]
        sources = (
            [[block_key(b.ids, proxy, depth=depth, kind=sources_kind(b.ends)) for b in p.blocks] for p in prompts]
            if cross
            else []
        )
        return cls(blocks, sources, block_key(prompts[0].prefix, proxy, depth=depth, kind="prefix"), cross)

    @property
    def wanted(self) -> list[list[str]]:
        """The key each block is wanted under: with cross, its encoding with its source queries."""
        return self.sources if self.cross else self.blocks


@dataclass
class _Encodings:
    """The entries a batch's question passes read, from the cache or just encoded: each block's states by block key,
    with cross each block's source queries by sources key, and the prefix's states."""

    cache: EncodingCache | None
    keys: _ContextKeys
    states: dict[str, EncodedStates] = field(default_factory=dict)
    queries: dict[str, EncodedStates] = field(default_factory=dict)
    prefix: EncodedStates | None = None

    def _lookup(self, found: dict[str, EncodedStates], key: str) -> EncodedStates | None:
        return found[key] if key in found else self.cache.get(key) if self.cache is not None else None

    def cached(self, c: int, b: int) -> bool:
        """Whether block ``b`` of context ``c`` is cached (its states, and with cross its source queries): kept."""
        k = self.keys.blocks[c][b]
        tk = self.keys.sources[c][b] if self.keys.cross else k
        got = self._lookup(self.states, k)
        got_q = self._lookup(self.queries, tk) if self.keys.cross and got is not None else None
        if got is None or (self.keys.cross and got_q is None):
            return False
        self.states[k] = got
        if got_q is not None:
            self.queries[tk] = got_q
        return True

    def parts(self, c: int) -> list[EncodedStates]:
        """What context ``c``'s question pass reads: the prefix's states, then each of its blocks'."""
        if self.prefix is None:  # pragma: no cover - extract_parallel reads or encodes it first
            raise RuntimeError("the prefix's states are read before any question pass")
        return [self.prefix, *(self.states[k] for k in self.keys.blocks[c])]


def _encode_missing(
    proxy: ProxyModel, prompts: Sequence[ParallelPrompt], found: _Encodings, layers: int, batch_tokens: int
) -> tuple[list[int], list[int]]:
    """Every entry of the batch in ``found``: the cached ones read, the others encoded (each distinct block once) and
    cached; returns each context's cache hits and misses (:func:`plan_blocks`)."""
    wanted, hits, misses = plan_blocks(found.keys.wanted, found.cached)
    found.prefix = found.cache.get(found.keys.prefix) if found.cache is not None else None
    if wanted:
        _encode_blocks(proxy, prompts, wanted, found, layers, batch_tokens)
    if found.prefix is None:  # every block was cached, the prefix was not: its own pass
        _, (alone,) = encode_blocks(proxy, [], [prompts[0].prefix], layers, batch_tokens=batch_tokens)
        found.prefix = _stored(found.cache, found.keys.prefix, alone)
    return hits, misses


def _encode_blocks(
    proxy: ProxyModel,
    prompts: Sequence[ParallelPrompt],
    wanted: dict[str, tuple[int, int]],
    found: _Encodings,
    layers: int,
    batch_tokens: int,
) -> None:
    """The blocks :func:`plan_blocks` wants (``wanted key -> (context, block)``) through batched document passes,
    each kept in the cache and in ``found`` as the cache stores it (a quantized format changes the states: a cold
    request reads what a warm one will, so both give the same answer); the prefix's states too, unless cached."""
    blocks = [prompts[c].blocks[b] for c, b in wanted.values()]
    ids = [b.ids for b in blocks]
    if found.keys.cross:
        pre, computed, kept = encode_blocks_with_sources(
            proxy, prompts[0].prefix, ids, [b.ends for b in blocks], layers, batch_tokens=batch_tokens
        )
    else:
        (pre, computed), kept = encode_blocks(proxy, prompts[0].prefix, ids, layers, batch_tokens=batch_tokens), []
    if found.prefix is None:
        found.prefix = _stored(found.cache, found.keys.prefix, pre)
    for i, (tk, (c, b)) in enumerate(wanted.items()):
        k = found.keys.blocks[c][b]
        found.states[k] = _stored(found.cache, k, computed[i])
        if found.keys.cross:
            found.queries[tk] = _stored(found.cache, tk, kept[i])


def _read_questions(
    proxy: ProxyModel,
    rows: Sequence[QuestionPass],
    found: _Encodings,
    hits: Sequence[int],
    misses: Sequence[int],
    layers: int,
) -> list[AttentionFeatures]:
    """Each row's features from batched question passes (:func:`_question_batches`), in ``rows``' order, with its
    cache hits and misses and, with cross, its cross-document reading."""
    fmt = found.cache.format.name if found.cache is not None else DEFAULT_FORMAT
    decoded = found.cache.decoded if found.cache is not None else None  # none kept without a cache: never read again
    out: list[AttentionFeatures | None] = [None] * len(rows)
    for batch in _question_batches(rows):
        checkpoint()
        with proxy.lock:
            capture = run_question_passes(proxy, [rows[j] for j in batch], layers, decoded)
        for b, j in enumerate(batch):
            feats = _features(rows[j].prompt, [capture.sums[layer][b] for layer in range(layers)])
            feats.cache_hits, feats.cache_misses = hits[j], misses[j]
            if found.keys.cross:
                feats.cross, feats.cross_sources = _cross_reading(proxy, rows[j], found, j, fmt, layers)
            out[j] = feats
    return [f for f in out if f is not None]


def _question_batches(rows: Sequence[QuestionPass]) -> Iterator[list[int]]:
    """The rows of each question pass, shortest first, as many per pass as fit :data:`QUESTION_BATCH_TOKENS`
    (padded to the longest; a row longer than that is a pass of its own)."""
    batch: list[int] = []
    for i in sorted(range(len(rows)), key=lambda i: rows[i].length):
        if batch and rows[i].length * (len(batch) + 1) > QUESTION_BATCH_TOKENS:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _cross_reading(
    proxy: ProxyModel, row: QuestionPass, found: _Encodings, c: int, fmt: str, layers: int
) -> tuple[np.ndarray, np.ndarray]:
    """Context ``c``'s cross-document reading, computed once per document set (:data:`CROSS_READS`): keyed by the
    tokens and units of each block and the format their states were read in."""
    sources = found.keys.sources[c]
    return CROSS_READS.get_or_compute(
        (fmt, *sources, row.prompt.question_start),
        lambda: cross_reads(proxy, row.prompt, row.parts, [found.queries[k] for k in sources], layers),
    )


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

"""The encoding cache on traffic that repeats as production traffic does: hit rate against cache size per tier and
format, warm and cold latency, two replicas, and the figures docs/capacity.md turns into cores and memory.

    OMP_NUM_THREADS=1 python benchmarks/cache.py                                   # → benchmarks/results/cache.json
    OMP_NUM_THREADS=1 python benchmarks/cache.py --requests 300 --latency-sample 10 --mix-requests 20   # quick look

**Traffic.** The corpus is the NQ multi-document passage pool (every record's gold passage and distractors in
``nq_multidoc/public.jsonl.gz``, deduplicated by text); the questions are the 3,610 NQ-open dev questions
(``nq_open/NQ-open.dev.jsonl``, which hold every nq_multidoc question). Each question retrieves its top ``--k`` (20)
passages by BM25 (bm25s) from the whole pool. ``--requests`` (4,000) requests each draw a question with Zipf
popularity (``--zipf`` 1.0: the question of popularity rank r is asked with probability proportional to
1 / r^1.0; ranks are a seeded permutation of the questions, ``--seed``), so popular questions, and the passages
that many questions retrieve, come back as they do in production.

**Entry sizes.** A sample of the stream's requests (``--size-sample`` passages) is encoded with the real proxy
through :meth:`EncodingCache.put`: each passage's key/value entry and its source-query entry, put into a cache of
every format; ``nbytes`` (what the memory tier counts) and ``len(entry.to_bytes(cache.store_key(k)))`` (what the
disk and shared tiers hold) over the passages' proxy tokens (title line and text, counted with the proxy's
tokenizer) give each format's bytes per token. Every pool passage's entry size is then its proxy tokens times that.

**Hit rate against cache size (no model run).** The whole stream is replayed through the real tiers: the
:class:`EncodingCache` memory LRU, a :class:`~rag_opt.models.cache_disk.DiskTier` in a temporary folder, and a
:class:`~rag_opt.models.cache_redis.RedisTier` on a real ``redis-server`` (``maxmemory`` at the size,
``allkeys-lru``), each tier alone at each size in ``--memory-sizes`` / ``--disk-sizes`` / ``--shared-sizes``, as a
request does: every document looked up (``get``), the missing ones put, the store tiers flushed before the next
request. The entries are placeholders of the right byte size (valid serialized entries: the cache verifies what
it reads), not encodings: a hit rate depends on the sizes and the order of lookups only. A passage's key/value
entry and its source-query entry are put and read together, so they are replayed as one entry of their summed
size. Sizes are divided by one factor per format (``scale`` in the results: the power of two that brings a
passage's entry near 32 KiB) with the tiers' bounds: a least-recently-used cache bounded in bytes takes the same
decisions when every size and its bound are divided alike, and the disk and the store then write gigabytes, not
terabytes. Redis's own memory (measured after FLUSHALL) is added to its ``maxmemory``. Reported per format: the
share of document lookups answered over the whole stream (a cold start included) and over its second half.
With ``--sizes-from`` (the entry sizes of an earlier run) and ``--latency-sample 0``, nothing runs the model: only
its tokenizer counts the passages' tokens.

**Two replicas.** The stream is split over two replicas, each with its own memory tier (``--replica-memory``),
both above one shared Redis tier (``--replica-shared``): routed at random, by a consistent hash (a ring with
virtual nodes) of the request's retrieved document set (``set``: equal sets meet), or of the set's MinHash
(``minhash``: the smallest hash of its documents, so sets that overlap meet as often as they overlap). Reported:
each replica's memory hit rate and the overall hit rate (memory and shared), against one replica taking it all.

**Latency (the model).** ``--latency-sample`` requests drawn from the stream, each measured in every arm in turn:
the lexical tier (``tier="lexical"``, before or after the others in turns); **partial**: every other document
cached (encoded just before, not timed), the others encoded; **cold**: parallel encoding with nothing cached (the
cache, the question buffers, the cross-document readings and the block tokenization memo emptied); **warm**:
another question over the same documents, their entries cached (the question buffers and cross-document readings
emptied: only the entries reused), once per ``--latency-formats`` (entries put in that format from the cold
request's states); **warm, same set**: a third question right after (what a repeated document set costs); and a
bare forward of the proxy over the same prompt, in fp32 and in the proxy's own precision (``bare_forward_ms`` of
benchmarks/compression.py). One thread (``--threads``). What encoding costs is fitted over the cold and partial
arms: their time over the warm arm's = a fixed part (a request that encodes anything) + ms per missed proxy token.

**The mix (the capacity model checked).** The first ``--mix-requests`` requests of the stream through one
optimizer with a real bf16 memory cache of ``--mix-memory``, from cold, in order: per-request latency and the
cache's real hits, against the placeholder replay of the same requests at the same bound (predicted hits) and the
capacity formula (question pass + the fixed encoding part when a document is missed + missed tokens × encoding ms
per token, all from the latency sample).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from common import data_dir, run_or_report

from rag_opt.models.cache_disk import DiskTier, parse_size
from rag_opt.models.encoding_cache import EncodingCache
from rag_opt.models.kv_codec import FORMATS, EncodedStates, resolve_format

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("bench.cache")

GiB = 2**30
MiB = 2**20
TARGET_ENTRY = 32 * 2**10  # a placeholder entry's size after scaling (see the module doc)
BIG = 64 * GiB  # a memory bound nothing reaches


# -- the traffic -----------------------------------------------------------------------------------------------------
def load_pool() -> list[dict[str, str]]:
    """Every nq_multidoc passage (gold and distractors) once, by text, in first-seen order."""
    path = data_dir() / "nq_multidoc" / "public.jsonl.gz"
    seen: dict[str, dict[str, str]] = {}
    with gzip.open(path, "rt") as fh:
        for line in fh:
            rec = json.loads(line)
            for ctx in [rec["gold_ctx"], *rec["distractor_ctxs"]]:
                if ctx["text"] not in seen:
                    seen[ctx["text"]] = {"id": str(len(seen)), "title": ctx["title"], "text": ctx["text"]}
    return list(seen.values())


def load_questions() -> list[str]:
    """The NQ-open dev questions, once each (by their normalised text), in file order."""
    out: dict[str, str] = {}
    with open(data_dir() / "nq_open" / "NQ-open.dev.jsonl") as fh:
        for line in fh:
            q = json.loads(line)["question"]
            out.setdefault(" ".join(q.lower().split()), q)
    return list(out.values())


def retrieve(questions: Sequence[str], pool: Sequence[dict[str, str]], k: int) -> np.ndarray:
    """Each question's top ``k`` pool indices by BM25 (title line and text), ``(questions, k)``."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its logger to DEBUG on import
    retriever = bm25s.BM25()
    corpus = bm25s.tokenize([f"{d['title']}\n{d['text']}" for d in pool], stopwords="en", show_progress=False)
    retriever.index(corpus, show_progress=False)
    queries = bm25s.tokenize(list(questions), stopwords="en", show_progress=False)
    hits, _ = retriever.retrieve(queries, k=k, show_progress=False)
    return np.asarray(hits, dtype=np.int64)


def zipf_stream(n_questions: int, requests: int, exponent: float, seed: int) -> np.ndarray:
    """``requests`` question indices: popularity rank r (a seeded permutation of the questions) drawn with
    probability proportional to 1 / r**exponent."""
    rng = np.random.default_rng(seed)
    by_rank = rng.permutation(n_questions)
    weights = 1.0 / np.arange(1, n_questions + 1, dtype=np.float64) ** exponent
    ranks = rng.choice(n_questions, size=requests, p=weights / weights.sum())
    return by_rank[ranks]


def proxy_tokens(tokenizer: Any, pool: Sequence[dict[str, str]], indices: Sequence[int]) -> dict[int, int]:
    """The proxy tokens of each passage in ``indices`` (its title line and text)."""
    idx = sorted(set(int(i) for i in indices))
    out: dict[int, int] = {}
    for a in range(0, len(idx), 1024):
        chunk = idx[a : a + 1024]
        texts = [f"{pool[i]['title']}\n{pool[i]['text']}" for i in chunk]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        out.update({i: len(x) for i, x in zip(chunk, ids, strict=True)})
    return out


@dataclass
class Traffic:
    """The replayed traffic: the pool, the questions, each question's retrieved passages and the request stream."""

    pool: list[dict[str, str]]
    questions: list[str]
    retrieved: np.ndarray  # (questions, k) pool indices
    stream: np.ndarray  # (requests,) question indices
    tokens: dict[int, int]  # proxy tokens of every passage the stream retrieves

    def docs(self, request: int) -> list[int]:
        """The pool indices request ``request`` retrieves."""
        return [int(i) for i in self.retrieved[self.stream[request]]]

    def documents(self, question: int) -> list[dict[str, str]]:
        """The documents question ``question`` retrieves, as ``optimize`` takes them."""
        return [self.pool[int(i)] for i in self.retrieved[question]]

    def summary(self) -> dict[str, Any]:
        """How much the stream repeats: distinct questions and documents, and what an unbounded cache answers."""
        lookups = len(self.stream) * self.retrieved.shape[1]
        distinct = {int(i) for q in set(self.stream.tolist()) for i in self.retrieved[q]}
        toks = np.array([self.tokens[i] for i in distinct])
        return {
            "pool_passages": len(self.pool),
            "questions": len(self.questions),
            "requests": len(self.stream),
            "distinct_questions": len(set(self.stream.tolist())),
            "lookups": lookups,
            "distinct_documents": len(distinct),
            "compulsory_hit_rate": 1 - len(distinct) / lookups,  # every repeat answered: an unbounded cache
            "top_question_share": float(np.bincount(self.stream).max() / len(self.stream)),
            "document_tokens": {
                "mean": float(toks.mean()),
                "p50": float(np.median(toks)),
                "p90": float(np.percentile(toks, 90)),
                "distinct_total": int(toks.sum()),
            },
        }


def build_traffic(args: argparse.Namespace, tokenizer: Any) -> Traffic:
    """The pool, the questions, their BM25 retrievals, the Zipf stream and the proxy tokens of what it retrieves."""
    pool = load_pool()
    questions = load_questions()
    t = time.perf_counter()
    retrieved = retrieve(questions, pool, args.k)
    logger.info(
        "BM25 top %d of %d passages for %d questions: %.0f s",
        args.k,
        len(pool),
        len(questions),
        time.perf_counter() - t,
    )
    stream = zipf_stream(len(questions), args.requests, args.zipf, args.seed)
    used = {int(i) for q in set(stream.tolist()) for i in retrieved[q]}
    return Traffic(pool, questions, retrieved, stream, proxy_tokens(tokenizer, pool, sorted(used)))


# -- entry sizes -----------------------------------------------------------------------------------------------------
class RecordingCache(EncodingCache):
    """A bf16 memory cache that remembers every state it was given, by content key (to fill other formats)."""

    def __init__(self) -> None:
        super().__init__(BIG, format="bf16")
        self.raw: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> EncodedStates:
        if not isinstance(value, EncodedStates):
            self.raw[key] = value
        return super().put(key, value)

    def reset(self) -> None:
        """Forget every entry and every state."""
        self.clear()
        self.raw.clear()


def measure_entry_sizes(
    model: Model, traffic: Traffic, formats: Sequence[str], sample_docs: int, seed: int
) -> dict[str, Any]:
    """Each format's bytes per proxy token, from real encodings of the stream's passages (see the module doc)."""
    from tqdm.auto import tqdm

    from rag_opt.models.parallel import prefix_tokens

    rng = np.random.default_rng([seed, 7])
    rec = RecordingCache()
    model.sentinel.cache = rec
    seen: set[int] = set()
    picks = rng.permutation(len(traffic.stream))
    bar = tqdm(total=sample_docs, desc="entry sizes", mininterval=10)
    for r in picks:
        if len(seen) >= sample_docs:
            break
        q = int(traffic.stream[r])
        docs = traffic.docs(int(r))
        if set(docs) <= seen:
            continue
        model.opt.optimize(traffic.questions[q], traffic.documents(q))
        bar.update(len(set(docs) - seen))
        seen |= set(docs)
    bar.close()
    n_prefix = len(prefix_tokens(model.proxy.tokenizer))
    raw = {k: v for k, v in rec.raw.items() if not (v.dim() == 5 and v.shape[3] == n_prefix)}
    tokens = sum(traffic.tokens[i] for i in seen)
    block_tokens = sum(int(v.shape[3]) for v in raw.values() if v.dim() == 5)
    out: dict[str, Any] = {
        "documents": len(seen),
        "entries": len(raw),
        "proxy_tokens": tokens,
        "block_tokens": block_tokens,
        "precision": model.proxy.precision,
        "formats": {},
    }
    for fmt in formats:
        cache = EncodingCache(BIG, format=fmt)
        mem = stored = 0
        for k, v in raw.items():
            entry = cache.put(k, v)
            mem += entry.nbytes
            stored += len(entry.to_bytes(cache.store_key(k)))
        out["formats"][fmt] = {
            "memory_bytes_per_token": mem / tokens,
            "stored_bytes_per_token": stored / tokens,
            "stored_bytes_per_block_token": stored / block_tokens,
        }
    rec.reset()
    return out


# -- placeholder entries ---------------------------------------------------------------------------------------------
class Placeholders:
    """Entries of one format for the replay: passage ``i``'s holds ``memory_bytes(i) / scale`` bytes (a view of one
    shared buffer: nothing is allocated per entry) and serializes to a valid entry (the cache checks what it reads)
    of about ``stored_bytes(i) / scale``."""

    def __init__(self, fmt: str, sizes: dict[str, Any], tokens: dict[int, int], scale: int | None = None) -> None:
        import torch

        self.fmt = fmt
        self.format = resolve_format(fmt)
        f = sizes["formats"][fmt]
        self.memory_bpt = f["memory_bytes_per_token"]
        self.stored_bpt = f["stored_bytes_per_token"]
        mean_tokens = float(np.mean(list(tokens.values())))
        auto = 2 ** max(0, round(math.log2(self.stored_bpt * mean_tokens / TARGET_ENTRY)))
        self.scale = auto if scale is None else scale
        self.tokens = tokens
        self.halves = {i: max(1, round(self.memory_bpt * t / self.scale / 2)) for i, t in tokens.items()}
        self._buffer = torch.zeros(2 * max(self.halves.values()), dtype=torch.uint8)

    def entry(self, doc: int) -> EncodedStates:
        """Passage ``doc``'s placeholder entry."""
        import torch

        m = self.halves[doc]
        states = self._buffer[: 2 * m].view(2, 1, 1, m, 1)
        return EncodedStates(self.format, "kv", (2, 1, 1, m, 1), torch.uint8, {"states": states})

    def bound(self, size: int) -> int:
        """A tier's bound of ``size`` real bytes, scaled."""
        return max(1, round(size / self.scale))

    def mean_stored_bytes(self) -> float:
        """A passage's entry as stored, on average, in real (unscaled) bytes."""
        return self.stored_bpt * float(np.mean(list(self.tokens.values())))


def content_key(doc: int) -> str:
    """Passage ``doc``'s content key (what :func:`~rag_opt.models.encoding_cache.encoding_key` is to a block)."""
    return hashlib.sha256(f"nq-passage-{doc}".encode()).hexdigest()


def replay(
    traffic: Traffic,
    ph: Placeholders,
    caches: Sequence[EncodingCache],
    route: Callable[[int], int] = lambda r: 0,
    requests: int | None = None,
    desc: str = "replay",
) -> dict[str, Any]:
    """Replay the stream (its first ``requests``) through ``caches`` (one per replica, ``route`` picks it):
    each document looked up, the missing ones put, the store tiers flushed. Hit rates per replica and overall,
    over the stream and over its second half; the per-request misses."""
    from tqdm.auto import tqdm

    n = len(traffic.stream) if requests is None else requests
    half = n // 2
    lookups = [0] * len(caches)
    half_lookups = [0] * len(caches)
    mid: list[Any] = [None] * len(caches)  # the counters at the second half's start
    served = [0] * len(caches)
    missed: list[list[int]] = []
    for r in tqdm(range(n), desc=desc, mininterval=10, leave=False):
        if r == half:
            mid = [c.stats() for c in caches]
            half_lookups = list(lookups)
        i = route(r)
        cache = caches[i]
        docs = traffic.docs(r)
        missing = [d for d in docs if cache.get(content_key(d)) is None]
        for d in missing:
            cache.put(content_key(d), ph.entry(d))
        if missing and cache.tiers:
            cache.flush()
        lookups[i] += len(docs)
        served[i] += 1
        missed.append(missing)
    end = [c.stats() for c in caches]

    def rates(st: Any, base: Any, looked: int) -> dict[str, float]:
        def d(name: str) -> int:
            return getattr(st, name) - (getattr(base, name) if base is not None else 0)

        looked = max(looked, 1)
        return {
            "hit_rate": d("hits") / looked,
            "memory": d("memory_hits") / looked,
            "disk": d("disk_hits") / looked,
            "shared": d("shared_hits") / looked,
        }

    per: list[dict[str, Any]] = []
    for i, st in enumerate(end):
        per.append(
            {
                "requests": served[i],
                "lookups": lookups[i],
                **rates(st, None, lookups[i]),
                "second_half": rates(st, mid[i], lookups[i] - half_lookups[i]),
                "evictions": st.evictions + sum(t.evictions for t in st.tiers),
                "store_errors": sum(t.errors for t in st.tiers),
                "store_skipped": sum(t.skipped for t in st.tiers),
            }
        )
    total = max(sum(lookups), 1)
    overall = {k: sum(p[k] * p["lookups"] for p in per) / total for k in ("hit_rate", "memory", "disk", "shared")}
    second = [p["lookups"] - h for p, h in zip(per, half_lookups, strict=True)]
    overall["second_half_hit_rate"] = sum(
        p["second_half"]["hit_rate"] * n2 for p, n2 in zip(per, second, strict=True)
    ) / max(sum(second), 1)
    return {"overall": overall, "replicas": per, "missed": missed}


# -- a redis-server of the benchmark's own ---------------------------------------------------------------------------
class Redis:
    """One ``redis-server`` on 127.0.0.1 (nothing saved, ``allkeys-lru``) and a client to size and empty it."""

    def __init__(self, workdir: Path) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(workdir), "--maxmemory-policy", "allkeys-lru", "--logfile", ""]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 15
        while True:
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def reset(self, maxmemory: int) -> int:
        """Empty the store and bound it at ``maxmemory`` bytes above what it uses empty; returns that base."""
        self.client.flushall()
        self.client.config_set("maxmemory", 0)
        base = int(self.client.info("memory")["used_memory"])
        self.client.config_set("maxmemory", base + maxmemory)
        self.client.config_resetstat()
        return base

    def info(self) -> dict[str, int]:
        """The memory the store uses and the keys it evicted since the last :meth:`reset`."""
        mem, stats = self.client.info("memory"), self.client.info("stats")
        return {"used_memory": int(mem["used_memory"]), "evicted_keys": int(stats["evicted_keys"])}

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        with contextlib.suppress(Exception):
            self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def shared_tier(url: str, namespace: str) -> Any:
    """A RedisTier for the replay: the library's, with a read timeout this loaded machine never reaches (a timeout
    would be answered as a miss and mark the tier down: not what a hit rate measures)."""
    from rag_opt.models.cache_redis import RedisTier

    return RedisTier(url, timeout=5.0, write_timeout=10.0, namespace=namespace)


# -- the hit-rate curves and the replicas ----------------------------------------------------------------------------
def size_label(n: int) -> str:
    """``n`` bytes as ``"512 MiB"`` or ``"4 GiB"``."""
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / MiB:g} MiB"


def hit_rate_curves(
    args: argparse.Namespace, traffic: Traffic, ph: Placeholders, redis: Redis | None, tmp: Path, stores: bool
) -> dict[str, Any]:
    """Each tier alone at each size (see the module doc); ``stores``: the disk and shared tiers too."""
    out: dict[str, Any] = {"scale": ph.scale, "mean_document_bytes": ph.mean_stored_bytes()}
    tiers = [("memory", args.memory_sizes)]
    if stores:
        tiers.append(("disk", args.disk_sizes))
        if redis is not None:
            tiers.append(("shared", args.shared_sizes))
    for tier, sizes in tiers:
        rows = []
        for size in sizes:
            bound = ph.bound(size)
            extra: dict[str, Any] = {}
            t = time.perf_counter()
            if tier == "memory":
                cache = EncodingCache(bound, format=ph.fmt)
            elif tier == "disk":
                folder = Path(tempfile.mkdtemp(prefix="disk-", dir=tmp))
                cache = EncodingCache(0, disk=DiskTier(folder, max_bytes=bound), format=ph.fmt)
            else:
                assert redis is not None
                extra["redis_base_bytes"] = redis.reset(bound)
                cache = EncodingCache(0, shared=shared_tier(redis.url, f"{ph.fmt}:{size}:"), format=ph.fmt)
            res = replay(traffic, ph, [cache], desc=f"{ph.fmt} {tier} {size_label(size)}")
            cache.close()
            if tier == "disk":
                shutil.rmtree(folder, ignore_errors=True)
            if tier == "shared" and redis is not None:
                extra.update(redis.info())
            rep = res["replicas"][0]
            rows.append(
                {
                    "bytes": size,
                    "label": size_label(size),
                    "documents_held": size / ph.mean_stored_bytes(),
                    "hit_rate": rep["hit_rate"],
                    "hit_rate_second_half": rep["second_half"]["hit_rate"],
                    "evictions": rep["evictions"],
                    "store_errors": rep["store_errors"],
                    "store_skipped": rep["store_skipped"],
                    "seconds": time.perf_counter() - t,
                    **extra,
                }
            )
            logger.info(
                "%-5s %-6s %8s: hit rate %.3f (second half %.3f)",
                ph.fmt,
                tier,
                size_label(size),
                rep["hit_rate"],
                rep["second_half"]["hit_rate"],
            )
        out[tier] = rows
    return out


class HashRing:
    """A consistent-hash ring: ``vnodes`` points per replica; a key goes to the replica of the next point."""

    def __init__(self, replicas: int, vnodes: int = 64) -> None:
        pts = sorted((h64(f"replica-{r}-{v}"), r) for r in range(replicas) for v in range(vnodes))
        self.points = [p for p, _ in pts]
        self.owner = [r for _, r in pts]

    def route(self, key: int) -> int:
        """The replica of ``key``."""
        return self.owner[bisect(self.points, key) % len(self.points)]


def h64(text: str) -> int:
    """A 64-bit hash of ``text`` (BLAKE2b), the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def routers(traffic: Traffic, replicas: int, seed: int) -> dict[str, Callable[[int], int]]:
    """Request → replica: at random, by the document set's hash, by the set's MinHash."""
    ring = HashRing(replicas)
    rng = np.random.default_rng([seed, 11])
    rand = rng.integers(0, replicas, size=len(traffic.stream))

    def by_set(r: int) -> int:
        return ring.route(h64(",".join(str(d) for d in sorted(traffic.docs(r)))))

    def by_minhash(r: int) -> int:
        return ring.route(min(h64(f"doc-{d}") for d in traffic.docs(r)))

    return {"random": lambda r: int(rand[r]), "set": by_set, "minhash": by_minhash}


def replica_study(args: argparse.Namespace, traffic: Traffic, ph: Placeholders, redis: Redis) -> dict[str, Any]:
    """Two replicas (own memory tiers) over one shared tier, by routing; one replica as the reference."""
    out: dict[str, Any] = {"shared": size_label(args.replica_shared), "by_memory": {}}
    route = routers(traffic, 2, args.seed)
    for memory in args.replica_memory:
        rows: dict[str, Any] = {}
        for name in ["single", *route]:
            redis.reset(ph.bound(args.replica_shared))
            n = 1 if name == "single" else 2
            ns = f"{ph.fmt}:replicas:{name}:{memory}:"
            caches = [
                EncodingCache(ph.bound(memory), shared=shared_tier(redis.url, ns), format=ph.fmt) for _ in range(n)
            ]
            res = replay(
                traffic,
                ph,
                caches,
                route=route.get(name, lambda r: 0),
                desc=f"{ph.fmt} replicas {name} {size_label(memory)}",
            )
            for c in caches:
                c.close()
            rows[name] = {
                "overall_hit_rate": res["overall"]["hit_rate"],
                "memory_hit_rate": res["overall"]["memory"],
                "shared_hit_rate": res["overall"]["shared"],
                "second_half_hit_rate": res["overall"]["second_half_hit_rate"],
                "replicas": [
                    {
                        "requests": p["requests"],
                        "memory_hit_rate": p["memory"],
                        "overall_hit_rate": p["hit_rate"],
                        "store_errors": p["store_errors"],
                    }
                    for p in res["replicas"]
                ],
            }
            logger.info(
                "%-5s replicas memory %s, %-7s: memory hit %s, overall %.3f",
                ph.fmt,
                size_label(memory),
                name,
                " / ".join(f"{p['memory']:.3f}" for p in res["replicas"]),
                res["overall"]["hit_rate"],
            )
        out["by_memory"][size_label(memory)] = rows
    return out


# -- the model: latency and the mix ----------------------------------------------------------------------------------
@dataclass
class Model:
    """The optimizer as users make it (parallel encoding, the shipped probes), its scorer seen through a spy (to
    time a bare forward over the same prompt), and an fp32 copy of the proxy for that bare forward."""

    opt: Any
    sentinel: Any
    spy: Any
    proxy: Any
    fp32: Any | None

    @classmethod
    def load(cls, threads: int, fp32: bool) -> Model:
        import torch
        from compression import ContextSpy

        from rag_opt.compressors.sentinel import SentinelCompressor
        from rag_opt.models.loader import load_proxy_model
        from rag_opt.models.threads import ThreadPolicy
        from rag_opt.pipeline import ContextOptimizer

        torch.set_num_threads(threads)
        sentinel = SentinelCompressor.from_model(None, encoding="parallel", cache=EncodingCache(BIG))
        sentinel.proxy.threads = ThreadPolicy(threads)
        spy = ContextSpy(sentinel)
        opt = ContextOptimizer(scorer=spy, threads=threads)
        opt.optimize("warm up?", [{"text": "Warm-up text."}])
        opt.optimize("warm up?", [{"text": "Warm-up text."}], tier="lexical")
        full = load_proxy_model(None, dtype="float32") if fp32 else None
        return cls(opt, sentinel, spy, sentinel.proxy, full)

    def forget_sets(self) -> None:
        """Empty what is kept per document set (question buffers, cross-document readings)."""
        from rag_opt.models.parallel_features import CROSS_READS

        CROSS_READS.clear()
        self.proxy.question_buffers.clear()

    def forget_all(self) -> None:
        """Also the block tokenization memo and the decoded entries: nothing of any document kept but what a cache
        holds."""
        from rag_opt.models import parallel, question_buffer

        question_buffer.forget(self.proxy)
        cache = getattr(self.sentinel, "cache", None)
        if cache is not None:
            cache.decoded.clear()
        self.forget_sets()
        parallel._local_blocks.cache_clear()


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """``fn(*args, **kwargs)``'s wall time in milliseconds, and its value."""
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return (time.perf_counter() - t) * 1e3, out


def latency_study(args: argparse.Namespace, model: Model, traffic: Traffic) -> dict[str, Any]:
    """The arms of the module doc, interleaved per request."""
    from compression import bare_forward_ms
    from tqdm.auto import tqdm

    from rag_opt.models.parallel import prefix_tokens

    rng = np.random.default_rng([args.seed, 3])
    picks = sorted(rng.choice(len(traffic.stream), size=min(args.latency_sample, len(traffic.stream)), replace=False))
    rec = RecordingCache()
    nq = len(traffic.questions)
    n_prefix = len(prefix_tokens(model.proxy.tokenizer))
    ms: dict[str, list[float]] = {}
    per: list[dict[str, Any]] = []
    load = os.getloadavg()[0]
    for r in tqdm(picks, desc="latency", mininterval=10):
        qi = int(traffic.stream[r])
        ids = [int(i) for i in traffic.retrieved[qi]]
        docs = traffic.documents(qi)
        q, q2, q3 = (traffic.questions[(qi + j) % nq] for j in range(3))
        row: dict[str, Any] = {"request": int(r), "tokens": sum(traffic.tokens[i] for i in ids)}
        lexical_first = len(per) % 2 == 0
        if lexical_first:
            row["lexical"], _ = timed(model.opt.optimize, q, docs, tier="lexical")
        # partial: every other document cached (encoded just before, not timed), the others encoded
        rec.reset()
        model.forget_all()
        model.sentinel.cache = rec
        model.opt.optimize(q, docs[::2])
        model.forget_sets()
        row["partial"], res = timed(model.opt.optimize, q, docs)
        row["partial_misses"] = res.cache_misses
        row["partial_missed_tokens"] = sum(traffic.tokens[i] for i in ids[1::2])
        rec.reset()
        model.forget_all()
        model.sentinel.cache = rec
        row["cold"], res = timed(model.opt.optimize, q, docs)
        row["cold_misses"], row["cold_hits"] = res.cache_misses, res.cache_hits
        units = model.spy.last[1]
        for fmt in args.latency_formats:
            if fmt == "bf16":
                continue
            cache = EncodingCache(BIG, format=fmt)
            for k, v in rec.raw.items():
                cache.put(k, v)
            model.forget_sets()
            model.sentinel.cache = cache
            row[f"warm_{fmt}"], res = timed(model.opt.optimize, q2, docs)
            assert res.cache_misses == 0, "a warm request encoded documents"
        model.forget_sets()
        model.sentinel.cache = rec
        row["warm_bf16"], res = timed(model.opt.optimize, q2, docs)
        assert res.cache_misses == 0, "a warm request encoded documents"
        row["warm_same_set"], _ = timed(model.opt.optimize, q3, docs)
        if not lexical_first:
            row["lexical"], _ = timed(model.opt.optimize, q, docs, tier="lexical")
        row["bare_native"] = bare_forward_ms(model.proxy, units, q)
        if model.fp32 is not None:
            row["bare_fp32"] = bare_forward_ms(model.fp32, units, q)
        row["block_tokens"] = sum(int(v.shape[3]) for v in rec.raw.values() if v.dim() == 5) - n_prefix
        per.append(row)
        for k, v in row.items():
            if isinstance(v, float):
                ms.setdefault(k, []).append(v)
    rec.reset()
    arms = {k: summary(v) for k, v in ms.items()}
    base = "bare_fp32" if "bare_fp32" in ms else "bare_native"
    ratio = {
        k: {
            "over_bare_fp32": statistics.median(a / b for a, b in zip(v, ms[base], strict=True))
            if base == "bare_fp32"
            else None,
            "over_bare_native": statistics.median(a / b for a, b in zip(v, ms["bare_native"], strict=True)),
        }
        for k, v in ms.items()
    }
    # encoding = what a request pays over the warm one: a fixed part (a request that encodes anything) and a part
    # per missed token, fitted over the cold (every document missed) and partial (every other one) arms
    missed = [float(p["tokens"]) for p in per] + [float(p["partial_missed_tokens"]) for p in per]
    extra = [p["cold"] - p["warm_bf16"] for p in per] + [p["partial"] - p["warm_bf16"] for p in per]
    (fixed, per_token), *_ = np.linalg.lstsq(np.c_[np.ones(len(missed)), missed], np.array(extra), rcond=None)
    ratio_cold = [(p["cold"] - p["warm_bf16"]) / p["tokens"] for p in per]
    return {
        "requests": len(per),
        "load_average": [load, os.getloadavg()[0]],
        "arms": arms,
        "ratios": ratio,
        "encoding_fixed_ms": float(fixed),
        "encoding_ms_per_token": float(per_token),
        "cold_extra_ms_per_token": statistics.median(ratio_cold),
        "question_pass_ms": statistics.median(ms["warm_bf16"]),
        "question_pass_ms_mean": statistics.fmean(ms["warm_bf16"]),
        "tokens_per_request": statistics.fmean(p["tokens"] for p in per),
        "block_tokens_per_proxy_token": sum(p["block_tokens"] for p in per) / sum(p["tokens"] for p in per),
        "per_request": per,
    }


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summary(ms: Sequence[float]) -> dict[str, float]:
    """p50, p90 and mean of ``ms``."""
    return {"p50_ms": statistics.median(ms), "p90_ms": pct(ms, 0.9), "mean_ms": statistics.fmean(ms), "n": len(ms)}


def mix_study(
    args: argparse.Namespace, model: Model, traffic: Traffic, sizes: dict[str, Any], lat: dict[str, Any]
) -> dict[str, Any]:
    """The first ``--mix-requests`` requests through a real bf16 memory cache of ``--mix-memory``, against the
    placeholder replay's hits and the capacity formula (see the module doc)."""
    from tqdm.auto import tqdm

    n = min(args.mix_requests, len(traffic.stream))
    # the same requests, the same bound, placeholder entries (unscaled: the memory tier allocates nothing for them)
    ph = Placeholders("bf16", sizes, traffic.tokens, scale=1)
    replayed = replay(traffic, ph, [EncodingCache(args.mix_memory, format="bf16")], requests=n, desc="mix replay")
    c, fixed, q_ms = lat["encoding_ms_per_token"], lat["encoding_fixed_ms"], lat["question_pass_ms"]
    cache = EncodingCache(args.mix_memory, format="bf16")
    model.forget_all()
    model.sentinel.cache = cache
    rows: list[dict[str, Any]] = []
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    for r in tqdm(range(n), desc="mix", mininterval=10):
        qi = int(traffic.stream[r])
        ms, res = timed(model.opt.optimize, traffic.questions[qi], traffic.documents(qi))
        missing = replayed["missed"][r]
        tokens = sum(traffic.tokens[d] for d in missing)
        rows.append(
            {
                "ms": ms,
                "hits": res.cache_hits,
                "misses": res.cache_misses,
                "replayed_misses": len(missing),
                "replayed_missed_tokens": tokens,
                "predicted_ms": q_ms + (fixed if missing else 0.0) + c * tokens,
            }
        )
    wall = time.perf_counter() - t0
    measured = [row["ms"] for row in rows]
    hits, misses = sum(row["hits"] for row in rows), sum(row["misses"] for row in rows)
    predicted_hit = replayed["overall"]["hit_rate"]
    k = traffic.retrieved.shape[1]
    mean_tokens = statistics.fmean(traffic.tokens[d] for r in range(n) for d in traffic.docs(r))
    any_miss = sum(1 for m in replayed["missed"] if m) / n
    formula_mean = q_ms + any_miss * fixed + (1 - predicted_hit) * k * mean_tokens * c
    return {
        "requests": n,
        "memory": size_label(args.mix_memory),
        "load_average": [load, os.getloadavg()[0]],
        "measured": {
            **summary(measured),
            "hit_rate": hits / max(hits + misses, 1),
            "requests_per_second": n / wall,
        },
        "predicted": {
            "hit_rate": predicted_hit,
            "requests_with_a_miss": any_miss,
            "formula_mean_ms": formula_mean,
            "formula_requests_per_second": 1000 / formula_mean,
            **{f"replay_{k}": v for k, v in summary([row["predicted_ms"] for row in rows]).items() if k != "n"},
        },
        "inputs": {
            "encoding_fixed_ms": fixed,
            "encoding_ms_per_token": c,
            "question_pass_ms": q_ms,
            "mean_document_tokens": mean_tokens,
            "k": k,
        },
        "per_request": rows,
    }


# -- capacity --------------------------------------------------------------------------------------------------------
def capacity(res: dict[str, Any]) -> dict[str, Any]:
    """The measured costs docs/capacity.md reads, in one place."""
    out: dict[str, Any] = {
        "bytes_per_token": {f: v["stored_bytes_per_token"] for f, v in res["entry_sizes"]["formats"].items()},
        "memory_bytes_per_token": {f: v["memory_bytes_per_token"] for f, v in res["entry_sizes"]["formats"].items()},
    }
    lat = res.get("latency")
    if lat:
        out["encoding_fixed_ms"] = lat["encoding_fixed_ms"]
        out["encoding_ms_per_token"] = lat["encoding_ms_per_token"]
        out["question_pass_ms"] = lat["question_pass_ms"]
        out["lexical_ms"] = lat["arms"]["lexical"]["p50_ms"]
    return out


# -- the run ---------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every part of the module doc, in order; the plot is written next to ``--out``."""
    from rag_opt.models.loader import load_proxy_model

    for f in [*args.formats, *args.store_formats, *args.latency_formats]:
        if f not in FORMATS:
            raise SystemExit(f"unknown format {f!r}: use {', '.join(FORMATS)}")
    for need in ("nq_multidoc/public.jsonl.gz", "nq_open/NQ-open.dev.jsonl"):
        if not (data_dir() / need).exists():
            raise SystemExit(f"real data not found: {data_dir() / need} (see ../shared/data/README.md); skipped")
    needs_model = args.latency_sample > 0 or args.sizes_from is None
    model = Model.load(args.threads, fp32=args.latency_sample > 0) if needs_model else None
    tokenizer = model.proxy.tokenizer if model is not None else load_proxy_model(None).tokenizer
    traffic = build_traffic(args, tokenizer)
    out: dict[str, Any] = {
        "command": "OMP_NUM_THREADS=1 python " + " ".join(["benchmarks/cache.py", *sys.argv[1:]]),
        "config": {k: readable(k, v) for k, v in vars(args).items() if k not in ("out", "report_only")},
        "traffic": traffic.summary(),
    }
    t = out["traffic"]
    logger.info(
        "%d requests over %d questions (%d distinct), top %d of %d passages: %d lookups, %d distinct documents "
        "(an unbounded cache answers %.3f)",
        t["requests"],
        t["questions"],
        t["distinct_questions"],
        args.k,
        t["pool_passages"],
        t["lookups"],
        t["distinct_documents"],
        t["compulsory_hit_rate"],
    )
    formats = list(dict.fromkeys(["bf16", *args.formats, *args.store_formats, *args.latency_formats]))
    if args.sizes_from is not None:
        out["entry_sizes"] = json.loads(Path(args.sizes_from).read_text())["entry_sizes"]
        out["entry_sizes"]["from"] = args.sizes_from
    else:
        assert model is not None
        out["entry_sizes"] = measure_entry_sizes(model, traffic, formats, args.size_sample, args.seed)
    for fmt, v in out["entry_sizes"]["formats"].items():
        logger.info(
            "%-5s %8.0f bytes per proxy token stored, %8.0f in memory",
            fmt,
            v["stored_bytes_per_token"],
            v["memory_bytes_per_token"],
        )
    t["working_set_bytes"] = {
        f: v["stored_bytes_per_token"] * t["document_tokens"]["distinct_total"]
        for f, v in out["entry_sizes"]["formats"].items()
    }
    if args.sizes_only:
        return out
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmpdir:
        tmp = Path(tmpdir)
        redis: Redis | None = None
        try:
            redis = Redis(tmp)
        except (ImportError, RuntimeError) as exc:
            logger.warning("no shared tier measured: %s", exc)
        try:
            out["hit_rate"] = {}
            out["replicas"] = {}
            for fmt in dict.fromkeys([*args.store_formats, *args.formats]):
                ph = Placeholders(fmt, out["entry_sizes"], traffic.tokens)
                stores = fmt in args.store_formats
                out["hit_rate"][fmt] = hit_rate_curves(args, traffic, ph, redis, tmp, stores)
                if stores and redis is not None and args.replica_memory:
                    out["replicas"][fmt] = replica_study(args, traffic, ph, redis)
        finally:
            if redis is not None:
                redis.close()
    if model is not None and args.latency_sample > 0:
        out["latency"] = latency_study(args, model, traffic)
        if args.mix_requests > 0:
            out["mix"] = mix_study(args, model, traffic, out["entry_sizes"], out["latency"])
    out["capacity"] = capacity(out)
    plot(out, Path(args.out).with_name(Path(args.out).stem + "_hit_rate.png"))
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    """Hit rate against cache size: a panel per tier, a line per format, the unbounded cache's rate dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = [t for t in ("memory", "disk", "shared") if any(t in v for v in res["hit_rate"].values())]
    fig, axes = plt.subplots(1, len(tiers), figsize=(5.2 * len(tiers), 4.4), sharey=True, squeeze=False)
    tr = res["traffic"]
    for ax, tier in zip(axes[0], tiers, strict=True):
        for n, fmt in enumerate(FORMATS):
            rows = res["hit_rate"].get(fmt, {}).get(tier, [])
            if rows:
                bpt = res["entry_sizes"]["formats"][fmt]["stored_bytes_per_token"]
                ax.plot(
                    [r["bytes"] for r in rows],
                    [r["hit_rate"] for r in rows],
                    marker="o",
                    color=f"C{n}",
                    label=f"{fmt} ({bpt / 1024:.1f} KiB/token)",
                )
                sizes = [r["bytes"] for r in rows]
        ax.axhline(
            tr["compulsory_hit_rate"],
            color="grey",
            linestyle=":",
            label=f"unbounded cache ({tr['compulsory_hit_rate']:.3f})",
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([size_label(s).replace(" ", "\n") for s in sizes], fontsize=8)
        ax.set_title({"memory": "memory tier (LRU)", "disk": "disk tier", "shared": "shared tier (Redis)"}[tier])
        ax.set_xlabel("cache size")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share of document lookups answered")
    axes[0][0].set_ylim(0, 1)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"{tr['requests']:,} NQ requests (Zipf {res['config']['zipf']:g} over {tr['questions']:,} questions), "
        f"top {res['config']['k']} of {tr['pool_passages']:,} passages by BM25",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def show(res: dict[str, Any]) -> None:
    """Log the results' tables."""
    t = res["traffic"]
    logger.info("%s", res.get("command", ""))
    logger.info(
        "%d requests, %d distinct questions, %d lookups, %d distinct documents (unbounded cache: %.3f)",
        t["requests"],
        t["distinct_questions"],
        t["lookups"],
        t["distinct_documents"],
        t["compulsory_hit_rate"],
    )
    for fmt, v in res["entry_sizes"]["formats"].items():
        logger.info("%-5s %8.0f bytes per token stored", fmt, v["stored_bytes_per_token"])
    for fmt, curves in res["hit_rate"].items():
        for tier in ("memory", "disk", "shared"):
            for r in curves.get(tier, []):
                logger.info(
                    "%-5s %-6s %8s  %6.0f docs  hit rate %.3f (second half %.3f)",
                    fmt,
                    tier,
                    r["label"],
                    r["documents_held"],
                    r["hit_rate"],
                    r["hit_rate_second_half"],
                )
    for fmt, rep in res.get("replicas", {}).items():
        for mem, rows in rep["by_memory"].items():
            for name, row in rows.items():
                logger.info(
                    "%-5s replicas with %s memory each, shared %s, %-7s requests %s, memory hit rate %s, overall %.3f",
                    fmt,
                    mem,
                    rep["shared"],
                    name,
                    " / ".join(str(p["requests"]) for p in row["replicas"]),
                    " / ".join(f"{p['memory_hit_rate']:.3f}" for p in row["replicas"]),
                    row["overall_hit_rate"],
                )
    lat = res.get("latency")
    if lat:
        for arm, s in lat["arms"].items():
            r = lat["ratios"][arm]
            logger.info(
                "%-14s p50 %8.1f ms  p90 %8.1f ms  × bare fp32 %s",
                arm,
                s["p50_ms"],
                s["p90_ms"],
                f"{r['over_bare_fp32']:.3f}" if r["over_bare_fp32"] is not None else "-",
            )
        logger.info(
            "encoding %.0f ms + %.3f ms per missed proxy token, question pass %.0f ms (warm)",
            lat["encoding_fixed_ms"],
            lat["encoding_ms_per_token"],
            lat["question_pass_ms"],
        )
    mix = res.get("mix")
    if mix:
        m, p = mix["measured"], mix["predicted"]
        logger.info(
            "mix of %d requests, memory %s: hit rate %.3f measured, %.3f replayed; mean %.0f ms measured, "
            "%.0f ms by the formula, %.0f ms by the replay; p50 %.0f / %.0f, p90 %.0f / %.0f",
            mix["requests"],
            mix["memory"],
            m["hit_rate"],
            p["hit_rate"],
            m["mean_ms"],
            p["formula_mean_ms"],
            p["replay_mean_ms"],
            m["p50_ms"],
            p["replay_p50_ms"],
            m["p90_ms"],
            p["replay_p90_ms"],
        )


def readable(name: str, value: Any) -> Any:
    """An option's value for the results: sizes as labels."""
    if name.endswith(("sizes", "replica_memory")):
        return [size_label(v) for v in value]
    if name in ("replica_shared", "mix_memory"):
        return size_label(value)
    return value


def sizes_arg(text: str) -> list[int]:
    """Comma-separated sizes (``64MiB,1GiB``) in bytes."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--k", type=int, default=20, help="passages retrieved per request")
    ap.add_argument("--zipf", type=float, default=1.0, help="the popularity exponent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--formats",
        type=lambda s: s.split(","),
        default=list(FORMATS),
        help="formats whose memory tier is replayed",
    )
    ap.add_argument(
        "--store-formats",
        type=lambda s: s.split(","),
        default=["bf16", "k4v2"],
        help="formats whose disk and shared tiers and replicas are replayed too",
    )
    ap.add_argument("--memory-sizes", type=sizes_arg, default=sizes_arg("64MiB,128MiB,256MiB,512MiB,1GiB,2GiB,4GiB"))
    ap.add_argument("--disk-sizes", type=sizes_arg, default=sizes_arg("1GiB,2GiB,4GiB,8GiB,16GiB,32GiB,64GiB"))
    ap.add_argument("--shared-sizes", type=sizes_arg, default=sizes_arg("1GiB,2GiB,4GiB,8GiB,16GiB,32GiB,64GiB"))
    ap.add_argument(
        "--replica-memory",
        type=sizes_arg,
        default=sizes_arg("512MiB,2GiB"),
        help="each replica's memory tier (comma-separated sizes; empty: no replica study)",
    )
    ap.add_argument("--replica-shared", type=parse_size, default=parse_size("16GiB"))
    ap.add_argument("--size-sample", type=int, default=200, help="passages encoded to measure entry sizes")
    ap.add_argument("--sizes-from", default=None, help="read the entry sizes from this results JSON (no model)")
    ap.add_argument("--latency-sample", type=int, default=40, help="requests timed in every arm (0: none)")
    ap.add_argument("--latency-formats", type=lambda s: s.split(","), default=["bf16", "k4v2"])
    ap.add_argument("--mix-requests", type=int, default=120, help="requests of the real mix (0: none)")
    ap.add_argument("--mix-memory", type=parse_size, default=parse_size("512MiB"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--sizes-only", action="store_true", help="measure the formats' entry sizes and stop (no replay, no timing)"
    )
    ap.add_argument("--out", default=str(RESULTS / "cache.json"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run_or_report(Path(args.out), args.report_only, lambda: run(args), (lambda r: None) if args.sizes_only else show)


if __name__ == "__main__":
    main()

"""``rag-opt index``: precompute a corpus's parallel document encodings into the encoding cache's disk tier.

Every row of the input (JSONL: one document per line, a JSON string or an object with ``text`` or
``page_content`` and optionally ``title`` / ``metadata.title``, as ``rag-opt optimize --input`` reads them; other
fields are ignored) is segmented into units exactly as :meth:`rag_opt.ContextOptimizer.optimize` segments a
request's documents (:meth:`~rag_opt.text.units.UnitTable.build` in ``--language``), cut into blocks as
:func:`rag_opt.models.parallel.parallel_prompt` cuts them, and each block's key/value states go through the
document passes of :mod:`rag_opt.models.document_pass` into the disk tier under the key a request computes
(:func:`~rag_opt.models.encoding_cache.block_key`, the one key function both use: the block's token ids, the proxy
model, its dtype, the depth and the parallel template; the shared prefix's entry too, as
:mod:`rag_opt.models.parallel_features` keeps it).
A server (``rag-opt serve --encoding parallel --cache-dir DIR``) or a ``ContextOptimizer(encoding="parallel",
cache=EncodingCache(disk=DIR))`` then reads those documents from the cache: a request costs only its question.

The depths are those the probes a request uses read (the shipped ones for the model by default, ``--probe``
otherwise): the sentence probe's depth, and the document probe's when document relevance is wanted (orderings
other than ``input``). Both come from one forward pass at the deeper one (a layer's states do not depend on the
layers after it). ``--layers N`` indexes that depth only.

Resumable: a block whose encodings are all on disk already is skipped (a rerun does no forward pass). Two indexers
on one folder do not encode the same block twice: each claims a block before encoding it (a claim file, removed when
its entry is written; a dead indexer's claim is taken over), and a row whose block another indexer holds is tried
again at the end of the run, when that entry is usually on disk. ``--cache-format`` must be the server's, and the
folder is bounded by ``--max-bytes`` (least recently used entries evicted). A row that
cannot be indexed (invalid JSON, no text, empty text, not UTF-8) is logged with its line number and the others go
on; the exit status is 0 when every row was indexed (or was already), 1 when some failed.

A document longer than one block (the model's positions, or ``max_window_tokens``, less the question) is indexed
in pieces; at request time its pieces depend on the question's length, so some of them may miss the cache.

``--ray`` runs the document passes on Ray Data (``map_batches`` with :class:`RayIndexer`, one model per actor;
needs the ``ray`` extra: ``pip install -e '.[ray]'`` from the checkout); the cache folder must then be one every
actor can reach.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_opt.cli.cache import byte_size
from rag_opt.cli.common import UserError, add_language_arg, add_model_args, add_title_args, positive_int, title_kwargs
from rag_opt.cli.index_rows import IndexSummary, RowResult, batches, count_rows, parse_row
from rag_opt.errors import RagOptError
from rag_opt.install import install_hint
from rag_opt.models.cache_disk import DEFAULT_DISK_BYTES
from rag_opt.models.kv_codec import DEFAULT_FORMAT, FORMATS
from rag_opt.work import DEFAULT_LIMITS, WorkLimits, check_units, scope

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.parallel import Block

__all__ = ["DocumentIndexer", "IndexSummary", "RowResult", "parse_row", "register", "run_index"]

logger = logging.getLogger("rag_opt.cli.index")

DEFAULT_BATCH = 16  # rows per batch of document passes
_QUESTION = "?"  # what the blocks are cut before (a block's tokens do not depend on the question)


# -- the indexer --------------------------------------------------------------------------------------------------
class DocumentIndexer:
    """Writes documents' parallel encodings into the disk tier at ``cache_dir`` (see the module docstring).

    The proxy model and the probes load as a request's do (a :class:`~rag_opt.ContextOptimizer` with
    ``encoding="parallel"``), so the model name, dtype and depths in the keys are the ones a request computes.
    ``layers``: the depth(s) to index (default: those the probes read, see the module docstring).
    """

    def __init__(
        self,
        cache_dir: str | Path,
        *,
        model: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        probe: str | None = "auto",
        language: str = "en",
        layers: int | Sequence[int] | None = None,
        batch_tokens: int = 6144,
        title_keys: Sequence[str] | None = None,
        title_from_text: bool = True,
        cache_format: str | None = None,
        max_bytes: int | None = None,
        max_units: int | None = DEFAULT_LIMITS.max_units,
        max_proxy_tokens: int | None = DEFAULT_LIMITS.max_proxy_tokens,
    ) -> None:
        from rag_opt.models.cache_disk import DEFAULT_DISK_BYTES, DiskTier
        from rag_opt.models.encoding_cache import EncodingCache
        from rag_opt.models.parallel import prefix_tokens
        from rag_opt.models.parallel_features import block_limit
        from rag_opt.pipeline import ContextOptimizer

        # the disk tier only (nothing kept in memory), written inline: a write-behind queue that is full skips a
        # write, which would leave a document out of the index
        self.disk = DiskTier(cache_dir, max_bytes=max_bytes or DEFAULT_DISK_BYTES, write_behind=False)
        self.cache: EncodingCache = EncodingCache(0, disk=self.disk, format=cache_format)
        self._held: set[str] = set()  # claims this indexer holds (blocks it encodes now)
        self.deferred: list[tuple[int, dict[str, Any]]] = []  # rows whose blocks another indexer was encoding
        titles: dict[str, Any] = {"title_from_text": title_from_text}
        if title_keys is not None:
            titles["title_keys"] = title_keys
        optimizer = ContextOptimizer(
            model=model,
            device=device,
            dtype=dtype,
            probe=probe,
            language=language,
            encoding="parallel",
            cache=None,
            **titles,
        )
        self.language = optimizer.language
        self.title_keys, self.title_from_text = optimizer.title_keys, optimizer.title_from_text
        scorer = optimizer.scorer()  # loads the model and resolves the probes as a request does
        proxy = getattr(scorer, "proxy", None)
        layers_of = getattr(scorer, "layers", None)
        if proxy is None or layers_of is None:  # pragma: no cover - the default scorer is the Sentinel scorer
            raise UserError("rag-opt index needs the proxy model's scorer")
        self.proxy = proxy
        self.cross = bool(getattr(scorer, "cross", False))  # the sentence probe reads the cross-document reading
        if layers is not None:
            depths = {int(layers)} if isinstance(layers, int) else {int(n) for n in layers}
            if not depths or not all(1 <= n <= proxy.num_layers for n in depths):
                raise UserError(f"--layers must be in 1..{proxy.num_layers} for {proxy.name}, got {layers}")
        else:  # the sentence probe's depth, and the document probe's (orderings that need document relevance)
            depths = {int(layers_of(documents=False)), int(layers_of(documents=True))}
        self.depths = sorted(depths)
        self.batch_tokens = batch_tokens
        self.prefix = tuple(prefix_tokens(proxy.tokenizer))
        # as a request cuts documents (the limit does not depend on the question)
        max_tokens = int(getattr(scorer, "max_tokens", optimizer.max_window_tokens))
        self.block_limit = block_limit(proxy, max_tokens)
        self.split_documents = 0  # documents indexed in more than one block
        # the server's limits, per row: a row past them is that row's error (it would never be read from the cache
        # by a server with the same limits), checked before any model work, and the other rows are written
        self.limits = WorkLimits(max_units=max_units, max_proxy_tokens=max_proxy_tokens)

    def key(self, ids: Sequence[int], depth: int, kind: str = "block") -> str:
        """The cache key a request computes for ``ids`` at ``depth``: :func:`~rag_opt.models.encoding_cache.block_key`,
        the one function :func:`rag_opt.models.parallel_features.extract_parallel` keys its blocks with too."""
        from rag_opt.models.encoding_cache import block_key

        return block_key(ids, self.proxy, depth=depth, kind=kind)

    def blocks(self, document: dict[str, Any]) -> list[Block]:
        """``document``'s blocks, segmented and cut as at request time."""
        from rag_opt.inputs import check_documents
        from rag_opt.models.parallel import parallel_prompt
        from rag_opt.text.units import UnitTable

        docs = check_documents([document])
        units = UnitTable.build(  # unit texts need no token counts
            docs, _uncounted, self.language, title_keys=self.title_keys, title_from_text=self.title_from_text
        ).by_document()
        with scope(limits=self.limits, progress=False):
            check_units(sum(len(u) for u in units))
            prompt = parallel_prompt(self.proxy.tokenizer, units, _QUESTION, max_block_tokens=self.block_limit)
        if len(prompt.blocks) > 1:
            self.split_documents += 1
        return list(prompt.blocks)

    def _done(self, ids: Sequence[int], kind: str = "block", ends: Sequence[int] | None = None) -> bool:
        """Whether ``ids``' entries are in the cache at every depth (with the cross reading, a block's source queries
        too: ``ends``, its units' last tokens, are part of their key)."""
        from rag_opt.models.encoding_cache import sources_kind

        kinds = (kind, sources_kind(ends)) if self.cross and kind == "block" and ends is not None else (kind,)
        return all(self.key(ids, d, k) in self.cache for d in self.depths for k in kinds)

    def _claim(self, block: Block) -> bool:
        """Claim ``block`` for this indexer in the disk folder (False: another indexer is encoding it now)."""
        ck = self.cache.store_key(self.key(block.ids, self.depths[-1], "block"))
        if ck in self._held or self.disk.claim(ck):
            self._held.add(ck)
            return True
        return False

    def release(self) -> None:
        """Release every claim this indexer holds (after its entries are written, or on failure)."""
        for ck in self._held:
            self.disk.release(ck)
        self._held.clear()

    def close(self) -> None:
        """Write what is pending, release the claims and the folder."""
        self.release()
        if not self.cache.flush(600):
            logger.error("the encoding cache's disk tier did not finish writing within 10 minutes")
        self.cache.close()

    def index_rows(self, rows: Sequence[tuple[int, dict[str, Any]]], *, defer: bool = True) -> list[RowResult]:
        """Index ``(line, document)`` rows: their missing blocks in shared document passes; one result per row (a
        row whose blocks another indexer holds is deferred: :attr:`deferred`, no result yet; ``defer=False``
        encodes it anyway)."""
        from rag_opt.models.document_pass import encode_blocks, encode_blocks_with_sources
        from rag_opt.models.encoding_cache import sources_kind

        out: dict[int, RowResult] = {}
        pending: dict[int, int] = {}  # row -> how many blocks it adds to the passes (a shared one counts once)
        todo: dict[tuple[tuple[int, ...], tuple[int, ...]], Block] = {}  # distinct (tokens, unit ends), in order
        for line, document in rows:
            try:
                missing = {(b.ids, b.ends): b for b in self.blocks(document) if not self._done(b.ids, ends=b.ends)}
            except (RagOptError, ValueError, TypeError) as exc:
                out[line] = RowResult(line, "failed", f"line {line}: {exc}")
                continue
            if not missing:
                out[line] = RowResult(line, "cached")
                continue
            # two indexers on one folder: a block another one is encoding now is left to it (the row is tried again
            # at the end of the run, when that entry is usually on disk)
            held_elsewhere = [k for k, b in missing.items() if k not in todo and not self._claim(b)]
            if held_elsewhere and defer:
                self.deferred.append((line, document))  # the claims it took are released below
                continue
            pending[line] = sum(k not in todo for k in missing)
            todo.update(missing)
        try:
            if todo:
                top = self.depths[-1]
                blocks = list(todo.values())
                if self.cross:  # the probe reads the cross-document reading: each block's source queries too
                    prefix_states, states, queries = encode_blocks_with_sources(
                        self.proxy,
                        self.prefix,
                        [b.ids for b in blocks],
                        [b.ends for b in blocks],
                        top,
                        batch_tokens=self.batch_tokens,
                    )
                    for b, q in zip(blocks, queries, strict=True):
                        self._put(b.ids, q, sources_kind(b.ends))
                else:
                    prefix_states, states = encode_blocks(
                        self.proxy, self.prefix, [b.ids for b in blocks], top, batch_tokens=self.batch_tokens
                    )
                for b, s in zip(blocks, states, strict=True):
                    self._put(b.ids, s, "block")
                self._put(self.prefix, prefix_states, "prefix")
            elif not self._done(self.prefix, "prefix"):  # every block is cached, the prefix is not: its own pass
                _, (prefix_states,) = encode_blocks(
                    self.proxy, [], [self.prefix], self.depths[-1], batch_tokens=self.batch_tokens
                )
                self._put(self.prefix, prefix_states, "prefix")
        except (RagOptError, RuntimeError, ValueError, OSError) as exc:
            for line in pending:
                out[line] = RowResult(line, "failed", f"line {line}: the document pass failed ({exc})")
            pending = {}
        finally:
            self.release()
        for line, new in pending.items():
            out[line] = RowResult(line, "indexed", blocks=new)
        deferred = {line for line, _ in self.deferred}
        return [out[line] for line, _ in rows if line in out or line not in deferred]

    def _put(self, ids: Sequence[int], states: Any, kind: str) -> None:
        """Keep ``states`` (``(2, depth, kv_heads, tokens, head_dim)`` at the deepest depth; source queries
        ``(depth, heads, sources, head_dim)``) under each depth's key: a shallower depth's are the first layers of a
        deeper pass's."""
        top = self.depths[-1]
        for d in self.depths:
            key = self.key(ids, d, kind)
            if key not in self.cache:
                first = states[:d] if kind.startswith("sources") else states[:, :d]
                self.cache.put(key, states if d == top else first.contiguous())


def _uncounted(text: str) -> int:
    return 0


# -- running ------------------------------------------------------------------------------------------------------
def run_index(
    input: str,
    cache_dir: str | Path,
    *,
    batch: int = DEFAULT_BATCH,
    progress: bool = True,
    ray: bool = False,
    ray_address: str | None = None,
    actors: int = 1,
    cpus_per_actor: float = 1.0,
    **options: Any,
) -> IndexSummary:
    """Index every row of ``input`` into the disk tier at ``cache_dir`` (``options``: :class:`DocumentIndexer`'s);
    bad rows are logged with their line number and counted, never raised."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    if input != "-" and not Path(input).is_file():
        raise UserError(f"input file not found: {input}")
    name = "<stdin>" if input == "-" else input
    t0 = time.perf_counter()
    summary = IndexSummary()
    with logging_redirect_tqdm(), tqdm(total=count_rows(input), unit="doc", disable=not progress) as bar:

        def tally(results: Sequence[RowResult]) -> None:
            for r in results:
                if r.status == "failed":
                    logger.error("%s, %s", name, r.error)
                summary.add(r)
            bar.update(len(results))

        if ray:
            from rag_opt.cli.index_ray import run_on_ray

            run_on_ray(input, cache_dir, batch, tally, ray_address, actors, cpus_per_actor, options, DocumentIndexer)
        else:
            indexer = DocumentIndexer(cache_dir, **options)
            failed: list[RowResult] = []
            for rows in batches(input, batch, failed):
                tally(failed)
                failed.clear()
                tally(indexer.index_rows(rows))
            tally(failed)
            if indexer.deferred:  # rows another indexer was encoding: read from its entries now, or encoded
                again, indexer.deferred = indexer.deferred, []
                tally(indexer.index_rows(again, defer=False))
            indexer.close()
            st = indexer.disk.stats()
            if st.errors or st.skipped:
                logger.error(
                    "the disk tier at %s failed %d writes and skipped %d: those documents are not indexed (see the "
                    "warnings above)",
                    cache_dir,
                    st.errors,
                    st.skipped,
                )
            if st.evictions:
                logger.warning(
                    "%d entries were evicted: the corpus is larger than the disk tier's bound (--max-bytes)",
                    st.evictions,
                )
            if indexer.split_documents:
                logger.info(
                    "%d documents are longer than one block (%d proxy tokens) and were indexed in pieces, as requests "
                    "cut them",
                    indexer.split_documents,
                    indexer.block_limit,
                )
    summary.seconds = time.perf_counter() - t0
    if summary.indexed + summary.cached + summary.failed == 0:
        raise UserError(f"{name} holds no documents")
    return summary


# -- the command --------------------------------------------------------------------------------------------------
def register(sub: Any) -> None:
    p = sub.add_parser(
        "index",
        help="precompute a corpus's parallel document encodings into the encoding cache (resumable)",
        description="Encode every document of a JSONL corpus (one document per line: a string or "
        "{'text', 'title'?}) with parallel encoding into the encoding cache's disk tier, so that later requests "
        "(rag-opt serve --encoding parallel --cache-dir DIR, or ContextOptimizer(encoding='parallel', "
        "cache=EncodingCache(disk=DIR))) read them from the cache. Documents already there are skipped; a bad row "
        "is reported with its line number and the others go on (exit status 1 if any failed).",
    )
    p.add_argument("--input", "-i", required=True, help="documents as JSONL ({'text', 'title'?} per line); - for stdin")
    p.add_argument("--cache-dir", required=True, help="the encoding cache's disk folder (created if absent)")
    add_model_args(p)
    p.add_argument(
        "--probe",
        default="auto",
        help="the probe the requests use: 'auto' (shipped), a JSON path or 'none'; it sets the depth (default: auto)",
    )
    p.add_argument(
        "--layers",
        type=positive_int,
        help="index at this depth only (default: the depths the probes read at request time)",
    )
    add_language_arg(p)
    add_title_args(p)  # as the requests read titles: a heading line read as a title changes the document's blocks
    p.add_argument(
        "--batch", type=positive_int, default=DEFAULT_BATCH, help=f"rows per batch (default {DEFAULT_BATCH})"
    )
    p.add_argument(
        "--cache-format",
        choices=list(FORMATS),
        default=DEFAULT_FORMAT,
        help=f"how entries are stored; the server's --cache-format must match (default {DEFAULT_FORMAT})",
    )
    p.add_argument(
        "--max-bytes",
        type=byte_size,
        default=DEFAULT_DISK_BYTES,
        help="the disk tier's bound (e.g. 20GiB; least recently used evicted; default 8GiB): the server's "
        "--cache-disk-bytes should match",
    )
    p.add_argument(
        "--max-units",
        type=positive_int,
        default=DEFAULT_LIMITS.max_units,
        help="a row with more units (sentences, titles, ...) is that row's error; the server's --max-units (default "
        f"{DEFAULT_LIMITS.max_units})",
    )
    p.add_argument(
        "--max-proxy-tokens",
        type=positive_int,
        default=DEFAULT_LIMITS.max_proxy_tokens,
        help="a row with more proxy-model tokens is that row's error, before any model work; the server's "
        f"--max-proxy-tokens (default {DEFAULT_LIMITS.max_proxy_tokens})",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    p.add_argument("--ray", action="store_true", help="run on Ray Data (needs the ray extra)")
    p.add_argument("--ray-address", help="with --ray: a running Ray cluster (default: a local Ray)")
    p.add_argument("--actors", type=positive_int, default=1, help="with --ray: indexer actors, one model each")
    p.add_argument("--cpus-per-actor", type=float, default=1.0, help="with --ray: CPUs reserved per actor")
    p.set_defaults(handler=_index)


def _index(args: argparse.Namespace) -> int:
    if args.ray and importlib.util.find_spec("ray") is None:
        raise UserError(f"rag-opt index --ray needs the ray extra: {install_hint('ray')}")
    cache_dir = Path(args.cache_dir).expanduser()
    if cache_dir.exists() and not cache_dir.is_dir():
        raise UserError(f"--cache-dir {args.cache_dir} exists and is not a folder")
    summary = run_index(
        args.input,
        cache_dir,
        batch=args.batch,
        progress=args.progress,
        ray=args.ray,
        ray_address=args.ray_address,
        actors=args.actors,
        cpus_per_actor=args.cpus_per_actor,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        probe=None if args.probe == "none" else args.probe,
        language=args.language,
        layers=args.layers,
        cache_format=args.cache_format,
        max_bytes=args.max_bytes,
        max_units=args.max_units,
        max_proxy_tokens=args.max_proxy_tokens,
        **title_kwargs(args),
    )
    print(summary.line(cache_dir))
    return 1 if summary.failed else 0

"""On-disk cache of raw attention features, so that training a probe never recomputes a forward pass.

Features are stored in shards (``shard-00000.npz``, plain numpy arrays, no pickle) under
``<root>/<model>/<dataset>/``; each shard holds many examples keyed by id. Extraction is resumable: ids already
cached are skipped, so a long background run can be stopped and restarted. Several extraction processes may
write to one cache at once: each shard is written under a temporary name and then claimed atomically under a
free shard name, so no writer overwrites another's shard and readers never see a partial one.

Cross-document attention (``AttentionFeatures.cross``, extracted with ``cross=True``) is stored when every
example of a shard has it; a probe that reads it needs a cache extracted that way (by convention, a dataset name
ending in ``-cross``: see :func:`rag_opt.training.sentence_probe.feature_store`).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rag_opt.models.extract import AttentionFeatures

__all__ = ["CachedExample", "FeatureCache", "FeatureStore", "fill_cache", "precision_tag"]

logger = logging.getLogger(__name__)


@dataclass
class CachedExample:
    id: str
    features: AttentionFeatures


class FeatureCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def shards(self) -> list[Path]:
        return sorted(self.root.glob("shard-*.npz"))

    def ids(self) -> set[str]:
        out: set[str] = set()
        for shard in self.shards():
            with np.load(shard, allow_pickle=False) as z:
                out.update(str(x) for x in z["ids"])
        return out

    def load(self, ids: Iterable[str] | None = None) -> dict[str, AttentionFeatures]:
        wanted = set(ids) if ids is not None else None
        out: dict[str, AttentionFeatures] = {}
        for shard in self.shards():
            with np.load(shard, allow_pickle=False) as z:
                uo, do = z["unit_offsets"], z["doc_offsets"]
                unit, mass, toks, ctx, win = (
                    z["unit"],
                    z["doc_mass"],
                    z["unit_tokens"],
                    z["ctx"],
                    z["windows"],
                )
                cross = z["cross"] if "cross" in z.files else None
                sources = z["cross_sources"] if "cross_sources" in z.files else None
                for i, ex_id in enumerate(z["ids"]):
                    key = str(ex_id)
                    if wanted is not None and key not in wanted:
                        continue
                    a, b = uo[i], uo[i + 1]
                    out[key] = AttentionFeatures(
                        unit=unit[a:b].astype(np.float32),
                        doc_mass=mass[do[i] : do[i + 1]].astype(np.float32),
                        unit_tokens=toks[a:b],
                        context_tokens=int(ctx[i]),
                        windows=int(win[i]),
                        cross=None if cross is None else cross[a:b].astype(np.float32),
                        cross_sources=None if sources is None else sources[a:b],
                    )
        return out

    def write_shard(self, items: Sequence[CachedExample]) -> Path:
        """Write ``items`` as a new shard and return its path; never overwrites another writer's shard.

        The shard is written to a temporary file of its own, then claimed under the first free
        ``shard-NNNNN.npz`` name with a hard link, which fails instead of replacing a name another process has
        just claimed (readers only ever see complete shards). Where hard links are not supported, the name is
        claimed under a file lock instead.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        uo = np.cumsum([0] + [it.features.unit.shape[0] for it in items])
        do = np.cumsum([0] + [it.features.doc_mass.shape[0] for it in items])
        arrays: dict[str, np.ndarray] = {
            "ids": np.array([it.id for it in items]),
            "unit": np.concatenate([it.features.unit for it in items]).astype(np.float16),
            "doc_mass": np.concatenate([it.features.doc_mass for it in items]).astype(np.float16),
            "unit_tokens": np.concatenate([it.features.unit_tokens for it in items]),
            "unit_offsets": uo,
            "doc_offsets": do,
            "ctx": np.array([it.features.context_tokens for it in items]),
            "windows": np.array([it.features.windows for it in items]),
        }
        cross = [it.features.cross for it in items]
        sources = [it.features.cross_sources for it in items]
        if any(c is not None for c in cross) and not all(c is not None for c in cross):
            raise ValueError("a shard mixes examples with and without cross-document attention")
        if items and cross[0] is not None:
            arrays["cross"] = np.concatenate([c for c in cross if c is not None]).astype(np.float16)
            arrays["cross_sources"] = np.concatenate([n for n in sources if n is not None])
        tmp = self.root / f"tmp-shard-{uuid.uuid4().hex}.npz"  # this writer's own name (not matched by shards())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, allow_pickle=False, **arrays)
                fh.flush()
                os.fsync(fh.fileno())
            return self._claim(tmp)
        finally:
            tmp.unlink(missing_ok=True)

    def _claim(self, tmp: Path) -> Path:
        """Give the finished file ``tmp`` the first free shard name, atomically (see :meth:`write_shard`)."""
        n = len(self.shards())
        while True:
            path = self.root / f"shard-{n:05d}.npz"
            try:
                os.link(tmp, path)  # atomic; FileExistsError when the name is taken
                return path
            except FileExistsError:
                n += 1
            except OSError as exc:  # no hard links on this filesystem: claim the name under a lock
                logger.debug("hard link failed in %s (%s); claiming the shard name under a file lock", self.root, exc)
                return self._claim_locked(tmp, n)

    def _claim_locked(self, tmp: Path, n: int) -> Path:
        from filelock import FileLock

        with FileLock(str(self.root / ".shards.lock")):
            path = self.root / f"shard-{n:05d}.npz"
            while path.exists():
                n += 1
                path = self.root / f"shard-{n:05d}.npz"
            os.replace(tmp, path)
            return path


_TAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8"}


def precision_tag(dtype: str) -> str:
    """Short name of a proxy precision in cache names (``bfloat16`` → ``bf16``)."""
    name = dtype.removeprefix("torch.")
    if name not in _TAGS:
        raise ValueError(f"unknown precision {dtype!r}; use one of {list(_TAGS)}")
    return _TAGS[name]


@dataclass(frozen=True)
class FeatureStore:
    """Every cache of one dataset's features at one precision, whatever depth it was extracted to.

    Caches are folders ``<folder>/<base>-<precision>-L<layers>`` (see :func:`precision_tag`); a cache extracted
    with more layers serves a probe that reads fewer (early exit leaves the first layers unchanged), so
    :meth:`load` merges all caches with at least ``layers`` layers, and extraction writes only what none has.
    ``num_layers``: the model's depth (a cache named ``<base>-<precision>`` without ``-L`` holds all of them).
    """

    folder: Path
    base: str
    precision: str
    layers: int
    num_layers: int

    @property
    def target(self) -> FeatureCache:
        """Where new features of this store are written."""
        return FeatureCache(self.folder / f"{self.base}-{precision_tag(self.precision)}-L{self.layers}")

    def caches(self) -> list[FeatureCache]:
        """The caches deep enough for ``layers``, deepest first (for a base without ``-cross``, its ``-cross``
        caches too: they hold the same features and more)."""
        # a "<base>-cross" cache holds every feature of "<base>" too (and the cross-document ones): it serves both
        cross = "" if self.base.endswith("-cross") else r"(?:-cross)?"
        pat = re.compile(
            re.escape(self.base) + cross + re.escape(f"-{precision_tag(self.precision)}") + r"(?:-L(\d+))?"
        )
        found: list[tuple[int, FeatureCache]] = []
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                m = pat.fullmatch(path.name)
                depth = int(m.group(1)) if m and m.group(1) else self.num_layers
                if m and path.is_dir() and depth >= self.layers:
                    found.append((depth, FeatureCache(path)))
        return [c for _, c in sorted(found, key=lambda t: -t[0])]

    def ids(self) -> set[str]:
        return set().union(*(c.ids() for c in self.caches()))

    def load(self, ids: Iterable[str] | None = None) -> dict[str, AttentionFeatures]:
        """Features of ``ids`` (all when None), each cut to the store's ``layers``."""
        wanted = list(ids) if ids is not None else None
        out: dict[str, AttentionFeatures] = {}
        for cache in self.caches():
            for key, feats in cache.load(wanted).items():
                out.setdefault(key, feats.first_layers(self.layers))
        return out


def fill_cache(
    cache: FeatureCache | FeatureStore,
    examples: Sequence[tuple[str, Sequence[Sequence[str]], str]],
    compute: Callable[[list[tuple[Sequence[Sequence[str]], str]]], list[AttentionFeatures]],
    *,
    shard_size: int = 25,
    progress: bool = True,
    desc: str = "attention features",
) -> int:
    """Compute and cache features for (id, docs-as-units, question) examples not cached yet (in a
    :class:`FeatureStore`: in none of its caches; new ones go to its :attr:`~FeatureStore.target`).

    ``compute`` takes a shard's ``(docs, question)`` contexts at once (so their forward passes can be batched)
    and returns their features in order. Returns the number of examples computed.
    """
    from tqdm.auto import tqdm

    done = cache.ids()
    if isinstance(cache, FeatureStore):
        cache = cache.target
    todo = [ex for ex in examples if ex[0] not in done]
    logger.info("%d of %d examples already cached for %s", len(examples) - len(todo), len(examples), cache.root)
    with tqdm(total=len(todo), desc=desc, disable=not progress, mininterval=5.0) as bar:
        for a in range(0, len(todo), shard_size):
            part = todo[a : a + shard_size]
            feats = compute([(docs, question) for _, docs, question in part])
            if len(feats) != len(part):
                raise RuntimeError(f"feature computation returned {len(feats)} results for {len(part)} contexts")
            cache.write_shard([CachedExample(ex_id, f) for (ex_id, _, _), f in zip(part, feats, strict=True)])
            bar.update(len(part))
    return len(todo)

"""On-disk cache of raw attention features, so that training a probe never recomputes a forward pass.

Features are stored in shards (``shard-00000.npz``, plain numpy arrays, no pickle) under
``<root>/<model>/<dataset>/``; each shard holds many examples keyed by id. Extraction is resumable: ids already
cached are skipped, so a long background run can be stopped and restarted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rag_opt.models.extract import AttentionFeatures

__all__ = ["CachedExample", "FeatureCache", "fill_cache"]

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
                for i, ex_id in enumerate(z["ids"]):
                    key = str(ex_id)
                    if wanted is not None and key not in wanted:
                        continue
                    out[key] = AttentionFeatures(
                        unit=unit[uo[i] : uo[i + 1]].astype(np.float32),
                        doc_mass=mass[do[i] : do[i + 1]].astype(np.float32),
                        unit_tokens=toks[uo[i] : uo[i + 1]],
                        context_tokens=int(ctx[i]),
                        windows=int(win[i]),
                    )
        return out

    def write_shard(self, items: Sequence[CachedExample]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        n = len(self.shards())
        path = self.root / f"shard-{n:05d}.npz"
        while path.exists():
            n += 1
            path = self.root / f"shard-{n:05d}.npz"
        uo = np.cumsum([0] + [it.features.unit.shape[0] for it in items])
        do = np.cumsum([0] + [it.features.doc_mass.shape[0] for it in items])
        tmp = path.with_suffix(".tmp.npz")
        np.savez(
            tmp,
            ids=np.array([it.id for it in items]),
            unit=np.concatenate([it.features.unit for it in items]).astype(np.float16),
            doc_mass=np.concatenate([it.features.doc_mass for it in items]).astype(np.float16),
            unit_tokens=np.concatenate([it.features.unit_tokens for it in items]),
            unit_offsets=uo,
            doc_offsets=do,
            ctx=np.array([it.features.context_tokens for it in items]),
            windows=np.array([it.features.windows for it in items]),
        )
        os.replace(tmp, path)
        return path


def fill_cache(
    cache: FeatureCache,
    examples: Sequence[tuple[str, Sequence[Sequence[str]], str]],
    compute: Callable[[Sequence[Sequence[str]], str], AttentionFeatures],
    *,
    shard_size: int = 25,
    progress: bool = True,
    desc: str = "attention features",
) -> int:
    """Compute and cache features for (id, docs-as-units, question) examples not cached yet.

    Returns the number of examples computed.
    """
    from tqdm.auto import tqdm

    done = cache.ids()
    todo = [ex for ex in examples if ex[0] not in done]
    logger.info("%d of %d examples already cached in %s", len(examples) - len(todo), len(examples), cache.root)
    pending: list[CachedExample] = []
    for ex_id, docs, question in tqdm(todo, desc=desc, disable=not progress, mininterval=5.0):
        pending.append(CachedExample(ex_id, compute(docs, question)))
        if len(pending) >= shard_size:
            cache.write_shard(pending)
            pending = []
    if pending:
        cache.write_shard(pending)
    return len(todo)

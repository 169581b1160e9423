"""``rag-opt index --ray``: the rows indexed by a pool of Ray actors (``Dataset.map_batches``), one
:class:`~rag_opt.cli.index.DocumentIndexer` (one model) each, writing into the same disk tier. The indexer's
class is passed in (``indexer``), so this module does not import the command's."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rag_opt.cli.index_rows import RowResult, batches

__all__ = ["RayIndexer", "run_on_ray"]


class RayIndexer:
    """The callable class of ``rag-opt index --ray`` for ``Dataset.map_batches``: one indexer
    (:class:`~rag_opt.cli.index.DocumentIndexer`, one model) per actor; a batch of ``line`` and ``record`` (the
    parsed document as JSON text) columns in, ``line``, ``status``, ``error`` and ``blocks`` out."""

    def __init__(self, indexer: Callable[..., Any], cache_dir: str, **options: Any) -> None:
        self.indexer = indexer(cache_dir, **options)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        rows = [(int(n), json.loads(str(r))) for n, r in zip(batch["line"], batch["record"], strict=True)]
        results = self.indexer.index_rows(rows, defer=False)  # (written inline: nothing left to flush)
        return {
            "line": [r.line for r in results],
            "status": [r.status for r in results],
            "error": [r.error or "" for r in results],
            "blocks": [r.blocks for r in results],
        }


def run_on_ray(
    input: str,
    cache_dir: str | Path,
    batch: int,
    tally: Callable[[Sequence[RowResult]], None],
    ray_address: str | None,
    actors: int,
    cpus_per_actor: float,
    options: dict[str, Any],
    indexer: Callable[..., Any],
) -> None:  # pragma: no cover - needs the ray extra (tests skip without it)
    import ray
    import ray.data

    failed: list[RowResult] = []
    items = [
        {"line": line, "record": json.dumps(doc, ensure_ascii=False)}
        for rows in batches(input, batch, failed)
        for line, doc in rows
    ]
    tally(failed)
    if not items:
        return
    started = not ray.is_initialized()  # a Ray this process already runs is used, and left running
    if started:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    try:
        ds: Any = ray.data.from_items(items)
        ds = ds.map_batches(
            RayIndexer,
            fn_constructor_kwargs={"indexer": indexer, "cache_dir": str(Path(cache_dir).resolve()), **options},
            batch_size=batch,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=cpus_per_actor,
        )
        for out in ds.iter_batches(batch_size=None, batch_format="numpy"):
            tally(
                [
                    RowResult(int(n), str(s), str(e) or None, int(b))  # type: ignore[arg-type]
                    for n, s, e, b in zip(out["line"], out["status"], out["error"], out["blocks"], strict=True)
                ]
            )
    finally:
        if started:
            ray.shutdown()

"""Batch optimization at scale on Ray Data: a callable class for ``Dataset.map_batches`` and a resumable job.

:class:`BatchOptimizer` follows Ray's callable-class pattern: a :class:`~rag_opt.ContextOptimizer` holds a loaded
model and is not picklable, so each actor builds its own once (in ``__init__``) and reuses it for every batch::

    import ray
    from rag_opt.batch import BatchOptimizer

    ds = ray.data.read_parquet("rows.parquet")  # columns: question, documents (+ any others, passed through)
    out = ds.map_batches(BatchOptimizer, fn_constructor_kwargs={"ratio": 0.33}, batch_format="pyarrow",
                         concurrency=4, num_cpus=1)

Each output row gets ``context`` (the optimized context), ``documents_json`` (the kept documents as a JSON list:
id, index, title, text, metadata, score, raw_score, retriever_score, kept_spans, tokens_before, tokens_after),
``tokens_before``, ``tokens_after`` and ``error``: a row that cannot be optimized gets its error message there
(and nulls in the other output columns) and the job goes on. Every row is optimized exactly as
``ContextOptimizer(...).optimize(question, documents)`` would.

:func:`run_batch` (``rag-opt batch``) is the job around it: it reads JSONL or Parquet rows, runs them on a local
Ray or a cluster, and writes the output as a folder of Parquet parts (``part-00000.parquet``, ...), each part a
fixed range of input rows written atomically once all its rows are done; a rerun skips the parts already written.

Needs the ``ray`` extra (``pip install -e '.[ray]'`` from the checkout: Ray Data, with pyarrow).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module

__all__ = ["MANIFEST", "OUTPUT_COLUMNS", "BatchOptimizer", "BatchSummary", "read_rows", "run_batch", "summary_dict"]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.batch.job import MANIFEST, BatchSummary, read_rows, run_batch, summary_dict
    from rag_opt.batch.optimizer import OUTPUT_COLUMNS, BatchOptimizer

__getattr__, __dir__ = lazy_module(
    __name__,
    {
        "OUTPUT_COLUMNS": "rag_opt.batch.optimizer",
        "BatchOptimizer": "rag_opt.batch.optimizer",
        **{n: "rag_opt.batch.job" for n in ("MANIFEST", "BatchSummary", "read_rows", "run_batch", "summary_dict")},
    },
)

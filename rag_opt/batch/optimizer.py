"""The callable class for Ray Data's ``Dataset.map_batches``: one optimizer per actor, a batch of rows in, the
optimized rows out (see :mod:`rag_opt.batch`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rag_opt.errors import ConfigurationError, InvalidInputError, RagOptError
from rag_opt.install import install_hint

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

    from rag_opt.types import OptimizeResult

__all__ = ["OUTPUT_COLUMNS", "BatchOptimizer", "pyarrow_module"]

logger = logging.getLogger(__name__)

OUTPUT_COLUMNS = ("context", "documents_json", "tokens_before", "tokens_after", "error")


def pyarrow_module() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ConfigurationError(f"batch optimization needs the ray extra: {install_hint('ray')}") from None
    return pyarrow


class BatchOptimizer:
    """Optimizes a batch of rows (``question`` and ``documents`` columns); for ``Dataset.map_batches``.

    Args:
        preload: load the proxy model in the constructor (once per Ray actor), not on the first batch.
        **options: the optimizer's options by name (:class:`~rag_opt.options.OptimizerOptions`: the budget,
            ``ordering``, ``language``, ``target``, ``model``, ``device``, ...; an unknown name raises
            :class:`~rag_opt.errors.InvalidInputError` naming the closest). They must be picklable: Ray sends them to
            each actor.

    A batch is a ``pyarrow.Table`` (``batch_format="pyarrow"``, recommended), a ``pandas.DataFrame`` or a dict of
    arrays; the result is a ``pyarrow.Table``: the input columns (passed through) and :data:`OUTPUT_COLUMNS`.
    ``documents`` is, per row, a list of strings or of ``{text, id?, title?, metadata?, score?}`` objects, or
    that list as a JSON string (for rows whose document shapes differ: an Arrow column holds one type). A row
    that arrives with a non-null ``error`` is passed through untouched (an earlier stage already rejected it).
    """

    def __init__(self, *, preload: bool = True, **options: Any) -> None:
        from rag_opt.pipeline import ContextOptimizer

        self.optimizer = ContextOptimizer(**options)
        if preload and self.optimizer.budget.compresses:
            self.optimizer.scorer()  # the model loads here, once per actor

    def __call__(self, batch: Any) -> pa.Table:
        pa = pyarrow_module()
        table = _as_table(batch)
        n = table.num_rows
        questions = _column(table, "question", n)
        documents = _column(table, "documents", n)
        errors_in = _column(table, "error", n)
        out: dict[str, list[Any]] = {c: [] for c in OUTPUT_COLUMNS}
        for row in self._optimize_rows(questions, documents, errors_in):
            for c in OUTPUT_COLUMNS:
                out[c].append(row.get(c))
        types = {"tokens_before": pa.int64(), "tokens_after": pa.int64()}
        for c in OUTPUT_COLUMNS:
            col = pa.array(out[c], type=types.get(c, pa.string()))
            if c in table.column_names:
                table = table.set_column(table.column_names.index(c), c, col)
            else:
                table = table.append_column(c, col)
        return table

    def _optimize_rows(self, questions: list[Any], documents: list[Any], errors: list[Any]) -> list[dict[str, Any]]:
        """The batch's valid rows through one ``optimize_batch`` (shared forward passes); when that fails (one
        bad row fails the call), row by row, so each row gets its own result or error."""
        rows: list[dict[str, Any]] = []
        todo: list[tuple[int, str, list[Any]]] = []
        for i, (question, docs, error) in enumerate(zip(questions, documents, errors, strict=True)):
            if error is not None:
                rows.append({"error": error})
                continue
            try:
                todo.append((i, *_parse_row(question, docs)))
            except RagOptError as exc:
                rows.append({"error": str(exc)})
                continue
            rows.append({})
        if todo:
            try:
                results = self.optimizer.optimize_batch([q for _, q, _ in todo], [d for _, _, d in todo])
            except Exception:  # one bad row fails the batch: row by row
                for i, q, d in todo:
                    rows[i] = _optimize_row(self.optimizer, q, d)
            else:
                for (i, _, _), result in zip(todo, results, strict=True):
                    rows[i] = _row_output(result)
        return rows


def _parse_row(question: Any, documents: Any) -> tuple[Any, Any]:
    if question is None:
        raise InvalidInputError("the row has no question")
    if documents is None:
        raise InvalidInputError("the row has no documents")
    if isinstance(documents, str):
        try:
            documents = json.loads(documents)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"documents is not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(documents, list):
            raise InvalidInputError(f"documents must be a JSON list, got {type(documents).__name__}")
    return question, documents


def _as_table(batch: Any) -> pa.Table:
    pa = pyarrow_module()
    if isinstance(batch, pa.Table):
        return batch
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas.DataFrame
        return pa.Table.from_pydict({c: _plain(batch[c].tolist()) for c in batch.columns})
    if isinstance(batch, Mapping):  # Ray's numpy batch format: column -> array
        return pa.Table.from_pydict({c: _plain(list(v)) for c, v in batch.items()})
    raise InvalidInputError(f"a batch must be a pyarrow Table, a pandas DataFrame or a dict of columns, got {batch!r}")


def _plain(values: list[Any]) -> list[Any]:
    """numpy arrays and scalars (pandas / numpy batches) as plain Python values."""
    out = []
    for v in values:
        if hasattr(v, "tolist"):
            v = v.tolist()
        out.append(v)
    return out


def _column(table: pa.Table, name: str, n: int) -> list[Any]:
    return table.column(name).to_pylist() if name in table.column_names else [None] * n


def _optimize_row(optimizer: Any, question: Any, documents: Any) -> dict[str, Any]:
    try:
        result = optimizer.optimize(*_parse_row(question, documents))
    except RagOptError as exc:
        logger.info("row not optimized: %s", exc)
        return {"error": str(exc)}
    except Exception as exc:  # a batch job records a failed row and goes on
        logger.warning("row not optimized: %s: %s", type(exc).__name__, exc, exc_info=True)
        return {"error": f"{type(exc).__name__}: {exc}"}
    return _row_output(result)


def _row_output(result: OptimizeResult) -> dict[str, Any]:
    docs = [d.model_dump(mode="json", exclude={"units"}) for d in result.documents]
    return {
        "context": result.context(),
        "documents_json": json.dumps(docs, ensure_ascii=False),
        "tokens_before": result.tokens_before,
        "tokens_after": result.tokens_after,
        "error": None,
    }

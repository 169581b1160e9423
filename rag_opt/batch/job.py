"""The batch job (``rag-opt batch``): JSONL or Parquet rows in, a resumable folder of Parquet parts out, on a local
Ray or a cluster (see :mod:`rag_opt.batch`)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_opt.batch.optimizer import BatchOptimizer, pyarrow_module
from rag_opt.errors import ConfigurationError, InvalidInputError
from rag_opt.inputs import has_lone_surrogate
from rag_opt.install import install_hint

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

__all__ = ["MANIFEST", "BatchSummary", "jsonl_columns", "read_rows", "run_batch", "summary_dict"]

logger = logging.getLogger(__name__)

MANIFEST = "_rag_opt_batch.json"  # in the output folder; readers of Parquet folders skip names starting with "_"
_PART = "part-{:05d}.parquet"


@dataclass
class BatchSummary:
    """What :func:`run_batch` did."""

    rows: int
    parts: int
    parts_skipped: int  # already written by an earlier run
    rows_optimized: int  # in this run
    rows_failed: int  # in this run: rows with an error
    seconds: float
    output: str
    failed_examples: list[str] = field(default_factory=list)

    @property
    def rows_per_second(self) -> float:
        return self.rows_optimized / self.seconds if self.seconds > 0 else 0.0


def _input_schema() -> pa.Schema:
    pa = pyarrow_module()
    return pa.schema(
        [
            ("row", pa.int64()),
            ("id", pa.string()),
            ("question", pa.string()),
            ("documents", pa.string()),
            ("error", pa.string()),
        ]
    )


def _output_schema() -> pa.Schema:
    pa = pyarrow_module()
    return pa.schema(
        [
            ("row", pa.int64()),
            ("id", pa.string()),
            ("question", pa.string()),
            ("context", pa.string()),
            ("documents_json", pa.string()),
            ("tokens_before", pa.int64()),
            ("tokens_after", pa.int64()),
            ("error", pa.string()),
        ]
    )


def _id_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):  # a Parquet binary column: shown, whatever its bytes
        return value.decode("utf-8", "replace")
    return json.dumps(value, ensure_ascii=False, default=str)


def read_rows(path: str | Path) -> pa.Table:
    """The rows of a JSONL or Parquet file as a table (``row``, ``id``, ``question``, ``documents``, ``error``).

    JSONL: one object per non-blank line with ``question`` and ``documents`` (and optionally ``id``); a line that
    is not UTF-8 text or not valid JSON, is not an object, holds a lone UTF-16 surrogate, or has no string
    ``question`` or no ``documents`` becomes a row with its ``error`` set (with the line number), so the job
    reports it and goes on (:func:`jsonl_columns`). ``documents`` is carried as JSON
    text (rows may give documents of different shapes). Parquet: the ``question`` and ``documents`` columns (and
    ``id`` if present) as they are.
    """
    pa = pyarrow_module()
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"input file not found: {path}")
    if p.suffix == ".parquet":
        return _read_parquet(p)
    if p.suffix not in (".jsonl", ".json", ".ndjson"):
        raise InvalidInputError(f"input must be a .jsonl or .parquet file, got {p.name}")
    cols = jsonl_columns(p)
    if not cols["row"]:
        raise InvalidInputError(f"{path} holds no rows")
    return pa.Table.from_pydict(cols, schema=_input_schema())


def jsonl_columns(path: str | Path) -> dict[str, list[Any]]:
    """The rows of a JSONL file as columns (``row``, ``id``, ``question``, ``documents`` as JSON text, ``error``).

    A line that cannot be a row becomes a row with its ``error`` set (``line N: why``) and the job goes on: not
    UTF-8 text, not valid JSON (a number too long to read, nesting too deep included), not an object, a lone
    UTF-16 surrogate (a ``\\ud800``-style escape without its pair: not Unicode text, so it cannot be optimized
    or written to Parquet), no string ``question`` or no ``documents`` (:func:`jsonl_row`).
    """
    cols: dict[str, list[Any]] = {"row": [], "id": [], "question": [], "documents": [], "error": []}
    with Path(path).open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            row_id, question, documents, error = jsonl_row(raw, line_no)
            cols["row"].append(len(cols["row"]))
            cols["id"].append(row_id)
            cols["question"].append(question)
            cols["documents"].append(documents)
            cols["error"].append(error)
    return cols


def jsonl_row(raw: bytes, line_no: int) -> tuple[str | None, str | None, str | None, str | None]:
    """One JSONL line as ``(id, question, documents as JSON text, error)``; never raises: whatever the line holds
    (not UTF-8, not JSON, a number too long to convert, nesting too deep, a lone surrogate, not an object...),
    a line that cannot be a row gets its ``error`` (``line N: why``), so one row never stops the job."""
    try:
        return _jsonl_row(raw, line_no)
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:  # a case not foreseen below
        logger.debug("line %d of a batch input could not be read", line_no, exc_info=True)
        return None, None, None, f"line {line_no}: cannot be read as a row ({type(exc).__name__})"


def _jsonl_row(raw: bytes, line_no: int) -> tuple[str | None, str | None, str | None, str | None]:
    rec, error = _parse_line(raw, line_no)
    if rec is None:
        return None, None, None, error
    question = rec.get("question")
    if question is None and "query" in rec:  # the Python API's name: a documented alias
        question = rec["query"]
    if "question" in rec and "query" in rec:
        error = f"line {line_no}: give the question once, as 'question' or as 'query' (its alias), not both"
    docs = rec.get("documents")
    if error is None and not isinstance(question, str):
        error = f"line {line_no}: " + ("missing 'question'" if question is None else "'question' must be a string")
    if error is None and docs is None:
        error = f"line {line_no}: missing 'documents'"
    try:
        documents = None if docs is None else json.dumps(docs, ensure_ascii=False)
    except (ValueError, RecursionError):  # nested too deeply to write back (it was just deep enough to read)
        documents, error = None, error or f"line {line_no}: 'documents' is nested too deeply"
    return _id_text(rec.get("id")), question if isinstance(question, str) else None, documents, error


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the JSON escape of a UTF-16 surrogate (paired or not)


def _parse_line(raw: bytes, line_no: int) -> tuple[dict[str, Any] | None, str | None]:
    where = f"line {line_no}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"{where}: invalid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        return None, f"{where}: invalid JSON (nested too deeply)"
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        return None, f"{where}: invalid JSON (a number too long to read: over {sys.get_int_max_str_digits()} digits)"
    if not isinstance(rec, dict):
        return None, f"{where}: expected a JSON object with 'question' and 'documents'"
    if _SURROGATE_ESCAPE.search(line) and has_lone_surrogate(rec):  # a pair is one character: fine
        return None, (
            f"{where}: holds a lone UTF-16 surrogate (a \\ud800-style escape without its pair), which is not "
            "Unicode text"
        )
    return rec, None


def _read_parquet(path: Path) -> pa.Table:
    pa = pyarrow_module()
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if "question" not in table.column_names and "query" in table.column_names:  # the Python API's name: an alias
        table = table.rename_columns(["question" if c == "query" else c for c in table.column_names])
    missing = [c for c in ("question", "documents") if c not in table.column_names]
    if missing:
        raise InvalidInputError(f"{path} has no column(s) {missing}; it needs 'question' and 'documents'")
    if table.num_rows == 0:
        raise InvalidInputError(f"{path} holds no rows")
    ids = table.column("id").to_pylist() if "id" in table.column_names else [None] * table.num_rows
    errors: list[str | None] = [None] * table.num_rows
    question = _text_column(table.column("question"), "question", errors)
    documents = table.column("documents")
    if _is_binary(documents.type):  # documents as JSON bytes
        documents = _text_column(documents, "documents", errors)
    return pa.Table.from_arrays(
        [
            pa.array(range(table.num_rows), pa.int64()),
            pa.array([_id_text(v) for v in ids], pa.string()),
            question,
            documents,
            pa.array(errors, pa.string()),
        ],
        names=["row", "id", "question", "documents", "error"],
    )


def _is_binary(type_: Any) -> bool:
    pa = pyarrow_module()
    return bool(pa.types.is_binary(type_) or pa.types.is_large_binary(type_))


def _text_column(column: Any, name: str, errors: list[str | None]) -> Any:
    """``column`` as strings; a binary one decoded row by row, a row that is not UTF-8 text getting its error
    (``row N: ...``) instead of failing the whole job."""
    pa = pyarrow_module()
    if not _is_binary(column.type):
        return column.cast(pa.string())
    values: list[str | None] = []
    for i, value in enumerate(column.to_pylist()):
        try:
            values.append(None if value is None else value.decode("utf-8"))
        except UnicodeDecodeError as exc:
            values.append(None)
            if errors[i] is None:
                errors[i] = f"row {i + 1}: '{name}' is not UTF-8 text ({exc.reason} at byte {exc.start})"
    return pa.array(values, pa.string())


def _check_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Write the run's manifest, or check that an earlier run's parts were made the same way."""
    path = out / MANIFEST
    # compared as JSON reads it back (a tuple of title keys is a list there): an identical rerun resumes
    manifest = json.loads(json.dumps(manifest, default=str))
    if path.is_file():
        earlier = json.loads(path.read_text(encoding="utf-8"))
        differs = sorted(k for k in ("rows", "rows_per_part", "settings") if earlier.get(k) != manifest.get(k))
        if differs:
            raise ConfigurationError(
                f"{out} holds parts of another run (different {', '.join(differs)}): use another --output, or "
                f"remove {out} to start over"
            )
        return
    if any(out.glob("part-*.parquet")):
        raise ConfigurationError(f"{out} holds parts without a {MANIFEST}: use another --output")
    tmp = out / f".{MANIFEST}.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def _write_part(out: Path, k: int, table: pa.Table) -> None:
    import pyarrow.parquet as pq

    tmp = out / f".{_PART.format(k)}.{uuid.uuid4().hex}"
    pq.write_table(table, tmp)
    os.replace(tmp, out / _PART.format(k))


def run_batch(
    input: str | Path,
    output: str | Path,
    *,
    ray_address: str | None = None,
    actors: int = 1,
    num_cpus: int | None = None,
    cpus_per_actor: float = 1.0,
    rows_per_part: int = 100,
    batch_size: int = 4,
    progress: bool = True,
    **optimizer_options: Any,
) -> BatchSummary:
    """Optimize every row of ``input`` (JSONL or Parquet) on Ray and write ``output`` (a folder of Parquet parts).

    Args:
        ray_address: a running cluster (``ray://host:10001``, ``host:6379`` or ``auto``); None: a new local Ray
            (``num_cpus`` CPUs, default all). A Ray already initialized in this process is used either way (and
            left running).
        actors: optimizer actors (each loads the proxy model once); ``cpus_per_actor`` CPUs each.
        rows_per_part: input rows per output part; a part is written once all its rows are done, and a rerun
            with the same output folder (same rows and settings) skips the parts already there.
        batch_size: rows per ``map_batches`` call.
        **optimizer_options: the optimizer's options by name (:class:`~rag_opt.options.OptimizerOptions`: the
            budget, ``ordering``, ``language``, ``model``, ...), as :class:`BatchOptimizer` takes them.

    Output columns: ``row`` (0-based input row), ``id``, ``question`` and :data:`OUTPUT_COLUMNS`.
    """
    if actors < 1 or rows_per_part < 1 or batch_size < 1:
        raise InvalidInputError("actors, rows_per_part and batch_size must be at least 1")
    from rag_opt.pipeline import ContextOptimizer

    ContextOptimizer(**optimizer_options)  # validate the options here (names, values), before any actor starts
    t0 = time.perf_counter()
    rows = read_rows(input)
    n = rows.num_rows
    n_parts = math.ceil(n / rows_per_part)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in sorted(optimizer_options.items()) if v is not None}
    _check_manifest(
        out,
        {"input": str(Path(input).resolve()), "rows": n, "rows_per_part": rows_per_part, "settings": settings},
    )
    pending = [k for k in range(n_parts) if not (out / _PART.format(k)).is_file()]
    skipped = n_parts - len(pending)
    if skipped:
        logger.info("%d of %d parts already written in %s: skipped", skipped, n_parts, out)
    summary = BatchSummary(n, n_parts, skipped, 0, 0, 0.0, str(out))
    if pending:
        parts = {k: rows.slice(k * rows_per_part, rows_per_part) for k in pending}
        for table in _run_on_ray(
            parts,
            rows_per_part,
            ray_address=ray_address,
            actors=actors,
            num_cpus=num_cpus,
            cpus_per_actor=cpus_per_actor,
            batch_size=batch_size,
            progress=progress,
            optimizer_options=optimizer_options,
        ):
            k = int(table.column("row")[0].as_py()) // rows_per_part
            _write_part(out, k, table)
            errors = [e for e in table.column("error").to_pylist() if e is not None]
            summary.rows_optimized += table.num_rows
            summary.rows_failed += len(errors)
            summary.failed_examples.extend(errors[: max(0, 5 - len(summary.failed_examples))])
            logger.info("wrote %s (%d rows, %d with an error)", _PART.format(k), table.num_rows, len(errors))
    summary.seconds = time.perf_counter() - t0
    return summary


def _run_on_ray(
    parts: dict[int, pa.Table],
    rows_per_part: int,
    *,
    ray_address: str | None,
    actors: int,
    num_cpus: int | None,
    cpus_per_actor: float,
    batch_size: int,
    progress: bool,
    optimizer_options: dict[str, Any],
) -> Iterator[pa.Table]:
    """Run the parts through :class:`BatchOptimizer` on Ray; yield each part (sorted by row) once complete."""
    pa = pyarrow_module()
    import pyarrow.compute as pc

    try:
        import ray
        import ray.data
    except ImportError:
        raise ConfigurationError(f"rag-opt batch needs the ray extra: {install_hint('ray')}") from None

    started = not ray.is_initialized()  # a Ray this process already runs is used, and left running
    if started and ray_address is not None:
        ray.init(address=ray_address, log_to_driver=True)
    elif started:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    elif ray_address is not None:
        logger.warning("Ray is already initialized in this process: it is used, not %s", ray_address)
    context = ray.data.DataContext.get_current()
    show_progress = context.enable_progress_bars
    try:
        context.enable_progress_bars = progress
        sizes = {k: t.num_rows for k, t in parts.items()}
        # one block per batch: Ray hands whole blocks to actors, so blocks this small keep every actor busy
        blocks = [t.slice(i, batch_size) for t in parts.values() for i in range(0, t.num_rows, batch_size)]
        ds: Any = ray.data.from_arrow(blocks)
        ds = ds.map_batches(
            BatchOptimizer,
            fn_constructor_kwargs=optimizer_options,
            batch_size=batch_size,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=cpus_per_actor,
        )
        schema = _output_schema()
        buffers: dict[int, list[Any]] = {}
        done: dict[int, int] = {}
        batch: Any
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            batch = batch.drop_columns(["documents"]).select(schema.names).cast(schema)
            for k, piece in _split_by_part(batch, rows_per_part):
                buffers.setdefault(k, []).append(piece)
                done[k] = done.get(k, 0) + piece.num_rows
                if done[k] == sizes[k]:
                    table = pa.concat_tables(buffers.pop(k))
                    yield table.take(pc.sort_indices(table, [("row", "ascending")]))
        if buffers:  # pragma: no cover - Ray lost rows
            raise RuntimeError(f"parts {sorted(buffers)} did not get all their rows back from Ray")
    finally:
        context.enable_progress_bars = show_progress
        if started:
            ray.shutdown()


def _split_by_part(batch: pa.Table, rows_per_part: int) -> Sequence[tuple[int, pa.Table]]:
    """The rows of ``batch`` grouped by the output part they belong to."""
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(batch.column("row").to_pylist()):
        groups.setdefault(row // rows_per_part, []).append(i)
    return [(k, batch.take(idx)) for k, idx in groups.items()]


def summary_dict(summary: BatchSummary) -> dict[str, Any]:
    """The summary as plain data (with ``rows_per_second``)."""
    return {**asdict(summary), "rows_per_second": summary.rows_per_second}

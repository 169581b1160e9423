"""What the subcommands share: budget and model options (defined once), reading documents, the data folder."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from rag_opt.errors import RagOptError
from rag_opt.models.prompt import DEFAULT_ENCODING, ENCODINGS
from rag_opt.types import DEFAULT_ORDERING, DEFAULT_RATIO, ORDERING_NAMES, TIERS, Budget

__all__ = [
    "UserError",
    "add_budget_args",
    "add_engine_args",
    "add_language_arg",
    "add_model_args",
    "add_optimizer_args",
    "add_title_args",
    "budget_from_args",
    "build_optimizer",
    "default_data_dir",
    "nonneg_int",
    "optimizer_kwargs",
    "positive_float",
    "positive_int",
    "read_documents",
    "title_kwargs",
]


class UserError(RagOptError):
    """An error caused by the user's input on the command line; reported without a traceback."""


def default_data_dir() -> Path:
    """``$RAG_OPT_DATA_DIR``, else ``../shared/data`` (relative to the current folder): the command line's default."""
    return Path(os.environ.get("RAG_OPT_DATA_DIR") or Path.cwd().parent / "shared" / "data")


def _number_in(low: float, high: float, name: str, *, open_low: bool) -> Any:
    """argparse type: a number in ``(low, high]`` (``open_low``) or ``[low, high]``."""
    interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number in {interval}, got {value!r}") from None
        if not (low < x <= high if open_low else low <= x <= high):
            raise argparse.ArgumentTypeError(f"{name} must be in {interval}, got {value}")
        return x

    return parse


_ratio = _number_in(0, 1, "ratio", open_low=True)
_probability = _number_in(0, 1, "threshold", open_low=False)


def nonneg_int(value: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return n


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    n = nonneg_int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return n


def positive_float(value: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return x


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """``--ratio`` / ``--target-tokens`` / ``--threshold``, mutually exclusive (a :class:`Budget`; none given:
    ``--ratio`` :data:`~rag_opt.types.DEFAULT_RATIO`, as on every surface)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--ratio",
        type=_ratio,
        help=f"fraction of target-LLM tokens to keep, in (0, 1] (default {DEFAULT_RATIO}; 1 keeps everything)",
    )
    g.add_argument("--target-tokens", type=nonneg_int, help="token budget in the target LLM's tokens")
    g.add_argument("--threshold", type=_probability, help="keep sentences whose relevance probability is >= this")


def budget_from_args(args: argparse.Namespace) -> Budget:
    """The :class:`Budget` of the parsed budget options (:data:`~rag_opt.types.DEFAULT_RATIO` when none was
    given)."""
    budget = Budget(ratio=args.ratio, target_tokens=args.target_tokens, threshold=args.threshold)
    return budget if budget.compresses else Budget(ratio=DEFAULT_RATIO)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model`` / ``--device`` / ``--dtype``: which proxy model, where, at what precision."""
    p.add_argument("--model", help="proxy model: Hugging Face id, local folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16", "int8"], help="proxy model dtype (int8 needs torchao)"
    )


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    """The options of a :class:`~rag_opt.ContextOptimizer` run: query, input, and :func:`add_engine_args`."""
    p.add_argument("--query", "-q", required=True, help="the question")
    p.add_argument(
        "--input", "-i", required=True, help="documents as JSONL ({'text','id'?,'metadata'?,'title'?}); - for stdin"
    )
    add_engine_args(p)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The optimizer's own options: target, ordering, probe, language, model."""
    p.add_argument("--target", help="target LLM tokenizer: OpenAI model or tiktoken encoding name, or hf:<id>")
    p.add_argument(
        "--ordering",
        default=DEFAULT_ORDERING,
        choices=ORDERING_NAMES,
        help=f"document ordering (default: {DEFAULT_ORDERING})",
    )
    p.add_argument("--probe", default="auto", help="probe JSON path, 'auto' (shipped) or 'none' (raw attention)")
    p.add_argument(
        "--tier",
        choices=TIERS,
        default="model",
        help="model: the proxy's attention through the probe; lexical: BM25 and lexical features, no model, "
        "milliseconds (default: model)",
    )
    p.add_argument(
        "--encoding",
        choices=ENCODINGS,
        default=DEFAULT_ENCODING,
        help="how the proxy reads the context: parallel (each document on its own, cached) or joint (one pass) "
        f"(default: {DEFAULT_ENCODING})",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="with --encoding parallel: the encoding cache's disk folder (e.g. one filled by 'rag-opt index'); "
        "default: memory only",
    )
    add_language_arg(p)
    add_title_args(p)
    add_model_args(p)


def add_title_args(p: argparse.ArgumentParser) -> None:
    """``--title-keys`` and ``--no-title-from-text``: where a document's title is read (rag_opt.text.titles)."""
    from rag_opt.text.titles import DEFAULT_TITLE_KEYS

    p.add_argument(
        "--title-keys",
        default=",".join(DEFAULT_TITLE_KEYS),
        help="metadata keys a document's title is read from when it has no title field, in order (a file-name key "
        f"such as source gives the file's stem; default: {','.join(DEFAULT_TITLE_KEYS)}; '' reads none)",
    )
    p.add_argument(
        "--no-title-from-text",
        dest="title_from_text",
        action="store_false",
        help="do not read a leading heading line of the text as its title (default: read it when there is no other)",
    )


def add_language_arg(p: argparse.ArgumentParser) -> None:
    """``--language``: the documents' language (segmentation and BM25 stopwords follow it)."""
    p.add_argument(
        "--language",
        default="en",
        help="ISO 639 code of the documents' language (en, de, fr, pt-BR, ...): sentence segmentation and BM25 "
        "stopwords follow it (default: en; the shipped probe was trained on English)",
    )


def optimizer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~rag_opt.ContextOptimizer` keyword arguments of the parsed :func:`add_engine_args` options."""
    return {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "target": args.target,
        "ordering": args.ordering,
        "tier": getattr(args, "tier", "model"),
        "probe": None if args.probe == "none" else args.probe,
        "keep_best_per_doc": getattr(args, "keep_best_per_doc", False),
        "keep_first": getattr(args, "keep_first", False),
        "drop_below_best": getattr(args, "drop_below_best", None),
        "keep_antecedents": getattr(args, "keep_antecedents", True),
        "calibrate": getattr(args, "calibrate", True),
        "language": args.language,
        "encoding": getattr(args, "encoding", DEFAULT_ENCODING),
        "cache": getattr(args, "cache_dir", None) or "auto",
        **title_kwargs(args),
    }


def title_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``title_keys`` and ``title_from_text`` of the parsed :func:`add_title_args` options (none when absent)."""
    out: dict[str, Any] = {}
    if getattr(args, "title_keys", None) is not None:
        out["title_keys"] = tuple(k.strip() for k in args.title_keys.split(",") if k.strip())
    if hasattr(args, "title_from_text"):
        out["title_from_text"] = args.title_from_text
    return out


def build_optimizer(args: argparse.Namespace) -> Any:
    """A ContextOptimizer from the shared model/target/ordering/probe/language arguments."""
    from rag_opt.pipeline import ContextOptimizer

    if not args.query.strip():
        raise UserError("--query is empty")
    return ContextOptimizer(**optimizer_kwargs(args))


def read_documents(path: str) -> list[dict[str, Any]]:
    """Read documents from JSONL (one JSON object or string per line); ``-`` reads standard input."""
    if path == "-":
        lines = sys.stdin.read().split("\n")  # JSONL lines end at \n only (not U+2028 etc.)
        name = "<stdin>"
    else:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"input file not found: {path}")
        try:
            lines = p.read_text(encoding="utf-8").split("\n")
        except UnicodeDecodeError as exc:
            raise UserError(f"{path} is not UTF-8 text: {exc}") from None
        name = path
    docs: list[dict[str, Any]] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{name}, line {n}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise UserError(f"{name}, line {n}: invalid JSON (nested too deeply)") from None
        except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
            raise UserError(
                f"{name}, line {n}: invalid JSON (a number too long to read: over {sys.get_int_max_str_digits()} "
                "digits)"
            ) from None
        if isinstance(rec, str):
            rec = {"text": rec}
        if not isinstance(rec, dict):
            raise UserError(f"{name}, line {n}: expected a JSON object with a 'text' field or a string")
        if not isinstance(rec.get("text", rec.get("page_content")), str):
            raise UserError(f"{name}, line {n}: missing string field 'text'")
        docs.append(rec)
    if not docs:
        raise UserError(f"{name} holds no documents")
    return docs

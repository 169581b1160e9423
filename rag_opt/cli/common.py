"""What the subcommands share: the optimizer's flags (generated from :mod:`rag_opt.options`), reading documents, the
data folder."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_opt.cli.option_flags import add_option_arguments, option_values
from rag_opt.errors import RagOptError
from rag_opt.types import DEFAULT_RATIO, Budget

__all__ = [
    "HOTPOTQA_TRAIN",
    "NQ_MULTIDOC",
    "DataFile",
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


@dataclass(frozen=True)
class DataFile:
    """A public data file the training commands read: what it is, where to get it, and its path in the data folder
    (:func:`default_data_dir`)."""

    what: str
    source: str
    parts: tuple[str, ...]

    @property
    def default(self) -> str:
        return "/".join(self.parts)

    def help(self) -> str:
        """The ``--help`` text of the option that names it."""
        return (
            f"{self.what}. Get it {self.source}. Default: $RAG_OPT_DATA_DIR/{self.default}, else "
            f"../shared/data/{self.default}"
        )

    def path(self, given: str | None, flag: str = "--data") -> str:
        """``given``, else the file in the data folder; a :class:`UserError` saying what it is and where to get it
        when it is not there."""
        data = given or str(default_data_dir().joinpath(*self.parts))
        if not Path(data).is_file():
            where = "" if given else f" ({flag} not given: the data folder is $RAG_OPT_DATA_DIR, else ../shared/data)"
            raise UserError(
                f"data not found: {data}{where}. {flag} is {self.what}. Get it {self.source}, then pass {flag} PATH "
                "or put it in the data folder"
            )
        return data


HOTPOTQA_TRAIN = DataFile(
    what="HotpotQA questions with sentence-level supporting facts, as JSON lines (gzip'd or not), each "
    "{_id, question, answer, supporting_facts, context} as in HotpotQA's distractor setting",
    source="from https://hotpotqa.github.io (hotpot_dev_distractor_v1.json or hotpot_train_v1.1.json, CC BY-SA 4.0), "
    "one question per line; the shipped probes were trained on part of the dev-distractor file, split by id",
    parts=("hotpotqa", "train.jsonl.gz"),
)
NQ_MULTIDOC = DataFile(
    what="the NQ multi-document file: NQ-open questions, each with its answers, its gold Wikipedia passage "
    "(gold_ctx) and retrieved passages that do not contain the answer (distractor_ctxs), as JSON lines (gzip'd or "
    "not): the multi-document QA setting of Lost in the Middle (Liu et al., 2023)",
    source="by converting Lost in the Middle's NQ files (https://github.com/nelson-liu/lost-in-the-middle, "
    "qa_data/30_total_documents/*.jsonl.gz; MIT, text CC BY-SA): in each record's ctxs the passage with isgold "
    "true is gold_ctx, the others, in order, distractor_ctxs",
    parts=("nq_multidoc", "public.jsonl.gz"),
)


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
    ``--ratio`` :data:`~rag_opt.types.DEFAULT_RATIO`, as on every surface): the options of group ``budget``."""
    add_option_arguments(p, groups=("budget",))


def budget_from_args(args: argparse.Namespace) -> Budget:
    """The :class:`Budget` of the parsed budget options (:data:`~rag_opt.types.DEFAULT_RATIO` when none was
    given)."""
    budget = Budget(**option_values(args, groups=("budget",)))
    return budget if budget.compresses else Budget(ratio=DEFAULT_RATIO)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model`` / ``--device`` / ``--dtype``: which proxy model, where, at what precision (group ``proxy``)."""
    add_option_arguments(p, groups=("proxy",))


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    """The options of a :class:`~rag_opt.ContextOptimizer` run: query, input, and :func:`add_engine_args`."""
    p.add_argument("--query", "-q", required=True, help="the question")
    p.add_argument(
        "--input", "-i", required=True, help="documents as JSONL ({'text','id'?,'metadata'?,'title'?}); - for stdin"
    )
    add_engine_args(p)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The optimizer's own options, every one written as text but the budget (:func:`add_budget_args`): a flag
    each, generated from :class:`~rag_opt.options.OptimizerOptions`."""
    add_option_arguments(p.add_argument_group("optimizer options (rag_opt.OptimizerOptions)"))


def add_title_args(p: argparse.ArgumentParser) -> None:
    """``--title-keys`` and ``--no-title-from-text``: where a document's title is read (rag_opt.text.titles)."""
    add_option_arguments(p, groups=("titles",))


def add_language_arg(p: argparse.ArgumentParser) -> None:
    """``--language``: the documents' language (segmentation and BM25 stopwords follow it)."""
    add_option_arguments(p, names=("language",))


def optimizer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~rag_opt.ContextOptimizer` options of the parsed :func:`add_engine_args` flags."""
    return option_values(args)


def title_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``title_keys`` and ``title_from_text`` of the parsed :func:`add_title_args` options (none when absent)."""
    return option_values(args, groups=("titles",))


def build_optimizer(args: argparse.Namespace) -> Any:
    """A ContextOptimizer from the parsed :func:`add_engine_args` flags."""
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

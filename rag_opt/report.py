"""The explain report: one self-contained HTML page showing what rag-opt did and why.

It renders an :class:`~rag_opt.types.OptimizeResult` together with the original documents (the result holds
only the kept text; the units' character offsets point into the originals): every document with each sentence
highlighted by its score (kept vs dropped) and, on hover, its rank and why it was kept or dropped, how many units
each reason decided, the document order before and after with each document's two numbers, labelled (its document
relevance, what the ordering ranks by, and its best sentence score), and token counts before and after. The units
and their reasons are :func:`rag_opt.explanation.explain_result`'s, all of them: the same data as
``explain_result(result)`` and ``explain: true`` on ``/v1/compress``. Inline CSS only: no scripts, no external
resources, every piece of document text escaped.

``render_html(result, documents)`` renders; ``explain(query, documents, ...)`` optimizes and renders;
``rag-opt explain --query Q --input docs.jsonl --out report.html`` does the same from the command line.
"""

from __future__ import annotations

import html
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rag_opt.errors import InvalidInputError
from rag_opt.explanation import REASONS, ExplainedDocument, describe, explain_result
from rag_opt.types import Document, DocumentLike, OptimizeResult, OutputDocument, Unit, to_documents

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.pipeline import ContextOptimizer

logger = logging.getLogger(__name__)

__all__ = ["explain", "render_html", "write_html"]

_CSS = """
:root { --fg:#1f2933; --muted:#6b7280; --line:#e5e7eb; --bg:#f8fafc; --card:#ffffff; --accent:#0f766e; }
* { box-sizing: border-box; }
body { margin:0; padding:28px 36px 48px; font: 15px/1.55 system-ui, -apple-system, "Segoe UI", Roboto,
  "Helvetica Neue", Arial, sans-serif; color:var(--fg); background:var(--bg); }
h1 { font-size:22px; margin:0 0 4px; letter-spacing:-0.01em; }
h1 small { font-weight:500; color:var(--muted); font-size:14px; margin-left:8px; }
h2 { font-size:17px; margin:32px 0 12px; }
.question { font-size:17px; margin:8px 0 18px; padding:10px 14px; background:var(--card);
  border-left:4px solid var(--accent); border-radius:4px; }
.stats { display:flex; flex-wrap:wrap; gap:10px; }
.stat { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:8px 14px; min-width:120px; }
.stat b { display:block; font-size:20px; font-variant-numeric: tabular-nums; }
.stat span { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:0.04em; }
.note { color:var(--muted); font-size:13px; margin:6px 0 0; }
table { border-collapse:collapse; background:var(--card); border:1px solid var(--line); border-radius:8px;
  font-size:14px; font-variant-numeric: tabular-nums; }
th, td { padding:6px 12px; border-bottom:1px solid var(--line); text-align:left; vertical-align:middle; }
th { font-size:12px; text-transform:uppercase; letter-spacing:0.04em; color:var(--muted); font-weight:600; }
td.num { text-align:right; }
tr.dropped td { color:var(--muted); }
.rel { display:inline-block; width:70px; height:8px; background:#eef2f7; border-radius:4px; margin-right:6px;
  vertical-align:middle; overflow:hidden; }
.rel i { display:block; height:100%; background:var(--accent); }
.chips { display:flex; flex-wrap:wrap; gap:6px; margin:10px 0 0; padding:0; list-style:none; }
.chips li { background:var(--card); border:1px solid var(--line); border-radius:14px; padding:3px 10px;
  font-size:13px; }
.chips li b { color:var(--accent); margin-right:4px; }
.pill { display:inline-block; font-size:12px; border-radius:10px; padding:1px 8px; font-weight:600; }
.pill.kept { background:#dcfce7; color:#166534; }
.pill.dropped { background:#fee2e2; color:#991b1b; }
.legend { display:flex; gap:18px; align-items:center; font-size:13px; color:var(--muted); margin:0 0 12px; }
.legend .swatch { display:inline-block; width:120px; height:12px; border-radius:3px; vertical-align:middle;
  margin:0 6px; }
.doc { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:14px 18px;
  margin:0 0 14px; }
.doc.dropped { opacity:0.85; border-style:dashed; }
.doc h3 { margin:0 0 4px; font-size:16px; }
.doc h3 .pos { color:var(--accent); margin-right:6px; }
.doc .id { color:var(--muted); font-weight:400; font-size:13px; margin-left:6px; }
.doc .meta { color:var(--muted); font-size:13px; margin:0 0 8px; }
.text { white-space:pre-wrap; overflow-wrap:anywhere; margin:0; }
.u { border-radius:3px; padding:1px 0; }
.u.drop { color:#6b7280; }
details { margin-top:8px; font-size:13px; color:var(--muted); }
pre.md { white-space:pre-wrap; overflow-wrap:anywhere; background:#f1f5f9; padding:8px; border-radius:4px; }
footer { margin-top:28px; color:var(--muted); font-size:12px; }
"""


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.{digits}f}" if abs(x) < 1000 else f"{x:.4g}"


class _Scale:
    """Maps unit scores to [0, 1] for colouring: probabilities as they are, anything else min–max."""

    def __init__(self, scores: Sequence[float]) -> None:
        finite = [s for s in scores if math.isfinite(s)]
        self.lo, self.hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
        self.identity = bool(finite) and self.lo >= 0.0 and self.hi <= 1.0

    def __call__(self, score: float | None) -> float | None:
        if score is None or not math.isfinite(score):
            return None
        if self.identity:
            return score
        if self.hi <= self.lo:
            return 1.0
        return (score - self.lo) / (self.hi - self.lo)


def _unit_style(kept: bool, s: float | None) -> str:
    if kept:
        alpha = 0.14 if s is None else 0.12 + 0.58 * s
        return f"background:rgba(22,163,74,{alpha:.3f})"
    alpha = 0.0 if s is None else 0.03 + 0.30 * s
    return f"background:rgba(220,38,38,{alpha:.3f})"


def _render_text(text: str, units: Sequence[Unit], scale: _Scale) -> str:
    parts: list[str] = []
    pos = 0
    for u in sorted(units, key=lambda u: u.start):
        if u.start > pos:
            parts.append(_esc(text[pos : u.start]))
        s = scale(u.score)
        rank = f" · rank {u.rank}" if u.rank is not None else ""
        tip = (
            f"{'kept' if u.kept else 'dropped'} · {u.kind} · score {_fmt(u.score)}{rank} · {u.tokens} tokens · "
            f"{describe(u)}"
        )
        cls = "u keep" if u.kept else "u drop"
        parts.append(
            f'<span class="{cls}" style="{_unit_style(u.kept, s)}" title="{_esc(tip)}">'
            f"{_esc(text[u.start : u.end])}</span>"
        )
        pos = max(pos, u.end)
    if pos < len(text):
        parts.append(_esc(text[pos:]))
    return "".join(parts)


def _calibration_note(result: OptimizeResult) -> str:
    """Whether document relevance is position-calibrated, and why not (pointing at warnings only when there are)."""
    if result.calibrated:
        return "document relevance calibrated against the positional attention profile."
    if result.encoding == "parallel":
        return (
            "document relevance needs no position calibration: under parallel encoding each document is read on "
            "its own, whatever its slot."
        )
    if result.encoding is None:
        return "no document relevance was computed by the proxy model."
    return "document relevance is not position-calibrated" + (" (see the warnings)." if result.warnings else ".")


def _relevance_source(result: OptimizeResult, docs: Sequence[OutputDocument]) -> str:
    """Where the documents' relevance (``OutputDocument.score``) came from, for its label."""
    if result.calibrated:
        return "document probe, position-calibrated"
    if any(d.score is not None and d.raw_score is not None and d.score != d.raw_score for d in docs):
        return "document probe"
    return "its best sentence's score: no document probe ran"


def _relevance_legend(source: str) -> str:
    """The line that says which relevance number is which."""
    return (
        f"<b>Document relevance</b> ({_esc(source)}): how relevant the whole document is; the ordering ranks "
        "documents by it. <b>Best sentence score</b>: the highest score of the document's sentences (the scores "
        "highlighted below, that the budget keeps sentences by). Two numbers from two scorers: they need not agree."
    )


def _relevance_bar(score: float | None, top: float) -> str:
    if score is None or not math.isfinite(score):
        return "—"
    width = 0.0 if top <= 0 else max(0.0, min(1.0, score / top)) * 100
    return f'<span class="rel"><i style="width:{width:.0f}%"></i></span>{_fmt(score)}'


def _name(doc: OutputDocument) -> str:
    return doc.title or doc.id


def _check(result: OptimizeResult, originals: list[Document]) -> None:
    n = len(result.documents) + len(result.dropped)
    if len(originals) != n:
        raise InvalidInputError(f"the result covers {n} input documents but {len(originals)} documents were given")
    for doc in [*result.documents, *result.dropped]:
        if not 0 <= doc.index < n:
            raise InvalidInputError(f"result document {doc.id!r} has index {doc.index} outside 0..{n - 1}")
        text = originals[doc.index].text
        if any(u.end > len(text) or u.start < 0 or u.start > u.end for u in doc.units):
            raise InvalidInputError(
                f"document {doc.index} ({doc.id!r}) does not match the result: its units point outside its "
                f"{len(text)} characters (pass the same documents that were optimized)"
            )


def render_html(
    result: OptimizeResult,
    documents: Sequence[DocumentLike],
    *,
    title: str = "rag-opt explain",
) -> str:
    """Render ``result`` (and the original ``documents`` it was computed from) as a self-contained HTML page."""
    originals = to_documents(documents)
    _check(result, originals)
    explanation = explain_result(result, max_units=None)  # every unit with its decision: one source
    units: dict[int, ExplainedDocument] = {e.index: e for e in explanation.documents}
    out_docs = list(result.documents)
    all_docs = sorted([*out_docs, *result.dropped], key=lambda d: d.index)
    out_pos = {d.index: rank for rank, d in enumerate(out_docs)}
    scale = _Scale([u.score for e in explanation.documents for u in e.units if u.score is not None])
    top = max(
        (abs(s) for d in all_docs for s in (d.score, d.raw_score) if s is not None and math.isfinite(s)), default=0
    )
    has_retriever = any(d.retriever_score is not None for d in all_docs)
    n_units = explanation.units_total
    n_kept_units = sum(u.kept for e in explanation.documents for u in e.units)

    h: list[str] = []
    h.append('<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">')
    h.append('<meta name="viewport" content="width=device-width, initial-scale=1">')
    h.append(f"<title>{_esc(title)} — {_esc(result.query[:80])}</title>")
    h.append(f"<style>{_CSS}</style>\n</head>\n<body>")

    # header and token summary
    h.append(f"<h1>{_esc(title)}<small>{_esc(result.scorer)} scorer</small></h1>")
    h.append(f'<div class="question"><b>Question:</b> {_esc(result.query)}</div>')
    pct = 100.0 * result.ratio
    stats = [
        (f"{result.tokens_before:,}", "tokens before"),
        (f"{result.tokens_after:,}", f"tokens after ({pct:.0f}%)"),
        (f"{result.tokens_saved:,}", "tokens saved"),
        ("—" if result.token_budget is None else f"{result.token_budget:,}", "budget"),
        (f"{len(out_docs)} / {len(all_docs)}", "documents kept"),
        (f"{n_kept_units} / {n_units}", "sentences kept"),
    ]
    h.append('<div class="stats">')
    h.extend(f'<div class="stat"><b>{_esc(v)}</b><span>{_esc(k)}</span></div>' for v, k in stats)
    h.append("</div>")
    note = (
        f"Tokens in the target tokenizer <code>{_esc(result.target_tokenizer)}</code>; proxy model "
        f"<code>{_esc(result.proxy_model or 'none')}</code>; ordering <code>{_esc(result.ordering)}</code>; "
        + _calibration_note(result)
    )
    h.append(f'<p class="note">{note}</p>')
    h.extend(f'<p class="note">⚠ {_esc(w)}</p>' for w in result.warnings)

    # why units were kept or dropped
    h.append("<h2>Why units were kept or dropped</h2>")
    h.append('<table class="reasons">\n<tr><th>Reason</th><th>Units</th><th>Meaning</th></tr>')
    h.extend(
        f'<tr><td><code>{_esc(code)}</code></td><td class="num">{n}</td><td>{_esc(REASONS.get(code, code))}</td></tr>'
        for code, n in sorted(explanation.reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    h.append("</table>")

    # order before / after
    h.append("<h2>Document order: before → after</h2>")
    h.append("<table>\n<tr><th>Input #</th><th>Document</th>")
    if has_retriever:
        h.append("<th>Retriever score</th>")
    source = _relevance_source(result, all_docs)
    h.append(
        "<th>Document relevance</th><th>Best sentence score</th><th>Tokens before → after</th><th>Output #</th></tr>"
    )
    for d in all_docs:
        kept = d.index in out_pos
        row = [f'<tr class="{"kept" if kept else "dropped"}"><td class="num">{d.index + 1}</td>']
        row.append(f"<td>{_esc(_name(d))}</td>")
        if has_retriever:
            row.append(f'<td class="num">{_fmt(d.retriever_score)}</td>')
        row.append(f"<td>{_relevance_bar(d.score, top)}</td>")
        row.append(f"<td>{_relevance_bar(d.raw_score, top)}</td>")
        row.append(f'<td class="num">{d.tokens_before} → {d.tokens_after}</td>')
        cell = f"{out_pos[d.index] + 1}" if kept else '<span class="pill dropped">dropped</span>'
        row.append(f'<td class="num">{cell}</td></tr>')
        h.append("".join(row))
    h.append("</table>")
    h.append(f'<p class="note legend-relevance">{_relevance_legend(source)}</p>')
    h.append('<ol class="chips" aria-label="output order">')
    h.extend(
        f"<li><b>{rank + 1}</b>{_esc(_name(d))} <small>(document relevance {_fmt(d.score, 2)})</small></li>"
        for rank, d in enumerate(out_docs)
    )
    h.append("</ol>")

    # documents with highlighted sentences
    h.append("<h2>Documents (output order, then dropped)</h2>")
    h.append(
        '<div class="legend"><span>kept<span class="swatch" style="background:linear-gradient(90deg,'
        'rgba(22,163,74,0.12),rgba(22,163,74,0.70))"></span></span><span>dropped<span class="swatch" '
        'style="background:linear-gradient(90deg,rgba(220,38,38,0.03),rgba(220,38,38,0.33))"></span></span>'
        f"<span>low → high sentence score{'' if scale.identity else ' (scaled min–max)'}; "
        "hover a sentence for its score</span></div>"
    )
    for d in [*out_docs, *sorted(result.dropped, key=lambda d: d.index)]:
        kept = d.index in out_pos
        original = originals[d.index]
        pos = (
            f'<span class="pos">#{out_pos[d.index] + 1}</span>'
            if kept
            else '<span class="pill dropped">dropped</span> '
        )
        h.append(f'<article class="doc {"kept" if kept else "dropped"}">')
        id_part = f'<span class="id">id {_esc(d.id)}</span>' if d.title and d.id != d.title else ""
        h.append(f"<h3>{pos}{_esc(_name(d))}{id_part}</h3>")
        doc_units = units[d.index].units
        n_k = sum(u.kept for u in doc_units)
        rel = (
            f"document relevance {_fmt(d.score)} ({source.split(':')[0]}) · best sentence score {_fmt(d.raw_score)}"
            if source.startswith("document probe")
            else f"document relevance = best sentence score {_fmt(d.raw_score)}"
        )
        h.append(
            f'<div class="meta">input #{d.index + 1} · {_esc(rel)} · {d.tokens_before} → {d.tokens_after} tokens '
            f"· {n_k} of {len(doc_units)} sentences kept</div>"
        )
        h.append(f'<p class="text">{_render_text(original.text, doc_units, scale)}</p>')
        if d.metadata:
            md = json.dumps(d.metadata, ensure_ascii=False, indent=1, default=str)
            h.append(f'<details><summary>metadata</summary><pre class="md">{_esc(md)}</pre></details>')
        h.append("</article>")

    t = result.timings
    h.append(
        f"<footer>rag-opt · segment {t.segment_ms:.0f} ms · score {t.score_ms:.0f} ms · select "
        f"{t.select_ms:.0f} ms · order {t.order_ms:.0f} ms · total {t.total_ms:.0f} ms</footer>"
    )
    h.append("</body>\n</html>\n")
    return "\n".join(h)


def write_html(
    result: OptimizeResult,
    documents: Sequence[DocumentLike],
    path: str | Path,
    *,
    title: str = "rag-opt explain",
) -> Path:
    """Render the report and write it to ``path`` (UTF-8); returns the path."""
    p = Path(path)
    p.write_text(render_html(result, documents, title=title), encoding="utf-8")
    logger.info("wrote explain report %s", p)
    return p


def explain(
    query: str,
    documents: Sequence[DocumentLike],
    *,
    optimizer: ContextOptimizer | None = None,
    ratio: float | None = None,
    target_tokens: int | None = None,
    threshold: float | None = None,
    ordering: str | None = None,
    out: str | Path | None = None,
) -> str:
    """Optimize ``documents`` for ``query`` and return the explain report's HTML (also written to ``out``).

    Settings are passed to :meth:`ContextOptimizer.optimize`; when neither they nor the optimizer set a
    budget, the optimizer's default applies (:data:`~rag_opt.types.DEFAULT_RATIO`, as everywhere).
    """
    from rag_opt.pipeline import ContextOptimizer

    opt = optimizer if optimizer is not None else ContextOptimizer()
    docs = to_documents(documents)
    result = opt.optimize(query, docs, ratio=ratio, target_tokens=target_tokens, threshold=threshold, ordering=ordering)
    page = render_html(result, docs)
    if out is not None:
        Path(out).write_text(page, encoding="utf-8")
        logger.info("wrote explain report %s", out)
    return page

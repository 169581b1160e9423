"""Max-pooling and cross-document attention: do they help the sentence probe? (issue 14's last two candidates)

One forward pass per question (the embedded proxy in bf16, first ``--layers`` layers) records, next to the
shipped features (mean attention per token of each sentence, from the question's tokens and from the final
token, relative to uniform):

* **max-pooling**: the *largest* attention any single token of the sentence gets, from the same two views,
  relative to uniform (a sentence with one strongly attended entity name but many filler tokens reads low
  under mean-pooling);
* **cross-document attention**: the attention a sentence receives from the last token of every sentence of
  *another* document later in the prompt (attention is causal: a sentence can only be read by what follows
  it), relative to uniform over that source's prefix, averaged over the sources — per layer and head. A
  bridge sentence that names an entity should send attention to the entity's own paragraph.

Variants of the first stage (shipped blocks; + max; + cross; + both) are trained on the first ``--train``
questions of HotpotQA train (seeded shuffle) and measured on dev questions ``--select`` (default 200:400, not
the headline benchmark's 0:200), each without and with the shipped second stage (own + named_by_other), at a
budget of 1/3 in o200k tokens in HotpotQA's own sentences (``benchmarks/ablations/probe_ablation.py``'s evaluation).

The extra rows are computed inside the fast attention path (rag-opt's capture hook), never with
``output_attentions=True``. Per-question results are cached (``--cache``, default
``~/.cache/rag-opt/experiments/pooling``), so the script resumes.

    python benchmarks/ablations/pooling_ablation.py [--train 600] [--select 200:400]   # → results/pooling_ablation.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import data_dir
from probe_ablation import evaluate

from rag_opt.compressors.context_features import DEFAULT_CONTEXT
from rag_opt.compressors.features import BASE_BLOCKS, FeatureLayout, build_features
from rag_opt.models.extract import AttentionFeatures
from rag_opt.paths import cache_dir
from rag_opt.text.units import UnitTable
from rag_opt.training.datasets import read_hotpotqa
from rag_opt.training.logistic import cross_val_scores, train_logistic
from rag_opt.training.sentence_probe import choose_l2, fit_context_stage, unit_labels
from rag_opt.training.units import hotpot_units

RESULTS = Path(__file__).resolve().parents[1] / "results"
logger = logging.getLogger("pooling_ablation")
EPS = 1e-3


@dataclass
class Record:
    """What one forward pass gave for one question."""

    attn: AttentionFeatures  # the shipped mean-pooled features
    maxed: np.ndarray  # (U, V, L, H) max over a unit's tokens, relative to uniform
    cross: np.ndarray  # (L, H, S=U, U) attention from the end of unit s to unit u, relative to uniform
    unit_doc: np.ndarray  # (U,) document of each unit


def _install_hook() -> None:
    """Wrap the capture hook so it also records max-pooled rows and unit-end → unit attention."""
    import torch

    import rag_opt.models.capture as cap

    original = cap._record

    def record(capture: Any, module: Any, query: Any, key: Any, scaling: Any) -> int:
        layer = original(capture, module, query, key, scaling)
        extra = getattr(capture, "extra", None)
        if extra is None:
            return layer
        n_heads, head_dim = query.shape[1], query.shape[-1]
        scale = scaling if scaling is not None else head_dim**-0.5
        for b, item in enumerate(capture.items):
            k = key[b].index_select(1, item.ctx_pos).float()
            if k.shape[0] != n_heads:
                k = k.repeat_interleave(n_heads // k.shape[0], dim=0)
            q = query[b].index_select(1, item.q_rows).float()
            probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)  # (H, R, C)
            nq = item.n_question_rows
            views = torch.stack([probs[:, -1, :], probs[:, :nq, :].mean(dim=1) if nq else probs[:, -1, :]])
            idx = item.unit_of_ctx.expand(views.shape[0], n_heads, -1)
            mx = torch.zeros(views.shape[0], n_heads, item.n_units).scatter_reduce(
                2, idx, views, reduce="amax", include_self=False
            )
            # unit ends as query rows; causal: each sees the context tokens up to itself
            src = extra["src_pos"][b]
            qs = query[b].index_select(1, src).float()  # (H, S, d)
            logits = torch.matmul(qs, k.transpose(-1, -2)) * scale  # (H, S, C)
            future = item.ctx_pos[None, :] > src[:, None]  # (S, C)
            logits = logits.masked_fill(future[None], float("-inf"))
            p = torch.softmax(logits, dim=-1)
            per_unit = torch.zeros(n_heads, p.shape[1], item.n_units)
            per_unit.index_add_(2, item.unit_of_ctx, p)
            extra["max"].setdefault(b, {})[layer] = mx
            extra["cross"].setdefault(b, {})[layer] = per_unit
        return layer

    cap._record = record


def forward(proxy: Any, docs: list[list[str]], question: str, layers: int) -> Record:
    import torch

    import rag_opt.models.extract as ex
    from rag_opt.models.capture import Capture, CaptureItem, StopForward, capturing

    windows = ex._plan_windows(proxy, docs, question, min(4096, proxy.max_positions))
    if len(windows) != 1:
        raise RuntimeError("a question longer than one window")
    pr = ex._prompt(proxy, 0, windows[0], docs, question)
    unit_of = np.asarray(pr.unit_of)
    ctx = np.asarray(pr.ctx_pos)
    n_units = pr.n_units
    ends = np.zeros(n_units, dtype=np.int64)
    for u in range(n_units):
        pos = ctx[unit_of == u]
        ends[u] = pos.max() if len(pos) else (ctx[unit_of < u].max() if (unit_of < u).any() else ctx[0])
    item = CaptureItem(
        ctx_pos=torch.tensor(pr.ctx_pos),
        unit_of_ctx=torch.tensor(pr.unit_of),
        n_units=n_units,
        q_rows=torch.tensor(pr.q_rows + [len(pr.ids) - 1]),
        n_question_rows=len(pr.q_rows),
    )
    capture = Capture(items=[item], stop_after=layers - 1 if layers < proxy.num_layers else None)
    capture.extra = {"src_pos": [torch.tensor(ends)], "max": {}, "cross": {}}  # type: ignore[attr-defined]
    with capturing(capture), torch.inference_mode():
        proxy.threads.apply()
        base = getattr(proxy.model, "model", None) or proxy.model.base_model
        try:
            base(input_ids=torch.tensor([pr.ids]), use_cache=False)
        except StopForward:
            pass
    n_ctx = len(pr.ctx_pos)
    sums = torch.stack([capture.sums[i][0] for i in range(layers)]).permute(3, 1, 0, 2).numpy()  # (U,V,L,H)
    counts = np.bincount(unit_of, minlength=n_units)
    attn = ex._assemble(docs, [(pr, ex._Read(sums, counts, n_ctx))], layers, proxy.num_heads)
    extra = capture.extra  # type: ignore[attr-defined]
    maxed = torch.stack([extra["max"][0][i] for i in range(layers)]).permute(3, 1, 0, 2).numpy() * n_ctx
    cross = torch.stack([extra["cross"][0][i] for i in range(layers)]).numpy()  # (L, H, S, U)
    prefix = np.searchsorted(ctx, ends, side="right")  # context tokens each source row sees
    cross = cross * prefix[None, None, :, None] / np.maximum(counts, 1)[None, None, None, :]
    unit_doc = np.concatenate([[d] * len(u) for d, u in enumerate(docs)])
    return Record(attn, maxed.astype(np.float32), cross.astype(np.float16), unit_doc)


def save(path: Path, r: Record) -> None:
    a = r.attn
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(
        tmp,
        unit=a.unit,
        doc_mass=a.doc_mass,
        unit_tokens=a.unit_tokens,
        meta=np.array([a.context_tokens, a.windows]),
        maxed=r.maxed,
        cross=r.cross,
        unit_doc=r.unit_doc,
    )
    tmp.replace(path)


def load(path: Path) -> Record:
    z = np.load(path)
    attn = AttentionFeatures(z["unit"], z["doc_mass"], z["unit_tokens"], int(z["meta"][0]), int(z["meta"][1]))
    return Record(attn, z["maxed"], z["cross"], z["unit_doc"])


def max_block(r: Record) -> np.ndarray:
    """log max-pooled attention per view, layer and head, raw and centred on the context's mean."""
    x = np.log(EPS + r.maxed.reshape(len(r.maxed), -1))
    return np.concatenate([x, x - x.mean(axis=0, keepdims=True)], axis=1)


def cross_block(r: Record) -> np.ndarray:
    """Mean attention (log, relative to uniform) a unit gets from later sentence ends of other documents, per
    layer and head, plus a flag for units no other document follows."""
    L, H, S, U = r.cross.shape
    src_doc, tgt_doc = r.unit_doc[:, None], r.unit_doc[None, :]
    later = np.arange(S)[:, None] > np.arange(U)[None, :]
    ok = (src_doc != tgt_doc) & later  # (S, U)
    n = ok.sum(axis=0)
    c = r.cross.astype(np.float32)
    mean = (c * ok[None, None]).sum(axis=2) / np.maximum(n, 1)  # (L, H, U)
    feat = np.log(EPS + mean.reshape(L * H, U).T)
    feat[n == 0] = 0.0
    return np.concatenate([feat, (n == 0)[:, None].astype(np.float64)], axis=1)


def features(variant: tuple[str, ...], layout: FeatureLayout, ex: Any, r: Record, units: UnitTable) -> np.ndarray:
    parts = [build_features(layout, r.attn, ex.question, units)]
    if "max" in variant:
        parts.append(max_block(r))
    if "cross" in variant:
        parts.append(cross_block(r))
    return np.concatenate(parts, axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=600, help="HotpotQA train questions (seeded shuffle prefix)")
    ap.add_argument("--select", default="200:400", help="dev questions (slice of the seeded shuffle)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ratio", type=float, default=1 / 3)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--extract-only", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "pooling_ablation.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dd = data_dir() / "hotpotqa"
    if not (dd / "train.jsonl.gz").exists():
        raise SystemExit(f"HotpotQA not found under {dd}: this benchmark needs ../shared/data (see its README)")
    a, b = (int(x) for x in args.select.split(":"))
    train = read_hotpotqa(dd / "train.jsonl.gz", seed=0, limit=args.train)
    dev = read_hotpotqa(dd / "dev.jsonl.gz", seed=0, limit=b)[a:b]
    root = Path(args.cache) if args.cache else cache_dir() / "experiments" / "pooling" / f"bf16-L{args.layers}"
    root.mkdir(parents=True, exist_ok=True)
    todo = [ex for ex in [*dev, *train] if not (root / f"{ex.id}.npz").exists()]
    if todo:
        import torch
        from tqdm.auto import tqdm

        from rag_opt.models.loader import load_proxy_model
        from rag_opt.models.threads import ThreadPolicy

        torch.set_num_threads(1)
        _install_hook()
        proxy = load_proxy_model("embedded:smollm2-135m", dtype="bfloat16")
        proxy.threads = ThreadPolicy(1)
        for ex in tqdm(todo, desc="forward passes", mininterval=10.0):
            save(root / f"{ex.id}.npz", forward(proxy, hotpot_units(ex), ex.question, args.layers))
    if args.extract_only:
        return
    recs = {ex.id: load(root / f"{ex.id}.npz") for ex in [*train, *dev]}
    any_rec = next(iter(recs.values()))
    layout = FeatureLayout(BASE_BLOCKS, any_rec.attn.num_layers, any_rec.attn.num_heads)
    results: dict[str, Any] = {}
    for variant in [(), ("max",), ("cross",), ("max", "cross")]:
        name = "+".join(("mean (shipped)", *variant))
        xs, ys, gs, tables = [], [], [], []
        for g, ex in enumerate(train):
            units = UnitTable.titled(hotpot_units(ex))
            X = features(variant, layout, ex, recs[ex.id], units)
            cand = units.candidate
            lab = np.concatenate([[False, *lab] for lab in unit_labels(ex)])
            xs.append(X[cand])
            ys.append(lab[cand])
            gs.append(np.full(int(cand.sum()), g))
            tables.append(units)
        X, y, groups = np.concatenate(xs), np.concatenate(ys).astype(np.float64), np.concatenate(gs)
        l2 = choose_l2(X, y, groups)[0]
        mean, scale, w, bias = train_logistic(X, y, l2=l2)
        held = cross_val_scores(X, y, groups, l2=l2)
        stage = fit_context_stage(tables, held, y, DEFAULT_CONTEXT)  # the shipped second stage, same fit

        def first(ex: Any, r: Record, units: UnitTable, v: tuple[str, ...] = variant, p: Any = (mean, scale, w, bias)):
            return ((features(v, layout, ex, r, units) - p[0]) / p[1]) @ p[2] + p[3]

        def second(ex: Any, r: Record, units: UnitTable, stage: Any = stage) -> np.ndarray:
            return stage.decision(first(ex, r, units), units)

        feats = {ex.id: recs[ex.id] for ex in dev}
        for label, fn in (("first stage", first), ("with context stage", second)):
            r = evaluate(dev, feats, lambda ex, rec, units, fn=fn: fn(ex, rec, units), args.ratio)
            r["features"] = int(X.shape[1])
            r["l2"] = l2
            results[f"{name} | {label}"] = r
            logger.info("%s | %s: %s", name, label, r)
    out = {"train": len(train), "dev": len(dev), "select": args.select, "layers": args.layers, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"train {len(train)} questions, dev {args.select}, ratio {args.ratio:.3f}")
    print(f"{'variant':<55} {'sf_recall':>9} {'all_kept':>9} {'answer':>7} {'feats':>6}")
    for k, r in results.items():
        rec, allk, ans = r["sf_recall"], r["all_facts_kept"], r["answer_retention"]
        print(f"{k:<55} {rec:>9.3f} {allk:>9.3f} {ans:>7.3f} {r['features']:>6}")


if __name__ == "__main__":
    main()

"""LongLLMLingua baseline on HotpotQA dev, run on rag-opt's own embedded SmolLM2-135M weights.

    python benchmarks/llmlingua_baseline.py --hotpot 50 --ratios 1/2,1/3,1/5   # → benchmarks/results/llmlingua.json

Install into the project venv (not a project dependency; a pure-Python wheel, installed without its dependency
pins so the project's torch / transformers 5 / tiktoken stay as they are; ``nltk`` and ``pyyaml`` are its only
other imports and were already in the venv, the second command is a no-op there)::

    /work/venv/bin/pip install --no-deps llmlingua==0.2.2
    /work/venv/bin/pip install nltk pyyaml

How it runs, with nothing in llmlingua patched:

* Model: ``llmlingua.PromptCompressor(model_name=<folder>, device_map="cpu",
  model_config={"trust_remote_code": False})`` where ``<folder>`` is
  ``rag_opt.models.gguf.converted_gguf_dir(rag_opt.models.sources.resolve_source(None))`` — the same embedded
  SmolLM2-135M weights rag-opt's probe reads, converted to a local transformers folder (float32, CPU). That conversion's
  config.json has no ``architectures`` field, which llmlingua's ``load_model`` iterates, so the compressor is
  loaded from a temporary view of the folder (symlinked weights/tokenizer, config.json copy with
  ``architectures: ["LlamaForCausalLM"]``); the cached folder is not modified.
* tiktoken: ``PromptCompressor.__init__`` calls ``tiktoken.encoding_for_model("gpt-3.5-turbo")``, which would
  download the BPE file; ``rag_opt.text.tokens.get_token_counter("cl100k_base")`` is called first, which writes the
  hash-verified file into tiktoken's cache, so the constructor finds it offline.
* KV cache: llmlingua 0.2.2 expects transformers-4 tuple caches (``past_key_values[0][0].shape[2]``, slicing a
  list of ``(k, v)`` per layer; upstream issues #210/#215), while transformers 5 returns ``Cache`` objects and
  no longer accepts tuples. We run in the project's own environment (transformers 5) and, after construction,
  replace ``compressor.model`` with :class:`TupleCacheLM`, a thin ``nn.Module`` wrapper whose ``forward`` turns
  an incoming tuple/list cache into a ``DynamicCache`` and the outgoing cache back into a tuple of ``(k, v)``
  per layer. Logits and losses are those of the unwrapped model.
* nltk: only ``use_sentence_level_filter=True`` reaches ``nltk.sent_tokenize`` (which needs the punkt data).
  We keep LongLLMLingua's default ``use_sentence_level_filter=False`` (as its README's RAG recipe does), so
  no nltk data is needed; nltk is merely imported.

Call, as LongLLMLingua's README recommends for RAG (question-aware coarse ranking, then token-level pruning):
``compress_prompt(documents, question=q, rate=r, condition_in_question="after_condition",
reorder_context="sort", dynamic_context_compression_ratio=0.3, condition_compare=True, context_budget="+100",
rank_method="longllmlingua", concate_question=False)``. ``reorder_context="sort"`` is kept: every metric below
searches the whole compressed string, so document order does not matter. ``concate_question=False`` so the
output is the compressed context alone (the question is not appended and not counted). Note llmlingua's
``rate`` is in SmolLM2 tokens and is computed over question + context; the achieved ratio reported here is
measured independently in o200k tokens.

Data and metrics match ``benchmarks/compression.py``: the same first N questions of
``read_hotpotqa(data_dir()/"hotpotqa"/"dev.jsonl.gz", seed=0)``; one document per paragraph, ``"title\\ntext"``.

* ``sf_recall``: share of supporting sentences whose whitespace-normalised text appears verbatim in the
  whitespace-normalised compressed prompt. LLMLingua drops tokens inside sentences, so this is strict: a
  sentence with one dropped token counts as lost. (``compression.py``'s sentence selectors keep or drop whole
  sentences, so for them the same test is natural.)
* ``all_facts_kept``: every supporting sentence of the question kept (same test).
* ``answer_retention``: ``contains_answer(compressed, answer)``; yes/no answers excluded.
* ``ratio`` / ``max_ratio``: o200k tokens of the compressed context / o200k tokens of the original context
  (the documents joined with ``"\\n\\n"``, as llmlingua joins them); mean and max.
* ``median_latency_s``: median wall time of one ``compress_prompt`` call (model already loaded).
* ``sf_word_recall`` (extra, lenient): mean over supporting sentences of the share of the sentence's
  whitespace words kept in order (longest common word subsequence with the whole compressed prompt / sentence
  length), to show how much of a fact survives when the sentence is broken. An upper bound: words may be
  matched in other documents.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from common import data_dir

from rag_opt.training.datasets import contains_answer, read_hotpotqa

logger = logging.getLogger("bench.llmlingua")
RESULTS = Path(__file__).resolve().parent / "results"
SAMPLES = 2
SAMPLE_CHARS = 600  # each sample keeps the first and the last 600 characters (the top-ranked document comes first
# and is pruned least; the tail shows the heavier token dropping)


def _make_wrapper() -> type:
    import torch
    from transformers import DynamicCache

    class TupleCacheLM(torch.nn.Module):
        """Causal LM that takes and returns transformers-4 style tuple KV caches (for llmlingua 0.2.2).

        ``forward`` turns an incoming tuple/list of ``(k, v)`` per layer into a ``DynamicCache``, runs the wrapped
        model, and returns ``logits`` plus the new cache as a tuple of ``(k, v)`` per layer (``past_key_values``,
        the two attributes llmlingua's ``get_ppl`` reads).
        """

        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.inner: Any = model
            self.config: Any = model.config
            params = inspect.signature(model.forward).parameters
            self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x

        @property
        def device(self) -> torch.device:
            return self.inner.device

        def forward(self, *args: Any, past_key_values: Any = None, **kwargs: Any) -> Any:
            if past_key_values is not None and not isinstance(past_key_values, DynamicCache):
                past_key_values = DynamicCache([(k, v) for k, v in past_key_values], config=self.config)
            out = self.inner(*args, **{self._cache_kw: past_key_values}, **kwargs)
            cache = out.get("cache", None)
            if cache is None:
                cache = out.get("past_key_values", None)
            if cache is not None and not isinstance(cache, tuple):
                cache = tuple((layer.keys, layer.values) for layer in cache.layers)
            return SimpleNamespace(logits=out.logits, past_key_values=cache)

    return TupleCacheLM


def load_compressor(model: str | None = None) -> tuple[Any, Path]:
    from rag_opt.models.gguf import converted_gguf_dir
    from rag_opt.models.sources import resolve_source
    from rag_opt.text.tokens import get_token_counter

    folder = converted_gguf_dir(resolve_source(model))
    get_token_counter("cl100k_base")  # seeds tiktoken's cache: PromptCompressor asks for gpt-3.5-turbo's encoding
    from llmlingua import PromptCompressor

    with tempfile.TemporaryDirectory(prefix="llmlingua-smollm2-") as tmp:
        view = _with_architectures(folder, Path(tmp))
        comp = PromptCompressor(model_name=str(view), device_map="cpu", model_config={"trust_remote_code": False})
    comp.model = _make_wrapper()(comp.model).eval()
    return comp, folder


def compress(comp: Any, docs: list[str], question: str, rate: float) -> str:
    """LongLLMLingua's RAG recipe (see the module docstring) on ``docs``; the compressed context alone."""
    import torch

    with torch.inference_mode():
        res = comp.compress_prompt(
            docs,
            question=question,
            rate=rate,
            condition_in_question="after_condition",
            reorder_context="sort",
            dynamic_context_compression_ratio=0.3,
            condition_compare=True,
            context_budget="+100",
            rank_method="longllmlingua",
            concate_question=False,
        )
    return str(res["compressed_prompt"])


def _with_architectures(folder: Path, tmp: Path) -> Path:
    """A view of ``folder`` whose config.json names its architecture (llmlingua reads ``config.architectures``).

    rag-opt's GGUF conversion writes no ``architectures`` field; llmlingua's ``load_model`` iterates it to pick
    the model class. The view symlinks every file (weights, tokenizer) and copies config.json with
    ``architectures`` set from the model type; the converted folder itself is left untouched.
    """
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures"):
        return folder
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    for f in folder.iterdir():
        if f.name != "config.json":
            (tmp / f.name).symlink_to(f.resolve())
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return tmp


def _norm(s: str) -> str:
    return " ".join(s.split())


def _lcs(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two word lists."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def hotpot_metrics(ex: Any, compressed: str, original: str, count: Any) -> dict[str, float | None]:
    text = _norm(compressed)
    words = text.split()
    hits, word_rec = [], []
    for p, s in sorted(ex.supporting):
        sent = _norm(ex.sentences[p][s])
        hits.append(not sent or sent in text)
        sw = sent.split()
        word_rec.append(_lcs(sw, words) / len(sw) if sw else 1.0)
    n_orig = count(original)
    return {
        "sf_recall": float(np.mean(hits)) if hits else None,
        "all_facts_kept": float(all(hits)) if hits else None,
        "answer_retention": None if ex.yes_no else float(contains_answer(compressed, ex.answer)),
        "ratio": count(compressed) / n_orig if n_orig else 0.0,
        "sf_word_recall": float(np.mean(word_rec)) if word_rec else None,
    }


def summarize(rows: list[dict[str, float | None]], latencies: list[float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in rows[0] if rows else []:
        vals = [float(v) for r in rows if (v := r[key]) is not None]
        if vals:
            out[key] = float(np.mean(vals))
    if rows:
        out["max_ratio"] = float(max(r["ratio"] or 0.0 for r in rows))
        out["answer_questions"] = float(sum(r["answer_retention"] is not None for r in rows))
    if latencies:
        out["median_latency_s"] = float(statistics.median(latencies))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    from rag_opt.text.tokens import get_token_counter

    if args.threads:
        torch.set_num_threads(args.threads)
    ratios = [float(Fraction(r)) for r in args.ratios.split(",")]
    hotpot = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.hotpot)
    count = get_token_counter("o200k_base").count
    t0 = time.perf_counter()
    comp, folder = load_compressor(args.model)
    load_s = time.perf_counter() - t0
    logger.info("llmlingua compressor loaded from %s in %.1f s", folder, load_s)
    by_ratio: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    for r in ratios:
        rows, lat = [], []
        for i, ex in enumerate(tqdm(hotpot, desc=f"LongLLMLingua r={r:.3f}")):
            docs = [f"{t}\n{ex.paragraph_text(p)}" for p, t in enumerate(ex.titles)]
            t = time.perf_counter()
            compressed = compress(comp, docs, ex.question, r)
            lat.append(time.perf_counter() - t)
            row = hotpot_metrics(ex, compressed, "\n\n".join(docs), count)
            rows.append(row)
            logger.info("q%d %s latency %.1f s %s", i, ex.id, lat[-1], json.dumps(row))
            if r == ratios[0] and i < SAMPLES:
                samples.append(
                    {
                        "id": ex.id,
                        "question": ex.question,
                        "answer": ex.answer,
                        "target_ratio": r,
                        "metrics": row,
                        "compressed": compressed[:SAMPLE_CHARS],
                        "compressed_tail": compressed[-SAMPLE_CHARS:],
                    }
                )
        by_ratio[f"{r:.3f}"] = summarize(rows, lat)
    setup = (
        "llmlingua==0.2.2 (pip install --no-deps) in the project venv with transformers "
        f"{__import__('transformers').__version__}, torch {torch.__version__}, CPU float32, "
        f"{torch.get_num_threads()} threads; model = rag-opt's embedded SmolLM2-135M ({folder.name}); "
        "compressor.model wrapped in TupleCacheLM (tuple <-> DynamicCache KV cache conversion), llmlingua "
        "unpatched; compress_prompt(rate=r, condition_in_question='after_condition', reorder_context='sort', "
        "dynamic_context_compression_ratio=0.3, condition_compare=True, context_budget='+100', "
        "rank_method='longllmlingua', concate_question=False); sentence-level filter off (no nltk data); "
        f"model load {load_s:.1f} s (not in latency)"
    )
    return {"questions": len(hotpot), "by_ratio": by_ratio, "samples": samples, "setup": setup}


def print_summary(results: dict[str, Any]) -> None:
    print(f"LongLLMLingua (SmolLM2-135M), HotpotQA dev: {results['questions']} questions")
    for r, m in results["by_ratio"].items():
        nan = float("nan")
        print(
            f"target {float(r):.3f}: sf_recall {m.get('sf_recall', nan):.3f} (strict, verbatim)  "
            f"all_facts_kept {m.get('all_facts_kept', nan):.3f}  answer {m.get('answer_retention', nan):.3f}  "
            f"ratio {m.get('ratio', nan):.3f} (max {m.get('max_ratio', nan):.3f})  "
            f"sf_word_recall {m.get('sf_word_recall', nan):.3f}  median latency {m.get('median_latency_s', nan):.1f} s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hotpot", type=int, default=50, help="HotpotQA dev questions (order as in compression.py)")
    ap.add_argument("--ratios", default="1/3", help="comma-separated target ratios, e.g. 1/2,1/3,1/5")
    ap.add_argument("--model", default=None, help="proxy model (default: rag-opt's embedded SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=str(RESULTS / "llmlingua.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not (data_dir() / "hotpotqa" / "dev.jsonl.gz").is_file():
        raise SystemExit(f"real data not found under {data_dir()}: this benchmark needs ../shared/data")
    results = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print_summary(results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Which layers' cached keys need 8 bits: each layer's keys alone at 4 bits, the rest unchanged (bf16).

Every question's documents are encoded once (bf16); for each arm the cache is filled from those same states with one
layer's keys quantized to 4 bits and decoded again (per channel over the block's tokens, as ``k4v2``; ``--rotated``:
rotated, one scale per token, as ``k4hv2``), and the sentence probe scores the same units from it. ``--formats``:
the arms are whole cache formats instead (every entry stored in the format and decoded, as the cache hands it out).
Reported per arm, against the bf16 arm on the same questions: the mean absolute change of a sentence's probe logit,
and the share of sentences whose place at a 1/3 budget (kept or not) changes. The layers that move the scores most
are the ones the ``w`` formats keep at 8 bits (``wide_key_layers`` in ``rag_opt.models.kv_codec``)::

    OMP_NUM_THREADS=1 python benchmarks/ablations/key_bits_by_layer.py --hotpot 80 \
        --out benchmarks/results/key_bits/layers.json
    OMP_NUM_THREADS=1 python benchmarks/ablations/key_bits_by_layer.py --hotpot 80 --rotated \
        --out benchmarks/results/key_bits/layers_rotated.json
    OMP_NUM_THREADS=1 python benchmarks/ablations/key_bits_by_layer.py --hotpot 80 \
        --formats int8,k8v2,k8v2q4,k4v4,k4v2,k4w4v2,k4w6v2,k4w6v2q4 --out benchmarks/results/key_bits/formats.json
    OMP_NUM_THREADS=1 python benchmarks/ablations/key_bits_by_layer.py --hotpot 80 \
        --formats k8v2,k4hv2,k4hw3v2,k4hw4v2q4,k4w5v2q4,k4w6v2q4 --out benchmarks/results/key_bits/formats_wide.json
    OMP_NUM_THREADS=1 python benchmarks/ablations/key_bits_by_layer.py --hotpot 80 \
        --formats k8v2,k8hv2,k4hw3v2,k4hw3hv2,k4w6hv2q4 --out benchmarks/results/key_bits/formats_rotated_values.json
    OMP_NUM_THREADS=1 python benchmarks/ablations/key_bits_by_layer.py --hotpot 80 \
        --formats k8v2,k6v2,k5v2,k5v2q4,k4hw3v2 --out benchmarks/results/key_bits/formats_bits.json
    OMP_NUM_THREADS=1 python benchmarks/ablations/key_bits_by_layer.py --hotpot 80 \
        --formats k8v2,k8hv2,k5v2q4,k5vh2,k5vh2q4,k6vh2q4 \
        --out benchmarks/results/key_bits/formats_bits_rotated_values.json
    OMP_NUM_THREADS=1 python benchmarks/ablations/key_bits_by_layer.py --hotpot 80 \
        --formats k8v2,k5vh2,k5vh2q6,k5w2vh2q4 --out benchmarks/results/key_bits/formats_k5_variants.json

A screen, not the verdict: a format's facts and answers kept are measured paired on 600 questions by
``benchmarks/cache_formats.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cache_formats import RecordingCache  # noqa: E402
from common import data_dir  # noqa: E402
from compression import ContextSpy, hotpot_documents  # noqa: E402

logger = logging.getLogger("bench.key_bits_by_layer")
RESULTS = Path(__file__).resolve().parents[1] / "results"
BIG = 8 << 30


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def _with_layer_keys(raw: dict[str, Any], layers: list[int], rotated: bool) -> dict[str, Any]:
    """``raw`` with the keys of ``layers`` quantized to 4 bits and decoded back (bf16)."""
    import torch

    from rag_opt.models.kv_quant import dequantized, hadamard, quant

    out: dict[str, Any] = {}
    for key, v in raw.items():
        if v.dim() != 5 or v.shape[3] == 0:
            out[key] = v
            continue
        v = v.clone()
        d = int(v.shape[4])
        for layer in layers:
            x = v[0, layer : layer + 1].float()
            t: dict[str, torch.Tensor] = {}
            if rotated:
                quant(x @ hadamard(d), 4, dim=3, prefix="k", out=t)
                back = dequantized(t, "k", 4, d, 1) @ hadamard(d)
            else:
                quant(x, 4, dim=2, prefix="k", out=t)
                back = dequantized(t, "k", 4, d, 1)
            v[0, layer] = back[0].to(v.dtype)
        out[key] = v
    return out


def _screened() -> dict[str, Any]:
    """Formats screened here but not shipped (:data:`rag_opt.models.kv_codec.FORMATS` holds the shipped ones)."""
    from rag_opt.models.kv_codec import KVFormat

    return {
        f.name: f
        for f in (
            KVFormat("k4w4v2", 4, 2, 8, wide_key_layers=(7, 8, 14, 15)),
            KVFormat("k4w6v2", 4, 2, 8, wide_key_layers=(5, 7, 8, 9, 14, 15)),
            KVFormat("k8v2q4", 8, 2, 4),
            KVFormat("k4hw4v2q4", 4, 2, 4, key_rotated=True, wide_key_layers=(7, 9, 14, 15)),
            KVFormat("k4w5v2q4", 4, 2, 4, wide_key_layers=(7, 8, 9, 14, 15)),
            KVFormat("k5v2", 5, 2, 8),
            KVFormat("k5v2q4", 5, 2, 4),
            KVFormat("k6v2", 6, 2, 8),
            KVFormat("k8hv2", 8, 2, 8, value_rotated=True),
            KVFormat("k4hw3hv2", 4, 2, 8, key_rotated=True, wide_key_layers=(7, 14, 15), value_rotated=True),
            KVFormat("k4w6hv2q4", 4, 2, 4, wide_key_layers=(5, 7, 8, 9, 14, 15), value_rotated=True),
            # "vh": rotated values after unrotated keys ("k5h" would read as rotated keys)
            KVFormat("k5vh2q4", 5, 2, 4, value_rotated=True),
            KVFormat("k6vh2q4", 6, 2, 4, value_rotated=True),
            KVFormat("k5w2vh2q4", 5, 2, 4, wide_key_layers=(7, 15), value_rotated=True),
        )
    }


def _through_format(raw: dict[str, Any], fmt: str) -> dict[str, Any]:
    """``raw`` stored in ``fmt`` and decoded back (the model's dtype), as a cache of that format hands it out."""
    from rag_opt.models.kv_codec import FORMATS, encode_states

    spec = FORMATS.get(fmt) or _screened().get(fmt)
    if spec is None:
        raise SystemExit(f"unknown format {fmt!r}: use {', '.join([*FORMATS, *_screened()])}")
    return {k: encode_states(v, spec).decode() for k, v in raw.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from rag_opt.compressors.sentinel import SentinelCompressor
    from rag_opt.models import question_buffer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.parallel_features import CROSS_READS
    from rag_opt.pipeline import ContextOptimizer
    from rag_opt.training.datasets import read_hotpotqa

    hotpot = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.offset + args.hotpot)
    hotpot = hotpot[args.offset :]
    sentinel = SentinelCompressor.from_model(None, encoding="parallel")
    spy = ContextSpy(sentinel)
    opt = ContextOptimizer(scorer=spy)
    depth = 16
    arms: dict[str, Any] = {}
    if args.formats:  # whole formats, through the codec
        arms.update({f: f for f in args.formats.split(",") if f})
    else:
        arms["all"] = list(range(depth))
        arms.update({f"L{layer}": [layer] for layer in range(depth)})
    delta: dict[str, list[float]] = {a: [] for a in arms}
    flips: dict[str, list[float]] = {a: [] for a in arms}
    for ex in tqdm(hotpot, desc="hotpot", mininterval=10):
        docs, _ = hotpot_documents(ex, args.titles)
        rec = RecordingCache()
        sentinel.cache = rec
        opt.optimize(ex.question, docs, ratio=1 / 3)
        assert spy.last is not None
        question, units = spy.last

        def scores(raw: dict[str, Any], question: str = question, units: Any = units) -> np.ndarray:
            cache = EncodingCache(BIG, format="bf16")
            for k, v in raw.items():
                cache.put(k, v)
            sentinel.cache = cache
            CROSS_READS.clear()
            question_buffer.forget(sentinel.proxy)
            return np.asarray(sentinel.score(question, units).unit, dtype=np.float64)

        base = scores(rec.raw)
        if base.size < 3:
            continue
        k = max(1, round(base.size / 3))
        kept = set(np.argsort(-base, kind="stable")[:k].tolist())
        for arm, layers in arms.items():
            if isinstance(layers, str):
                s = scores(_through_format(rec.raw, layers))
            else:
                s = scores(_with_layer_keys(rec.raw, layers, args.rotated))
            delta[arm].append(float(np.mean(np.abs(_logit(s) - _logit(base)))))
            kept_arm = set(np.argsort(-s, kind="stable")[:k].tolist())
            flips[arm].append(len(kept ^ kept_arm) / base.size)
    return {
        "questions": len(next(iter(delta.values()))),
        "titles": args.titles,
        "rotated": bool(args.rotated),
        "formats": args.formats,
        "arms": {a: {"logit_change": float(np.mean(delta[a])), "kept_changes": float(np.mean(flips[a]))} for a in arms},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hotpot", type=int, default=60, help="HotpotQA dev questions")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--titles", default="field", choices=["field", "none"])
    ap.add_argument("--rotated", action="store_true", help="rotated keys, one scale per token (k4hv2's)")
    ap.add_argument("--formats", default="", help="arms: these cache formats whole (e.g. k8v2,k4v2) instead of layers")
    ap.add_argument("--out", default=str(RESULTS / "key_bits" / "layers.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not (data_dir() / "hotpotqa" / "dev.jsonl.gz").exists():
        logger.warning("skipped: HotpotQA not found under %s (see ../shared/data/README)", data_dir())
        return
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=1))
    ranked = sorted(res["arms"].items(), key=lambda kv: -kv[1]["logit_change"])
    for arm, v in ranked:
        logger.info("%-4s logit change %.4f  kept changes %.4f", arm, v["logit_change"], v["kept_changes"])


if __name__ == "__main__":
    main()

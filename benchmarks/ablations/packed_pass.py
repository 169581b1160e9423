"""Cold requests with packed document passes against the length-sorted padded batches they replaced, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/ablations/packed_pass.py --questions 8 --pass-tokens 1536,3072,6144

A cold parallel-encoding request reads each of its documents in a *document pass* (``prefix + block``). They used
to run as batches of blocks of about one length, sorted and right-padded (a new batch past 1.2x the shortest);
:mod:`rag_opt.models.document_pass` now packs them one after the other into one row, each attending causally to
itself only. This script times cold ``optimize()`` calls (an empty encoding cache each time) of held-out HotpotQA
dev questions padded with the next questions' paragraphs (``benchmarks/encoding.py``'s contexts) under four arms in a
rotating order per question:

* **packed**: the shipped document passes (at most :data:`rag_opt.models.document_pass.PASS_TOKENS` tokens a
  pass), and with ``--pass-tokens`` the same at other pass sizes (``packed_<n>``);
* **padded**: the previous ones, reproduced below as they were;
* **per document**: one pass per document (``batch_tokens=1``: nothing shares a pass);
* **joint**: ``encoding="joint"``, the same ordering (``input`` by default: the joint encoding then reads the
  sentence probe's 16 layers, as the parallel arms do).

Writes ``results/packed_pass.json``. Reported per size: median latency of each arm, the per-question median ratio
to packed, and how often each other parallel arm kept exactly the packed arm's context.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: encoding.py and its siblings
from encoding import contexts  # noqa: E402

from rag_opt.models import document_pass  # noqa: E402
from rag_opt.models.capture import Capture, StopForward, capturing  # noqa: E402
from rag_opt.models.encoding_cache import EncodingCache  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.work import checkpoint  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.loader import ProxyModel

RESULTS = Path(__file__).resolve().parents[1] / "results"
logger = logging.getLogger("bench.packed_pass")
BASE_ARMS = ("packed", "padded", "per_document", "joint")


def padded_encode(
    proxy: ProxyModel,
    prefix: Sequence[int],
    blocks: Sequence[Sequence[int]],
    depth: int,
    batch_tokens: int,
    sources: Sequence[Sequence[int]] | None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor] | None]:
    """The previous ``document_pass._encode``: blocks sorted by length, right-padded into batches of one length."""
    order = sorted(range(len(blocks)), key=lambda i: len(blocks[i]))
    out: list[torch.Tensor | None] = [None] * len(blocks)
    queries: list[torch.Tensor | None] = [None] * len(blocks)
    prefix_states: torch.Tensor | None = None
    batch: list[int] = []
    p = len(prefix)
    for i in [*order, -1]:
        width = p + len(blocks[i]) if i >= 0 else 0
        if batch and (
            i < 0 or width * (len(batch) + 1) > batch_tokens or width > 1.2 * (p + len(blocks[batch[0]])) + 8
        ):
            checkpoint()
            rows = None if sources is None else [sources[j] for j in batch]
            pre, states, qs = _padded_run(proxy, prefix, [blocks[j] for j in batch], depth, rows)
            prefix_states = pre if prefix_states is None else prefix_states
            for k, (j, s) in enumerate(zip(batch, states, strict=True)):
                out[j] = s
                queries[j] = None if qs is None else qs[k]
            batch = []
        if i >= 0:
            batch.append(i)
    assert prefix_states is not None
    kept = None if sources is None else [q for q in queries if q is not None]
    return prefix_states, [s for s in out if s is not None], kept


def _padded_run(
    proxy: ProxyModel,
    prefix: Sequence[int],
    blocks: Sequence[Sequence[int]],
    depth: int,
    sources: Sequence[Sequence[int]] | None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor] | None]:
    import torch

    dev = proxy.device
    p = len(prefix)
    width = p + max(len(b) for b in blocks)
    pad = proxy.tokenizer.pad_token_id
    pad = pad if pad is not None else proxy.tokenizer.eos_token_id or 0
    ids = torch.tensor([[*prefix, *b] + [pad] * (width - p - len(b)) for b in blocks], device=dev)
    capture = Capture(items=[], stop_after=depth - 1 if depth < proxy.num_layers else None, keep_kv=True)
    if sources is not None:
        capture.keep_q = [torch.tensor([p + i for i in rows], dtype=torch.long, device=dev) for rows in sources]
    base = getattr(proxy.model, "model", None) or proxy.model.base_model
    with capturing(capture), proxy.lock, torch.inference_mode():
        if dev == "cpu":
            proxy.threads.apply()
        try:
            base(input_ids=ids, use_cache=False)
        except StopForward:
            pass
        keys = torch.stack([capture.kv[layer][0] for layer in range(depth)], dim=1)
        values = torch.stack([capture.kv[layer][1] for layer in range(depth)], dim=1)
        both = torch.stack([keys, values], dim=1).cpu()
        queries = None
        if sources is not None:
            queries = [
                torch.stack([capture.q[layer][b] for layer in range(depth)]).cpu().clone() for b in range(len(blocks))
            ]
    prefix_states = both[0, :, :, :, :p].clone()
    return prefix_states, [both[b, :, :, :, p : p + len(blk)].clone() for b, blk in enumerate(blocks)], queries


SHIPPED = document_pass._encode
SHIPPED_PASS_TOKENS = document_pass.PASS_TOKENS
ENCODERS = {
    "packed": SHIPPED,
    "padded": padded_encode,
    # one pass per document: a pass limit of one token puts every block in a pass of its own
    "per_document": lambda proxy, prefix, blocks, depth, _tokens, sources: SHIPPED(
        proxy, prefix, blocks, depth, 1, sources
    ),
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(x) for x in args.pass_tokens.split(",")] if args.pass_tokens else []
    arms = (*BASE_ARMS, *(f"packed_{n}" for n in sizes))
    cache = EncodingCache(max_bytes=512 * 2**20)
    par = ContextOptimizer(encoding="parallel", cache=cache, threads=args.threads, ordering=args.ordering)
    joint = ContextOptimizer(encoding="joint", threads=args.threads, ordering=args.ordering)
    for opt in (par, joint):
        opt.optimize("What is this about?", [{"text": "Warm-up text."}])
    out: dict[str, Any] = {"config": vars(args), "sizes": {}}
    for size in [int(x) for x in args.sizes.split(",")]:
        rows: list[dict[str, float]] = []
        same = {a: 0 for a in arms if a not in ("packed", "joint")}
        for qi, (question, _, docs) in enumerate(contexts(args.questions, size)):
            row: dict[str, float] = {}
            kept: dict[str, str] = {}
            for arm in arms[qi % len(arms) :] + arms[: qi % len(arms)]:
                if arm == "joint":
                    t = time.perf_counter()
                    joint.optimize(question, docs)
                else:
                    document_pass._encode = ENCODERS[arm.split("_")[0] if arm.startswith("packed") else arm]
                    if arm.startswith("packed_"):
                        document_pass.PASS_TOKENS = int(arm.split("_")[1])
                    try:
                        cache.clear()
                        t = time.perf_counter()
                        res = par.optimize(question, docs)
                    finally:
                        document_pass._encode, document_pass.PASS_TOKENS = SHIPPED, SHIPPED_PASS_TOKENS
                    assert res.cache_misses >= len(docs)
                    kept[arm] = res.context()
                row[arm] = (time.perf_counter() - t) * 1e3
            for arm in same:
                same[arm] += kept[arm] == kept["packed"]
            rows.append(row)
            logger.info("N=%d q%d %s", size, qi, {k: round(v) for k, v in row.items()})
        out["sizes"][str(size)] = {
            "rows": rows,
            "median_ms": {a: statistics.median(r[a] for r in rows) for a in arms},
            "median_ratio_to_packed": {a: statistics.median(r[a] / r["packed"] for r in rows) for a in arms},
            "same_context_as_packed": same,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--sizes", default="10,40")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ordering", default="input")
    ap.add_argument("--pass-tokens", default="", help="other pass sizes to time, comma-separated (e.g. 1536,6144)")
    ap.add_argument("--out", default=str(RESULTS / "packed_pass.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"cold optimize(), {args.questions} questions a size, ordering {args.ordering}, {args.threads} thread(s)")
    print(f"packed: passes of at most {SHIPPED_PASS_TOKENS} tokens (document_pass.PASS_TOKENS)")
    for n, r in res["sizes"].items():
        arms = list(r["median_ms"])
        print(f"{'N':>4} " + " ".join(f"{a + ' ms':>16}" for a in arms) + "   ratio to packed (median per question)")
        ms = " ".join(f"{r['median_ms'][a]:16.0f}" for a in arms)
        ratios = ", ".join(f"{a} {r['median_ratio_to_packed'][a]:.2f}x" for a in arms if a != "packed")
        print(f"{n:>4} {ms}   {ratios}; same kept context: {r['same_context_as_packed']} of {len(r['rows'])}")


if __name__ == "__main__":
    main()

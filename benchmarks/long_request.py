"""One huge request against the proxy's time budget (issue 52, A1): is it answered within its budget, is the model
worker free again soon after, and does a normal request sent 2 s later get the model tier?

Starts the deterministic upstream of ``load.py`` and ``rag-opt serve`` (embedded model, parallel encoding) on
loopback, warms the model with one normal ``/v1/compress`` request, then for each huge request:

1. sends it to ``/v1/compress`` and times the answer (its ``status``, ``tier`` and ``reason``);
2. from the answer on, polls ``ragopt_optimizer_workers_busy`` in ``/metrics`` until the worker is free: the
   seconds the worker stayed busy after the answer;
3. 2 s after the answer, sends a normal request (10 HotpotQA paragraphs) and records which tier answered it.

The huge requests: one document of ~1 MB of short sentences (16,000: past ``--max-proxy-tokens``, refused before
any model work), and one just under the proxy-token limit (~60,000 proxy tokens: the model tier would need far more
than the budget, so it is cancelled at the budget and the lexical tier answers)::

    OMP_NUM_THREADS=1 python benchmarks/long_request.py          # → benchmarks/results/long_request.json

Targets: each huge request answered within its budget + 10 %; the worker busy for ≤ 2 s after any answer; the
normal request 2 s later optimized by the model tier.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from load import free_port, parse_metrics, peak_rss_mb, wait_http

logger = logging.getLogger("bench.long_request")
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
EXAMPLES = HERE.parent / "examples"
WORDS = "river mountain city honey water treatment winter paper museum station bridge island".split()


def huge_document(sentences: int, seed: int = 0) -> str:
    rnd = random.Random(seed)
    return " ".join(
        " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(4, 9))).capitalize() + "." for _ in range(sentences)
    )


def normal_request() -> dict[str, Any]:
    docs = [json.loads(line) for line in (EXAMPLES / "hotpotqa_docs.jsonl").read_text().splitlines() if line.strip()]
    question = (EXAMPLES / "hotpotqa_question.txt").read_text().strip()
    return {"question": question, "documents": docs, "ratio": 0.33}


def busy(client: httpx.Client, base: str) -> float:
    return parse_metrics(client.get(f"{base}/metrics").text).get("ragopt_optimizer_workers_busy", 0.0)


def trial(client: httpx.Client, base: str, name: str, body: dict[str, Any], budget_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = client.post(f"{base}/v1/compress", json=body)
    answer_s = time.perf_counter() - t0
    out = r.json()
    t_answer = time.perf_counter()
    busy_after = None
    while time.perf_counter() - t_answer < 120:
        if busy(client, base) == 0:
            busy_after = time.perf_counter() - t_answer
            break
        time.sleep(0.05)
    time.sleep(max(0.0, 2.0 - (time.perf_counter() - t_answer)))
    nxt = client.post(f"{base}/v1/compress", json=normal_request()).json()
    res = {
        "request": name,
        "chars": sum(len(d) if isinstance(d, str) else len(d["text"]) for d in body["documents"]),
        "http": r.status_code,
        "answer_s": answer_s,
        "budget_s": budget_s,
        "within_budget_plus_10pct": answer_s <= 1.1 * budget_s,
        "status": out.get("status"),
        "tier": out.get("tier"),
        "reason": out.get("reason"),
        "worker_busy_after_answer_s": busy_after,
        "next_request": {"status": nxt.get("status"), "tier": nxt.get("tier"), "reason": nxt.get("reason")},
    }
    logger.info(
        "%-28s %.0f kB: answered in %.2f s (budget %.1f s) %s/%s (%s); worker busy %.2f s after; next: %s/%s",
        name,
        res["chars"] / 1e3,
        answer_s,
        budget_s,
        res["status"],
        res["tier"],
        res["reason"],
        busy_after if busy_after is not None else float("nan"),
        res["next_request"]["status"],
        res["next_request"]["tier"],
    )
    return res


def mcp_trial(budget_ms: float, document: str) -> dict[str, Any]:
    """``rag-opt mcp --time-budget-ms`` on raw stdio: one call over ``document`` timed from the request to its
    answer (the budget's error, or the result), and a ping after it."""
    import select

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rag_opt.cli", "mcp", "--time-budget-ms", str(budget_ms)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def send(msg: dict[str, Any]) -> None:
        proc.stdin.write(json.dumps(msg).encode() + b"\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]

    def reply() -> dict[str, Any]:
        ready, _, _ = select.select([proc.stdout], [], [], 900)
        if not ready:
            raise RuntimeError("rag-opt mcp did not answer within 15 minutes")
        return dict(json.loads(proc.stdout.readline()))  # type: ignore[union-attr]

    try:
        init = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}
        send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init})
        reply()
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        # warm: the model loads before the budget starts (once)
        warm = {"question": "Which river is it?", "documents": ["The Rhine is a river."]}
        send(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {"name": "optimize_context", "arguments": warm},
            }
        )
        reply()
        args = {"question": "Which river is it?", "documents": [document]}
        t = time.perf_counter()
        send(
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": "optimize_context", "arguments": args},
            }
        )
        answer = reply()
        s = time.perf_counter() - t
        t = time.perf_counter()
        send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
        reply()
        ping_s = time.perf_counter() - t
        result = answer.get("result", {})
        text = " ".join(c.get("text", "") for c in result.get("content", []))[:200]
        out = {
            "chars": len(document),
            "answer_s": s,
            "budget_s": budget_ms / 1e3,
            "within_budget_plus_10pct": s <= 1.1 * budget_ms / 1e3,
            "is_error": result.get("isError"),
            "message": text,
            "ping_after_s": ping_s,
        }
        logger.info(
            "MCP, %.0f kB: answered in %.2f s (budget %.1f s), error=%s: %s",
            len(document) / 1e3,
            s,
            budget_ms / 1e3,
            out["is_error"],
            text[:100],
        )
        return out
    finally:
        proc.kill()
        proc.wait(10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    up_port, proxy_port = free_port(), free_port()
    up_url, base = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{proxy_port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        [sys.executable, str(HERE / "load.py"), "--serve-upstream", str(up_port)], env=env, start_new_session=True
    )
    log = tempfile.NamedTemporaryFile(prefix="rag-opt-long-request-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "rag_opt.cli", "serve", "--upstream", f"{up_url}/v1", "--port", str(proxy_port)]
    cmd += ["--time-budget-ms", str(args.time_budget_ms), "--encoding", "parallel"]
    proxy = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    budget_s = args.time_budget_ms / 1e3
    try:
        wait_http(f"{up_url}/v1/models", up, 60, lambda r: r.status_code in (200, 400, 404))
        wait_http(f"{base}/healthz", proxy, 600, lambda r: r.json().get("optimizer") in ("ready", "failed"))
        with httpx.Client(timeout=600) as client:
            warm = client.post(f"{base}/v1/compress", json=normal_request()).json()
            logger.info("warm-up: %s/%s", warm.get("status"), warm.get("tier"))
            trials = [
                trial(
                    client,
                    base,
                    "1 MB, 16,000 sentences",
                    {"question": "Which river is it?", "documents": [huge_document(16_000)]},
                    budget_s,
                ),
                trial(
                    client,
                    base,
                    "under the token limit",
                    {"question": "Which river is it?", "documents": [huge_document(args.under_sentences, seed=1)]},
                    budget_s,
                ),
            ]
        mcp = mcp_trial(args.time_budget_ms, huge_document(args.under_sentences, seed=1))
        return {
            "time_budget_ms": args.time_budget_ms,
            "trials": trials,
            "mcp": mcp,
            "proxy_peak_rss_mb": peak_rss_mb(proxy.pid),
        }
    finally:
        for p in (proxy, up):
            p.terminate()
        for p in (proxy, up):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-budget-ms", type=float, default=10_000)
    ap.add_argument(
        "--under-sentences", type=int, default=6_000, help="sentences of the request under the proxy-token limit"
    )
    ap.add_argument("--out", default=str(RESULTS / "long_request.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

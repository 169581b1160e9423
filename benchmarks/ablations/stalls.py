"""Stalls: how responsive the proxy stays while an adversarial request is in flight (issue 21, defects 2, 5, 7-10).

    python benchmarks/ablations/stalls.py                  # → benchmarks/results/stalls.json (a few minutes)
    python benchmarks/ablations/stalls.py --report-only    # show the saved results

Starts its own servers on 127.0.0.1, as ``benchmarks/load.py`` does: the deterministic upstream (a subprocess)
and the real proxy (``rag-opt serve`` in a subprocess, the embedded proxy model loaded at start-up, default
settings). Then, in one run, a *probe* runs alongside each phase: ``GET /livez`` every 25 ms (the event loop's
responsiveness) and, one after the other, ordinary ``POST /v1/compress`` requests (4 HotpotQA paragraphs, the
default tier: the proxy model). The phases:

* **quiet**: the probe alone, before and after the attacks (the baseline of this run);
* **compress 150k / 600k tiny documents**: one ``/v1/compress`` with 150,000 or 600,000 two-character documents;
* **long question**: a 4,000-word question over one short document;
* **lexical flood**: 32 clients sending ``tier: lexical`` requests back to back for ``--flood-s`` seconds;
* **forward 64k blocks**: a chat completion with 64,000 ``<document>`` blocks (2.5 MB), forwarded unoptimized;
* **stats with 2 MB model names**: ``GET /stats`` after 10 optimizations whose ``model`` is a 2 MB name;
* **1 MB language codes**: 20 requests with a 1 MB ``language``; the bytes the proxy's log grew by are reported.

Reported per phase: the attack's own answers (status, size, seconds), the /livez latency (median, p99, max) and the
ordinary requests' latency (median, max, outcomes), each also as a ratio to the quiet baseline, and the proxy's
RSS after the phase and its peak (VmHWM). Nothing here is a pass/fail bound: the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import run_or_report
from load import free_port, peak_rss_mb, wait_http

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLES = ROOT / "examples"
logger = logging.getLogger("bench.stalls")
LIVEZ_EVERY_S = 0.025
JSON = {"content-type": "application/json"}

Attack = Callable[[httpx.AsyncClient], Awaitable[dict[str, Any]]]


def example_docs() -> list[str]:
    return [json.loads(line)["text"] for line in (EXAMPLES / "hotpotqa_docs.jsonl").read_text().splitlines() if line]


QUESTION = (EXAMPLES / "hotpotqa_question.txt").read_text().strip()
DOCS = example_docs()


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# -- the probe ----------------------------------------------------------------------------------------------------
async def probe(client: httpx.AsyncClient, done: asyncio.Event, min_s: float) -> dict[str, Any]:
    """/livez every 25 ms and ordinary compress requests one after the other, until ``done`` (at least
    ``min_s`` seconds)."""
    livez: list[float] = []
    ordinary: list[float] = []
    outcomes: Counter[str] = Counter()
    t_end = time.perf_counter() + min_s

    def going() -> bool:
        return not (done.is_set() and time.perf_counter() >= t_end)

    async def live() -> None:
        while going():
            t = time.perf_counter()
            try:
                await client.get("/livez", timeout=300)
                livez.append(time.perf_counter() - t)
            except httpx.HTTPError:
                outcomes["livez_error"] += 1
            await asyncio.sleep(LIVEZ_EVERY_S)

    async def work() -> None:
        body = {"question": QUESTION, "documents": DOCS[:4], "budget": {"ratio": 0.5}}
        while going():
            t = time.perf_counter()
            try:
                r = await client.post("/v1/compress", json=body, timeout=300)
                ordinary.append(time.perf_counter() - t)
                outcomes[
                    r.json().get("status", str(r.status_code)) if r.status_code == 200 else str(r.status_code)
                ] += 1
            except (httpx.HTTPError, ValueError):
                outcomes["error"] += 1

    await asyncio.gather(live(), work())
    return {"livez_s": livez, "ordinary_s": ordinary, "outcomes": dict(outcomes)}


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "median_ms": None, "p99_ms": None, "max_ms": None}
    s = sorted(values)
    return {
        "n": len(s),
        "median_ms": statistics.median(s) * 1e3,
        "p99_ms": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))] * 1e3,
        "max_ms": s[-1] * 1e3,
    }


# -- the attacks --------------------------------------------------------------------------------------------------
async def _send(client: httpx.AsyncClient, method: str, path: str, **kw: Any) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        r = await client.request(method, path, timeout=600, **kw)
    except httpx.HTTPError as exc:
        return {"status": type(exc).__name__, "bytes": 0, "seconds": time.perf_counter() - t}
    out: dict[str, Any] = {"status": r.status_code, "bytes": len(r.content), "seconds": time.perf_counter() - t}
    if r.headers.get("content-type", "").startswith("application/json") and len(r.content) < 256 * 1024:
        body = r.json()
        out["answer"] = body.get("status") or (body.get("error") or {}).get("code")
        out["reason"] = body.get("reason")
    if "x-ragopt-status" in r.headers:
        out["answer"] = r.headers["x-ragopt-status"]
        out["reason"] = r.headers.get("x-ragopt-reason")
    return out


def tiny_documents(n: int) -> Attack:
    raw = json.dumps({"question": "Which is it?", "documents": ["a."] * n}).encode()

    async def attack(client: httpx.AsyncClient) -> dict[str, Any]:
        return {"request_bytes": len(raw), **await _send(client, "POST", "/v1/compress", content=raw, headers=JSON)}

    return attack


def long_question(words: int) -> Attack:
    question = " ".join(f"word{i % 997} about magazines" for i in range(words // 3)) + "?"
    body = {"question": question, "documents": [DOCS[0]], "budget": {"ratio": 0.5}}

    async def attack(client: httpx.AsyncClient) -> dict[str, Any]:
        return await _send(client, "POST", "/v1/compress", json=body)

    return attack


def lexical_flood(clients: int, seconds: float) -> Attack:
    body = {"question": QUESTION, "documents": DOCS, "budget": {"ratio": 0.5}, "tier": "lexical"}

    async def attack(client: httpx.AsyncClient) -> dict[str, Any]:
        answers: Counter[str] = Counter()
        deadline = time.perf_counter() + seconds
        t = time.perf_counter()

        async def one() -> None:
            while time.perf_counter() < deadline:
                r = await _send(client, "POST", "/v1/compress", json=body)
                answers[f"{r['status']} {r.get('answer')} {r.get('reason') or ''}".strip()] += 1

        await asyncio.gather(*(one() for _ in range(clients)))
        return {"status": "flood", "seconds": time.perf_counter() - t, "answers": dict(answers)}

    return attack


def many_blocks(n: int) -> Attack:
    blocks = "\n".join(f"<document>Fact {i} is here.</document>" for i in range(n))
    body = {"model": "bench", "messages": [{"role": "user", "content": f"{blocks}\n\nWhich fact?"}]}
    raw = json.dumps(body).encode()

    async def attack(client: httpx.AsyncClient) -> dict[str, Any]:
        headers = {**JSON, "x-bench-id": "7"}
        return {
            "request_bytes": len(raw),
            **await _send(client, "POST", "/v1/chat/completions", content=raw, headers=headers),
        }

    return attack


async def big_model_names(client: httpx.AsyncClient, n: int, size: int) -> dict[str, Any]:
    """The set-up of the /stats phase: ``n`` optimized chat requests whose ``model`` is ``size`` characters."""
    blocks = "\n".join(f"<document>{d}</document>" for d in DOCS[:2])
    answers: Counter[str] = Counter()
    for i in range(n):
        body = {"model": f"{i}-" + "m" * size, "messages": [{"role": "user", "content": f"{blocks}\n\n{QUESTION}"}]}
        r = await _send(client, "POST", "/v1/chat/completions", json=body, headers={"x-bench-id": str(100 + i)})
        answers[str(r.get("answer"))] += 1
    return dict(answers)


async def stats_attack(client: httpx.AsyncClient) -> dict[str, Any]:
    return await _send(client, "GET", "/stats")


def language_codes(n: int, size: int) -> Attack:
    async def attack(client: httpx.AsyncClient) -> dict[str, Any]:
        statuses: Counter[str] = Counter()
        t = time.perf_counter()
        out: dict[str, Any] = {}
        for i in range(n):
            code = f"x{chr(97 + i % 26)}" + "-abcdefgh" * (size // 9)
            out = await _send(
                client, "POST", "/v1/compress", json={"question": "q?", "documents": ["a."], "language": code}
            )
            statuses[str(out["status"])] += 1
        return {"status": dict(statuses), "bytes": out.get("bytes"), "seconds": time.perf_counter() - t}

    return attack


# -- the run ------------------------------------------------------------------------------------------------------
async def phase(client: httpx.AsyncClient, attack: Attack | None, min_s: float) -> dict[str, Any]:
    done = asyncio.Event()
    probing = asyncio.ensure_future(probe(client, done, min_s))
    await asyncio.sleep(0.2)  # the probe is running before the attack starts
    result: dict[str, Any] = {}
    if attack is not None:
        result = await attack(client)
    done.set()
    seen = await probing
    return {"attack": result, **seen}


async def run_async(args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    up_port, proxy_port = free_port(), free_port()
    up_url, proxy_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{proxy_port}"
    load_py = str(Path(__file__).resolve().parent / "load.py")
    up = subprocess.Popen([sys.executable, load_py, "--serve-upstream", str(up_port)], env=env, start_new_session=True)
    log = tempfile.NamedTemporaryFile(prefix="rag-opt-stalls-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "rag_opt.cli", "serve", "--upstream", f"{up_url}/v1", "--port", str(proxy_port)]
    proxy = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log_path = Path(log.name)
    phases: dict[str, Any] = {}
    try:
        wait_http(f"{up_url}/v1/models", up, 60, lambda r: r.status_code in (200, 400, 404))
        wait_http(f"{proxy_url}/healthz", proxy, 600, lambda r: r.json().get("optimizer") in ("ready", "failed"))
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=2)
        async with httpx.AsyncClient(base_url=proxy_url, limits=limits) as client:
            for _ in range(3):  # warm up
                await client.post("/v1/compress", json={"question": QUESTION, "documents": DOCS[:4]}, timeout=120)
            attacks: list[tuple[str, Attack]] = [
                ("compress 150k tiny documents", tiny_documents(150_000)),
                ("compress 600k tiny documents", tiny_documents(600_000)),
                ("long question (4,000 words)", long_question(4_000)),
                ("lexical flood (32 clients)", lexical_flood(32, args.flood_s)),
                ("forward 64k blocks", many_blocks(64_000)),
                ("stats with 2 MB model names", stats_attack),
                ("1 MB language codes (20)", language_codes(20, 1_000_000)),
            ]
            only = [w.strip() for w in args.only.split(",") if w.strip()]
            logger.info("phase: quiet")
            phases["quiet"] = await phase(client, None, args.quiet_s)
            for name, attack in attacks:
                if only and not any(w in name for w in only):
                    continue
                setup: dict[str, Any] | None = None
                if attack is stats_attack:
                    logger.info("set-up: 10 optimizations with 2 MB model names")
                    setup = await big_model_names(client, 10, 2_000_000)
                logger.info("phase: %s", name)
                log_before = log_path.stat().st_size
                phases[name] = await phase(client, attack, 2.0)
                phases[name]["attack"]["log_bytes"] = log_path.stat().st_size - log_before
                if setup is not None:
                    phases[name]["attack"]["setup"] = setup
                phases[name]["rss_mb"] = rss_mb(proxy.pid)
                logger.info("  %s", phases[name]["attack"])
            logger.info("phase: quiet (again)")
            phases["quiet (after)"] = await phase(client, None, args.quiet_s)
        peak = peak_rss_mb(proxy.pid)
    finally:
        for p in (proxy, up):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return summarize(phases, peak, log_path)


def summarize(phases: dict[str, Any], peak: float | None, log_path: Path) -> dict[str, Any]:
    quiet_live = phases["quiet"]["livez_s"] + phases["quiet (after)"]["livez_s"]
    quiet_ord = phases["quiet"]["ordinary_s"] + phases["quiet (after)"]["ordinary_s"]
    base_live, base_ord = _stats(quiet_live), _stats(quiet_ord)
    out: dict[str, Any] = {"quiet": {"livez": base_live, "ordinary": base_ord}, "phases": {}}
    for name, ph in phases.items():
        live, ordinary = _stats(ph["livez_s"]), _stats(ph["ordinary_s"])

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        out["phases"][name] = {
            "attack": ph["attack"],
            "livez": live,
            "ordinary": ordinary,
            "ordinary_outcomes": ph["outcomes"],
            "livez_median_ratio": ratio(live["median_ms"], base_live["median_ms"]),
            "livez_max_ratio": ratio(live["max_ms"], base_live["max_ms"]),
            "ordinary_median_ratio": ratio(ordinary["median_ms"], base_ord["median_ms"]),
            "rss_mb": ph.get("rss_mb"),
        }
    out["proxy_peak_rss_mb"] = peak
    out["proxy_log"] = str(log_path)
    out["cpu_count"] = os.cpu_count()
    return out


def show(res: dict[str, Any]) -> None:
    def f(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    q = res["quiet"]
    print(
        f"quiet baseline: /livez median {f(q['livez']['median_ms'])} ms, max {f(q['livez']['max_ms'])} ms; "
        f"ordinary compress median {f(q['ordinary']['median_ms'], '.0f')} ms"
    )
    head = f"{'phase':<30} {'attack':>22} {'s':>6} {'livez med':>9} {'max':>8} {'x med':>6} {'x max':>6}"
    print(head + f" {'ord med':>8} {'x':>5} {'RSS MiB':>8}")
    for name, p in res["phases"].items():
        a = p["attack"]
        what = f"{a.get('status', '')} {a.get('answer') or ''}".strip() if a else ""
        print(
            f"{name:<30} {what[:22]:>22} {f(a.get('seconds'), '.1f'):>6} {f(p['livez']['median_ms']):>9} "
            f"{f(p['livez']['max_ms'], '.0f'):>8} {f(p['livez_median_ratio'], '.2f'):>6} "
            f"{f(p['livez_max_ratio'], '.1f'):>6} {f(p['ordinary']['median_ms'], '.0f'):>8} "
            f"{f(p['ordinary_median_ratio'], '.2f'):>5} {f(p['rss_mb'], '.0f'):>8}"
        )
    for name, p in res["phases"].items():
        a = p["attack"]
        extra = {k: v for k, v in a.items() if k not in ("status", "answer", "seconds")}
        if extra:
            print(f"  {name}: {extra}")
    print(f"proxy peak RSS: {f(res['proxy_peak_rss_mb'], '.0f')} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quiet-s", type=float, default=5.0, help="seconds of each quiet baseline phase")
    ap.add_argument("--flood-s", type=float, default=5.0, help="seconds of the lexical flood")
    ap.add_argument("--only", default="", help="comma-separated words: run only the phases whose names hold one")
    ap.add_argument("--out", default=str(RESULTS / "stalls.json"))
    ap.add_argument("--report-only", action="store_true", help="show the saved results without running")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_or_report(Path(args.out), args.report_only, lambda: asyncio.run(run_async(args)), show)


if __name__ == "__main__":
    main()

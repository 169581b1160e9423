"""Load test of the OpenAI-compatible proxy on loopback: added latency, errors, corruption, memory.

Starts its own servers on 127.0.0.1: a deterministic OpenAI-compatible upstream (uvicorn, in a subprocess) and
the real proxy (``rag-opt serve``, in a subprocess, embedded proxy model loaded at start-up). Then, in one run:

1. an unloaded probe: one client, requests without context alternately direct to the upstream and through the
   proxy (the proxy's added latency with nothing else going on), then a few context requests through the proxy
   one at a time (optimization latency with a free worker);
2. the same load twice, for ``--seconds`` each: first direct to the upstream (the baseline), then through the
   proxy, a mix of non-streaming and streaming chat requests, with and without context (10 HotpotQA paragraphs
   as ``<document>`` blocks). Closed loop by default: ``--clients`` concurrent clients, each sending its next
   request when the previous one is answered. Open loop with ``--request-rate R`` (as vLLM's benchmark): requests
   arrive at R per second, at Poisson (``--arrivals poisson``, the default) or fixed intervals, whether or not
   earlier ones were answered (at most ``--max-in-flight`` at once; arrivals over it are counted, not sent).
   A closed loop hides queueing: when the server slows down, its clients slow down with it. An open loop shows
   it: latency is measured from each request's scheduled arrival, and its *queueing delay* is that latency minus
   the least latency of requests of the same route, kind and outcome in the run (their time with no queue), so
   waiting anywhere — in the client's connection pool, the kernel's accept queue, the event loop, the
   optimizer's queue — counts. The proxy's own optimizer queue wait (its metrics) is reported too.

Every response body is compared with the bytes the upstream sent for that request (the upstream's answer is a
pure function of the request's ``x-bench-id``): a difference is a corrupted response. The upstream also rejects
(400) any request body that is not a JSON chat request, so a corrupted request shows up as an error. With the
default single optimizer worker most context requests under load are forwarded unoptimized (fail-open through
the bounded queue): that is the intended behaviour, and the counts are reported.

    OMP_NUM_THREADS=1 python benchmarks/load.py --seconds 20 --clients 64     # → benchmarks/results/load.json
    OMP_NUM_THREADS=1 python benchmarks/load.py --seconds 20 --request-rate 50  # open loop, 50 requests/s

Needs the ``server`` extra (uvicorn, httpx) and psutil (``bench`` extra).

**N replicas on Ray Serve** (``--ray-replicas N``, docs/scaling.md): instead of the above, ``rag-opt serve-ray``
(a local Ray of N CPUs, or ``--ray-address``) with N replicas under parallel encoding, sharing a redis-server of
the benchmark's own (or ``--cache-url``), loaded with ``/v1/compress`` requests over ``--doc-sets`` HotpotQA
document sets (its dev set from ../shared/data, or ``$RAG_OPT_DATA_DIR``): every set is read once (the warm-up),
then ``--clients`` clients draw a set and a question at random for ``--seconds``, over cached documents. Run for
``--routing documents``, ``random`` or ``both`` (each on new replicas and an emptied Redis), it reports errors,
p50/p99 latency, the share of answers the model tier scored, the requests each replica served, and each replica's
encoding cache over the load (from its ``/stats``, reached with ``x-ragopt-routing-key``): lookups, memory-tier
hits and hit rate, shared-tier hits, misses, evictions. The memory tiers tell the routings apart when the sets
outgrow one replica's memory tier (``--serve-args "--cache-bytes ..."``) but fit in all of them together::

    OMP_NUM_THREADS=1 python benchmarks/load.py --ray-replicas 2 --clients 64 --seconds 60 --doc-sets 64 \\
        --serve-args "--cache-bytes 900000000"      # → benchmarks/results/load_ray.json

(A HotpotQA set is ~18 MiB of encodings in bf16: 64 sets outgrow one 858 MB memory tier, their half fits.)

Reported: requests served, errors, corrupted responses, p50/p99 latency by request kind (direct vs proxy, the
difference = latency added by the proxy, and their ratio), optimized vs fail-open counts and latencies, the
proxy's metrics, and the proxy process's peak RSS (VmHWM). Targets: 0 errors and 0 corrupted responses; the
pass-through overhead p50 <= 3 ms (unloaded probe).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLES = ROOT / "examples"
KINDS = ("plain", "plain-stream", "context", "context-stream")
VOCAB = "the a of in proxy model token answer context paris france river seine 東京 القاهرة 🚀 café".split()


# -- the upstream: a deterministic OpenAI-compatible server -------------------------------------------------------
def upstream_body(n: int, stream: bool) -> tuple[list[bytes], bytes]:
    """The upstream's answer to request ``n``: (body chunks as sent, content type)."""
    rnd = random.Random(n)
    words = [rnd.choice(VOCAB) for _ in range(rnd.randint(3, 80))]
    if not stream:
        msg = {"role": "assistant", "content": " ".join(words)}
        body = {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": 0,
            "model": "bench",
            "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": n % 1000, "completion_tokens": len(words), "total_tokens": 0},
        }
        return [json.dumps(body, ensure_ascii=False).encode()], b"application/json"
    chunks = []
    for i in range(0, len(words), 8):
        delta = {"content": " ".join(words[i : i + 8]) + " "}
        event = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
        chunks.append(b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    return chunks, b"text/event-stream"


async def upstream_app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    headers = dict(scope["headers"])
    try:
        req = json.loads(body)
        assert isinstance(req, dict) and isinstance(req["messages"], list) and "rag_opt" not in req
        n = int(headers[b"x-bench-id"])
    except Exception:
        err = b'{"error": {"message": "bad request body", "type": "invalid_request_error"}}'
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": err})
        return
    chunks, ctype = upstream_body(n, bool(req.get("stream")))
    head = [(b"content-type", ctype)]
    if len(chunks) == 1:
        head.append((b"content-length", str(len(chunks[0])).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": head})
    for i, chunk in enumerate(chunks):
        await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on")


# -- processes --------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float, ready: Callable[[httpx.Response], bool]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with status {proc.returncode}")
        try:
            if ready(httpx.get(url, timeout=2)):
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout:.0f} s")
        time.sleep(0.2)


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident set size (Linux VmHWM), in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class RssSampler:
    """Polls a process's RSS (psutil when installed, else /proc): the peak seen, for non-Linux systems."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_mb = 0.0
        self._stop = False

    async def run(self) -> None:
        try:
            import psutil

            proc = psutil.Process(self.pid)
            read: Callable[[], float] = lambda: proc.memory_info().rss / 2**20  # noqa: E731
        except ImportError:
            return
        while not self._stop:
            try:
                self.peak_mb = max(self.peak_mb, read())
            except Exception:
                return
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        self._stop = True


# -- clients ----------------------------------------------------------------------------------------------------
def context_messages() -> list[dict[str, Any]]:
    docs = [json.loads(line) for line in (EXAMPLES / "hotpotqa_docs.jsonl").read_text().splitlines() if line.strip()]
    question = (EXAMPLES / "hotpotqa_question.txt").read_text().strip()
    blocks = "\n".join(f'<document id="{d["id"]}" title="{d["title"]}">{d["text"]}</document>' for d in docs)
    return [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": f"{blocks}\n\nQuestion: {question}"},
    ]


@dataclass
class Record:
    kind: str
    latency_s: float
    ok: bool
    corrupted: bool = False
    outcome: str = ""  # x-ragopt-status (through the proxy)
    reason: str = ""
    error: str = ""
    lag_s: float = 0.0  # open loop: how late the request was sent after its scheduled arrival


@dataclass
class Load:
    records: list[Record] = field(default_factory=list)
    seconds: float = 0.0
    not_sent: int = 0  # open loop: arrivals while --max-in-flight requests were outstanding
    max_in_flight: int = 0


class Bench:
    def __init__(self, mix: dict[str, float], seed: int = 0) -> None:
        self.ids = iter(range(1, 10**9))
        self.mix = mix
        self.rnd = random.Random(seed)
        ctx = context_messages()
        plain = [{"role": "user", "content": "Say something about Paris."}]
        self.bodies = {kind: {"messages": ctx if kind.startswith("context") else plain} for kind in KINDS}

    def pick(self) -> str:
        return self.rnd.choices(list(self.mix), weights=list(self.mix.values()))[0]

    async def one(self, client: httpx.AsyncClient, base: str, kind: str, scheduled: float | None = None) -> Record:
        """One request; its latency counts from ``scheduled`` (open loop: its arrival) when given."""
        n = next(self.ids)
        stream = kind.endswith("stream")
        body = {"model": "bench", **self.bodies[kind], "stream": stream}
        expected = b"".join(upstream_body(n, stream)[0])
        sent = time.perf_counter()
        t0 = sent if scheduled is None else scheduled
        try:
            req = client.build_request("POST", f"{base}/v1/chat/completions", json=body, headers={"x-bench-id": str(n)})
            r = await client.send(req, stream=True)
            try:
                got = b"".join([chunk async for chunk in r.aiter_raw()])
            finally:
                await r.aclose()
            latency = time.perf_counter() - t0
        except httpx.HTTPError as exc:
            return Record(kind, time.perf_counter() - t0, False, error=f"{type(exc).__name__}: {exc}"[:120])
        rec = Record(kind, latency, r.status_code == 200, outcome=r.headers.get("x-ragopt-status", ""))
        rec.reason = r.headers.get("x-ragopt-reason", "")
        rec.lag_s = sent - t0
        if r.status_code != 200:
            rec.error = f"HTTP {r.status_code}"
        elif got != expected:
            rec.corrupted = True
        return rec

    async def load(self, base: str, clients: int, seconds: float) -> Load:
        # idle connections expire before the servers' keep-alive timeout (uvicorn: 5 s), as a client should
        limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8, keepalive_expiry=2)
        out = Load()
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            deadline = time.monotonic() + seconds
            t0 = time.monotonic()

            async def worker() -> None:
                while time.monotonic() < deadline:
                    out.records.append(await self.one(client, base, self.pick()))

            await asyncio.gather(*(worker() for _ in range(clients)))
            out.seconds = time.monotonic() - t0
        return out

    async def open_loop(self, base: str, rate: float, seconds: float, arrivals: str, max_in_flight: int) -> Load:
        """Requests arriving at ``rate`` per second for ``seconds`` (Poisson or fixed intervals), each sent at its
        arrival whatever the others are doing, at most ``max_in_flight`` outstanding."""
        limits = httpx.Limits(
            max_connections=max_in_flight, max_keepalive_connections=max_in_flight, keepalive_expiry=2
        )
        out = Load()
        rnd = random.Random(self.rnd.random())
        in_flight = 0

        async def send(kind: str, scheduled: float) -> Record:
            nonlocal in_flight
            in_flight += 1
            out.max_in_flight = max(out.max_in_flight, in_flight)
            try:
                return await self.one(client, base, kind, scheduled)
            finally:
                in_flight -= 1

        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            tasks: list[asyncio.Future[Record]] = []
            t0 = time.perf_counter()
            at = 0.0
            while True:
                at += rnd.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
                if at >= seconds:
                    break
                wait = t0 + at - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                if in_flight >= max_in_flight:
                    out.not_sent += 1
                    continue
                tasks.append(asyncio.ensure_future(send(self.pick(), t0 + at)))
            out.records = list(await asyncio.gather(*tasks))
            out.seconds = time.perf_counter() - t0
        return out

    async def sequential(self, base: str, kind: str, n: int) -> list[Record]:
        async with httpx.AsyncClient(timeout=120) as client:
            return [await self.one(client, base, kind) for _ in range(n)]


# -- statistics -------------------------------------------------------------------------------------------------
async def livez_latencies(base: str, seconds: float, every: float = 0.25) -> list[float]:
    """``GET /livez`` every ``every`` seconds for ``seconds``, from a process of its own (so the load clients' event
    loop, busy with 64 clients, does not delay reading the answers): each answer's latency (ms)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--livez-probe",
        base,
        "--seconds",
        str(seconds),
        "--livez-every",
        str(every),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    return [float(x) for x in json.loads(out or b"[]")]


def probe_livez(base: str, seconds: float, every: float) -> None:
    """``--livez-probe``: the prober's own process; prints the latencies (ms) as a JSON list."""
    out: list[float] = []
    end = time.perf_counter() + seconds
    with httpx.Client(timeout=30) as client:
        while time.perf_counter() < end:
            t = time.perf_counter()
            try:
                r = client.get(f"{base}/livez")
                if r.status_code == 200:
                    out.append((time.perf_counter() - t) * 1e3)
            except httpx.TransportError:
                pass
            time.sleep(every)
    print(json.dumps(out))


def huge_text(sentences: int = 16_000, seed: int = 0) -> str:
    """About 1 MB of short sentences (the review's A1 request)."""
    rnd = random.Random(seed)
    words = "river mountain city honey water treatment winter paper museum station bridge island".split()
    return " ".join(
        " ".join(rnd.choice(words) for _ in range(rnd.randint(4, 9))).capitalize() + "." for _ in range(sentences)
    )


async def big_request(base: str, budget_s: float) -> dict[str, Any]:
    """One ~1 MB single-document ``/v1/compress`` request at the start of the load: its latency against the budget
    and the tier that answered."""
    body = {"question": "Which river is it?", "documents": [huge_text()]}
    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        r = await client.post(f"{base}/v1/compress", json=body)
        s = time.perf_counter() - t
    out = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    return {
        "bytes": len(body["documents"][0]),
        "http": r.status_code,
        "seconds": s,
        "within_budget_plus_10pct": s <= 1.1 * budget_s,
        "status": out.get("status"),
        "tier": out.get("tier"),
        "reason": out.get("reason"),
    }


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summary(records: list[Record]) -> dict[str, Any]:
    lat = [r.latency_s * 1e3 for r in records if r.ok and not r.corrupted]
    return {
        "requests": len(records),
        "errors": sum(not r.ok for r in records),
        "corrupted": sum(r.corrupted for r in records),
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
        "error_kinds": dict(Counter(r.error for r in records if r.error)),
    }


def queueing(records: list[Record]) -> dict[str, Any]:
    """Open loop: latency from the scheduled arrival, and queueing delay = that latency minus the least latency of
    the requests of the same kind and outcome (their time with no queue), in ms."""
    ok = [r for r in records if r.ok and not r.corrupted]
    least: dict[tuple[str, str], float] = {}
    for r in ok:
        key = (r.kind, r.outcome + r.reason)
        least[key] = min(least.get(key, r.latency_s), r.latency_s)
    delay = [(r.latency_s - least[(r.kind, r.outcome + r.reason)]) * 1e3 for r in ok]
    lag = [r.lag_s * 1e3 for r in records]
    return {
        "queueing_p50_ms": pct(delay, 0.5),
        "queueing_p99_ms": pct(delay, 0.99),
        "queueing_max_ms": max(delay) if delay else None,
        "send_lag_p99_ms": pct(lag, 0.99),
    }


def added(proxy: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for q in ("p50_ms", "p99_ms"):
        p, d = proxy.get(q), direct.get(q)
        out[f"added_{q}"] = None if p is None or d is None else p - d
        out[f"ratio_{q.removesuffix('_ms')}"] = None if not p or not d else p / d
    return out


def fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}{unit}"
    return f"{v}{unit}"


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if "_bucket{" not in name:
                out[name] = float(value)
    return out


# -- main -------------------------------------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> dict[str, Any]:
    up_port, proxy_port = free_port(), free_port()
    up_url, proxy_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{proxy_port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # each server in its own session (so its own scheduling autogroup on Linux), like a separate service
    up_proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-upstream", str(up_port)], env=env, start_new_session=True
    )
    log = tempfile.NamedTemporaryFile(prefix="rag-opt-load-proxy-", suffix=".log", delete=False)  # noqa: SIM115
    print(f"proxy log: {log.name}", file=sys.stderr)
    cmd = [sys.executable, "-m", "rag_opt.cli", "serve", "--upstream", f"{up_url}/v1", "--port", str(proxy_port)]
    cmd += ["--max-concurrency", str(args.max_concurrency)]
    if args.max_queue is not None:  # else the server's default for its encoding
        cmd += ["--max-queue", str(args.max_queue)]
    cmd += ["--time-budget-ms", str(args.time_budget_ms), "--ratio", str(args.ratio)]
    cmd += ["--optimizer-nice", str(args.optimizer_nice)]
    cmd += shlex.split(args.serve_args)
    proxy_proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"{up_url}/v1/models", up_proc, 60, lambda r: r.status_code in (200, 400, 404))
        t = time.perf_counter()
        wait_http(f"{proxy_url}/healthz", proxy_proc, 600, lambda r: r.json().get("optimizer") in ("ready", "failed"))
        startup_s = time.perf_counter() - t
        health = httpx.get(f"{proxy_url}/healthz").json()
        print(f"proxy up in {startup_s:.1f} s: {health}", file=sys.stderr)
        c = args.context_share
        mix = {"plain": (1 - c) * 2 / 3, "plain-stream": (1 - c) / 3, "context": c / 2, "context-stream": c / 2}
        bench = Bench(mix, seed=args.seed)
        sampler = RssSampler(proxy_proc.pid)
        sampling = asyncio.ensure_future(sampler.run())

        # 1. unloaded probe
        print(f"unloaded probe: {args.probe} pass-through requests each way", file=sys.stderr)
        direct_seq: list[Record] = []
        proxy_seq: list[Record] = []
        for _ in range(args.probe // 50):
            direct_seq += await bench.sequential(up_url, "plain", 50)
            proxy_seq += await bench.sequential(proxy_url, "plain", 50)
        opt_direct = await bench.sequential(up_url, "context", args.optimized)
        opt_seq = await bench.sequential(proxy_url, "context", args.optimized)  # one at a time, nothing else
        # optimizations one at a time again; meanwhile one client sends pass-through requests one at a time
        optimizing = asyncio.ensure_future(bench.sequential(proxy_url, "context", args.optimized))
        during: list[Record] = []
        while not optimizing.done():
            during += await bench.sequential(proxy_url, "plain", 1)
        opt_during = await optimizing
        unloaded = {
            "pass_through": {"direct": summary(direct_seq), "proxy": summary(proxy_seq)},
            "optimized": {"direct": summary(opt_direct), "proxy": summary(opt_seq)},
            "optimized_outcomes": dict(Counter(r.outcome for r in opt_seq)),
            "pass_through_while_optimizing": {"direct": summary(direct_seq), "proxy": summary(during)},
            "optimized_with_pass_through": {"direct": summary(opt_direct), "proxy": summary(opt_during)},
            "optimized_with_pass_through_outcomes": dict(
                Counter(r.outcome + (f" ({r.reason})" if r.reason else "") for r in opt_during)
            ),
        }
        for k in ("pass_through", "optimized", "pass_through_while_optimizing", "optimized_with_pass_through"):
            unloaded[k].update(added(unloaded[k]["proxy"], unloaded[k]["direct"]))

        # 2. load: direct, then through the proxy (closed loop, or open loop at --request-rate)
        loads: dict[str, Load] = {}
        waits_before = parse_metrics(httpx.get(f"{proxy_url}/metrics").text)
        side: dict[str, Any] = {}
        for name, base in (("direct", up_url), ("proxy", proxy_url)):
            if name == "proxy":  # the proxy's liveness under the load, and (--big-request) one 1 MB request in it
                side["livez"] = asyncio.ensure_future(livez_latencies(proxy_url, args.seconds, args.livez_every))
                if args.big_request:
                    side["big"] = asyncio.ensure_future(big_request(proxy_url, args.time_budget_ms / 1e3))
            if args.request_rate:
                print(
                    f"load: open loop, {args.request_rate:g} requests/s ({args.arrivals}) for {args.seconds:.0f} s, "
                    f"{name}",
                    file=sys.stderr,
                )
                loads[name] = await bench.open_loop(
                    base, args.request_rate, args.seconds, args.arrivals, args.max_in_flight
                )
            else:
                print(f"load: {args.clients} clients for {args.seconds:.0f} s, {name}", file=sys.stderr)
                loads[name] = await bench.load(base, args.clients, args.seconds)
        sampler.stop()
        await sampling
        livez = await side["livez"] if "livez" in side else []
        big = await side["big"] if "big" in side else None
        proxy_metrics = parse_metrics(httpx.get(f"{proxy_url}/metrics").text)
        waited = {
            k: proxy_metrics.get(f"ragopt_optimizer_queue_wait_seconds_{k}", 0.0)
            - waits_before.get(f"ragopt_optimizer_queue_wait_seconds_{k}", 0.0)
            for k in ("sum", "count")
        }
        peak = peak_rss_mb(proxy_proc.pid) or sampler.peak_mb or None
    finally:
        for proc in (proxy_proc, up_proc):
            proc.send_signal(signal.SIGINT)
        for proc in (proxy_proc, up_proc):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()

    by_kind: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        d = summary([r for r in loads["direct"].records if r.kind == kind])
        p = summary([r for r in loads["proxy"].records if r.kind == kind])
        by_kind[kind] = {"direct": d, "proxy": p, **added(p, d)}
    ctx = [r for r in loads["proxy"].records if r.kind.startswith("context")]
    by_outcome: dict[str, list[Record]] = defaultdict(list)
    for r in ctx:
        by_outcome[r.outcome + (f" ({r.reason})" if r.reason else "")].append(r)
    # which tier served each context request, from x-ragopt-status
    tier_names = {"optimized": "model", "optimized-lexical": "lexical", "fail-open": "fail_open"}
    tiers = Counter(tier_names.get(r.outcome, r.outcome or "none") for r in ctx if r.ok)
    served = tiers["model"] + tiers["lexical"]
    tier_counts = {
        "context_requests": len(ctx),
        **{k: tiers[k] for k in ("model", "lexical", "fail_open")},
        "other": {k: v for k, v in tiers.items() if k not in ("model", "lexical", "fail_open")},
        "optimized_share": served / len(ctx) if ctx else None,
    }
    totals = {name: summary(load.records) for name, load in loads.items()}
    for name, load in loads.items():
        totals[name]["throughput_rps"] = len(load.records) / load.seconds if load.seconds else None
        if args.request_rate:
            totals[name].update(queueing(load.records))
            totals[name].update(not_sent=load.not_sent, max_in_flight=load.max_in_flight)
    if args.request_rate:
        for kind in KINDS:
            for name in ("direct", "proxy"):
                by_kind[kind][name].update(queueing([r for r in loads[name].records if r.kind == kind]))
    plain = [r for r in loads["proxy"].records if not r.kind.startswith("context")]
    plain_direct = [r for r in loads["direct"].records if not r.kind.startswith("context")]
    results = {
        "config": {
            "loop": "open" if args.request_rate else "closed",
            "clients": None if args.request_rate else args.clients,
            "request_rate": args.request_rate,
            "arrivals": args.arrivals if args.request_rate else None,
            "max_in_flight": args.max_in_flight if args.request_rate else None,
            "seconds": args.seconds,
            "mix": bench.mix,
            "proxy": {
                "max_concurrency": args.max_concurrency,
                "max_queue": args.max_queue,
                "time_budget_ms": args.time_budget_ms,
                "ratio": args.ratio,
                "on_overload": "fail-open",
                "optimizer_nice": args.optimizer_nice,
                "serve_args": args.serve_args,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
                "python": platform.python_version(),
                "platform": platform.platform(),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            },
        },
        "startup_s": startup_s,
        "health": health,
        "unloaded": unloaded,
        "load": {
            "totals": totals,
            "by_kind": by_kind,
            "pass_through": {
                "direct": summary(plain_direct),
                "proxy": summary(plain),
                **added(summary(plain), summary(plain_direct)),
            },
            "context_outcomes": {k: summary(v) for k, v in sorted(by_outcome.items())},
            "context_tiers": tier_counts,
            "livez": {
                "probes": len(livez),
                "p50_ms": pct(livez, 0.5),
                "p99_ms": pct(livez, 0.99),
                "max_ms": max(livez, default=None),
            },
            "big_request": big,
        },
        "proxy_optimizer_queue_wait": {
            "optimizations": waited["count"],
            "mean_ms": waited["sum"] / waited["count"] * 1e3 if waited["count"] else None,
        },
        "proxy_peak_rss_mb": peak,
        "proxy_metrics": {
            k: v
            for k, v in proxy_metrics.items()
            if v and not k.startswith("ragopt_optimizer_latency") and "queue_wait" not in k
        },
    }
    p50_added = unloaded["pass_through"]["added_p50_ms"]
    results["targets"] = {
        "zero_errors": totals["proxy"]["errors"] == 0,
        "zero_corrupted": totals["proxy"]["corrupted"] == 0 and totals["direct"]["corrupted"] == 0,
        "pass_through_added_p50_le_3ms": p50_added is not None and p50_added <= 3.0,
        "context_optimized_ge_95pct": (tier_counts["optimized_share"] or 0.0) >= 0.95,
        "peak_rss_le_1_1_gib": peak is not None and peak <= 1.1 * 1024,
        "livez_p99_lt_100ms": bool(livez) and (pct(livez, 0.99) or 0.0) < 100.0,
    }
    if big is not None:
        results["targets"]["big_request_within_budget_plus_10pct"] = big["within_budget_plus_10pct"]
    return results


def print_report(res: dict[str, Any]) -> None:
    c = res["config"]
    loop = (
        f"open loop at {c['request_rate']:g} requests/s ({c['arrivals']} arrivals, at most {c['max_in_flight']} "
        "in flight)"
        if c["loop"] == "open"
        else f"{c['clients']} clients"
    )
    queue = c["proxy"]["max_queue"] if c["proxy"]["max_queue"] is not None else "default"
    print(
        f"\nrag-opt proxy load test: {loop} x {c['seconds']:.0f} s per side, loopback, "
        f"{c['machine']['cpus']} CPUs; proxy: {c['proxy']['max_concurrency']} worker(s), queue "
        f"{queue}, budget {c['proxy']['time_budget_ms']:.0f} ms, optimizer nice "
        f"{c['proxy']['optimizer_nice']}; started in {res['startup_s']:.1f} s"
    )
    u = res["unloaded"]
    print("\nunloaded (one request at a time)                direct p50/p99      proxy p50/p99       added p50/p99")
    for name in ("pass_through", "optimized", "pass_through_while_optimizing", "optimized_with_pass_through"):
        d, p = u[name]["direct"], u[name]["proxy"]
        print(
            f"  {name:<46} {fmt(d['p50_ms'])}/{fmt(d['p99_ms'])} ms".ljust(68)
            + f"{fmt(p['p50_ms'])}/{fmt(p['p99_ms'])} ms".ljust(20)
            + f"{fmt(u[name]['added_p50_ms'])}/{fmt(u[name]['added_p99_ms'])} ms"
        )
    print(
        f"  outcomes: optimized alone {u['optimized_outcomes']}, "
        f"with pass-through {u['optimized_with_pass_through_outcomes']}"
    )
    L = res["load"]
    print(
        f"\nunder load ({loop})\n                                     requests (direct|proxy)  errors  corrupted   "
        "p50 ms (direct|proxy|added|ratio)     p99 ms (direct|proxy|added|ratio)"
    )
    rows = [(k, v) for k, v in L["by_kind"].items()] + [("all pass-through", L["pass_through"])]
    for kind, v in rows:
        d, p = v["direct"], v["proxy"]
        print(
            f"  {kind:<34} {d['requests']:>7} | {p['requests']:<7}  {d['errors'] + p['errors']:>6}  "
            f"{d['corrupted'] + p['corrupted']:>9}   "
            f"{fmt(d['p50_ms'])} | {fmt(p['p50_ms'])} | {fmt(v['added_p50_ms'])} | {fmt(v['ratio_p50'])}x".ljust(40)
            + f"   {fmt(d['p99_ms'])} | {fmt(p['p99_ms'])} | {fmt(v['added_p99_ms'])} | {fmt(v['ratio_p99'])}x"
        )
    t = L["totals"]
    print(
        f"  throughput: direct {fmt(t['direct']['throughput_rps'])} req/s, proxy {fmt(t['proxy']['throughput_rps'])} "
        f"req/s; errors {t['proxy']['errors']} (kinds {t['proxy']['error_kinds']}), corrupted {t['proxy']['corrupted']}"
    )
    if c["loop"] == "open":
        print("  open loop: latency from each request's scheduled arrival; queueing delay = it minus the least")
        print(
            "  of its kind and outcome, ms:      queueing p50 | p99 | max (direct)    queueing p50 | p99 | max (proxy)"
        )
        for kind in KINDS:
            d, p = L["by_kind"][kind]["direct"], L["by_kind"][kind]["proxy"]
            dq = f"{fmt(d['queueing_p50_ms'])} | {fmt(d['queueing_p99_ms'])} | {fmt(d['queueing_max_ms'])}"
            pq = f"{fmt(p['queueing_p50_ms'])} | {fmt(p['queueing_p99_ms'])} | {fmt(p['queueing_max_ms'])}"
            print(f"  {kind:<34} {dq}".ljust(70) + pq)
        for name in ("direct", "proxy"):
            print(
                f"  {name}: achieved {fmt(t[name]['throughput_rps'])} req/s, send lag p99 "
                f"{fmt(t[name]['send_lag_p99_ms'])} ms, at most {t[name]['max_in_flight']} in flight, "
                f"{t[name]['not_sent']} arrivals not sent"
            )
        w = res["proxy_optimizer_queue_wait"]
        print(
            f"  proxy optimizer queue: {w['optimizations']:.0f} optimizations waited {fmt(w['mean_ms'])} ms on average"
        )
    print("  context requests through the proxy, by outcome:")
    for k, v in L["context_outcomes"].items():
        print(f"    {k:<28} {v['requests']:>6} requests, p50 {fmt(v['p50_ms'])} ms, p99 {fmt(v['p99_ms'])} ms")
    ct = L["context_tiers"]
    print(
        f"  context requests by tier: model {ct['model']}, lexical {ct['lexical']}, fail-open {ct['fail_open']}, "
        f"other {ct['other']} of {ct['context_requests']}: {fmt((ct['optimized_share'] or 0) * 100)} % optimized"
    )
    lz = L.get("livez") or {}
    if lz.get("probes"):
        p50, p99 = fmt(lz["p50_ms"], " ms"), fmt(lz["p99_ms"], " ms")
        print(f"/livez under load: {lz['probes']} probes, p50 {p50}, p99 {p99}")
    big = L.get("big_request")
    if big:
        print(
            f"one {big['bytes'] / 1e6:.1f} MB request in the mix: HTTP {big['http']} in {big['seconds']:.2f} s, "
            f"{big['status']} / {big['tier']} ({big['reason']})"
        )
    print(f"\nproxy peak RSS: {fmt(res['proxy_peak_rss_mb'])} MiB")
    m = res["proxy_metrics"]
    prefixes = ("ragopt_fail_open", "ragopt_optimizer_shed", "ragopt_optimizer_timeouts", "ragopt_optimizations_total")
    keys = [k for k in m if k.startswith((*prefixes, "ragopt_lexical_tier", "ragopt_optimizer_batch_size_count"))]
    print("proxy metrics: " + ", ".join(f"{k}={m[k]:.0f}" for k in keys))
    print("targets: " + ", ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in res["targets"].items()))


# -- N replicas on Ray Serve (--ray-replicas) --------------------------------------------------------------------
@dataclass
class RayRecord:
    latency_s: float
    ok: bool
    status: str = ""  # the compress answer's status (optimized, optimized_lexical, fail_open, ...)
    tier: str = ""  # the tier that scored: model, lexical, none
    replica: str = ""  # x-ragopt-replica
    doc_set: int = -1
    error: str = ""
    reason: str = ""  # why not the model tier (the answer's reason: overload, timeout, ...)


class RedisProc:
    """A redis-server of the benchmark's own on 127.0.0.1 (nothing saved), emptied between routings."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while self.command(b"PING") != b"+PONG":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self, cmd: bytes) -> bytes:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
                sock.sendall(cmd + b"\r\n")
                return sock.recv(256).strip()
        except OSError:
            return b""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def hotpot_sets(n: int) -> list[dict[str, Any]]:
    """The first ``n`` HotpotQA dev examples as document sets: {"question", "documents"} (10 paragraphs each)."""
    import gzip

    data = Path(os.environ.get("RAG_OPT_DATA_DIR") or ROOT.parent / "shared" / "data") / "hotpotqa" / "dev.jsonl.gz"
    if not data.exists():
        raise SystemExit(f"--ray-replicas needs the HotpotQA dev set at {data} (or set RAG_OPT_DATA_DIR)")
    out = []
    with gzip.open(data, "rt") as fh:
        for line in fh:
            ex = json.loads(line)
            docs = [{"id": t, "title": t, "text": "".join(sents)} for t, sents in ex["context"]]
            out.append({"question": ex["question"], "documents": docs})
            if len(out) >= n:
                break
    return out


RAY_QUESTIONS = ("Who is mentioned first?", "Which of these is the oldest?", "Where did it happen?")


async def compress_one(
    client: httpx.AsyncClient, base: str, sets: list[dict[str, Any]], i: int, question: str, ratio: float
) -> RayRecord:
    body = {"question": question, "documents": sets[i]["documents"], "ratio": ratio}
    t0 = time.perf_counter()
    try:
        r = await client.post(f"{base}/v1/compress", json=body)
        latency = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        return RayRecord(time.perf_counter() - t0, False, doc_set=i, error=f"{type(exc).__name__}: {exc}"[:120])
    rec = RayRecord(latency, r.status_code == 200, replica=r.headers.get("x-ragopt-replica", ""), doc_set=i)
    if r.status_code != 200:
        rec.error = f"HTTP {r.status_code}"
        return rec
    out = r.json()
    rec.status, rec.tier = out.get("status", ""), out.get("tier", "")
    rec.reason = out.get("reason") or ""
    return rec


async def replica_ids(client: httpx.AsyncClient, base: str, n: int) -> list[str]:
    """The ``n`` replicas' ids, learnt from the answers to /stats under routing keys of our own (no model run)."""
    seen: set[str] = set()
    for i in range(50 * n):
        r = await client.get(f"{base}/stats", headers={"x-ragopt-routing-key": f"probe-{i}"})
        seen.add(r.headers.get("x-ragopt-replica", ""))
        if len(seen - {""}) >= n:
            break
    return sorted(seen - {""})


async def replica_stats(client: httpx.AsyncClient, base: str, replicas: list[str]) -> dict[str, dict[str, Any]]:
    """Each replica's /stats, reached through a routing key it serves (rendezvous hashing, as the router ranks)."""
    from rag_opt.server.ray_serve.keys import rank_replicas

    out: dict[str, dict[str, Any]] = {}
    for replica in replicas:
        key = next(k for k in (f"probe-{i}" for i in range(10_000)) if rank_replicas(k, replicas)[0] == replica)
        r = await client.get(f"{base}/stats", headers={"x-ragopt-routing-key": key})
        assert r.headers.get("x-ragopt-replica") == replica, "a replica changed: rerun"
        out[replica] = r.json()
    return out


def cache_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One replica's encoding cache over the load: lookups, hits by tier, the memory tier's hit rate, its size."""
    b, a = before.get("encoding_cache") or {}, after.get("encoding_cache") or {}
    d = {k: a.get(k, 0) - b.get(k, 0) for k in ("hits", "misses", "memory_hits", "shared_hits", "evictions")}
    lookups = d["hits"] + d["misses"]
    d["lookups"] = lookups
    d["memory_hit_rate"] = d["memory_hits"] / lookups if lookups else None
    d["shared_hit_rate"] = d["shared_hits"] / lookups if lookups else None
    d["memory_bytes"], d["memory_max_bytes"] = a.get("bytes"), a.get("max_bytes")
    return d


async def ray_phase(args: argparse.Namespace, routing: str, up_url: str, cache_url: str) -> dict[str, Any]:
    """One routing: ``rag-opt serve-ray`` started, every document set read once (warm), then ``--clients`` clients
    over the cached sets for ``--seconds``; the replicas' caches read before and after the load."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix=f"rag-opt-load-ray-{routing}-", suffix=".log", delete=False)  # noqa: SIM115
    print(f"serve-ray ({routing} routing) log: {log.name}", file=sys.stderr)
    cmd = [sys.executable, "-m", "rag_opt.cli", "serve-ray", "--replicas", str(args.ray_replicas)]
    cmd += ["--routing", routing, "--upstream", f"{up_url}/v1", "--port", str(port), "--encoding", "parallel"]
    cmd += ["--cache-url", cache_url, "--cpus-per-replica", str(args.cpus_per_replica)]
    cmd += ["--ray-address", args.ray_address] if args.ray_address else ["--num-cpus", str(args.ray_num_cpus)]
    cmd += ["--max-concurrency", str(args.max_concurrency), "--time-budget-ms", str(args.time_budget_ms)]
    cmd += ["--optimizer-nice", str(args.optimizer_nice)]
    if args.max_queue is not None:
        cmd += ["--max-queue", str(args.max_queue)]
    cmd += shlex.split(args.serve_args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sets = hotpot_sets(args.doc_sets)
    rnd = random.Random(args.seed)
    try:
        t = time.perf_counter()
        wait_http(f"{base}/readyz", proc, 900, lambda r: r.status_code == 200)
        startup_s = time.perf_counter() - t
        limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            replicas = await replica_ids(client, base, args.ray_replicas)
            print(f"{routing}: {len(replicas)} replicas up in {startup_s:.1f} s: {replicas}", file=sys.stderr)
            # warm: every set read once (its documents encoded, kept in Redis and in the reading replica's memory)
            sem = asyncio.Semaphore(args.warm_concurrency)

            async def warm(i: int) -> RayRecord:
                async with sem:
                    return await compress_one(client, base, sets, i, sets[i]["question"], args.ratio)

            t = time.perf_counter()
            warmed = await asyncio.gather(*(warm(i) for i in range(len(sets))))
            warm_s = time.perf_counter() - t
            print(f"{routing}: {len(sets)} document sets read in {warm_s:.1f} s; load...", file=sys.stderr)
            before = await replica_stats(client, base, replicas)
            records: list[RayRecord] = []
            deadline = time.monotonic() + args.seconds
            t0 = time.monotonic()

            async def worker() -> None:
                while time.monotonic() < deadline:
                    i = rnd.randrange(len(sets))
                    q = rnd.choice((sets[i]["question"], *RAY_QUESTIONS))
                    records.append(await compress_one(client, base, sets, i, q, args.ratio))

            await asyncio.gather(*(worker() for _ in range(args.clients)))
            seconds = time.monotonic() - t0
            after = await replica_stats(client, base, replicas)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

    ok = [r for r in records if r.ok]
    lat = [r.latency_s * 1e3 for r in ok]
    tiers = Counter(r.tier or "none" for r in ok)
    by_set: dict[int, set[str]] = defaultdict(set)
    for r in ok:
        by_set[r.doc_set].add(r.replica)
    caches = {rid: cache_delta(before[rid], after[rid]) for rid in replicas}
    lookups = sum(c["lookups"] for c in caches.values())
    return {
        "routing": routing,
        "startup_s": startup_s,
        "warm": {"seconds": warm_s, "errors": sum(not r.ok for r in warmed)},
        "requests": len(records),
        "seconds": seconds,
        "throughput_rps": len(records) / seconds if seconds else None,
        "errors": len(records) - len(ok),
        "error_kinds": dict(Counter(r.error for r in records if r.error)),
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
        "statuses": dict(Counter(r.status for r in ok)),
        "tiers": dict(tiers),
        "reasons": dict(Counter(r.reason for r in ok if r.reason)),  # why a request was not served by the model
        "model_tier_share": tiers["model"] / len(ok) if ok else None,
        "served_by_replica": dict(Counter(r.replica for r in ok)),
        "sets_on_one_replica": sum(len(v) == 1 for v in by_set.values()) / len(by_set) if by_set else None,
        "replica_caches": caches,
        "memory_hit_rate": sum(c["memory_hits"] for c in caches.values()) / lookups if lookups else None,
        "shared_hit_rate": sum(c["shared_hits"] for c in caches.values()) / lookups if lookups else None,
    }


async def run_ray(args: argparse.Namespace) -> dict[str, Any]:
    """The load over cached documents against ``--ray-replicas`` replicas on Ray Serve, for each routing."""
    up_port = free_port()
    up_url = f"http://127.0.0.1:{up_port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up_proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-upstream", str(up_port)], env=env, start_new_session=True
    )
    redis = RedisProc() if args.cache_url is None else None
    cache_url = args.cache_url or (redis.url if redis else "")
    phases: dict[str, Any] = {}
    try:
        wait_http(f"{up_url}/v1/models", up_proc, 60, lambda r: r.status_code in (200, 400, 404))
        for routing in ("documents", "random") if args.routing == "both" else (args.routing,):
            if redis is not None:
                redis.command(b"FLUSHALL")  # each routing starts from an empty shared tier (and new replicas)
            phases[routing] = await ray_phase(args, routing, up_url, cache_url)
    finally:
        if redis is not None:
            redis.stop()
        up_proc.send_signal(signal.SIGINT)
        try:
            up_proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up_proc.kill()
    return {
        "config": {
            "replicas": args.ray_replicas,
            "clients": args.clients,
            "seconds": args.seconds,
            "doc_sets": args.doc_sets,
            "ratio": args.ratio,
            "cpus_per_replica": args.cpus_per_replica,
            "ray": args.ray_address or f"local, {args.ray_num_cpus} CPUs",
            "cache_url": "own redis-server" if redis is not None else "--cache-url",
            "serve_args": args.serve_args,
            "max_concurrency": args.max_concurrency,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            },
        },
        "routings": phases,
    }


def print_ray_report(res: dict[str, Any]) -> None:
    c = res["config"]
    print(
        f"\nrag-opt on Ray Serve: {c['replicas']} replicas ({c['ray']}, {c['cpus_per_replica']:g} CPU each), "
        f"{c['clients']} clients x {c['seconds']:.0f} s of /v1/compress over {c['doc_sets']} cached HotpotQA "
        f"document sets (ratio {c['ratio']}), shared tier: {c['cache_url']}"
    )
    for routing, r in res["routings"].items():
        print(
            f"\n{routing} routing: {r['requests']} requests ({fmt(r['throughput_rps'])} req/s), errors {r['errors']} "
            f"{r['error_kinds'] or ''}, p50 {fmt(r['p50_ms'])} ms, p99 {fmt(r['p99_ms'])} ms; model tier "
            f"{fmt((r['model_tier_share'] or 0) * 100)} % of answers (tiers {r['tiers']}, statuses {r['statuses']})"
        )
        print(
            f"  served by replica {r['served_by_replica']}; document sets served by one replica only: "
            f"{fmt((r['sets_on_one_replica'] or 0) * 100)} %; started in {r['startup_s']:.1f} s, warm-up "
            f"{r['warm']['seconds']:.1f} s ({r['warm']['errors']} errors)"
        )
        print("  replica    lookups  memory hits  hit rate  shared hits  misses  evictions  memory MiB (of)")
        for rid, cache in r["replica_caches"].items():
            mib = (cache["memory_bytes"] or 0) / 2**20
            cap = (cache["memory_max_bytes"] or 0) / 2**20
            print(
                f"  {rid:<10} {cache['lookups']:>7}  {cache['memory_hits']:>11}  "
                f"{fmt((cache['memory_hit_rate'] or 0) * 100):>7} %  {cache['shared_hits']:>11}  "
                f"{cache['misses']:>6}  {cache['evictions']:>9}  {mib:.0f} ({cap:.0f})"
            )
        print(
            f"  all replicas: memory tier hit rate {fmt((r['memory_hit_rate'] or 0) * 100)} %, shared tier "
            f"{fmt((r['shared_hit_rate'] or 0) * 100)} %"
        )
    rs = res["routings"]
    if "documents" in rs and "random" in rs:
        d, x = rs["documents"]["memory_hit_rate"], rs["random"]["memory_hit_rate"]
        print(f"\nmemory tier hit rate: document routing {fmt((d or 0) * 100)} %, random {fmt((x or 0) * 100)} %")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="load duration per side (direct, proxy)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (closed loop)")
    p.add_argument(
        "--request-rate", type=float, default=None, help="open loop: requests per second, sent whatever the answers"
    )
    p.add_argument("--arrivals", choices=["poisson", "fixed"], default="poisson", help="open loop: arrival process")
    p.add_argument("--max-in-flight", type=int, default=512, help="open loop: most requests outstanding at once")
    p.add_argument("--probe", type=int, default=400, help="unloaded pass-through requests per side")
    p.add_argument("--optimized", type=int, default=5, help="unloaded context requests per side")
    p.add_argument("--context-share", type=float, default=0.4, help="share of requests with context (half streamed)")
    p.add_argument("--max-concurrency", type=int, default=1, help="proxy optimizer workers")
    p.add_argument(
        "--max-queue", type=int, default=None, help="proxy optimizer queue (default: the server's for its encoding)"
    )
    p.add_argument("--time-budget-ms", type=float, default=10_000)
    p.add_argument(
        "--big-request", action="store_true", help="also send one ~1 MB single-document request at the load's start"
    )
    p.add_argument("--optimizer-nice", type=int, default=10, help="proxy --optimizer-nice (0: same priority)")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--livez-every", type=float, default=0.25, help="seconds between /livez probes under the load")
    p.add_argument(
        "--serve-args", default="", help="more rag-opt serve flags, e.g. '--no-lexical-tier --batch-wait-ms 0'"
    )
    p.add_argument("--out", default=None, help="results JSON (default: results/load.json, load_ray.json on Ray)")
    ray = p.add_argument_group("N replicas on Ray Serve (rag-opt serve-ray; needs the ray extra and HotpotQA)")
    ray.add_argument("--ray-replicas", type=int, default=0, help="run on Ray Serve with this many replicas instead")
    ray.add_argument(
        "--routing",
        choices=["documents", "random", "both"],
        default="both",
        help="Ray: the routing to load (both: document routing, then random routing, compared)",
    )
    ray.add_argument("--doc-sets", type=int, default=64, help="Ray: HotpotQA document sets the clients draw from")
    ray.add_argument("--warm-concurrency", type=int, default=4, help="Ray: requests at once reading every set once")
    ray.add_argument("--cache-url", default=None, help="Ray: the shared tier (default: a redis-server of our own)")
    ray.add_argument("--ray-address", default=None, help="Ray: a running cluster (default: a local Ray)")
    ray.add_argument("--ray-num-cpus", type=int, default=None, help="Ray: CPUs of the local Ray (default: replicas)")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray: CPUs reserved per replica")
    p.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--livez-probe", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return
    if args.livez_probe is not None:
        probe_livez(args.livez_probe, args.seconds, args.livez_every)
        return
    if args.ray_replicas:
        args.ray_num_cpus = args.ray_num_cpus or max(1, round(args.ray_replicas * args.cpus_per_replica))
        results = asyncio.run(run_ray(args))
        print_ray_report(results)
    else:
        results = asyncio.run(run(args))
        print_report(results)
    out = args.out or str(RESULTS / ("load_ray.json" if args.ray_replicas else "load.json"))
    Path(out).write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The ``rag-opt`` command line: optimize, models, train-probe.

User errors (bad files, bad settings) exit with status 2 and one clear ``rag-opt: error: ...`` line, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("rag_opt.cli")


class UserError(Exception):
    """An error caused by the user's input; reported without a traceback."""


def _ratio(value: str) -> float:
    try:
        r = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"ratio must be a number in (0, 1], got {value!r}") from None
    if not 0 < r <= 1:
        raise argparse.ArgumentTypeError(f"ratio must be in (0, 1], got {value}")
    return r


def _nonneg_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return n


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


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="proxy model: Hugging Face id, local folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="proxy model dtype")


def build_parser() -> argparse.ArgumentParser:
    from rag_opt.pipeline import ORDERINGS

    parser = argparse.ArgumentParser(
        prog="rag-opt",
        description="Optimize retrieved context for an LLM: compress sentences, reorder documents.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("optimize", help="compress and reorder documents for a query")
    p.add_argument("--query", "-q", required=True, help="the question")
    p.add_argument(
        "--input",
        "-i",
        required=True,
        help="documents as JSONL ({'text','id'?,'metadata'?,'title'?}); - for stdin",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ratio", type=_ratio, help="fraction of target-LLM tokens to keep, in (0, 1]")
    g.add_argument("--target-tokens", type=_nonneg_int, help="token budget in the target LLM's tokens")
    g.add_argument("--threshold", type=float, help="keep sentences whose relevance probability is >= this")
    p.add_argument("--target", help="target LLM tokenizer: OpenAI model or tiktoken encoding name, or hf:<id>")
    p.add_argument("--ordering", default="input", choices=list(ORDERINGS), help="document ordering (default: input)")
    p.add_argument("--probe", default="auto", help="probe JSON path, 'auto' (shipped) or 'none' (raw attention)")
    p.add_argument("--keep-best-per-doc", action="store_true", help="keep at least the best sentence of each document")
    p.add_argument("--keep-first", action="store_true", help="always keep each document's first sentence")
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="do not position-calibrate document relevance (default: calibrate when a profile exists)",
    )
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    _add_model_args(p)

    p = sub.add_parser("explain", help="write an HTML report of what rag-opt keeps, drops and reorders, and why")
    p.add_argument("--query", "-q", required=True, help="the question")
    p.add_argument("--input", "-i", required=True, help="documents as JSONL (as for optimize); - for stdin")
    p.add_argument("--out", "-o", required=True, help="where to write the HTML report; - for stdout")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ratio", type=_ratio, help="fraction of target-LLM tokens to keep (default 0.5)")
    g.add_argument("--target-tokens", type=_nonneg_int, help="token budget in the target LLM's tokens")
    g.add_argument("--threshold", type=float, help="keep sentences whose relevance probability is >= this")
    p.add_argument("--target", help="target LLM tokenizer: OpenAI model or tiktoken encoding name, or hf:<id>")
    p.add_argument("--ordering", default="input", help=f"document ordering: {', '.join(ORDERINGS)} (default: input)")
    p.add_argument("--probe", default="auto", help="probe JSON path, 'auto' (shipped) or 'none' (raw attention)")
    _add_model_args(p)

    p = sub.add_parser("models", help="show which proxy model would load, from where")
    p.add_argument("--model", help="model to resolve (default: the embedded default)")

    p = sub.add_parser("calibrate", help="measure the proxy's positional attention profile (cached on disk)")
    p.add_argument("--n-docs", type=int, required=True, help="number of documents (slots) to calibrate for")
    p.add_argument("--contexts", type=int, default=50, help="calibration contexts to average (default 50)")
    p.add_argument("--data", default=None, help="NQ multi-doc JSONL(.gz) (default ../shared/data/nq_multidoc)")
    p.add_argument("--store", default=None, help="profile folder (default <rag-opt cache>/calibration)")
    p.add_argument(
        "--plot", default=None, help="where to write the PNG of the profile (default: next to the profile JSON)"
    )
    p.add_argument("--force", action="store_true", help="re-estimate even when a cached profile exists")
    _add_model_args(p)

    p = sub.add_parser("train-probe", help="train the sentence-relevance probe on HotpotQA")
    p.add_argument(
        "--data",
        default=None,
        help="HotpotQA train JSONL(.gz) (default ../shared/data/hotpotqa/train.jsonl.gz)",
    )
    p.add_argument("--out", required=True, help="where to write the probe JSON")
    p.add_argument("--limit", type=_nonneg_int, help="use the first N questions (after shuffling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="feature cache folder (default: <rag-opt cache>/features)")
    p.add_argument("--l2", type=float, default=None, help="L2 strength (default: chosen on held-out questions)")
    p.add_argument("--blocks", default=None, help="comma-separated feature blocks (default: all)")
    _add_model_args(p)

    p = sub.add_parser("train-doc-probe", help="train the document relevance probe on NQ (its train split)")
    p.add_argument("--data", default=None, help="NQ multi-doc JSONL(.gz) (default ../shared/data/nq_multidoc)")
    p.add_argument("--out", required=True, help="where to write the probe JSON")
    p.add_argument("--n-docs", default="20", help="comma-separated numbers of documents to train with (default 20)")
    p.add_argument("--limit", type=_nonneg_int, help="use the first N train questions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="feature cache folder (default: <rag-opt cache>/features)")
    p.add_argument("--store", default=None, help="calibration profile folder (default <rag-opt cache>/calibration)")
    p.add_argument("--l2", type=float, default=None, help="L2 strength (default: chosen on held-out questions)")
    p.add_argument("--blocks", default=None, help="comma-separated document feature blocks")
    _add_model_args(p)

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible proxy: optimize the context of chat requests, forward them upstream",
        description="OpenAI-compatible HTTP proxy (needs the server extra). Every option can also be set by "
        "the environment variable RAG_OPT_<OPTION> (e.g. RAG_OPT_UPSTREAM, RAG_OPT_RATIO, RAG_OPT_UPSTREAM_API_KEY); "
        "the command line wins.",
    )
    from rag_opt.server.settings import add_settings_arguments

    add_settings_arguments(p)  # one flag per ProxySettings field
    return parser


def _quiet_third_party(verbose: bool) -> None:
    """Hide transformers' weight-loading progress bars on the command line (kept with -v)."""
    if verbose:
        return
    import os

    # read by huggingface_hub and transformers when they are imported (later, when a model loads)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    _quiet_third_party(verbose=args.verbose > 0)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "optimize":
            return _cmd_optimize(args)
        if args.command == "explain":
            return _cmd_explain(args)
        if args.command == "models":
            return _cmd_models(args)
        if args.command == "train-probe":
            return _cmd_train_probe(args)
        if args.command == "calibrate":
            return _cmd_calibrate(args)
        if args.command == "train-doc-probe":
            return _cmd_train_doc_probe(args)
        if args.command == "serve":
            return _cmd_serve(args)
    except UserError as exc:
        print(f"rag-opt: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"rag-opt: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # e.g. ModelNotFoundError
        print(f"rag-opt: error: {exc}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.command}")
    return 2


def _check_query_args(args: argparse.Namespace) -> None:
    if not args.query.strip():
        raise UserError("--query is empty")
    if args.threshold is not None and not 0 <= args.threshold <= 1:
        raise UserError(f"--threshold must be in [0, 1], got {args.threshold}")


def _optimizer(args: argparse.Namespace) -> Any:
    """A ContextOptimizer from the shared model/target/ordering/probe arguments."""
    from rag_opt.pipeline import ContextOptimizer

    return ContextOptimizer(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        target=args.target,
        ordering=args.ordering,
        probe=None if args.probe == "none" else args.probe,
        keep_best_per_doc=getattr(args, "keep_best_per_doc", False),
        keep_first=getattr(args, "keep_first", False),
        calibrate=getattr(args, "calibrate", True),
    )


def _cmd_optimize(args: argparse.Namespace) -> int:
    _check_query_args(args)
    docs = read_documents(args.input)
    opt = _optimizer(args)
    result = opt.optimize(
        args.query, docs, ratio=args.ratio, target_tokens=args.target_tokens, threshold=args.threshold
    )
    if args.json:
        print(result.to_json())
        return 0
    print(result.context())
    saved = result.tokens_saved
    pct = 100.0 * saved / result.tokens_before if result.tokens_before else 0.0
    print(
        f"\n--- rag-opt: {result.tokens_before} → {result.tokens_after} tokens ({result.target_tokenizer}), "
        f"saved {saved} ({pct:.0f}%); {len(result.documents)} of {len(docs)} documents kept; "
        f"scorer: {result.scorer}; {result.timings.total_ms:.0f} ms",
        file=sys.stderr,
    )
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from rag_opt.report import DEFAULT_EXPLAIN_RATIO, render_html

    _check_query_args(args)
    out = Path(args.out) if args.out != "-" else None
    if out is not None and not out.parent.is_dir():
        raise UserError(f"output folder not found: {out.parent}")
    docs = read_documents(args.input)
    ratio = args.ratio
    if ratio is None and args.target_tokens is None and args.threshold is None:
        ratio = DEFAULT_EXPLAIN_RATIO
    opt = _optimizer(args)
    result = opt.optimize(args.query, docs, ratio=ratio, target_tokens=args.target_tokens, threshold=args.threshold)
    page = render_html(result, docs)
    if out is None:
        sys.stdout.write(page)
        return 0
    out.write_text(page, encoding="utf-8")
    print(
        f"rag-opt: wrote {out} ({len(result.documents)} of {len(docs)} documents kept, "
        f"{result.tokens_before} → {result.tokens_after} tokens, scorer: {result.scorer})",
        file=sys.stderr,
    )
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from rag_opt.probe import shipped_probe
    from rag_opt.proxy import EMBEDDED_MODELS, ModelNotFoundError, cache_dir, resolve_source

    try:
        src = resolve_source(args.model)
    except ModelNotFoundError as exc:
        print(f"proxy model: NOT AVAILABLE\n  {exc}")
        return 1
    print(f"proxy model: {src.name}")
    print(f"  what:      {src.description}")
    print(f"  from:      {src.location}")
    print(f"  cache:     {cache_dir()}")
    probe = shipped_probe(src.name)
    probe_desc = f"shipped ({probe.metadata.get('trained_on', '')})" if probe else "none (raw attention)"
    print(f"  probe:     {probe_desc}")
    print("embedded models:")
    for name, emb in EMBEDDED_MODELS.items():
        status = "installed" if emb.locate() else f"not installed ({emb.install})"
        print(f"  embedded:{name:<16} {emb.display_name}: {status}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from rag_opt.calibration import ProfileStore, estimate_profile, nq_calibration_contexts, plot_profile
    from rag_opt.proxy import load_proxy

    if args.n_docs < 1 or args.contexts < 1:
        raise UserError("--n-docs and --contexts must be positive")
    if args.data and not Path(args.data).is_file():
        raise UserError(f"calibration data not found: {args.data}")
    store = ProfileStore(args.store, shipped=False)
    proxy = load_proxy(args.model, device=args.device, dtype=args.dtype)
    profile = None if args.force else store.get(proxy.name, args.n_docs)
    shipped = None if args.force or profile else ProfileStore(args.store).get(proxy.name, args.n_docs)
    if shipped is not None:
        profile = shipped
        print(f"using the profile shipped with rag-opt ({profile.contexts} contexts); --force measures your own")
    elif profile is None:
        contexts = nq_calibration_contexts(args.n_docs, args.contexts, args.data)
        profile = estimate_profile(
            proxy, contexts, args.n_docs, metadata={"data": "nq_multidoc calibration split (distractors only)"}
        )
        path = store.put(profile)
        print(f"wrote {path} ({profile.contexts} contexts)")
    else:
        print(f"using cached {store.path(proxy.name, args.n_docs)} ({profile.contexts} contexts)")
    curve = profile.slot_attention("last")
    print("slot attention (final token, mean over layers and heads): " + " ".join(f"{x:.3f}" for x in curve))
    plot = args.plot or str(store.path(proxy.name, args.n_docs).with_suffix(".png"))
    try:
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        plot_profile(profile, plot)
    except ImportError:
        if args.plot:
            raise UserError("--plot needs matplotlib: pip install 'rag-opt[plot]'") from None
        print("(pip install 'rag-opt[plot]' to also get a PNG of the profile)")
    else:
        print(f"wrote {plot}")
    return 0


def _cmd_train_doc_probe(args: argparse.Namespace) -> int:
    from rag_opt.datasets import data_dir
    from rag_opt.proxy import cache_dir
    from rag_opt.train_docs import train_doc_probe_cli

    data = args.data or str(data_dir() / "nq_multidoc" / "public.jsonl.gz")
    if not Path(data).is_file():
        raise UserError(f"training data not found: {data}")
    try:
        n_docs = [int(x) for x in args.n_docs.split(",")]
    except ValueError:
        raise UserError(f"--n-docs must be comma-separated integers, got {args.n_docs!r}") from None
    if any(n < 2 for n in n_docs):
        raise UserError("--n-docs values must be at least 2")
    blocks = tuple(b.strip() for b in args.blocks.split(",")) if args.blocks else None
    _, report = train_doc_probe_cli(
        data=data,
        out=args.out,
        model=args.model,
        n_docs=n_docs,
        limit=args.limit,
        seed=args.seed,
        cache_root=args.cache or str(cache_dir() / "features"),
        store=args.store,
        l2=args.l2,
        blocks=blocks,
    )
    cv = report["cv_5fold"]
    print(
        f"document probe written to {args.out}: {report['questions']} questions, l2 {report['l2']}, "
        f"5-fold Recall@1 {cv['recall@1']:.3f}, Recall@3 {cv['recall@3']:.3f}"
    )
    return 0


def _cmd_train_probe(args: argparse.Namespace) -> int:
    from rag_opt.datasets import data_dir
    from rag_opt.proxy import cache_dir
    from rag_opt.train import train_probe_cli

    data = args.data or str(data_dir() / "hotpotqa" / "train.jsonl.gz")
    if not Path(data).is_file():
        raise UserError(f"training data not found: {data}")
    blocks = tuple(b.strip() for b in args.blocks.split(",")) if args.blocks else None
    train_probe_cli(
        data=data,
        out=args.out,
        model=args.model,
        limit=args.limit,
        seed=args.seed,
        cache_root=args.cache or str(cache_dir() / "features"),
        l2=args.l2,
        blocks=blocks,
    )
    return 0


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise UserError("rag-opt serve needs the server extra: pip install 'rag-opt[server]'") from None
    from rag_opt.server.app import create_app
    from rag_opt.server.settings import redact_url, settings_from_args

    settings = settings_from_args(args)
    if settings.probe not in (None, "auto", "none"):  # validate a probe file before serving (not at first use)
        from rag_opt.probe import Probe

        Probe.load(settings.probe)
    app = create_app(settings)
    logging.getLogger("rag_opt").setLevel(min(logging.getLogger().getEffectiveLevel(), logging.INFO))
    budget = ", ".join(f"{k}={v}" for k, v in settings.budget.as_kwargs().items() if v is not None)
    print(
        f"rag-opt proxy on http://{settings.host}:{settings.port}/v1 -> {redact_url(settings.upstream)} ({budget}, "
        f"ordering={settings.ordering}, time budget {settings.time_budget_ms:.0f} ms, "
        f"{settings.max_concurrency} worker(s), queue {settings.max_queue}, on overload {settings.on_overload}, "
        f"proxy key {'required' if settings.api_key is not None else 'off'})",
        file=sys.stderr,
    )
    if settings.host not in _LOOPBACK and settings.api_key is None:
        logger.warning(
            "listening on %s without --api-key: anyone who can reach this port can send requests through it "
            "(with your --upstream-api-key, if set)",
            settings.host,
        )
    if settings.log_bodies:
        logger.warning("--log-bodies: request and response bodies are logged (credentials redacted)")
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="debug" if args.verbose >= 2 else "info",
        access_log=False,  # rag-opt's own access log leaves out query strings (they may carry credentials)
        # idle client connections stay open 75 s, longer than client pools keep them (httpx, hence the OpenAI
        # SDKs: 5 s): a client never sends a request on a connection the proxy is closing
        timeout_keep_alive=75,
        server_header=False,  # the upstream's Server and Date headers are relayed
        date_header=False,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

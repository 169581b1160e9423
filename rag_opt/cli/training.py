"""``rag-opt calibrate``, ``train-probe`` and ``train-doc-probe``: the training side, on ../shared/data by default."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from rag_opt.cli.common import (
    HOTPOTQA_TRAIN,
    NQ_MULTIDOC,
    UserError,
    add_model_args,
    nonneg_int,
    positive_float,
    positive_int,
)
from rag_opt.install import install_hint

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure the proxy's positional attention profile (cached on disk)",
        description="Measure how much attention the proxy model (or, with --reader, the model that reads the context) "
        "gives each document slot, for --n-docs documents, on NQ questions; ordering='calibrated' and document "
        "relevance use the profile. The embedded model's profiles for 10, 20 and 30 documents are shipped: this is "
        "needed for other numbers of documents or other models. Data: --data, the NQ multi-document file (see "
        "--data below).",
    )
    p.add_argument("--n-docs", type=int, required=True, help="number of documents (slots) to calibrate for")
    p.add_argument("--contexts", type=int, default=50, help="calibration contexts to average (default 50)")
    p.add_argument("--data", default=None, help=NQ_MULTIDOC.help())
    p.add_argument("--store", default=None, help="profile folder (default <rag-opt cache>/calibration)")
    p.add_argument(
        "--plot", default=None, help="where to write the PNG of the profile (default: next to the profile JSON)"
    )
    p.add_argument("--force", action="store_true", help="re-estimate even when a cached profile exists")
    p.add_argument(
        "--reader",
        default=None,
        help="measure the profile of the model that reads the context (the target LLM) instead of the proxy's: a "
        "local model by its attention, or, with --upstream, a model behind an OpenAI-compatible API by its accuracy "
        "per slot. ordering='calibrated' then places documents by it for that target",
    )
    p.add_argument(
        "--upstream",
        default=None,
        help="the reader's OpenAI-compatible base URL, e.g. http://localhost:8080/v1 (default $RAG_OPT_UPSTREAM when "
        "--reader is not a local model): accuracy per slot, through the API",
    )
    p.add_argument(
        "--upstream-api-key", default=None, help="bearer key for --upstream (default $RAG_OPT_UPSTREAM_API_KEY)"
    )
    p.add_argument(
        "--method",
        choices=["attention", "accuracy"],
        default=None,
        help="how a reader's profile is measured: its attention share per slot (a local model only) or its accuracy "
        "per slot on NQ calibration questions (default: accuracy through --upstream, else attention)",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=200,
        help="at most this many answers for an accuracy profile (spread over the measured slots; default 200)",
    )
    add_model_args(p)
    p.set_defaults(handler=_calibrate)

    p = sub.add_parser(
        "train-probe",
        help="train the sentence-relevance probe on HotpotQA",
        description="Train the sentence-relevance probe (what ContextOptimizer(probe=...) reads) on HotpotQA's "
        "supporting facts: the proxy model reads each question's context (slow on a CPU; the features are cached "
        "under --cache). Data: --data, HotpotQA with sentence-level supporting facts, and with --nq N also --nq-data, "
        "the NQ multi-document file (see each option below for what it is and where to get it).",
    )
    _add_probe_args(p, data=HOTPOTQA_TRAIN.help(), model_features=True)
    _add_context(p)
    p.add_argument(
        "--nq",
        type=nonneg_int,
        default=0,
        help="also learn from the answer sentences of this many NQ train contexts of 10 documents (default 0)",
    )
    p.add_argument("--nq-data", default=None, help=NQ_MULTIDOC.help())
    p.add_argument(
        "--nq-weight",
        type=positive_float,
        default=1.0,
        help="how much each NQ sentence counts in the first stage's loss against a HotpotQA sentence's 1 (default 1)",
    )
    p.add_argument(
        "--cached-only",
        action="store_true",
        help="extract nothing: train on the HotpotQA questions (of the first --limit) whose features are cached "
        "already, e.g. while a long extraction is still running (missing NQ contexts are still extracted)",
    )
    _add_title_mix(p)
    p.add_argument(
        "--hidden",
        type=nonneg_int,
        default=0,
        help="hidden units per network of the first stage (default 0: logistic, as the joint encoding's shipped "
        "probe; the shipped parallel probe has 64: docs/research-log.md)",
    )
    p.add_argument(
        "--members",
        type=positive_int,
        default=None,
        help="networks averaged in a first stage with hidden units (default 3)",
    )
    p.add_argument(
        "--linear-blocks",
        default=None,
        help="with --hidden: comma-separated feature blocks passed around the network straight to the logit "
        "(default 'lexical': BM25 and term overlap count the same in any context; 'none': every feature goes "
        "through the network)",
    )
    p.set_defaults(handler=_train_probe)

    p = sub.add_parser("train-doc-probe", help="train the document relevance probe on NQ (its train split)")
    _add_probe_args(p, data=NQ_MULTIDOC.help(), model_features=True)
    p.add_argument("--n-docs", default="20", help="comma-separated numbers of documents to train with (default 20)")
    p.add_argument("--store", default=None, help="calibration profile folder (default <rag-opt cache>/calibration)")
    p.add_argument(
        "--cached-only",
        action="store_true",
        help="train on the contexts whose features are already cached (no forward pass), e.g. while an extraction "
        "is still running",
    )
    p.add_argument(
        "--first-slot",
        type=nonneg_int,
        default=0,
        help="also train on the first K questions with the gold passage in the first slot, for each N (default 0)",
    )
    p.add_argument(
        "--sentence-probe",
        default=None,
        help="sentence probe whose scores the doc_best_sentence block reads (default: the shipped one)",
    )
    p.set_defaults(handler=_train_doc_probe)

    p = sub.add_parser("train-lexical-probe", help="train the lexical-tier probe on HotpotQA (no model needed)")
    _add_probe_args(p, data=HOTPOTQA_TRAIN.help(), model_features=False)
    _add_context(p)
    _add_title_mix(p)
    p.set_defaults(handler=_train_lexical_probe)


def _add_probe_args(p: argparse.ArgumentParser, *, data: str, model_features: bool) -> None:
    """The options every probe trainer takes; ``model_features``: also those of attention features."""
    p.add_argument("--data", default=None, help=data)
    p.add_argument("--out", required=True, help="where to write the probe JSON")
    p.add_argument("--limit", type=nonneg_int, help="use the first N questions (after shuffling; default all)")
    p.add_argument("--seed", type=int, default=0)
    if model_features:
        p.add_argument("--cache", default=None, help="feature cache folder (default: <rag-opt cache>/features)")
        p.add_argument("--l2", type=float, default=None, help="L2 strength (default: chosen on held-out questions)")
        p.add_argument("--blocks", default=None, help="comma-separated feature blocks (default: the shipped ones)")
        p.add_argument(
            "--encoding",
            choices=("parallel", "joint"),
            default="joint",
            help="how the proxy reads the context: joint (one causal pass) or parallel (each document on its own, "
            "then the question; features cached apart) (default joint)",
        )
        _add_layers(p)
        add_model_args(p)


def _add_context(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--context",
        default=None,
        help="second-stage context features, comma-separated, or 'none' (default: those of the shipped probe)",
    )


def _add_title_mix(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--title-mix",
        default=None,
        help="share of HotpotQA contexts given in each title regime, e.g. field=0.6,none=0.4 (field: a title field; "
        "text: the title as the text's first line; none: no title) (default field=1)",
    )


def _title_mix(arg: str | None) -> dict[str, float] | None:
    from rag_opt.errors import InvalidInputError
    from rag_opt.training.units import parse_title_mix

    if arg is None:
        return None
    try:
        return parse_title_mix(arg)
    except InvalidInputError as e:
        raise UserError(f"--title-mix: {e}") from None


def _add_layers(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="train on the first N layers only: the forward pass stops there when the probe is used (early exit)",
    )


def _feature_cache(arg: str | None) -> str:
    from rag_opt.paths import cache_dir

    return arg or str(cache_dir() / "features")


def _blocks(arg: str | None) -> tuple[str, ...] | None:
    return tuple(b.strip() for b in arg.split(",")) if arg else None


def _calibrate(args: argparse.Namespace) -> int:
    if args.reader is not None:
        from rag_opt.cli.reader_calibration import calibrate_reader

        return calibrate_reader(args)
    from rag_opt.artifacts.position_profiles import ProfileStore
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.training.calibration import estimate_profile, nq_calibration_contexts, plot_profile

    if args.n_docs < 1 or args.contexts < 1:
        raise UserError("--n-docs and --contexts must be positive")
    store = ProfileStore(args.store, shipped=False)
    proxy = load_proxy_model(args.model, device=args.device, dtype=args.dtype)
    profile = None if args.force else store.get(proxy.name, args.n_docs)
    shipped = None if args.force or profile else ProfileStore(args.store).get(proxy.name, args.n_docs)
    if shipped is not None:
        profile = shipped
        print(f"using the profile shipped with rag-opt ({profile.contexts} contexts); --force measures your own")
    elif profile is None:
        data = NQ_MULTIDOC.path(args.data)
        contexts = nq_calibration_contexts(args.n_docs, args.contexts, data)
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
            raise UserError(f"--plot needs matplotlib: {install_hint('plot')}") from None
        print(f"({install_hint('plot')} to also get a PNG of the profile)")
    else:
        print(f"wrote {plot}")
    return 0


def _train_doc_probe(args: argparse.Namespace) -> int:
    from rag_opt.training.doc_probe import train_doc_probe_cli

    data = NQ_MULTIDOC.path(args.data)
    try:
        n_docs = [int(x) for x in args.n_docs.split(",")]
    except ValueError:
        raise UserError(f"--n-docs must be comma-separated integers, got {args.n_docs!r}") from None
    if any(n < 2 for n in n_docs):
        raise UserError("--n-docs values must be at least 2")
    _, report = train_doc_probe_cli(
        data=data,
        out=args.out,
        model=args.model,
        n_docs=n_docs,
        limit=args.limit,
        seed=args.seed,
        cache_root=_feature_cache(args.cache),
        store=args.store,
        l2=args.l2,
        blocks=_blocks(args.blocks),
        layers=args.layers,
        dtype=args.dtype,
        cached_only=args.cached_only,
        sentence_probe=args.sentence_probe,
        first_slot=args.first_slot,
        encoding=args.encoding,
    )
    cv = report["cv_5fold"]
    per_n = "; ".join(
        f"{n} documents {r['recall@1']:.3f} / {r['recall@3']:.3f}" for n, r in report["cv_5fold_per_n"].items()
    )
    print(
        f"document probe written to {args.out}: {report['questions']} questions ({report['contexts']} contexts), "
        f"l2 {report['l2']}, 5-fold Recall@1 {cv['recall@1']:.3f}, Recall@3 {cv['recall@3']:.3f} "
        f"(folds by question; per N, Recall@1 / Recall@3: {per_n})"
    )
    return 0


def _linear_blocks(value: str) -> tuple[str, ...]:
    """``--linear-blocks``: 'none' or comma-separated sentence feature blocks."""
    from rag_opt.compressors.features import ALL_BLOCKS

    if value.strip() == "none":
        return ()
    blocks = tuple(b.strip() for b in value.split(",") if b.strip())
    unknown = [b for b in blocks if b not in ALL_BLOCKS]
    if not blocks or unknown:
        raise UserError(f"--linear-blocks {value!r}: give 'none' or sentence feature blocks among {list(ALL_BLOCKS)}")
    return blocks


def _train_probe(args: argparse.Namespace) -> int:
    from rag_opt.training.mlp import MLPConfig
    from rag_opt.training.sentence_probe import train_probe_cli

    hidden = args.hidden
    if hidden and args.l2 is not None:
        raise UserError("--l2 is the L2 strength of a logistic first stage: drop --hidden, or drop --l2")
    if not hidden and args.members is not None:
        raise UserError("--members averages networks with hidden units: drop it, or give --hidden N")
    if args.nq_weight != 1.0 and not args.nq:
        raise UserError("--nq-weight weighs the NQ training contexts: give --nq N too")
    if not hidden and args.linear_blocks is not None:
        raise UserError("--linear-blocks passes features around a hidden layer: drop it, or give --hidden N")
    data = HOTPOTQA_TRAIN.path(args.data)  # the files first: a missing one is said before any work
    nq_data = NQ_MULTIDOC.path(args.nq_data, "--nq-data") if args.nq else None
    mlp = MLPConfig(hidden=hidden) if hidden else None
    if mlp is not None and args.members:
        mlp = replace(mlp, members=args.members)
    if mlp is not None and args.linear_blocks is not None:
        mlp = replace(mlp, linear_blocks=_linear_blocks(args.linear_blocks))
    train_probe_cli(
        data=data,
        out=args.out,
        model=args.model,
        limit=args.limit,
        seed=args.seed,
        cache_root=_feature_cache(args.cache),
        l2=args.l2,
        blocks=_blocks(args.blocks),
        layers=args.layers,
        dtype=args.dtype,
        context=_context(args.context),
        nq_data=nq_data,
        nq_limit=args.nq,
        encoding=args.encoding,
        cached_only=args.cached_only,
        title_mix=_title_mix(args.title_mix),
        mlp=mlp,
        nq_weight=args.nq_weight,
    )
    return 0


def _context(arg: str | None) -> tuple[str, ...] | None:
    from rag_opt.compressors.context_features import CONTEXT_FEATURES, DEFAULT_CONTEXT

    if arg is None:
        return DEFAULT_CONTEXT
    if arg.strip().lower() == "none":
        return None
    names = tuple(x.strip() for x in arg.split(",") if x.strip())
    unknown = [x for x in names if x not in CONTEXT_FEATURES]
    if unknown or not names:
        raise UserError(f"--context: unknown feature(s) {unknown}; use 'none' or some of {list(CONTEXT_FEATURES)}")
    return names


def _train_lexical_probe(args: argparse.Namespace) -> int:
    from rag_opt.training.lexical_probe import LEXICAL_CONTEXT, train_lexical_probe

    probe = train_lexical_probe(
        HOTPOTQA_TRAIN.path(args.data),
        args.out,
        limit=args.limit,
        seed=args.seed,
        context=LEXICAL_CONTEXT if args.context is None else _context(args.context),
        title_mix=_title_mix(args.title_mix),
    )
    print(f"lexical probe written to {args.out}: {probe.metadata['trained_on']}, l2 {probe.metadata['l2']}")
    return 0

"""``rag-opt calibrate --reader MODEL``: measure the positional profile of the model that reads the context."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rag_opt.cli.common import NQ_MULTIDOC, UserError
from rag_opt.install import install_hint
from rag_opt.orderers.reader_profiles import ReaderProfile, ReaderProfileStore, reader_key

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.training.datasets import NQExample

__all__ = ["calibrate_reader"]


def calibrate_reader(args: argparse.Namespace) -> int:
    """Measure (or reuse) ``args.reader``'s profile for ``args.n_docs`` documents: by its accuracy per slot through
    ``args.upstream`` (an OpenAI-compatible API), else by its attention as a local model. Writes the profile JSON
    (and a PNG) where ``ordering="calibrated"`` finds it."""
    reader = reader_key(args.reader)
    if not reader:
        raise UserError("--reader needs a model name")
    if args.n_docs < 1 or args.contexts < 1:
        raise UserError("--n-docs and --contexts must be positive")
    if args.max_requests < 1:
        raise UserError("--max-requests must be positive")
    data = NQ_MULTIDOC.path(args.data)
    if args.upstream and args.method == "attention":
        raise UserError(
            "--method attention needs a local model: drop --upstream (a remote reader's attention cannot be read)"
        )
    method = args.method or ("accuracy" if args.upstream else "attention")
    store = ReaderProfileStore(args.store)
    profile = None if args.force else store.get(reader, args.n_docs)
    if profile is not None and args.method and profile.method != args.method:  # an explicit other method measures
        print(f"the cached {store.path(reader, args.n_docs)} was measured by {profile.method}: measuring by {method}")
        profile = None
    if profile is not None:
        print(f"using cached {store.path(reader, args.n_docs)} ({profile.describe()}); --force measures it again")
    elif args.upstream:
        profile = _by_accuracy(args, reader, data)
    elif method == "accuracy":
        profile = _by_local_accuracy(args, reader, data)
    else:
        profile = _by_attention(args, data)
    path = store.put(profile)
    print(f"wrote {path}: {profile.describe()}")
    print("slot weights: " + " ".join(f"{x:.3f}" for x in profile.slot_weight))
    if profile.reader != reader:
        print(f"(the local model calls itself {profile.reader!r}: use that name as the target or the reader)")
    _plot(profile, args.plot or str(path.with_suffix(".png")), explicit=bool(args.plot))
    return 0


def _calibration_records(args: argparse.Namespace, data: str) -> list[NQExample]:
    """The NQ calibration split's questions with the distractors ``args.n_docs`` documents need."""
    from rag_opt.training.datasets import nq_split, read_nq_multidoc

    return nq_split(read_nq_multidoc(data, min_distractors=max(args.n_docs - 1, 0)), "calibration")


def _by_accuracy(args: argparse.Namespace, reader: str, data: str) -> ReaderProfile:
    from rag_opt.training.reader_calibration import OpenAIChatReader, reader_accuracy_profile

    key = args.upstream_api_key or os.environ.get("RAG_OPT_UPSTREAM_API_KEY") or None
    records = _calibration_records(args, data)
    client = OpenAIChatReader(args.upstream, reader, api_key=key)
    try:
        profile = reader_accuracy_profile(client, reader, args.n_docs, records, max_requests=args.max_requests)
    finally:
        client.close()
    print(f"{client.requests} requests to {args.upstream}")
    return profile


def _by_local_accuracy(args: argparse.Namespace, reader: str, data: str) -> ReaderProfile:
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.training.reader_calibration import LocalChatReader, reader_accuracy_profile

    model = load_proxy_model(args.reader, device=args.device, dtype=args.dtype)
    records = _calibration_records(args, data)
    local = LocalChatReader(model)
    profile = reader_accuracy_profile(local, model.name, args.n_docs, records, max_requests=args.max_requests)
    print(f"{local.requests} answers from {model.name}")
    return profile


def _by_attention(args: argparse.Namespace, data: str) -> ReaderProfile:
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.training.calibration import nq_calibration_contexts
    from rag_opt.training.reader_calibration import reader_attention_profile

    model = load_proxy_model(args.reader, device=args.device, dtype=args.dtype)
    contexts = nq_calibration_contexts(args.n_docs, args.contexts, data)
    return reader_attention_profile(model, contexts, args.n_docs)


def _plot(profile: ReaderProfile, path: str, *, explicit: bool) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if explicit:
            raise UserError(f"--plot needs matplotlib: {install_hint('plot')}") from None
        print(f"({install_hint('plot')} to also get a PNG of the profile)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    slots = list(range(1, profile.n_docs + 1))
    ax.plot(slots, profile.slot_weight, marker="o", label=profile.method)
    measured = profile.metadata.get("measured_slots")
    if measured:
        acc = profile.metadata.get("accuracy", [])
        ax.scatter(measured, acc, color="k", zorder=3, label="measured")
    ax.set_xlabel("document slot")
    ax.set_ylabel("accuracy" if profile.method == "accuracy" else "share of context attention")
    ax.set_title(profile.describe(), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")

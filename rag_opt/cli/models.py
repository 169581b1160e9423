"""``rag-opt models``: which proxy model would load, from where, and how to install the embedded ones."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser("models", help="show which proxy model would load, from where")
    p.add_argument("--model", help="model to resolve (default: the embedded default)")
    p.set_defaults(handler=_models)


def _describe(probe: Any) -> str:
    """A shipped sentence probe in one line: its first stage and what it was trained on."""
    if probe is None:
        return "none (raw attention)"
    hidden = probe.hidden
    if hidden is None:
        kind = "logistic"
    else:
        kind = f"one hidden layer of {hidden.units} units" + (
            ", lexical features around it" if hidden.linear is not None else ""
        )
    return f"shipped, {kind} ({probe.metadata.get('trained_on', '')})"


def _models(args: argparse.Namespace) -> int:
    from rag_opt.compressors.probe import shipped_probe
    from rag_opt.errors import ModelNotFoundError
    from rag_opt.models.sources import EMBEDDED_MODELS, resolve_source
    from rag_opt.paths import cache_dir

    try:
        src = resolve_source(args.model)
    except ModelNotFoundError as exc:
        print(f"proxy model: NOT AVAILABLE\n  {exc}")
        return 1
    print(f"proxy model: {src.name}")
    print(f"  what:      {src.description}")
    print(f"  from:      {src.location}")
    print(f"  cache:     {cache_dir()}")
    for encoding, label in (("parallel", "parallel (the default)"), ("joint", "joint")):
        print(f"  {'probe, ' + label + ':':<31} {_describe(shipped_probe(src.name, encoding=encoding))}")
    print("embedded models:")
    for name, emb in EMBEDDED_MODELS.items():
        status = "installed" if emb.locate() else f"not installed ({emb.install})"
        print(f"  embedded:{name:<16} {emb.display_name}: {status}")
    return 0

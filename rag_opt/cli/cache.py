"""``rag-opt cache stats|clear --cache-dir DIR``: the encoding cache's disk tier (see
:mod:`rag_opt.models.encoding_cache`): how many encodings it holds and their bytes, or remove them.

The disk tier's layout: one ``<key>.safetensors`` file per encoding (its ``.lock`` beside it, and a ``.<key>.*.tmp``
while it is being written) in a subfolder named after the key's first two hex digits. ``clear`` refuses a folder
holding anything else: it does not look like an encoding cache, and nothing in it is removed.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rag_opt.cli.common import UserError

__all__ = ["DiskCache", "register", "scan"]

_SHARD = re.compile(r"[0-9a-f]{2}")
_ENTRY = ".safetensors"


@dataclass
class DiskCache:
    """What :func:`scan` found in a cache folder."""

    folder: str
    entries: int = 0  # encodings (.safetensors files)
    bytes: int = 0  # their bytes
    other_files: list[str] = field(default_factory=list)  # cache bookkeeping: locks, interrupted writes
    foreign: list[str] = field(default_factory=list)  # anything an encoding cache does not hold
    shards: list[str] = field(default_factory=list)  # the two-hex-digit subfolders
    files: list[str] = field(default_factory=list)  # every file the cache holds (entries and bookkeeping)


def _own(name: str, in_shard: bool) -> bool:
    """Whether a file named ``name`` is one the encoding cache writes."""
    if name.endswith((_ENTRY, ".lock")):
        return True
    return in_shard and name.startswith(".") and name.endswith(".tmp")  # a write under way, or interrupted


def scan(folder: str | Path) -> DiskCache:
    """The encodings and other files in the disk tier at ``folder`` (raises :class:`UserError` if absent)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise UserError(f"cache folder not found: {folder}")
    found = DiskCache(str(root))
    for item in sorted(root.iterdir()):
        if item.is_dir() and not item.is_symlink() and _SHARD.fullmatch(item.name):
            found.shards.append(str(item))
            for sub in sorted(item.iterdir()):
                _add(found, sub, in_shard=True)
        else:
            _add(found, item, in_shard=False)
    return found


def _add(found: DiskCache, path: Path, *, in_shard: bool) -> None:
    if path.is_symlink() or not path.is_file() or not _own(path.name, in_shard):
        found.foreign.append(str(path))
        return
    found.files.append(str(path))
    if path.name.endswith(_ENTRY) and not path.name.startswith("."):
        found.entries += 1
        found.bytes += path.stat().st_size
    else:
        found.other_files.append(str(path))


def register(sub: Any) -> None:
    p = sub.add_parser("cache", help="the encoding cache's disk folder (stats, clear) and the model cache (models)")
    inner = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    stats = inner.add_parser("stats", help="encodings and bytes in a cache folder")
    stats.add_argument("--cache-dir", required=True, help="the encoding cache's disk folder")
    stats.add_argument("--json", action="store_true", help="print the figures as JSON")
    stats.set_defaults(handler=_stats)
    clear = inner.add_parser("clear", help="remove every encoding from a cache folder (not the folder itself)")
    clear.add_argument("--cache-dir", required=True, help="the encoding cache's disk folder")
    clear.set_defaults(handler=_clear)
    models = inner.add_parser(
        "models", help="the converted proxy models (<rag-opt cache>/models): list them, --clean the superseded ones"
    )
    models.add_argument("--clean", action="store_true", help="remove the folders that newer installs replaced")
    models.add_argument("--json", action="store_true", help="print the list as JSON")
    models.set_defaults(handler=_models)


def _models(args: argparse.Namespace) -> int:
    from rag_opt.models.model_cache import model_cache_entries, remove_superseded

    if args.clean:
        removed = remove_superseded()
        freed = sum(e.bytes for e in removed)
        print(f"removed {len(removed)} superseded model folders, {freed / 2**20:.0f} MiB")
        return 0
    entries = model_cache_entries()
    if args.json:
        rows = [{"folder": str(e.folder), "bytes": e.bytes, "state": e.state, "model": e.model} for e in entries]
        print(json.dumps(rows))
        return 0
    for e in entries:
        print(f"{e.state:<10} {e.bytes / 2**20:8.0f} MiB  {e.folder}")
    stale = [e for e in entries if e.state == "superseded"]
    total = sum(e.bytes for e in entries)
    hint = f"; {len(stale)} superseded ({sum(e.bytes for e in stale) / 2**20:.0f} MiB): rag-opt cache models --clean"
    print(f"{len(entries)} folders, {total / 2**20:.0f} MiB" + (hint if stale else ""))
    return 0


def _stats(args: argparse.Namespace) -> int:
    found = scan(args.cache_dir)
    if args.json:
        keep = ("folder", "entries", "bytes")
        data = {k: v for k, v in asdict(found).items() if k in keep}
        print(json.dumps({**data, "other_files": len(found.other_files), "foreign_files": len(found.foreign)}))
        return 0
    note = f"; {len(found.foreign)} other files (not an encoding cache's)" if found.foreign else ""
    print(
        f"{found.folder}: {found.entries} encodings, {found.bytes} bytes ({found.bytes / 2**20:.1f} MiB) on disk{note}"
    )
    return 0


def _clear(args: argparse.Namespace) -> int:
    found = scan(args.cache_dir)
    if found.foreign:
        shown = ", ".join(found.foreign[:3]) + (f" and {len(found.foreign) - 3} more" if len(found.foreign) > 3 else "")
        raise UserError(
            f"{found.folder} does not look like an encoding cache (it holds {shown}); nothing was removed. An "
            "encoding cache holds only two-hex-digit folders of .safetensors and .lock files"
        )
    for name in found.files:
        Path(name).unlink(missing_ok=True)
    for shard in found.shards:
        try:
            Path(shard).rmdir()
        except OSError:  # a worker wrote into it meanwhile: left in place
            pass
    print(f"rag-opt cache clear: removed {found.entries} encodings ({found.bytes / 2**20:.1f} MiB) from {found.folder}")
    return 0

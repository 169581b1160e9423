"""``rag-opt cache stats|prune|clear --cache-dir DIR``: the encoding cache's disk tier (see
:mod:`rag_opt.models.cache_disk`): how many encodings it holds, their bytes and how full its bound is; remove the
least recently used ones down to a bound; or remove them all.

An encoding is not a document: each document block (a document longer than one block has several) has an entry of
key/value states per depth the probes read, and, for the cross-document reading, one of its source queries; every
model, precision and depth adds one entry for the shared prompt prefix. ``stats`` reads each entry's header and
counts them by kind, so ``rag-opt index`` of 10 documents showing 21 encodings (10 blocks' states, their 10 source
query sets and the prefix) is explained where it is shown.

The disk tier's layout: one ``<key>.safetensors`` file per encoding in a subfolder named after the key's first two
hex digits; beside it, while it is being written, a ``.<key>.<uuid>.tmp``, and while a process computes it
(``rag-opt index``), its claim ``.<key>.claim`` (removed once the entry is written). There are no lock files: the
``<key>.safetensors.lock`` files older versions left are counted as bookkeeping and removed by ``prune`` and
``clear``. ``clear`` refuses a folder holding anything else: it does not look like an encoding cache, and nothing
in it is removed. ``prune`` removes only the disk tier's own files, whatever else the folder holds.

Sizes (``--max-bytes``) are bytes or a size with a unit: ``500MB``, ``8GiB``
(:func:`~rag_opt.models.cache_disk.parse_size`).
"""

from __future__ import annotations

import argparse
import json
import re
import struct
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rag_opt.cli.common import UserError
from rag_opt.errors import InvalidInputError
from rag_opt.models.cache_disk import DEFAULT_DISK_BYTES, DiskTier, parse_size

__all__ = ["DiskCache", "byte_size", "entry_kind", "register", "scan"]

_SHARD = re.compile(r"[0-9a-f]{2}")
_ENTRY = ".safetensors"
_LOCK = ".lock"  # older versions' per-entry lock files
_CLAIM = ".claim"
_MAX_HEADER = 1 << 20  # an entry's header is a few hundred bytes: a larger one is no entry's


@dataclass
class DiskCache:
    """What :func:`scan` found in a cache folder."""

    folder: str
    entries: int = 0  # encodings (.safetensors files)
    bytes: int = 0  # their bytes
    other_files: list[str] = field(default_factory=list)  # bookkeeping: claims, writes under way, old lock files
    claims: int = 0  # entries a process is computing (.<key>.claim)
    legacy_locks: int = 0  # lock files older versions left (<key>.safetensors.lock)
    foreign: list[str] = field(default_factory=list)  # anything an encoding cache does not hold
    shards: list[str] = field(default_factory=list)  # the two-hex-digit subfolders
    files: list[str] = field(default_factory=list)  # every file the cache holds (entries and bookkeeping)
    # with ``kinds=True``: entries by kind (``kv``: a block's or the prefix's key/value states; ``rows``: a block's
    # source queries; ``unreadable``: no entry header), and the key/value entries by depth (layers)
    kinds: dict[str, int] = field(default_factory=dict)
    kv_depths: dict[int, int] = field(default_factory=dict)


def _own(name: str, in_shard: bool) -> bool:
    """Whether a file named ``name`` is one the encoding cache writes."""
    if name.endswith((_ENTRY, _LOCK)):
        return True
    # a write under way (or interrupted), a claim
    return in_shard and name.startswith(".") and name.endswith((".tmp", _CLAIM))


def scan(folder: str | Path, *, kinds: bool = False) -> DiskCache:
    """The encodings and other files in the disk tier at ``folder`` (raises :class:`UserError` if absent); ``kinds``:
    also read each entry's header to count the entries by kind (:attr:`DiskCache.kinds`)."""
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
    if kinds:
        tally: Counter[str] = Counter()
        depths: Counter[int] = Counter()
        for name in found.files:
            if name.endswith(_ENTRY) and not Path(name).name.startswith("."):
                kind, depth = entry_kind(name)
                tally[kind] += 1
                if kind == "kv" and depth is not None:
                    depths[depth] += 1
        found.kinds, found.kv_depths = dict(tally), dict(sorted(depths.items()))
    return found


def entry_kind(path: str | Path) -> tuple[str, int | None]:
    """An entry's kind from its safetensors header (:meth:`~rag_opt.models.kv_codec.EncodedStates.to_bytes` records
    it): ``("kv", layers)`` for key/value states, ``("rows", layers)`` for source queries, ``("unreadable", None)``
    for a file without such a header (or one removed meanwhile)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            header = json.loads(fh.read(n)) if 0 < n <= _MAX_HEADER else None
    except (OSError, ValueError):
        return "unreadable", None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        return "unreadable", None
    kind, shape = meta.get("kind"), str(meta.get("shape", "")).split("x")
    if kind not in ("kv", "rows"):
        return "unreadable", None
    layers = shape[1] if kind == "kv" and len(shape) > 1 else shape[0]  # kv: 2xLx...; rows: Lx...
    return kind, int(layers) if layers.isdigit() else None


def _add(found: DiskCache, path: Path, *, in_shard: bool) -> None:
    if path.is_symlink() or not path.is_file() or not _own(path.name, in_shard):
        found.foreign.append(str(path))
        return
    found.files.append(str(path))
    if path.name.endswith(_ENTRY) and not path.name.startswith("."):
        try:
            size = path.stat().st_size
        except FileNotFoundError:  # evicted by a process using the folder meanwhile
            found.files.pop()
            return
        found.entries += 1
        found.bytes += size
    else:
        found.other_files.append(str(path))
        found.claims += path.name.endswith(_CLAIM)
        found.legacy_locks += path.name.endswith(_LOCK)


def byte_size(value: str) -> int:
    """argparse type: a size in bytes, plain or with a unit (``500MB``, ``8GiB``)."""
    try:
        return parse_size(value)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(n: float) -> str:
    """``n`` bytes for a person: MiB below a GiB, GiB above."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "cache", help="the encoding cache's disk folder (stats, prune, clear) and the model cache (models)"
    )
    inner = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    stats = inner.add_parser(
        "stats",
        help="encodings and bytes in a cache folder, how full its bound is, and what the encodings are",
        description="Count the encodings in a disk tier, their bytes and how full its bound is, and say what they are: "
        "an encoding is not a document, but a document block's key/value states at one depth the probes read, a "
        "block's source queries (the cross-document reading), or the shared prompt prefix's states (one per model "
        "and depth). So rag-opt index of 10 one-block documents writes 21: 10 + 10 + 1.",
    )
    stats.add_argument("--cache-dir", required=True, help="the encoding cache's disk folder")
    stats.add_argument(
        "--max-bytes",
        type=byte_size,
        default=DEFAULT_DISK_BYTES,
        help="the disk tier's bound, to show how full it is (bytes, or 500MB, 8GiB; default "
        f"{_size(DEFAULT_DISK_BYTES)})",
    )
    stats.add_argument("--json", action="store_true", help="print the figures as JSON")
    stats.set_defaults(handler=_stats)
    prune = inner.add_parser(
        "prune", help="remove the least recently used encodings until the folder holds at most --max-bytes"
    )
    prune.add_argument("--cache-dir", required=True, help="the encoding cache's disk folder")
    prune.add_argument(
        "--max-bytes", type=byte_size, required=True, help="the bytes to keep at most (bytes, or 500MB, 8GiB)"
    )
    prune.set_defaults(handler=_prune)
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
    found = scan(args.cache_dir, kinds=True)
    bound = int(args.max_bytes)
    fill = found.bytes / bound if bound else 0.0
    if args.json:
        keep = ("folder", "entries", "bytes", "claims", "legacy_locks", "kinds")
        data = {k: v for k, v in asdict(found).items() if k in keep}
        extra = {
            "max_bytes": bound,
            "fill": round(fill, 6),
            "kv_depths": {str(k): v for k, v in found.kv_depths.items()},
        }
        print(json.dumps({**data, **extra, "other_files": len(found.other_files), "foreign_files": len(found.foreign)}))
        return 0
    notes = []
    if found.claims:
        notes.append(f"{found.claims} being computed")
    if found.legacy_locks:
        notes.append(f"{found.legacy_locks} old lock files (rag-opt cache prune removes them)")
    if found.foreign:
        notes.append(f"{len(found.foreign)} other files (not an encoding cache's)")
    over = f"; over the bound: rag-opt cache prune --max-bytes {bound}" if found.bytes > bound else ""
    print(
        f"{found.folder}: {found.entries} encodings, {found.bytes} bytes ({_size(found.bytes)}) on disk, "
        f"{fill:.1%} of the {_size(bound)} bound{over}" + "".join(f"; {n}" for n in notes)
    )
    for line in _kind_lines(found):
        print(f"  {line}")
    return 0


def _kind_lines(found: DiskCache) -> list[str]:
    """What the encodings are, by kind: an entry is not a document (see the module docstring)."""
    if not found.entries:
        return []
    kv, rows, unreadable = (found.kinds.get(k, 0) for k in ("kv", "rows", "unreadable"))
    depths = " and ".join(str(d) for d in found.kv_depths)
    at = f" ({depths} layers deep)" if depths else ""
    lines = []
    if kv:
        lines.append(
            f"{kv} key/value states{at}: each document block's at each depth the probes read (a long document has "
            "several blocks), and the shared prompt prefix's, one per model and depth"
        )
    if rows:
        lines.append(f"{rows} source-query sets: each block's, for the cross-document reading")
    if unreadable:
        lines.append(f"{unreadable} without an entry header (not written by this rag-opt, or damaged)")
    return lines


def _prune(args: argparse.Namespace) -> int:
    found = scan(args.cache_dir)  # the folder exists (UserError otherwise)
    tier = DiskTier(found.folder, max_bytes=max(1, int(args.max_bytes)), write_behind=False)
    try:
        removed, freed = tier.prune(int(args.max_bytes))
        errors = tier.stats().errors
    finally:
        tier.close()
    after = scan(found.folder)
    print(
        f"rag-opt cache prune: removed {removed} encodings ({_size(freed)}) from {found.folder}; "
        f"{after.entries} left, {_size(after.bytes)} of the {_size(args.max_bytes)} bound"
        + (f"; {errors} files could not be read or removed (see the log)" if errors else "")
    )
    return 1 if errors else 0


def _clear(args: argparse.Namespace) -> int:
    found = scan(args.cache_dir)
    if found.foreign:
        shown = ", ".join(found.foreign[:3]) + (f" and {len(found.foreign) - 3} more" if len(found.foreign) > 3 else "")
        raise UserError(
            f"{found.folder} does not look like an encoding cache (it holds {shown}); nothing was removed. An "
            "encoding cache holds only two-hex-digit folders of .safetensors files (and its claim and temporary "
            "files)"
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

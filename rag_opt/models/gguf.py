"""GGUF proxy weights → a plain safetensors folder, converted once per file and cached on disk."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from rag_opt.models.sources import ModelSource
from rag_opt.paths import cache_dir

__all__ = ["FINGERPRINTS", "content_key", "converted_gguf_dir"]

logger = logging.getLogger(__name__)


FINGERPRINTS = "fingerprints.json"  # in the model cache: each source file's content digest, by path, size and mtime


def content_key(paths: tuple[Path, ...]) -> str:
    """The converted folder's key: a digest of the source files' *contents* (not their install path or time), so
    reinstalling the same wheel reuses the folder instead of adding another ~0.8 GB. A file's digest is computed
    once and remembered (:data:`FINGERPRINTS`) under its path, size and modification time."""
    h = hashlib.sha256()
    for p in paths:
        h.update(_content_digest(p).encode())
    return h.hexdigest()[:16]


def _content_digest(path: Path) -> str:
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    index = cache_dir() / "models" / FINGERPRINTS
    known: dict[str, str] = {}
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(stamp), str):
        return known[stamp]
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    index.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(index.with_suffix(".lock"))):  # read-modify-write, atomically replaced
        try:
            current = json.loads(index.read_text(encoding="utf-8"))
            current = current if isinstance(current, dict) else {}
        except (OSError, ValueError):
            current = {}
        current[stamp] = digest
        tmp = index.with_name(f".{index.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(current, indent=0, sort_keys=True), encoding="utf-8")
        os.replace(tmp, index)
    return digest


def converted_gguf_dir(source: ModelSource, dtype: str = "float32") -> Path:
    """Return a safetensors folder converted from the source's GGUF file(s), converting once if needed.

    ``dtype="bfloat16"``/``"float16"``: a copy of the float32 folder stored at that precision (made once), so a model
    loaded in bf16 maps only its bf16 weights: casting memory-mapped float32 weights pages the whole float32 file
    in next to the copy (1.2 GiB peak RSS instead of 0.6 for the embedded model).
    """
    stem = source.name.replace(":", "-").replace("/", "-")
    key = content_key(source.paths)
    folder = cache_dir() / "models" / f"{stem}-{key}"
    if not _complete(folder):  # the same files converted under another name (the embedded model by its path): reused
        folder = _converted_as(folder.parent, key) or folder
    _once(folder, lambda: _convert_gguf(source, folder))
    if dtype == "float32":
        return folder
    half = folder.with_name(f"{folder.name}-{dtype}")
    _once(half, lambda: _save_as(folder, half, dtype))
    return half


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _converted_as(models: Path, key: str) -> Path | None:
    """A complete float32 folder converted from files of content key ``key`` under any name (the first by name), or
    None: a GGUF file given by its path and the embedded model it is share one conversion (~0.5 GB each)."""
    try:
        found = sorted(p for p in models.glob(f"*-{key}") if p.is_dir() and _complete(p))
    except OSError:
        return None
    return found[0] if found else None


def _once(folder: Path, make: Callable[[], None]) -> None:
    if _complete(folder):
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.with_suffix(".lock"))):  # two processes never convert the same model at once
        if not _complete(folder):
            make()


def _save_as(src: Path, folder: Path, dtype: str) -> None:
    """The float32 folder ``src`` stored at ``dtype`` in ``folder`` (written to a temporary folder, then moved)."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("storing %s at %s in %s (once)", src, dtype, folder)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp_str:
        out_dir = Path(tmp_str) / "model"
        out_dir.mkdir()
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=getattr(torch, dtype), local_files_only=True)
        save_model(model, str(out_dir / "model.safetensors"))
        model.config.save_pretrained(out_dir)
        AutoTokenizer.from_pretrained(str(src), local_files_only=True).save_pretrained(out_dir)
        for extra in src.glob("rag_opt_source.json"):
            shutil.copy(extra, out_dir / extra.name)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(out_dir, folder)


def _convert_gguf(source: ModelSource, folder: Path) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a safetensors folder at %s (once)", source.description, folder)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp_str:
        tmp = Path(tmp_str)
        gguf_path = source.paths[0]
        if len(source.paths) > 1:  # a GGUF shipped in several parts: concatenate in order
            gguf_path = tmp / "model.gguf"
            with open(gguf_path, "wb") as out:
                for part in source.paths:
                    with open(part, "rb") as src:
                        shutil.copyfileobj(src, out, 1 << 24)
        out_dir = tmp / "model"
        out_dir.mkdir()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        save_model(hf_model, str(out_dir / "model.safetensors"))
        config = hf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the de-quantised weights are plain tensors
        config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        (out_dir / "rag_opt_source.json").write_text(
            json.dumps({"source": source.name, "files": [str(p) for p in source.paths]}, indent=2)
        )
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(out_dir, folder)

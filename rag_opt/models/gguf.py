"""GGUF proxy weights → a plain safetensors folder, converted once per file and cached on disk."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from rag_opt.models.sources import ModelSource
from rag_opt.paths import cache_dir

__all__ = ["converted_gguf_dir"]

logger = logging.getLogger(__name__)


def _fingerprint(paths: tuple[Path, ...]) -> str:
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def converted_gguf_dir(source: ModelSource) -> Path:
    """Return a safetensors folder converted from the source's GGUF file(s), converting once if needed."""
    stem = source.name.replace(":", "-").replace("/", "-")
    folder = cache_dir() / "models" / f"{stem}-{_fingerprint(source.paths)}"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock_path = folder.with_suffix(".lock")
    with FileLock(str(lock_path)):  # two processes never convert the same model at once (any OS)
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
        _convert_gguf(source, folder)
    return folder


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

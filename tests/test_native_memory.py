"""The native-memory settings of long-running commands: applied at their start only, and refusable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CODE = (
    "import json, os, sys; from rag_opt.native_memory import tune_native_memory; "
    "print(json.dumps([tune_native_memory(), os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY')]))"
)


def _run(env: dict[str, str]) -> list[object]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "RAG_OPT_NATIVE_MEMORY")
    }
    out = subprocess.run([sys.executable, "-c", CODE], env={**clean, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_the_settings_are_applied_and_can_be_refused() -> None:
    applied, onednn = _run({})
    assert applied == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": 8,
        "mmap_threshold": 65536,
        "trim_threshold": 0,
        "arena_max": 2,
    }
    assert onednn == "8"
    assert _run({"RAG_OPT_NATIVE_MEMORY": "default"}) == [{}, None]
    # an operator's own oneDNN setting wins
    applied, onednn = _run({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"})
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in applied and onednn == "64"


def test_importing_rag_opt_changes_nothing() -> None:
    code = "import os, rag_opt, rag_opt.native_memory; print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"

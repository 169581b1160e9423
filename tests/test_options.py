"""The optimizer's options have one home, :class:`rag_opt.OptimizerOptions`: the optimizer, the command line, the
server, the adapters, the gateway and batch derive from it (issue 54, "One home for the optimizer's options")."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rag_opt import Budget, ContextOptimizer, OptimizerOptions, WorkLimits
from rag_opt.errors import InvalidInputError, InvalidInputTypeError
from rag_opt.option_text import text_options
from rag_opt.options import option_names, option_spec

ROOT = Path(__file__).resolve().parents[1]


def test_an_options_object_and_keywords_build_the_same_optimizer() -> None:
    kw = {"ratio": 0.3, "keep_best_per_doc": True, "tier": "lexical", "title_keys": ["headline"], "cache": None}
    by_name, by_object = ContextOptimizer(**kw), ContextOptimizer(OptimizerOptions(**kw))
    assert by_name.options == by_object.options == OptimizerOptions(**kw)
    assert by_name.budget == Budget(ratio=0.3) and by_name.selection_options.keep_best_per_doc
    assert by_name.title_keys == ("headline",) and by_name.tier == "lexical" and by_name.cache is None
    # an options object is reused, with options replaced; a budget given replaces the options' budget
    again = ContextOptimizer(by_name.options, threshold=0.2, language="de")
    assert again.budget == Budget(threshold=0.2) and again.language == "de" and again.tier == "lexical"
    assert ContextOptimizer(options=by_name.options).options is by_name.options
    assert ContextOptimizer().budget == Budget(ratio=0.5) and ContextOptimizer().options == OptimizerOptions()


def test_an_unknown_option_names_the_closest_on_every_entry() -> None:
    import rag_opt

    with pytest.raises(InvalidInputError, match=r"ContextOptimizer got unknown option\(s\) 'rati' \(did you mean"):
        ContextOptimizer(rati=0.5)  # type: ignore[call-arg]
    with pytest.raises(InvalidInputError, match=r"'keep_best_per_document' \(did you mean 'keep_best_per_doc'\?\)"):
        rag_opt.optimize("q", ["d."], keep_best_per_document=True)
    with pytest.raises(InvalidInputTypeError, match="options must be a rag_opt.OptimizerOptions"):
        ContextOptimizer({"ratio": 0.5})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"ratio": 0.3, "threshold": 0.2}, InvalidInputError, "at most one of ratio, target_tokens and threshold"),
        ({"ratio": 0.3, "budget": Budget(ratio=0.2)}, InvalidInputError, "either as ratio/target_tokens/threshold"),
        ({"ordering": "best"}, InvalidInputError, "unknown ordering 'best'"),
        ({"max_window_tokens": 64}, InvalidInputError, "max_window_tokens must be at least 128"),
        ({"drop_below_best": 2}, InvalidInputError, r"drop_below_best must be in \(0, 1\]"),
        ({"title_from_text": "yes"}, InvalidInputTypeError, "title_from_text must be true or false"),
        ({"reader": " "}, InvalidInputError, "reader must be a non-empty model name"),
        ({"tier": "fast"}, InvalidInputError, "unknown tier 'fast'"),
        ({"limits": 5}, InvalidInputTypeError, "limits must be a rag_opt.WorkLimits or None"),
        ({"over_limit": "skip"}, InvalidInputError, "over_limit must be 'raise' or 'lexical'"),
        ({"threads": 0}, InvalidInputError, "threads must be at least 1"),
        ({"encoding": "both"}, InvalidInputError, "both"),
        ({"target": "no-such-tokenizer"}, InvalidInputError, "no-such-tokenizer"),
    ],
)
def test_an_invalid_option_raises_what_the_optimizer_always_raised(kw, error, message) -> None:
    with pytest.raises(error, match=message):
        OptimizerOptions(**kw)
    with pytest.raises(error, match=message):
        ContextOptimizer(**kw)


def test_every_option_has_a_type_a_default_a_one_line_help_and_its_docs() -> None:
    fields = {f.name: f for f in dataclasses.fields(OptimizerOptions)}
    assert list(fields) == list(option_names())
    for name in fields:
        spec = option_spec(name)
        assert spec.help and "\n" not in spec.help and not spec.help.endswith("."), name
        assert fields[name].type and fields[name].default is not dataclasses.MISSING, name
    # each field is followed by its docstring (rendered by mkdocstrings in docs/python-api.md)
    tree = ast.parse((ROOT / "rag_opt" / "options.py").read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OptimizerOptions"]
    documented = {
        a.target.id
        for a, b in zip(cls.body, cls.body[1:], strict=False)
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
        if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)
    }
    assert documented == set(fields)
    # the options the text surfaces take: every one whose value is text, the objects none
    cli, server = {o.name for o in text_options("cli")}, {o.name for o in text_options("server")}
    assert {"scorer", "budget", "limits"}.isdisjoint(cli | server)
    assert server == cli - {"tier", "threads", "cache", "over_limit"}  # the server sets these its own way


def test_the_optimizer_signature_is_the_options_typed() -> None:
    params = inspect.signature(ContextOptimizer).parameters
    assert list(params) == ["options", *option_names()]
    assert params["keep_best_per_doc"].default is False and params["limits"].default == WorkLimits(
        max_units=20_000, max_proxy_tokens=65_536, max_question_tokens=1024
    )
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in params.items() if n != "options")


# -- one declaration reaches every surface ----------------------------------------------------------------------
_NEW_OPTION = '''
    shout: bool = option(False, "shout the kept text (an option a test declares)")
    """An option declared in this file alone, by tests/test_options.py."""

'''

_SURFACES = """
import argparse, contextlib, io, sys
import rag_opt
assert rag_opt.__file__.startswith(sys.argv[1]), rag_opt.__file__
from rag_opt import ContextOptimizer, OptimizerOptions

def help_of(argv):
    from rag_opt.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()

# the library: the optimizer, rag_opt.optimize's check
assert ContextOptimizer(shout=True).options.shout is True and OptimizerOptions().shout is False
from rag_opt.one_call import _check_options
_check_options({"shout": True})

# the command line: a flag of every command that runs the optimizer
from rag_opt.cli import build_parser
from rag_opt.cli.common import build_optimizer
args = build_parser().parse_args(["optimize", "-q", "q", "-i", "docs.jsonl", "--shout"])
assert build_optimizer(args).options.shout is True
assert all("--shout" in help_of([c]) for c in ("optimize", "explain", "batch", "mcp"))

# rag-opt serve: a setting, its flag and its variable, and the server's optimizer has it
from rag_opt.server.settings import ProxySettings
from rag_opt.server.settings_cli import add_settings_arguments, settings_from_args
from rag_opt.server.state import build_optimizer as server_optimizer
parser = argparse.ArgumentParser()
add_settings_arguments(parser)
settings = settings_from_args(parser.parse_args(["--upstream", "http://up/v1", "--shout"]), {})
assert settings.options.shout is True and "--shout" in help_of(["serve"])
assert ProxySettings.from_sources({"upstream": "http://up/v1"}, {"RAG_OPT_SHOUT": "true"}).options.shout is True
assert server_optimizer(settings).options.shout is True

# the adapters, the gateway, batch
from rag_opt.adapters.langchain import RagOptCompressor
assert RagOptCompressor(shout=True).optimizer.options.shout is True
from rag_opt.adapters.llamaindex import RagOptNodePostprocessor
assert RagOptNodePostprocessor(shout=True).optimizer.options.shout is True
from rag_opt.adapters.haystack import RagOptDocumentCompressor
data = RagOptDocumentCompressor(shout=True).to_dict()
assert data["init_parameters"]["shout"] is True
assert RagOptDocumentCompressor.from_dict(data).optimizer.options.shout is True
from rag_opt.adapters.gateway import GatewaySettings, RequestOptimizer
gateway = RequestOptimizer(GatewaySettings(optimizer={"shout": True}, warmup=False))
assert gateway._optimizer.options.shout is True
from rag_opt.batch.optimizer import BatchOptimizer
assert BatchOptimizer(shout=True, preload=False).optimizer.options.shout is True
print("every surface has it")
"""


def test_a_new_option_reaches_every_surface_from_its_one_declaration(tmp_path: Path) -> None:
    """Declare one more option in rag_opt/options.py alone (a copy of the package): the optimizer, rag_opt.optimize,
    the command line, rag-opt serve (setting, flag, variable), LangChain, LlamaIndex, Haystack, the gateway and
    batch all take it, with no other edit."""
    for extra in ("langchain_core", "llama_index.core", "haystack", "starlette", "httpx"):
        pytest.importorskip(extra, reason=f"{extra} is not installed (pip install -e '.[dev]')")
    copy = tmp_path / "rag_opt"
    shutil.copytree(ROOT / "rag_opt", copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = (copy / "options.py").read_text(encoding="utf-8")
    anchor = "    def __post_init__(self) -> None:\n"
    assert source.count(anchor) == 1
    (copy / "options.py").write_text(source.replace(anchor, _NEW_OPTION + anchor), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RAG_OPT_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SURFACES), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and "every surface has it" in run.stdout, run.stderr[-4000:]

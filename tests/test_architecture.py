"""The shape of the package holds: no import cycles, training code out of the runtime, lazy heavy imports.

Imports are read statically (module level, outside ``if TYPE_CHECKING:``), so these tests load no model.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "rag_opt"


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rag_opt"):
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("rag_opt"))
            elif not top_level_only or isinstance(node, (ast.If, ast.Try)):
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child])

    visit(tree.body)
    return out


def _graph(*, top_level_only: bool) -> dict[str, set[str]]:
    files = {_module(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in _imports(p, top_level_only=top_level_only) if i in files} - {m} for m, p in files.items()}


def test_no_import_cycles_at_module_level() -> None:
    graph = _graph(top_level_only=True)
    state: dict[str, int] = {}
    path: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n) :] + [n]))
            if n not in state:
                dfs(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)


# deferred-import cycles kept on purpose: a registry that imports its implementations by name when one is asked
# for, and the joint extractor handing parallel encoding to its module (which returns the extractor's type)
_DEFERRED_CYCLES_KEPT = (
    frozenset(
        {
            "rag_opt.orderers.attention_sort",
            "rag_opt.orderers.base",
            "rag_opt.orderers.calibrated",
            "rag_opt.orderers.lost_in_the_middle",
            "rag_opt.orderers.simple",
        }
    ),
    frozenset({"rag_opt.models.extract", "rag_opt.models.parallel_features"}),
)


def test_no_import_cycles_even_through_deferred_imports() -> None:
    """Strongly connected groups of the import graph, function-level imports included (the batcher and the
    pipeline, the document probe and the NQ sentence labels, no longer import each other)."""
    graph = _graph(top_level_only=False)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(frozenset(group))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    unexpected = [sorted(g) for g in groups if g not in _DEFERRED_CYCLES_KEPT]
    assert not unexpected, f"import cycles: {unexpected}"


def _package(module: str) -> str:
    """The unit of the package-level graph a module belongs to: its subpackage of rag_opt (``rag_opt.orderers``), or
    itself for a module directly under rag_opt (``rag_opt.pipeline``)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PKG / parts[1]).is_dir() else module


def _is_subpackage(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 2 and (PKG / parts[1]).is_dir()


def _package_graph() -> dict[str, dict[str, list[str]]]:
    """``{package: {package it imports: [the module imports that make the edge]}}``, every import counted: module
    level, deferred into functions, and under ``if TYPE_CHECKING:`` (a type import is a dependency too)."""
    files = {_module(p): p for p in PKG.rglob("*.py")}
    out: dict[str, dict[str, list[str]]] = {_package(m): {} for m in files}
    for m, p in files.items():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rag_opt"):
                # ``from rag_opt import telemetry`` imports the module rag_opt.telemetry, not the package's facade
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [n for n in subs if n in files] + ([node.module] if any(n not in files for n in subs) else [])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for n in names:
                if n in files and _package(n) != _package(m):
                    out[_package(m)].setdefault(_package(n), []).append(f"{m} -> {n}")
    return out


def _cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_import_cycles_between_packages() -> None:
    """rag_opt's subpackages (and its top-level modules) import each other one way only, counting every import:
    what the scorer and the orderers both read (position profiles, the shipped probes' metadata) lives a floor
    below both, in rag_opt.artifacts."""
    graph = _package_graph()
    # a cycle of top-level modules alone (rag_opt.types, rag_opt.pipeline, ...) is the module-level tests' concern
    cycles = [group for group in _cycles(graph) if any(_is_subpackage(name) for name in group)]
    edges = [
        f"{a} -> {b}: {graph[a][b][:3]}" for group in cycles for a in group for b in group if b in graph.get(a, {})
    ]
    assert not cycles, f"package-level import cycles {cycles}:\n" + "\n".join(edges)
    assert "rag_opt.orderers" not in graph["rag_opt.compressors"], graph["rag_opt.compressors"]["rag_opt.orderers"]
    for low in ("rag_opt.artifacts", "rag_opt.models", "rag_opt.text"):
        up = sorted(set(graph[low]) & {"rag_opt.compressors", "rag_opt.orderers", "rag_opt.pipeline"})
        assert not up, f"{low} imports a package above it: {up}"


def test_the_package_cycle_check_finds_a_cycle() -> None:
    """The check above can fail: a made-up edge back from compressors to orderers closes a cycle."""
    graph = _package_graph()
    graph["rag_opt.compressors"]["rag_opt.orderers"] = ["made up"]
    graph["rag_opt.orderers"].setdefault("rag_opt.compressors", ["made up"])
    assert any({"rag_opt.compressors", "rag_opt.orderers"} <= set(group) for group in _cycles(graph))


MAX_FUNCTION_LINES = 60  # in rag_opt/models/: the hot path reads as small named steps


def test_no_function_in_models_is_over_60_lines() -> None:
    """Every function and method in rag_opt/models/ fits in 60 lines, decorators and docstring included."""
    long = []
    for path in sorted((PKG / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - start + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{_module(path)}.{node.name} (line {node.lineno}): {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)
    ]


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_cache_keys_are_made_in_one_place() -> None:
    """The optimizer and rag-opt index key a block with the same function (block_key), and nothing else makes a
    content key: a change to how a key is made reaches both, so an index cannot silently miss."""
    makers = {
        _module(path)
        for path in PKG.rglob("*.py")
        if _calls(ast.parse(path.read_text(encoding="utf-8")), "encoding_key")
    }
    assert makers == {"rag_opt.models.encoding_cache"}, makers
    cache = ast.parse((PKG / "models" / "encoding_cache.py").read_text(encoding="utf-8"))
    assert _calls(_function(cache, "block_key"), "encoding_key")
    assert len(_calls(cache, "encoding_key")) == 1  # block_key's call only
    index = ast.parse((PKG / "cli" / "index.py").read_text(encoding="utf-8"))
    assert _calls(_function(index, "key"), "block_key")
    features = ast.parse((PKG / "models" / "parallel_features.py").read_text(encoding="utf-8"))
    assert _calls(features, "block_key")
    for tree in (index, features):  # no key of their own: the template is block_key's
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "PARALLEL_TEMPLATE_ID"]


def test_the_runtime_never_imports_training_code() -> None:
    graph = _graph(top_level_only=False)
    for m, deps in graph.items():
        if m.startswith(("rag_opt.training", "rag_opt.cli")):
            continue
        bad = sorted(d for d in deps if d.startswith("rag_opt.training"))
        assert not bad, f"{m} imports training code: {bad}"


# helpers, not adapters (gateway: a request body's context optimized, for the adapters inside a gateway)
_SHARED_BY_ADAPTERS = ("rag_opt.adapters.metadata", "rag_opt.adapters.options", "rag_opt.adapters.gateway")


def test_adapters_and_the_server_import_no_other_adapter() -> None:
    graph = _graph(top_level_only=False)
    for m, deps in graph.items():
        if m.startswith(("rag_opt.adapters.", "rag_opt.server")):
            others = sorted(
                d for d in deps if d.startswith("rag_opt.adapters.") and d not in _SHARED_BY_ADAPTERS and d != m
            )
            assert not others, f"{m} imports another adapter: {others}"


def test_every_public_module_declares_all() -> None:
    missing = [
        _module(p)
        for p in PKG.rglob("*.py")
        if not p.name.startswith("_") and p.name != "__main__.py" and "__all__" not in p.read_text(encoding="utf-8")
    ]
    assert not missing, f"modules without __all__: {missing}"


def test_importing_rag_opt_loads_no_torch_transformers_or_framework() -> None:
    code = (
        "import sys, rag_opt, rag_opt.types, rag_opt.errors, rag_opt.orderers, rag_opt.compressors, rag_opt.models\n"
        "import rag_opt.batch, rag_opt.mcp_server, rag_opt.cli\n"
        "heavy = ('torch', 'transformers', 'langchain_core', 'httpx', 'starlette', 'ray', 'mcp', 'pyarrow')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "rag_opt.Budget; rag_opt.RagOptError; rag_opt.Unit; rag_opt.Timings; rag_opt.Scorer; rag_opt.Orderer\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# 'rag-opt' on the package index is an unrelated project that also installs as rag_opt: an install hint that names
# it (pip install rag-opt, 'rag-opt[server]', ...) would install someone else's code
_PIP_INSTALL = re.compile(r"pip3? install ([^\n`#;&|)]*)")
_THE_OTHER = re.compile(r"""^['"]?rag[-_.]?opt(\[[^\]]*\])?([<>=!~].*)?['"]?$""", re.IGNORECASE)


def _names_the_other_project(line: str) -> bool:
    """Whether a pip install command on ``line`` asks for the distribution 'rag-opt' (any spelling, extras)."""
    return any(_THE_OTHER.match(arg) for m in _PIP_INSTALL.finditer(line) for arg in m.group(1).split())


def test_no_install_hint_names_the_other_project() -> None:
    from rag_opt.install import DISTRIBUTION, install_hint

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for name in files:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".toml", ".txt", ".yml", ".yaml", ".cfg", ".html") or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if _names_the_other_project(line) and "# the check's own examples" not in line:
                bad.append(f"{name}:{n}: {line.strip()}")
    assert not bad, "install hints that name the unrelated 'rag-opt' project:\n" + "\n".join(bad)
    for extra in ("server", "mcp", "ray"):
        hint = install_hint(extra)
        assert not _names_the_other_project(hint) and ("-e '" in hint or DISTRIBUTION in hint), hint
    # the check catches the hints it is for, and not the command or other packages
    wrong = [
        "pip install rag-opt",
        "pip install 'rag-opt[server]'",
        'pip install -U "rag_opt[mcp]"',
    ]  # the check's own examples
    right = [".venv/bin/pip install -e . && .venv/bin/rag-opt optimize", "pip install -e '.[server]'  # not rag-opt"]
    assert all(_names_the_other_project(w) for w in wrong) and not any(_names_the_other_project(r) for r in right)


# -- the optimizer's options have one home (rag_opt/options.py) -------------------------------------------------
# The modules that build an optimizer from a surface's input (the server, the command line, the adapters, the
# gateway, batch, rag_opt.optimize) take the options from their declaration and never list them. They may name the
# per-call options (ContextOptimizer.optimize's keywords: the budget, ordering, tier, language, target: a per-call
# API of its own) and, each with its reason, the few below.
_MAY_NAME = {
    "server/state.py": {"threads", "cache", "encoding"},  # the server's thread policy and one cache; what it reports
    "server/settings.py": {"threads"},  # its own --threads (default adaptive, the cores shared by its workers)
    "server/settings_cli.py": set(),
    "server/option_settings.py": set(),
    "cli/common.py": set(),
    "cli/option_flags.py": set(),
    "cli/optimize.py": set(),
    "cli/batch.py": set(),
    "cli/mcp.py": {"limits"},  # the title of its argument group for the server's limits (--max-units, ...)
    "adapters/options.py": set(),
    "adapters/gateway.py": {"model"},  # a tier's name ("auto", "model", "lexical"), not the option
    "adapters/langchain.py": set(),
    "adapters/llamaindex.py": set(),
    "adapters/haystack.py": set(),
    "adapters/litellm.py": {"scorer"},  # an object: not an option a LiteLLM config can give
    "batch/__init__.py": set(),
    "batch/optimizer.py": set(),
    "batch/job.py": set(),
    "one_call.py": {"model"},  # rag_opt.optimize(query, documents, model=...): a parameter of its own
}


def _option_names_in(path: Path, names: set[str]) -> dict[str, list[int]]:
    """Where ``path`` names an option: a string that is its name, a keyword of a ``ContextOptimizer(...)`` or
    ``OptimizerOptions(...)`` call, a field or a parameter named as it."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        hits: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            hits = [node.value]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in (
            "ContextOptimizer",
            "OptimizerOptions",
        ):
            hits = [k.arg for k in node.keywords if k.arg]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            hits = [node.target.id]
        elif isinstance(node, ast.arg):
            hits = [node.arg]
        for name in hits:
            if name in names:
                found.setdefault(name, []).append(getattr(node, "lineno", 0))
    return found


def test_no_module_but_rag_opt_options_lists_the_optimizer_options(tmp_path: Path) -> None:
    import inspect

    from rag_opt.options import option_names
    from rag_opt.pipeline import ContextOptimizer

    per_call = set(inspect.signature(ContextOptimizer.optimize).parameters)
    construction = set(option_names()) - per_call
    assert {"model", "keep_best_per_doc", "title_keys", "encoding"} <= construction  # (the check checks something)
    bad = []
    for rel, allowed in _MAY_NAME.items():
        for name, lines in sorted(_option_names_in(PKG / rel, construction - allowed).items()):
            bad.append(f"rag_opt/{rel}:{lines[0]}: names the option {name!r}")
    assert not bad, "derive these from rag_opt.options instead of naming them:\n" + "\n".join(bad)
    # and the check finds a list of options written by hand
    sample = tmp_path / "by_hand.py"
    sample.write_text('KW = {"keep_first": False}\nopt = ContextOptimizer(device="cpu")\n', encoding="utf-8")
    assert set(_option_names_in(sample, construction)) == {"keep_first", "device"}


# -- the transport-free request core (rag_opt.wire) ----------------------------------------------------------------
# The planners, the /v1/compress contracts and the flow that applies an optimization to a request body live in
# rag_opt.wire, which the routes of rag-opt serve (rag_opt.server) and the gateway adapter both call (vLLM keeps its
# protocol and serving classes apart from its API routers the same way). Neither surface builds a stand-in of the
# other: each derives the core's WireSettings from its own settings.
_TRANSPORTS = ("starlette", "httpx", "prometheus_client", "uvicorn")


def test_the_request_core_loads_no_transport_and_nothing_of_the_server() -> None:
    """Importing rag_opt.wire and every module in it, in a fresh interpreter, loads no HTTP server, client or
    metrics library and no module of rag_opt.server."""
    code = (
        "import importlib, pkgutil, sys, rag_opt.wire\n"
        "for m in pkgutil.iter_modules(rag_opt.wire.__path__):\n"
        "    importlib.import_module('rag_opt.wire.' + m.name)\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {_TRANSPORTS!r} or m.startswith('rag_opt.server')]\n"
        "assert not bad, sorted(bad)\n"
        "rag_opt.wire.RequestFlow; rag_opt.wire.WireSettings; rag_opt.wire.plan_chat; rag_opt.wire.Outcome\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_request_core_imports_nothing_of_the_server_or_an_http_library() -> None:
    """Every import in rag_opt/wire/, deferred and type-only ones included, read statically."""
    bad = []
    for path in sorted((PKG / "wire").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                if name.startswith("rag_opt.server") or name.split(".")[0] in _TRANSPORTS:
                    bad.append(f"{_module(path)} imports {name} (line {node.lineno})")
    assert not bad, "\n".join(bad)


def test_the_gateway_adapter_calls_the_core_not_the_server() -> None:
    """rag_opt/adapters/gateway.py builds no ProxySettings (it derives the core's settings from its own) and
    imports nothing of rag_opt.server; the server's flow and the gateway both run rag_opt.wire.flow.RequestFlow."""
    gateway = (PKG / "adapters" / "gateway.py").read_text(encoding="utf-8")
    assert "ProxySettings" not in gateway
    graph = _graph(top_level_only=False)
    assert not sorted(d for d in graph["rag_opt.adapters.gateway"] if d.startswith("rag_opt.server"))
    for module in ("rag_opt.adapters.gateway", "rag_opt.server.flow"):
        assert "rag_opt.wire.flow" in graph[module], module


MAX_MODULE_LINES = 450


def test_the_server_and_the_core_have_no_module_over_450_lines() -> None:
    """Every module of rag_opt/server/ and rag_opt/wire/ fits in 450 lines: one job each, named by it."""
    long = [
        f"{_module(p)}: {n} lines"
        for folder in ("server", "wire")
        for p in sorted((PKG / folder).rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"

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

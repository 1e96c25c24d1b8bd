"""The package's shape: no import cycles, every package importable on its own, analysis apart from
the command line, modules of a readable size."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "dscluster"
MAX_LINES = 450
# Modules allowed past the limit, each with its reason (none today).
OVER_MAX_LINES: dict[str, str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = sorted(name for name, p in MODULES.items() if p.name == "__init__.py")


def imports_of(name: str) -> set[str]:
    """The dscluster modules `name` imports, anywhere in it (a function's import counts too)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    out.add(f"{base}.{alias.name}")
                elif base in MODULES:
                    out.add(base)
    out.discard(name)
    return out


GRAPH = {name: imports_of(name) for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_graph_sees_the_imports():
    # The checks below are only as good as the graph: it must see a top-level, a from-import of a
    # module and a function-level import.
    assert "dscluster.errors" in GRAPH["dscluster.hosts"]
    assert "dscluster.launch.builders" in GRAPH["dscluster.cli.launch"]
    assert "dscluster.launch.run" in GRAPH["dscluster.cli.launch"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_analysis_never_imports_the_command_line():
    for name in (n for n in MODULES if n == "dscluster.analysis" or n.startswith("dscluster.analysis.")):
        cli = sorted(m for m in reachable(GRAPH, name) if m == "dscluster.cli" or m.startswith("dscluster.cli."))
        assert not cli, f"{name} imports {cli}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_imports_in_a_fresh_interpreter(package):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", f"import {package}"], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr


def test_the_training_package_imports_without_torch_and_its_modules_in_a_fresh_interpreter():
    # the package face stays cheap (the CLI imports it for --help); every module of it imports on its own
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    face = subprocess.run([sys.executable, "-c", "import sys, dscluster.train; print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert face.returncode == 0 and face.stdout.strip() == "False", face.stderr or face.stdout
    train = sorted(n for n in MODULES if n.startswith("dscluster.train."))
    assert "dscluster.train.loop" in train and "dscluster.train" in PACKAGES
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    out = subprocess.run([sys.executable, "-c", code, *train], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr


def test_no_module_is_over_the_line_limit():
    long = {name: n for name, p in MODULES.items()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES and name not in OVER_MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}; split by job"


MAX_FUNCTION_LINES = 80


def test_no_function_is_over_the_line_limit():
    # a function past one screen hides its steps: split it into named steps that read top to bottom
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name} (line {node.lineno}): {lines} lines")
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}; split into named steps"


# Top-level modules that users or scripts call by name: kept at the top even when one package imports them.
TOP_LEVEL_BY_NAME = {
    "dscluster.__main__": "`python -m dscluster`",
    "dscluster.demo": "`make demo` runs `python -m dscluster.demo`",
    "dscluster.rankrecord": "entry_cn.sh runs `python -m dscluster.rankrecord`",
    "dscluster.userlog": "users' own training scripts import it",
}


def package_of(name: str) -> str:
    """The package a module belongs to (`dscluster.cli` for `dscluster.cli.env`); `dscluster` for the top level."""
    parts = name.split(".")
    return ".".join(parts[:2]) if MODULES[name].name == "__init__.py" or len(parts) > 2 else "dscluster"


def test_the_top_level_holds_only_what_two_or_more_packages_import():
    # a module only one package uses belongs inside that package; the top level is for what is shared
    assert package_of("dscluster.cli.env") == "dscluster.cli" and package_of("dscluster.hosts") == "dscluster"
    assert set(TOP_LEVEL_BY_NAME) <= set(MODULES), "a module kept by name no longer exists: drop it from the list"
    top = [n for n, p in MODULES.items() if n.count(".") == 1 and p.name != "__init__.py"]
    alone = {}
    for module in top:
        users = {package_of(n) for n, deps in GRAPH.items() if module in deps}
        if len(users) < 2 and module not in TOP_LEVEL_BY_NAME:
            alone[module] = sorted(users)
    assert not alone, f"top-level modules imported by fewer than two packages: {alone}; move each into its package"

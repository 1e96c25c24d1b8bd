"""The package's shape: no circle between modules or packages, every package importable on its own, the
training core reached through its face, and the style rules a machine can check."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "dscluster"
MAX_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_DOCSTRING_LINES = 12
MAX_LAZY_IMPORTS = 60
# What may load inside a function: the stack a light command must not pay for at start-up.
HEAVY = {"torch", "deepspeed", "timm", "torchvision", "matplotlib", "paramiko", "sklearn", "tensorboard", "mpi4py",
         "pynvml", "GPUtil", "PIL", "numpy"}
# Top-level modules, each with why it stays at the top.
TOP_LEVEL = {
    "dscluster.__main__": "`python -m dscluster`",
    "dscluster.demo": "`make demo` runs `python -m dscluster.demo`",
    "dscluster.userlog": "users' own training scripts import it by name",
    "dscluster.errors": "the exceptions every package raises",
    "dscluster.console": "the one console every command prints through",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = sorted(name for name, p in MODULES.items() if p.name == "__init__.py")
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def imports_of(name: str) -> set[str]:
    """The dscluster modules `name` imports, anywhere in it (a function's import counts too)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(TREES[name]):
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


def part_of(name: str) -> str:
    """The package a module belongs to (`dscluster.cli` for `dscluster.cli.env`), or the module itself at the top."""
    return ".".join(name.split(".")[:2])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for following in sorted(graph.get(node, ())):
            if state.get(following) == 1:
                return path[path.index(following):] + [following]
            if following not in state and (cycle := visit(following)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, imported in GRAPH.items():
        targets = {part_of(m) for m in imported} - {part_of(name), "dscluster"}
        graph.setdefault(part_of(name), set()).update(targets)
    return graph


def functions():
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node


def lazy_imports() -> list[tuple[str, str, int, tuple[str, ...]]]:
    """(module, function, line, the imported roots) of every import statement inside a function."""
    found = set()
    for name, function in functions():
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found.add((name, function.name, node.lineno, tuple(a.name.split(".")[0] for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                root = "." if node.level else (node.module or "").split(".")[0]
                found.add((name, function.name, node.lineno, (root,)))
    return sorted(found)


def test_the_graph_sees_the_imports():
    # The checks below are only as good as the graph: it must see a top-level, a from-import of a
    # module and a function-level import.
    assert "dscluster.errors" in GRAPH["dscluster.node.hosts"]
    assert "dscluster.launch.builders" in GRAPH["dscluster.cli.launch"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert part_of("dscluster.core.config") == "dscluster.core" and part_of("dscluster.demo") == "dscluster.demo"


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_packages_stand_in_layers_no_package_imports_one_that_imports_it():
    # an arrow back up a layer is a circle between packages, even when no two modules form one
    cycle = find_cycle(package_graph())
    assert cycle is None, "packages in a circle: " + " -> ".join(cycle)


def test_train_never_imports_plan():
    # what train records for plan lives in runmodel, which both read
    reached = {m for n, deps in GRAPH.items() if n.startswith("dscluster.train") for m in deps}
    assert not {m for m in reached if m.startswith("dscluster.plan")}


def test_outside_the_core_only_its_face_is_imported():
    # plan, bench, check and the rest call the training core through dscluster.core; train builds on its parts
    inside = ("dscluster.core", "dscluster.train")
    reaching = {name: sorted(m for m in deps if m.startswith("dscluster.core."))
                for name, deps in GRAPH.items() if part_of(name) not in inside}
    reaching = {name: parts for name, parts in reaching.items() if parts}
    assert not reaching, f"import `dscluster.core` (its face), not its parts: {reaching}"


def test_analysis_never_imports_the_command_line():
    for name in (n for n in MODULES if part_of(n) == "dscluster.analysis"):
        assert not [m for m in GRAPH[name] if part_of(m) == "dscluster.cli"], name


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_imports_in_a_fresh_interpreter(package):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", f"import {package}"], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr


def test_the_core_face_loads_no_torch_and_every_name_it_offers_resolves():
    # the face stays cheap (the command line imports it for --help); each name it offers loads from its part
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    code = ("import sys, dscluster.core as core, dscluster.train\n"
            "print('torch' in sys.modules)\n"
            "missing = [n for n in core.__all__ if getattr(core, n, None) is None]\n"
            "print(missing)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False", "[]"], out.stdout
    parts = sorted(n for n in MODULES if part_of(n) in ("dscluster.core", "dscluster.train"))
    assert "dscluster.train.loop" in parts and "dscluster.core.setup_engine" in parts
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    out = subprocess.run([sys.executable, "-c", code, *parts], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr


def test_at_most_six_modules_stand_at_the_top():
    top = sorted(n for n, p in MODULES.items() if n.count(".") == 1 and p.name != "__init__.py")
    loose = sorted(set(top) - set(TOP_LEVEL))
    assert not loose, f"fold these into a package named for their job: {loose}"
    assert len(top) <= 6


def test_no_module_is_over_the_line_limit():
    long = {name: lines for name, path in MODULES.items()
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}; split by job"


def test_no_function_is_over_the_line_limit():
    # a function past one screen hides its steps: split it into named steps that read top to bottom
    long = [f"{name}.{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for name, node in functions() if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}; split into named steps"


def unrelated_tuple_assignments(tree: ast.AST) -> list[int]:
    """Lines of `a, b, c = x, y, z`: three or more targets given a literal tuple of as many values."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and len(target.elts) >= 3 and len(node.value.elts) == len(target.elts):
                    lines.append(node.lineno)
    return lines


def test_one_assignment_a_line_where_the_values_are_unrelated():
    assert unrelated_tuple_assignments(ast.parse("a, b, c = 1, 2, 3\nx, y = 1, 2\nh, p, u = split(s)\n")) == [1]
    packed = {name: lines for name, tree in TREES.items() if (lines := unrelated_tuple_assignments(tree))}
    assert not packed, f"write one assignment a line: {packed}"


# Functions whose imports must stay inside them, with why.
SELF_CONTAINED = {
    ("dscluster.check.dsops", "ds_op_facts"): "check/probe.py sends this function's source alone to every node",
}


def test_imports_inside_functions_are_only_the_heavy_stack_and_few():
    assert lazy_imports_of("def f():\n    import torch, os\n") == [("x", "f", 2, ("torch", "os"))]
    found = lazy_imports()
    light = [f"{name}:{line} ({', '.join(roots)})" for name, function, line, roots in found
             if not set(roots) <= HEAVY and (name, function) not in SELF_CONTAINED]
    assert not light, f"move these imports to the top of their module: {light}"
    assert len(found) <= MAX_LAZY_IMPORTS, f"{len(found)} imports inside functions (at most {MAX_LAZY_IMPORTS})"


def lazy_imports_of(source: str):
    saved = dict(TREES)
    TREES.clear()
    TREES["x"] = ast.parse(source)
    try:
        return lazy_imports()
    finally:
        TREES.clear()
        TREES.update(saved)


DATE = re.compile(r"\b20\d\d-[01]\d(-[0-3]\d)?\b")


def test_no_date_stands_in_the_source():
    # measurements and their dates belong in docs/ and commit bodies
    dated = [f"{name}:{number}" for name, path in MODULES.items()
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if DATE.search(line)]
    assert not dated, f"move the dated text to docs/: {dated}"


def test_module_docstrings_say_what_the_module_owns_in_a_few_lines():
    long = {name: n for name, tree in TREES.items()
            if (doc := ast.get_docstring(tree, clean=False)) and (n := len(doc.splitlines())) > MAX_DOCSTRING_LINES}
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the detail to docs/): {long}"

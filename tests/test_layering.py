"""The import graph points one way (issue 28): walked with `ast` over every
module of the packages below, imports inside functions and under
TYPE_CHECKING included.

- common/ imports none of the process packages (it is what they share);
- the three process packages never import one another: they talk over IPC
  (common/messages.py), and a process must not load another's code;
- kernels/ (the Triton kernels) is imported by model_proc only, and imports
  nothing of this project's but itself;
- no cycle between modules. Importing a submodule counts as an edge to that
  module, not to its package's __init__ (which Python runs first, but which
  only re-exports here).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "model_proc", "scheduler_proc", "tokenizer_proc", "kernels")
PROCESSES = ("model_proc", "scheduler_proc", "tokenizer_proc")
# which top-level packages each one may import (besides itself)
ALLOWED = {
    "common": set(),
    "kernels": set(),
    "model_proc": {"common", "kernels"},
    "scheduler_proc": {"common"},
    "tokenizer_proc": {"common"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project modules `path` imports: for `from a.b import c`, a.b.c
    when that is a module, else a.b."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` of a module not in the project (a package's attribute): its nearest module
            while target and target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)
    return {name: imports_of(path, name, modules) for name, path in sorted(files.items())}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module
    (Tarjan), each as a path a -> ... -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(cycle_in(graph, component, v))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_in(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A path start -> ... -> start inside the component (breadth first: a shortest one)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError("not a cycle")


def test_the_graph_sees_the_packages() -> None:
    graph = import_graph()
    assert "model_proc.attention.native" in graph["model_proc.native_decoder"]
    assert "common.tokenizer_files" in graph["scheduler_proc.grammar"]  # an import inside a function


def test_no_upward_or_cross_import() -> None:
    bad = [f"{a} imports {b}" for a, targets in import_graph().items() for b in sorted(targets)
           if (top := b.split(".")[0]) != a.split(".")[0] and top not in ALLOWED[a.split(".")[0]]]
    assert not bad, "imports against the layering (tests/test_layering.py ALLOWED):\n  " + "\n  ".join(bad)


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n  " + "\n  ".join(" -> ".join(c) for c in found)


def test_the_scheduler_process_loads_no_torch() -> None:
    """The scheduler keeps accounts (slots, pages, its copy of the table) in
    numpy and lists: every module of scheduler_proc imported, torch is not
    loaded (its ~2 s of import CPU would be taken, on 2 cores, from the model
    process loading beside it at every server start). xgrammar, which loads
    torch, is imported only by a grammar's first use."""
    import subprocess
    import sys

    code = ("import pkgutil, importlib, sys, scheduler_proc\n"
            "for m in pkgutil.walk_packages(scheduler_proc.__path__, 'scheduler_proc.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted(n for n in ('torch', 'xgrammar', 'transformers') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

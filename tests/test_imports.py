"""Every pocket_mlx module imports on its own, and the modules import each other one way only.

Why: an import cycle works or breaks depending on which module a program happens to import
first (`memory -> wired -> platform -> memory` once did). (a) imports each module first, in an
interpreter where no other pocket_mlx module is loaded yet; (b) reads every import statement,
module-level and inside functions alike, and asserts the graph they make has no cycle; (c) the
subpackages form layers, in docs/ARCHITECTURE.md's order: no import from a layer to one above it
(a cycle between packages, `convert -> engine -> convert`, is a cycle of modules waiting to
happen).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT

PACKAGE = "pocket_mlx"
# The source folders of the package: tui/ is installed as pocket_mlx.tui (pyproject's package-dir).
SOURCES = {PACKAGE: ROOT / "pocket_mlx", f"{PACKAGE}.tui": ROOT / "tui"}
# Not imported in (a): running it is running the CLI. It is still in the graph of (b).
NOT_IMPORTED = {f"{PACKAGE}.__main__"}
# Compiled modules: leaves of the graph of (b), built or not (imported only through kernels/).
EXTENSIONS = {f"{PACKAGE}._qkernels"}


def module_files() -> dict[str, Path]:
    """Module name -> source file, for every .py file of the package (C extension excluded)."""
    out: dict[str, Path] = {}
    for prefix, folder in SOURCES.items():
        for f in sorted(folder.rglob("*.py")):  # rglob does not follow the pocket_mlx/tui link
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = f
    return out


def _resolve(name: str, file: Path, module: str, level: int) -> str:
    """Absolute name of a (possibly relative) `from ... import` base."""
    if level == 0:
        return name
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{name}" if name else base


def import_graph() -> dict[str, set[str]]:
    """Module -> the pocket_mlx modules it imports anywhere in its source."""
    files: dict[str, Path | None] = {**module_files(), **dict.fromkeys(EXTENSIONS)}
    graph: dict[str, set[str]] = {m: set() for m in files}

    def target(name: str) -> str | None:
        while name and name not in files:  # `import a.b.c` where c is a function: edge to a.b
            name = name.rpartition(".")[0]
        return name or None

    for module, file in files.items():
        if file is None:
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", file, module, node.level)
                # `from pkg import sub` imports the submodule; `from mod import name`, the module.
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                         for a in node.names]
            for n in names:
                t = target(n)
                if t is not None and t != module:
                    graph[module].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


# Imports each module named on stdin with no other pocket_mlx module loaded (the compiled
# extension stays: a C extension cannot be initialised twice); prints {module: traceback}.
_IMPORT_EACH = textwrap.dedent("""
    import importlib, json, sys, traceback
    failed = {}
    for name in json.load(sys.stdin):
        for loaded in [m for m in sys.modules
                       if (m == "pocket_mlx" or m.startswith("pocket_mlx."))
                       and m != "pocket_mlx._qkernels"]:
            del sys.modules[loaded]
        try:
            importlib.import_module(name)
        except BaseException:
            failed[name] = traceback.format_exc()
    print(json.dumps(failed))
""")


def test_every_module_imports_first():
    modules = sorted(set(module_files()) - NOT_IMPORTED)
    assert f"{PACKAGE}.tui.app" in modules and f"{PACKAGE}.system.host" in modules
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH], input=json.dumps(modules),
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{m}:\n{tb}" for m, tb in failed.items())


def test_import_graph_has_no_cycle():
    graph = import_graph()
    # The walk sees what it must: a module-level and a function-level import.
    assert f"{PACKAGE}.errors" in graph[f"{PACKAGE}.convert.writer"]
    assert f"{PACKAGE}.engine.loader" in graph[PACKAGE]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_is_named_like_the_standard_library():
    clashes = sorted(m for m in module_files() if m.rpartition(".")[2] in sys.stdlib_module_names)
    assert not clashes, f"named like standard-library modules: {clashes}"


# ---- layers ------------------------------------------------------------------------------------
# Bottom to top, as docs/ARCHITECTURE.md writes them. "base": the package's top-level modules
# (errors, units, paths, config, ...: the standard library and each other only); "api": the package
# itself (pocket_mlx/__init__.py: load, generate, and the `synthetic:` scheme it registers).
# Every other layer is the subpackage of that name; the compiled extension sits with kernels/.
LAYERS = ["base", "system", "kernels", "models", "engine", "convert", "analysis", "server", "tui",
          "api", "cli"]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def layer_of(module: str) -> str:
    """The layer of a pocket_mlx module (see LAYERS)."""
    if module == PACKAGE:
        return "api"
    first = module.split(".")[1]
    if first == "__main__":
        return "cli"
    if module in EXTENSIONS:
        return "kernels"
    if module.count(".") == 1 and first not in LAYERS:  # a top-level module, not a package
        return "base"
    return first


def upward_imports(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    """Every import of `graph` from a layer to one above it, as 'a -> b (layer < layer)'."""
    rank = {name: i for i, name in enumerate(layers)}
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = layer_of(a), layer_of(b)
            if rank[la] < rank[lb]:
                out.append(f"{a} -> {b} ({la} is below {lb})")
    return out


def test_every_module_has_a_layer():
    unknown = sorted({m: layer_of(m) for m in import_graph()}.items())
    assert not [m for m, la in unknown if la not in LAYERS], (
        "modules outside the layers (add the package to LAYERS and docs/ARCHITECTURE.md): "
        f"{unknown}")


def test_imports_flow_one_way_through_the_layers():
    bad = upward_imports(import_graph(), LAYERS)
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_upward_imports_are_found_and_named():
    graph = {f"{PACKAGE}.engine.loader": {f"{PACKAGE}.convert.synthetic", f"{PACKAGE}.errors"},
             f"{PACKAGE}.convert.synthetic": {f"{PACKAGE}.engine.loader"}, PACKAGE: set()}
    assert upward_imports(graph, LAYERS) == [
        f"{PACKAGE}.engine.loader -> {PACKAGE}.convert.synthetic (engine is below convert)"]
    assert [layer_of(m) for m in (PACKAGE, f"{PACKAGE}.config", f"{PACKAGE}.tui.app",
                                  f"{PACKAGE}._qkernels", f"{PACKAGE}.__main__")] == [
        "api", "base", "tui", "kernels", "cli"]


def test_architecture_doc_writes_the_layers_this_test_checks():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    found = re.findall(r"Layers, bottom to top: `([^`]+)`", text)
    assert len(found) == 1, (
        "docs/ARCHITECTURE.md: one line `Layers, bottom to top: `a -> b -> ...``")
    assert found[0].split(" -> ") == LAYERS

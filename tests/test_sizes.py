"""The size rules, so they hold as the code grows: no function over 100 lines and no class over
400 lines in pocket_mlx/ and tui/ (installed as pocket_mlx.tui). A definition's size is its
lines from `def`/`class` to its last line (decorators not counted), nested ones included in
the one around them; each nested function is held to the rule too."""

from __future__ import annotations

import ast

from conftest import ROOT

FOLDERS = (ROOT / "pocket_mlx", ROOT / "tui")
MAX_FUNCTION = 100
MAX_CLASS = 400


def sizes() -> list[tuple[str, str, int]]:
    """(where, kind, lines) of every function and class of the package's source files."""
    out = []
    for folder in FOLDERS:
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                    out.append((where, kind, node.end_lineno - node.lineno + 1))
    return out


def test_sizes_are_read():
    """The walk sees the source (a broken one would pass the rules vacuously)."""
    found = sizes()
    assert sum(kind == "function" for _, kind, _ in found) > 500
    assert sum(kind == "class" for _, kind, _ in found) > 50
    assert any(w.startswith("tui/") for w, _, _ in found)


def test_no_function_over_100_lines():
    over = [f"{w}: {n} lines" for w, kind, n in sizes() if kind == "function" and n > MAX_FUNCTION]
    assert not over, f"functions over {MAX_FUNCTION} lines (split them):\n" + "\n".join(over)


def test_no_class_over_400_lines():
    over = [f"{w}: {n} lines" for w, kind, n in sizes() if kind == "class" and n > MAX_CLASS]
    assert not over, f"classes over {MAX_CLASS} lines (split them):\n" + "\n".join(over)

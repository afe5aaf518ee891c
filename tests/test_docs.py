"""The front door stays a front door: README.md is short, opens with the two set-up commands
(the second is what .ci/run runs), and every relative link in README.md and docs/ resolves.

Why: the README is what a newcomer reads first; its details live in docs/, so a link that
points at a moved or renamed file (or a heading that changed) loses them.
"""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

README = ROOT / "README.md"
MAX_README_LINES = 200
# The two commands a newcomer runs on a fresh machine, exactly as the README gives them.
CHAT = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && pocket-mlx chat"
TESTS = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" '
         "&& python -m pytest -q")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.S)


def docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def anchors(md: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -N repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in CODE.sub("", md.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6} +(.*?) *#*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of `md` whose file, or heading in a .md file, does not exist."""
    bad = []
    for target in LINK.findall(CODE.sub("", md.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked here
            continue
        path, _, frag = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{md.relative_to(root)}: {target} (no such file)")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{md.relative_to(root)}: {target} (no such heading)")
    return bad


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move details into docs/"


def test_readme_opens_with_the_two_setup_commands_ci_runs():
    head = README.read_text(encoding="utf-8").splitlines()[:10]
    assert CHAT in head and TESTS in head, "README's first lines: the install+chat and test commands"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip install -v -e ".[test]"' in ci and "\npython -m pytest -q\n" in ci


def test_relative_links_resolve():
    bad = [b for md in docs() for b in broken_links(md)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# A heading: `code`\n")
    md = tmp_path / "x.md"
    md.write_text("[ok](there.md#a-heading-code) [gone](missing.md) [no](there.md#nope)\n"
                  "```\n[in code](ignored.md)\n```\n")
    assert anchors(tmp_path / "there.md") == {"a-heading-code"}
    got = [b.split(": ", 1)[1] for b in broken_links(md, tmp_path)]
    assert got == ["missing.md (no such file)", "there.md#nope (no such heading)"]


"""The wheel: what `pip wheel .` builds (and so `pip install .` without -e, pipx, uv tool and
every packager) holds every package and data file of the source tree, and an install of it
runs on its own files.

CI installs with -e, which maps the source tree and would not notice a package or data file
left out of the wheel (issue 54: engine/distributed/ was). Both tests build from a copy of the
checkout (tracked and untracked-but-not-ignored files, as a clone holds them), never in the
checkout itself, so a test run leaves no build/ behind and two runs do not share one:
- test_wheel_holds_every_file: a wheel without the C++ extension (POCKET_MLX_BUILD_KERNELS=0:
  seconds, the file list is the same), its file list against the source tree's;
- test_wheel_installs_and_runs (slow, ~2-3 min, most of it the extension's compile; CI runs
  it): the wheel as users get it, extension included, installed into a fresh virtual
  environment; every subpackage imports from there, `pocket-mlx generate -n 4` and
  `pocket-mlx serve` (GET /health, the chat page) run there on the bundled model.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> where its files go in the wheel (pyproject's package-dir).
SHIPPED = {"pocket_mlx": "pocket_mlx", "tui": "pocket_mlx/tui",
           "assets/pocket-tiny": "pocket_mlx/assets/pocket-tiny"}
NOT_SHIPPED = (".pyc", ".so", ".pyd")  # compiled here; the wheel builds its own extension


def _source_files() -> list[str]:
    """The checkout's files as a clone (plus local work) holds them: tracked and untracked
    files that git does not ignore; without git, every file but caches, builds and venvs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True, check=True,
                             timeout=60).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return sorted(f for f in files if (ROOT / f).is_file())  # not files deleted in the tree


def _in_wheel(src: str) -> str | None:
    """Where the source file `src` belongs in the wheel; None if it is not shipped."""
    for folder, dest in SHIPPED.items():
        if src.startswith(folder + "/") and not src.endswith(NOT_SHIPPED):
            return dest + src[len(folder):]
    return None


def _packages() -> list[str]:
    """Every package of the source tree (a folder with __init__.py), by its installed name."""
    return sorted(_in_wheel(f)[: -len("/__init__.py")].replace("/", ".")
                  for f in _source_files() if f.endswith("/__init__.py") and _in_wheel(f))


def _build_wheel(out: Path, extension: bool) -> Path:
    """`pip wheel` of a copy of the checkout, into `out`; the wheel's path."""
    src = out / "src"
    for f in _source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if not extension:
        env["POCKET_MLX_BUILD_KERNELS"] = "0"
        env.pop("POCKET_MLX_REQUIRE_KERNELS", None)  # CI's, which would fail the lean build
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                        "-w", str(out / "dist")], cwd=out, env=env, capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
    (wheel,) = (out / "dist").glob("pocket_mlx-*.whl")
    print(f"built {wheel.name} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return wheel


@pytest.fixture(scope="session")
def lean_wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("lean-wheel"), extension=False)


@pytest.fixture(scope="session")
def full_wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"), extension=True)


def test_source_tree_is_read():
    """The checks below see the source tree (a broken listing would make them vacuous)."""
    assert {"pocket_mlx", "pocket_mlx.engine.distributed", "pocket_mlx.tui"} <= set(_packages())
    shipped = {_in_wheel(f) for f in _source_files()}
    assert {"pocket_mlx/tui/chat.tcss", "pocket_mlx/server/static/chat.html",
            "pocket_mlx/assets/pocket-tiny/model.safetensors",
            "pocket_mlx/assets/pocket-tiny/chat_template.jinja"} <= shipped


def test_wheel_holds_every_file(lean_wheel):
    """Every package (its __init__.py and modules) and every data file of pocket_mlx/, tui/
    and the bundled model is in the wheel, where the installed package looks for it; nothing
    lands outside pocket_mlx/ (a top-level tui/ or assets/ would be a broken mapping)."""
    names = set(zipfile.ZipFile(lean_wheel).namelist())
    missing_packages = [p for p in _packages()
                        if p.replace(".", "/") + "/__init__.py" not in names]
    assert not missing_packages, f"packages not in the wheel: {missing_packages}"
    missing = [f for f in _source_files() if _in_wheel(f) and _in_wheel(f) not in names]
    assert not missing, f"source files not in the wheel: {missing}"
    stray = [n for n in names if not n.startswith(("pocket_mlx/", "pocket_mlx-"))]
    assert not stray, f"files outside pocket_mlx/ in the wheel: {stray}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_venv(where: Path) -> Path:
    """A new virtual environment that sees this one's installed dependencies but not the
    project itself; its python.

    The dependencies (mlx, mlx-lm, textual, ...) come through a .pth file naming this
    environment's site-packages: a path line adds the folder to sys.path after the new
    environment's own site-packages and runs none of the .pth files in it, so the editable
    install's finder (a .pth hook) is not installed and the source tree is not importable.
    This keeps the test offline and fast (no download of ~200 MB of wheels), and the new
    environment's own site-packages comes first, so the wheel's pocket_mlx is the one
    imported (the test checks each module's file)."""
    venv.create(where, with_pip=True, symlinks=os.name != "nt")
    py = where / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True).stdout
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site.strip(), "outer-deps.pth").write_text("\n".join(sorted(outer)) + "\n")
    return py


IMPORT_ALL = """
import importlib, json, pkgutil, sys
from pathlib import Path
import pocket_mlx
venv = Path(sys.prefix).resolve()
imported, outside = [], []
for m in pkgutil.walk_packages(pocket_mlx.__path__, "pocket_mlx."):
    if m.name.endswith(".__main__"):  # runs the CLI
        continue
    mod = importlib.import_module(m.name)
    if m.ispkg:
        imported.append(m.name)
    if venv not in Path(mod.__file__).resolve().parents:
        outside.append(mod.__file__)
from pocket_mlx import kernels, paths
print(json.dumps({"file": pocket_mlx.__file__, "packages": imported, "outside": outside,
                  "model": str(paths.default_model_path()),
                  "kernels": kernels.load_error()}))
"""


@pytest.mark.slow
def test_wheel_installs_and_runs(full_wheel, tmp_path):
    """The wheel as users get it, installed into a fresh virtual environment (no -e): every
    subpackage imports from that environment, `pocket-mlx generate -n 4` and `pocket-mlx serve`
    run there on the bundled model (which ships in the wheel)."""
    py = _fresh_venv(tmp_path / "venv")
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        str(full_wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    bin_dir = py.parent
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "POCKET_MLX_MODEL", "VIRTUAL_ENV")}
    env.update(POCKET_MLX_HOME=str(tmp_path / "home"), POCKET_MLX_CACHE=str(tmp_path / "cache"),
               PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True)  # not the checkout

    r = subprocess.run([str(py), "-c", IMPORT_ALL], timeout=300, **run)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    site = Path(got["file"]).resolve().parent.parent
    assert (tmp_path / "venv").resolve() in site.parents, got["file"]
    assert not got["outside"], f"imported from outside the new environment: {got['outside']}"
    assert sorted(["pocket_mlx", *got["packages"]]) == _packages()
    assert Path(got["model"]).resolve() == site / "pocket_mlx" / "assets" / "pocket-tiny"
    has_ext = any(n.startswith("pocket_mlx/_qkernels")
                  for n in zipfile.ZipFile(full_wheel).namelist())
    if has_ext or os.environ.get("POCKET_MLX_REQUIRE_KERNELS", "") in ("1", "true", "yes", "on"):
        assert got["kernels"] is None, f"the installed C++ extension does not load: {got}"

    cli = str(bin_dir / "pocket-mlx")
    r = subprocess.run([cli, "generate", "-p", "Hello", "-n", "4", "--json"], timeout=300, **run)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["generation_tokens"] == 4 and out["text"], out

    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([cli, "serve", "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", "/health")
                resp = conn.getresponse()
                status, body = resp.status, json.loads(resp.read())
                conn.close()
                break
            except OSError:
                time.sleep(0.3)
        assert status == 200, (tmp_path / "serve.log").read_text()
        assert body.get("status") == "ok", body
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/chat")  # the chat page: package data read at run time
        resp = conn.getresponse()
        page = resp.read()
        conn.close()
        assert resp.status == 200 and b"<html" in page.lower(), (resp.status, page[:200])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()

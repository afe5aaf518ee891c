"""Build hook for the optional C++ extension `pocket_mlx._qkernels` (fast CPU quantized matmul).

All package metadata lives in pyproject.toml; this file adds the list of packages (found, not
kept by hand: see _packages) and a CMake-driven build_ext.
If the extension cannot be built (no compiler, no CMake, no MLX headers, nanobind ABI mismatch,
or POCKET_MLX_BUILD_KERNELS=0), a warning is printed and the installation still succeeds: the
package then runs on MLX's own kernels. With POCKET_MLX_REQUIRE_KERNELS=1 (CI, .ci/run) the same
failure fails the installation, after the compiler's own output.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent
EXT_NAME = "pocket_mlx._qkernels"


def _packages() -> list[str]:
    """Every package of the source tree, found by setuptools: pocket_mlx and all below it, and
    tui/ (a top-level folder, mapped to pocket_mlx.tui by pyproject's package-dir) with its own
    subpackages, plus pocket_mlx.assets (the bundled model, package data only). The discovery
    is here, not in pyproject's [tool.setuptools.packages.find], because find names a folder's
    packages after the folder (tui, not pocket_mlx.tui) and cannot be combined with a list."""
    tui = ["pocket_mlx.tui"] + ["pocket_mlx.tui." + p for p in find_packages(str(ROOT / "tui"))]
    return find_packages(str(ROOT), include=["pocket_mlx", "pocket_mlx.*"]) + tui + [
        "pocket_mlx.assets"]


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path):
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


def _kernels_required() -> bool:
    """POCKET_MLX_REQUIRE_KERNELS=1: CI must not pass on a build that broke (same values as
    pocket_mlx.kernels.required(), which this build cannot import)."""
    return os.environ.get("POCKET_MLX_REQUIRE_KERNELS", "").strip().lower() in ("1", "true", "yes",
                                                                               "on")


def _warn(msg: str) -> None:
    bar = "=" * 78
    print(f"\n{bar}\nWARNING: pocket-mlx: {msg}\n"
          "The C++ CPU kernels were NOT built; pocket-mlx will use MLX's own (slower) CPU kernels."
          "\n(POCKET_MLX_REQUIRE_KERNELS=1 makes this an error.)"
          f"\n{bar}\n", file=sys.stderr, flush=True)


def _failed(msg: str) -> None:
    """A failed build of the extension: fatal under POCKET_MLX_REQUIRE_KERNELS=1, else a warning."""
    if _kernels_required():
        raise CompileError(f"pocket-mlx: building the C++ extension failed: {msg} "
                           "(POCKET_MLX_REQUIRE_KERNELS=1; the compiler's output is above)")
    _warn(msg)


def _target_python_query(code: str) -> str | None:
    """Run `code` in this interpreter without the build-isolation overlay (-E ignores PYTHONPATH),
    i.e. in the environment the package is being installed into."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    try:
        out = subprocess.run([sys.executable, "-E", "-c", code], capture_output=True, text=True,
                             env=env, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _find_mlx() -> str | None:
    # Prefer the MLX the package will run with (ABI must match exactly), then the build env's.
    found = _target_python_query("import mlx; print(mlx.__path__[0])")
    if found:
        return found
    try:
        import mlx  # noqa: F401

        return str(Path(mlx.__path__[0]))
    except ImportError:
        return None


def _find_nanobind() -> str | None:
    try:
        import nanobind

        return nanobind.cmake_dir()
    except ImportError:
        return _target_python_query("import nanobind; print(nanobind.cmake_dir())")


def _nanobind_abi_matches(mlx_dir: str, nb_cmake_dir: str) -> tuple[bool, str]:
    """mlx's core module embeds nanobind's internals key (..._v<N>); ours must be the same."""
    hdr = Path(nb_cmake_dir).parent / "src" / "nb_internals.h"
    try:
        m = re.search(r"#\s*define\s+NB_INTERNALS_VERSION\s+(\d+)", hdr.read_text())
    except OSError:
        return True, "nanobind internals header not found; ABI not checked"
    if not m:
        return True, "NB_INTERNALS_VERSION not found; ABI not checked"
    tag = f"_v{m.group(1)}".encode()
    cores = list(Path(mlx_dir).glob("core*.so")) + list(Path(mlx_dir).glob("core*.pyd"))
    if not cores:
        return True, "mlx core module not found; ABI not checked"
    data = cores[0].read_bytes()
    if re.search(rb"nanobind_[A-Za-z0-9_]*" + re.escape(tag) + rb"(?![0-9])", data):
        return True, f"nanobind ABI {tag.decode()} matches mlx"
    return False, (f"nanobind internals version {tag.decode()} does not match the one mlx was built "
                   "with (see `strings mlx/core*.so | grep nanobind_`)")


def _find_cmake() -> str | None:
    exe = shutil.which("cmake")
    if exe:
        return exe
    try:
        import cmake

        cand = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        return str(cand) if cand.exists() else None
    except (ImportError, AttributeError):
        return None


class BuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except CompileError:
            raise  # _failed() under POCKET_MLX_REQUIRE_KERNELS=1
        except Exception as e:  # otherwise never fail the install for the optional extension
            _failed(f"building the extension failed: {e}")

    def build_extension(self, ext):
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        try:
            self._build_cmake(ext)
        except Exception as e:
            _failed(str(e))

    def _build_cmake(self, ext: CMakeExtension):
        if os.environ.get("POCKET_MLX_BUILD_KERNELS", "1") == "0":
            raise RuntimeError("disabled by POCKET_MLX_BUILD_KERNELS=0")
        cmake = _find_cmake()
        if not cmake:
            raise RuntimeError("cmake not found")
        mlx_dir = _find_mlx()
        if not mlx_dir:
            raise RuntimeError("mlx is not installed (its headers and CMake config are needed)")
        nb_dir = _find_nanobind()
        if not nb_dir:
            raise RuntimeError("nanobind is not available (pip install nanobind==3.0.1)")
        ok, why = _nanobind_abi_matches(mlx_dir, nb_dir)
        if not ok:
            raise RuntimeError(why)
        print(f"pocket-mlx: building {EXT_NAME} against mlx at {mlx_dir} ({why})", flush=True)

        out_file = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_dir = out_file.parent
        out_dir.mkdir(parents=True, exist_ok=True)
        build_dir = Path(self.build_temp).resolve() / "qkernels"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = [
            cmake, "-S", ext.source_dir, "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DMLX_PREFIX={mlx_dir}",
            f"-Dnanobind_DIR={nb_dir}",
            f"-DQK_OUTPUT_DIR={out_dir}",
        ]
        jobs = str(max(1, min(os.cpu_count() or 1, 8)))
        subprocess.run(cfg, check=True)
        subprocess.run([cmake, "--build", str(build_dir), "--target", "_qkernels", "-j", jobs],
                       check=True)
        built = list(out_dir.glob("_qkernels*" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")))
        if not built:
            raise RuntimeError(f"CMake finished but no _qkernels module in {out_dir}")
        if built[0] != out_file:
            shutil.move(str(built[0]), out_file)

    def copy_extensions_to_source(self):
        # Editable installs: copy only what was actually built (from build_lib to the source tree).
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            fullname = self.get_ext_fullname(ext.name)
            filename = self.get_ext_filename(fullname)
            regular = Path(self.build_lib) / filename
            if not regular.exists():
                continue
            package = ".".join(fullname.split(".")[:-1])
            dest = Path(build_py.get_package_dir(package)) / Path(filename).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(regular, dest)
            print(f"pocket-mlx: copied {regular.name} to {dest.parent}", flush=True)

    def get_outputs(self):
        return [p for p in super().get_outputs() if Path(p).exists()]


setup(
    packages=_packages(),
    ext_modules=[CMakeExtension(EXT_NAME, ROOT / "csrc")],
    cmdclass={"build_ext": BuildExt},
)

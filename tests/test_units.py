"""pocket_mlx.units and kernels.label, and one size figure, recipe label and kernels label for
the bundled model in `pocket-mlx info`, `pocket-mlx bench`'s table and the chat header."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

from pocket_mlx import kernels, units
from pocket_mlx.config import weights_bytes
from pocket_mlx.engine.session import Settings
from pocket_mlx.tui.app import ChatApp
from pocket_mlx.tui.header import ModelHeader

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "assets" / "pocket-tiny"


def test_sizes_are_iec_and_say_so():
    assert units.size(0) == "0 B" and units.size(1023) == "1023 B"
    assert units.size(1024) == "1.00 KiB"
    assert units.size(9_270_464) == "8.84 MiB"  # 9270464 / 2**20 = 8.841
    assert units.size(221 * units.MiB + 400 * units.KiB) == "221 MiB"
    assert units.size(20000 * units.MiB) == "19.5 GiB"
    assert units.size(56 * units.GiB) == "56.0 GiB" and units.size(128 * units.GiB) == "128 GiB"
    assert units.size(3 * units.TiB) == "3.00 TiB"
    assert units.size(None) == "n/a"


def test_counts_and_bandwidth_are_decimal():
    assert units.count(512) == "512" and units.count(51_200) == "51.2K"
    assert units.count(16_608_032) == "16.6M" and units.count(8_743_712) == "8.74M"
    assert units.count(34_660_000_000) == "34.7B"
    assert units.gbps(2 * units.GB, 0.5) == 4.0
    assert units.bandwidth(0.2249) == "0.22 GB/s" and units.bandwidth(546.0) == "546.0 GB/s"
    assert units.bandwidth(None) == "n/a"


def test_kernel_label_is_one_function_of_kernels_info():
    assert kernels.label({"active": False, "reason": "disabled by POCKET_MLX_KERNELS=0"}) == "mlx"
    assert kernels.label({"active": True, "isa": "avx2", "threads": 4, "mode": "fast"}) == (
        "avx2 ×4, fast")
    assert kernels.label({"active": True, "isa": "neon"}) == "neon"
    assert kernels.label() == kernels.label(kernels.info())
    assert len(kernels.label({"active": True, "isa": "avx512", "threads": 8, "mode": "exact"})) <= 16


def _run(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "pocket_mlx", *argv], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _header_text() -> str:
    """The chat header's text once the bundled model is loaded (Pilot, headless, CPU)."""
    app = ChatApp(device="cpu", settings=Settings(max_tokens=8))

    async def main() -> str:
        async with app.run_test(size=(160, 24)) as pilot:
            t = time.monotonic()
            while not app.ready:
                assert time.monotonic() - t < 60, "model did not load"
                await pilot.pause(0.05)
            await pilot.pause(0.05)
            top = app.query_one(ModelHeader).region.y
            return app.screen._compositor.render_strips()[top].text

    return asyncio.run(main())


def test_info_bench_and_chat_header_agree_on_the_bundled_model():
    size = units.size(weights_bytes(BUNDLED))
    label = "pocket-3bit (24/32 experts)"
    assert size == "9.61 MiB"  # with its MTP head (0.77 MiB)

    info = _run("info")
    assert re.search(r"^recipe +(.+)$", info, re.M).group(1) == label
    assert re.search(r"^size +(\S+ \S+) of weights", info, re.M).group(1) == size
    assert "{" not in info  # not the recipe's rules dict

    table = _run("bench", "-p", "0", "-n", "1", "-r", "1", "-q").splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    row = dict(zip(head, (c.strip() for c in table[2].strip("|").split("|"))))
    assert (row["model"], row["size"], row["recipe"]) == ("pocket-tiny", size, label)
    assert row["kernels"] == re.search(r"^kernels +(.+)$", info, re.M).group(1) == kernels.label()

    header = _header_text()
    assert f"·  {label}  ·  {size}" in header
    assert "18.3M params, 8.74M active (top-4)" in header  # with the MTP head (not active)
    readme = (ROOT / "README.md").read_text()
    assert f"`{label}`" in readme and f"{size} of weights" in readme

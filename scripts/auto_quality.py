"""The reference model's `--recipe auto --target-size` builds at llama.cpp's IQ2_XS bytes and at
75% of them, as scripts/quality_report.py makes them (8192 calibration tokens per domain, the
same perplexity windows), with each build's wall time: before/after checks of the auto search.

    python scripts/auto_quality.py [--root REPO] [--cache FILE] [--rounding gptq|rtn] [--no-mtp]

`--root`: the checkout whose code converts (default: this one), for a before/after pair.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--cache", type=Path, required=True, help="JSON cache of the rows")
    ap.add_argument("--rounding", default=None, help="rtn|gptq (default: auto's own, gptq)")
    ap.add_argument("--no-mtp", action="store_true",
                    help="build from a copy of the reference without its MTP head (as "
                         "docs/QUALITY.md's budget rows were measured, before it had one)")
    ap.add_argument("--only", choices=("iq2", "75"), help="one of the two builds")
    a = ap.parse_args()
    sys.path.insert(0, str(a.root / "scripts"))
    qr = importlib.import_module("quality_report")
    if a.no_mtp:
        qr.SRC = _without_mtp(qr.SRC, Path(tempfile.mkdtemp(prefix="ref-no-mtp-")))
    rep = qr.Report(a.cache, 4, 8192)
    iq2 = qr.LLAMACPP[qr.IQ2_XS][2]
    if a.rounding:  # quality_report builds with the default rounding; override it here
        orig = qr.ConvertOptions

        def opts(*args, **kw):
            return orig(*args, **{**kw, "rounding": a.rounding})
        qr.ConvertOptions = opts
    try:
        builds = (("IQ2_XS bytes", iq2), ("75% of IQ2_XS bytes", int(0.75 * iq2)))
        for name, b in builds[{"iq2": 0, "75": 1}[a.only]:][:1] if a.only else builds:
            key = f"size-{b}"
            t, c = time.perf_counter(), time.process_time()
            row = rep.build(key, f"size:{b}", calib=qr.DOMAINS)
            if "build_s" not in row:  # conversion and perplexity, wall and this process's CPU
                row["build_s"] = round(time.perf_counter() - t, 1)
                row["cpu_s"] = round(time.process_time() - c, 1)
                rep.save()
            print(json.dumps({"build": name, "bytes": row["weights_bytes"],
                              "experts": row["experts"], "ppl": row["ppl"],
                              "seconds": row["build_s"], "cpu_s": row.get("cpu_s")}),
                  flush=True)
    finally:
        shutil.rmtree(rep.tmp, ignore_errors=True)
    return 0


def _without_mtp(src: Path, out: Path) -> Path:
    """A copy of checkpoint `src` without its `mtp.*` tensors and `mtp_num_hidden_layers`."""
    import mlx.core as mx

    for f in src.iterdir():
        if f.suffix == ".safetensors":
            w = {k: v for k, v in mx.load(str(f)).items() if not k.startswith("mtp.")}
            mx.save_safetensors(str(out / f.name), w, {"format": "pt"})
        elif f.name == "config.json":
            cfg = json.loads(f.read_text())
            for c in (cfg, cfg.get("text_config", {})):
                c.pop("mtp_num_hidden_layers", None)
            (out / f.name).write_text(json.dumps(cfg, indent=2))
        elif f.name.endswith(".index.json"):
            idx = json.loads(f.read_text())
            idx["weight_map"] = {k: v for k, v in idx["weight_map"].items()
                                 if not k.startswith("mtp.")}
            (out / f.name).write_text(json.dumps(idx, indent=2))
        elif f.is_file() and f.name != "mtp_train.json":
            shutil.copy(f, out / f.name)
    return out


if __name__ == "__main__":
    sys.exit(main())

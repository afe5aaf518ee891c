"""scripts/train_mtp.py: a head trained by self-distillation on a tiny random checkpoint, written
in Qwen3.5's layout, loaded back with the head the training left (real subprocess, files)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import load_file

from pocket_mlx import kernels
from pocket_mlx.engine.loader import load

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "train_mtp.py"
sys.path.insert(0, str(ROOT / "scripts"))


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_train_mtp_distils_and_writes_hf_layout(make_ckpt, tmp_path):
    import train_mtp

    src = make_ckpt("src", vocab_size=8192)  # transformers layout, float32, no head
    out = tmp_path / "with-head"
    text = tmp_path / "train.txt"
    text.write_text((ROOT / "assets" / "text" / "en.calib.txt").read_text()[:20000])
    args = ["--steps", "25", "--tokens", "1024", "--window", "32", "--batch", "8",
            "--lr", "3e-3", "--text", str(text), "--json"]
    r = subprocess.run([sys.executable, str(SCRIPT), str(src), str(out), *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["steps"] == 25 and s["kl_last"] < 0.5 * s["kl_first"], s

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1
    before, after = _tensors(src), _tensors(out)
    head = {k for k in after if k.startswith("mtp.")}
    assert {k for k in after if not k.startswith("mtp.")} == set(before)
    for k, v in before.items():  # the trunk untouched
        assert after[k].dtype == v.dtype and np.array_equal(after[k], v), k
    n = cfg["num_experts"]
    assert {f"mtp.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(n)} <= head
    assert not any("switch_mlp" in k for k in head)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate.weight"} <= head

    # Loaded back (norms shifted by the transformers convention, experts stacked), the head
    # scores as the trained one did: the file holds what was trained.
    model, tok = load(out, device="cpu", dtype="float32")
    assert model.mtp is not None
    ids, pre, post = train_mtp.trunk_data(model, tok, [text], 1024, 33)
    kernels.set_enabled(False)  # MLX's ops, as the training measured it
    try:
        got = train_mtp.agreement(model, model.mtp, ids, post, post)
    finally:
        kernels.set_enabled(True)
    # The summary rounds to 1e-4; one position of the 512 scored moves it by 2e-3.
    assert abs(got - s["train_agreement_after"]) < 1e-3, (got, s)
    assert s["train_agreement_after"] > s["train_agreement_before"]
    mx.eval(model.mtp_logits(post[:1, :4], ids[:1, 1:5], model.make_mtp_cache())[0])


def test_train_mtp_bad_input_one_line(tmp_path):
    for argv in ([str(tmp_path / "none"), str(tmp_path / "o")],
                 [str(ROOT / "assets" / "pocket-tiny-bf16"), str(tmp_path / "o"),
                  "--text", str(tmp_path / "missing.txt")]):
        r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr

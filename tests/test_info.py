"""pocket-mlx info: parameters, bytes per token and RAM checked against hand arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pocket_mlx import kernels
from pocket_mlx.analysis import info
from pocket_mlx.engine import devices
from pocket_mlx.system import chips
from pocket_mlx.system.host import CommandResult, FakePlatform

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


class _Host(FakePlatform):
    """A Linux host with a given amount of RAM."""

    def __init__(self, ram: int):
        super().__init__()
        self._ram = ram

    def total_ram_bytes(self) -> int:
        return self._ram

    def is_macos(self) -> bool:
        return False


def _q(out_dim: int, in_dim: int, bits: int, gs: int = 64, scale_bytes: int = 2) -> int:
    """Bytes of one quantized [out, in] matrix: packed words + scales + biases."""
    return out_dim * in_dim * bits // 8 + 2 * out_dim * (in_dim // gs) * scale_bytes


@pytest.mark.parametrize("gpu", [False, True])
def test_bundled_model_by_hand(monkeypatch, gpu):
    """assets/pocket-tiny-bf16: bf16 matrices, float32 (1 + w) norms, no quantization, and its
    MTP head (stored, not read per token). The cache is sized for the device a run would take:
    float32 on the CPU, bf16 on a GPU."""
    monkeypatch.setattr(devices, "gpu_available", lambda: gpu)
    d = info.describe(str(ROOT / "assets" / "pocket-tiny-bf16"), context=1024,
                      platform=_Host(24 * GiB))
    H, V, L, n_lin, n_full = 256, 8192, 8, 6, 2
    E, k, I, S = 32, 4, 64, 128
    kh, vh, kd, vd, conv_k = 4, 8, 32, 32, 4
    nh, nkv, hd = 4, 2, 64
    bf, f32 = 2, 4
    conv_dim = 2 * kh * kd + vh * vd
    linear = bf * (conv_dim * H + vh * vd * H + 2 * vh * H + H * vh * vd  # projections
                   + conv_dim * conv_k + 2 * vh + vd)  # conv1d, dt_bias + A_log, gated norm
    full = bf * (2 * nh * hd * H + 2 * nkv * hd * H + H * nh * hd) + f32 * 2 * hd
    moe_dense = bf * (E * H + H + 3 * S * H) + f32 * 2 * H  # router, gate, shared; 2 norms
    experts = bf * E * 3 * I * H
    embed = bf * V * H
    lm_head = bf * V * H
    dense = n_lin * linear + n_full * full + L * moe_dense + f32 * H + lm_head
    assert d["bytes_per_token"] == dense + L * experts * k // E + embed // V
    # The head: fc, 3 norms, one full-attention layer with its MoE block (all its experts).
    mtp = bf * 2 * H * H + f32 * 3 * H + full + moe_dense + experts
    assert d["mtp"] == {"layers": 1, "bytes": mtp}
    assert d["weights_bytes"] == dense + L * experts + embed + mtp
    params_experts = L * E * 3 * I * H
    mtp_f32 = 5 * H + 2 * hd  # the head's float32 norms
    f32_elems = L * 2 * H + n_full * 2 * hd + H + mtp_f32  # the float32 norms
    assert d["params_total"] == (d["weights_bytes"] - f32 * f32_elems) // bf + f32_elems
    mtp_params = (mtp - f32 * mtp_f32) // bf + mtp_f32  # not active: read only when drafting
    assert d["params_active"] == (d["params_total"] - params_experts * (E - k) // E
                                  - mtp_params)
    # RAM: weights + K/V of the 2 full layers at 1024 tokens + f32 delta state and conv window
    # of the 6 linear layers; K/V and conv window in the activation dtype.
    act = bf if gpu else f32
    assert (d["device"], d["activation_dtype"]) == (("gpu", "bfloat16") if gpu
                                                   else ("cpu", "float32"))
    kv = n_full * 2 * nkv * hd * 1024 * act
    state = n_lin * (vh * vd * kd * 4 + (conv_k - 1) * conv_dim * act)
    assert (d["kv_cache_bytes"], d["linear_state_bytes"]) == (kv, state)
    assert d["ram_needed_bytes"] == d["weights_bytes"] + kv + state
    assert d["fits"] is True
    assert d["disk_bytes"] > d["weights_bytes"]  # safetensors headers
    assert d["experts_per_layer"] == d["experts_original"] == 32
    assert d["quantization"]["experts"]["bits"] == []
    assert d["quantization"]["experts"]["float_dtypes"] == ["bfloat16"]
    assert d["kernels"] and d["decode_ceiling_tps"] is None
    assert d["cpu_layout"].startswith("panels") == kernels.panels_wanted()


def test_synthetic_35b_by_hand():
    """Qwen3.5-35B-A3B shape, pocket-2bit, bf16 scales; 4096 tokens of context."""
    d = info.describe("synthetic:pocket-35b", context=4096, bandwidth_gbps=100.0,
                      platform=_Host(16 * GiB))
    H, V, L, n_lin, n_full = 2048, 248320, 40, 30, 10
    E, k, I, S = 256, 8, 512, 512
    kh, vh, kd, vd, conv_k = 16, 32, 128, 128, 4
    nh, nkv, hd = 16, 2, 256
    bf = 2
    conv_dim = 2 * kh * kd + vh * vd  # 8192
    linear = (_q(conv_dim, H, 4) + _q(vh * vd, H, 4) + 2 * _q(vh, H, 4) + _q(H, vh * vd, 4)
              + bf * (conv_dim * conv_k + 2 * vh + vd))
    full = (_q(2 * nh * hd, H, 4) + 2 * _q(nkv * hd, H, 4) + _q(H, nh * hd, 4)
            + bf * 2 * hd)
    moe_dense = (_q(E, H, 8) + _q(1, H, 8) + 2 * _q(S, H, 4) + _q(H, S, 4)
                 + bf * 2 * H)  # router, shared gate, shared expert, 2 layer norms
    # Per layer, 8 of 256 experts x 3 projections, each 512 x 2048 at 2 bits + scales/biases.
    experts_per_token = k * (2 * _q(I, H, 2) + _q(H, I, 2))
    assert experts_per_token == 8 * 3 * (2048 * 512 * 2 // 8 + 2 * 512 * 32 * 2)
    embed_row = H * 6 // 8 + 2 * (H // 64) * bf
    lm_head = _q(V, H, 6)
    per_token = (n_lin * linear + n_full * full + L * (moe_dense + experts_per_token)
                 + bf * H + lm_head + embed_row)
    assert d["bytes_per_token"] == per_token
    weights = per_token - L * experts_per_token + L * E // k * experts_per_token \
        - embed_row + V * embed_row
    assert d["weights_bytes"] == weights
    assert 1.40e9 < per_token < 1.60e9 and 11.0e9 < weights < 12.5e9
    act = 2 if devices.gpu_available() else 4  # bf16 on a GPU, float32 on the CPU
    kv = n_full * 2 * nkv * hd * 4096 * act
    state = n_lin * (vh * vd * kd * 4 + (conv_k - 1) * conv_dim * act)
    assert d["ram_needed_bytes"] == weights + kv + state
    # 16 GiB host: 4 GiB reserve -> 12 GiB usable; 11.x GB of weights fits at 4096 tokens.
    assert d["ram_usable_bytes"] == 12 * GiB and d["fits"] is (weights + kv + state <= 12 * GiB)
    assert d["decode_ceiling_tps"] == pytest.approx(100e9 / per_token)
    q = d["quantization"]
    assert (q["experts"]["bits"], q["router"]["bits"], q["embeddings"]["bits"],
            q["lm_head"]["bits"], q["attention"]["bits"], q["shared_expert"]["bits"]) == \
        ([2], [8], [6], [6], [4], [4])
    assert q["experts"]["bytes_per_token"] == L * experts_per_token
    assert d["params_total"] > 34e9 and 3.0e9 < d["params_active"] < 3.6e9
    assert (d["experts_per_layer"], d["experts_original"], d["top_k"]) == (256, 256, 8)
    e128 = info.describe("synthetic:pocket-35b-e128", context=4096, platform=_Host(16 * GiB))
    assert e128["experts_per_layer"] == 128 and e128["experts_original"] == 256
    # Pruning keeps the experts read per token; only the router shrinks (128 rows, not 256).
    assert e128["bytes_per_token"] == per_token - L * (_q(E, H, 8) - _q(128, H, 8))
    assert e128["fits"] is True


def test_config_json_path(tmp_path):
    cfg = {**info.open_source("synthetic:tiny").config}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = info.describe(str(tmp_path / "config.json"), platform=_Host(8 * GiB))
    b = info.describe("synthetic:tiny", platform=_Host(8 * GiB))
    assert a["bytes_per_token"] == b["bytes_per_token"] and a["disk_bytes"] is None


def test_chips():
    assert chips.parse_chip("Apple M3 Pro") == "M3 Pro"
    assert chips.parse_chip("Apple M2") == "M2"
    assert chips.parse_chip("Intel(R) Core(TM) i9") is None
    assert chips.chip_bandwidth("M4 Max", 12) == 546 and chips.chip_bandwidth("M4 Max", 10) == 410
    assert chips.chip_bandwidth("M3 Max") == 300
    assert chips.chip_bandwidth("M2 Ultra") == 800


def _mac(brand: str, perf_cores: int, ram: int = 36 * GiB) -> FakePlatform:
    ok = CommandResult
    return FakePlatform(responses={
        "uname -s": ok(0, "Darwin\n"), "sw_vers -productVersion": ok(0, "15.1\n"),
        "sysctl hw.memsize": ok(0, f"hw.memsize: {ram}\n"),
        "sysctl -n machdep.cpu.brand_string": ok(0, brand + "\n"),
        "sysctl -n hw.perflevel0.physicalcpu": ok(0, f"{perf_cores}\n"),
    })


def test_mac_chip_detection_and_ceiling():
    assert chips.detect(_mac("Apple M3 Pro", 6)) == ("M3 Pro", 150.0)
    assert chips.detect(_mac("Apple M4 Max", 12)) == ("M4 Max", 546.0)
    assert chips.detect(_Host(8 * GiB)) is None
    d = info.describe("synthetic:pocket-35b-e128", context=4096,
                      platform=_mac("Apple M3 Pro", 6))
    assert d["bandwidth_source"] == "Apple M3 Pro (published spec)"
    assert d["decode_ceiling_tps"] == pytest.approx(150e9 / d["bytes_per_token"])
    assert d["ram_total_bytes"] == 36 * GiB and d["fits"] is True
    # --bandwidth wins over the table.
    d = info.describe("synthetic:tiny", bandwidth_gbps=50.0, platform=_mac("Apple M3 Pro", 6))
    assert d["bandwidth_source"] == "--bandwidth" and d["bandwidth_gbps"] == 50.0


def test_cli_info_json():
    proc = subprocess.run([sys.executable, "-m", "pocket_mlx", "info", "--model",
                           "synthetic:pocket-35b", "--context", "8192", "--bandwidth", "120",
                           "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    for key in ("params_total", "params_active", "bytes_per_token", "ram_needed_bytes", "fits"):
        assert key in d
    assert d["decode_ceiling_tps"] == pytest.approx(120e9 / d["bytes_per_token"])
    text = subprocess.run([sys.executable, "-m", "pocket_mlx", "info"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert text.returncode == 0 and "bytes" not in text.stderr and "per token" in text.stdout
    bad = subprocess.run([sys.executable, "-m", "pocket_mlx", "info", "--model",
                          "synthetic:nope"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown synthetic model" in bad.stderr


def test_default_model_is_the_pruned_mixed_precision_build():
    d = info.describe(None, context=1024, platform=_Host(24 * GiB))
    js = json.loads((ROOT / "assets" / "pocket-tiny" / "pocket.json").read_text())
    assert js["recipe"]["name"] == "pocket-3bit" and js["original_num_experts"] == 32
    assert d["params_total"] < 19_770_144  # 24 of 32 experts kept
    assert d["bytes_per_token"] < 13_335_616 / 2  # vs the bf16 build's 13.3 MB per token

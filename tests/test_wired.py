"""`pocket-mlx wired`: every branch through FakePlatform (recorded macOS outputs), plus real
subprocess runs of the CLI on this (Linux) machine."""

from __future__ import annotations

import argparse
import io
import json
import os
import plistlib
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from pocket_mlx.cli.wired import register, run
from pocket_mlx.errors import PocketError
from pocket_mlx.system.host import (
    FAKE_PLATFORM_ENV,
    CommandResult,
    FakePlatform,
    RealPlatform,
    parse_meminfo_total,
    parse_sysctl_int,
    parse_version,
    total_ram_bytes,
)
from pocket_mlx.system.wired import (
    KEY_BYTES,
    KEY_MB,
    LAUNCHD_LABEL,
    LAUNCHD_PATH,
    GiB,
    default_reserve_bytes,
    find_key,
    fitting_context,
    kv_cache_bytes,
    model_footprint,
    parse_limit_arg,
    read_limit,
    recommended_limit_mb,
    serve_ram_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "macos"
REFERENCE = ROOT / "assets" / "pocket-tiny-bf16"


def fake(name: str, **kwargs) -> FakePlatform:
    return FakePlatform.from_file(FIXTURES / f"{name}.txt", **kwargs)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["wired", *argv])


def wired(argv: list[str], platform: FakePlatform, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run(parse(argv), platform=platform, stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def refused(argv: list[str], platform: FakePlatform) -> str:
    with pytest.raises(PocketError) as e:
        wired(argv, platform)
    message = str(e.value)
    assert "\n" not in message and e.value.exit_code == 2
    assert platform.writes == []
    return message


# -- platform parsing of recorded outputs ----------------------------------------------------------
@pytest.mark.parametrize(
    "name, version, ram, key, raw",
    [
        ("macos15-64gb", (15, 1), 64 * GiB, KEY_MB, 57344),
        ("macos14-32gb", (14, 5), 32 * GiB, KEY_MB, 0),
        ("macos13-16gb", (13, 6, 7), 16 * GiB, KEY_BYTES, 0),
        ("macos12-16gb", (12, 7, 4), 16 * GiB, None, None),
        ("linux-64gb", None, 65841204 * 1024, None, None),
    ],
)
def test_fixture_platforms(name, version, ram, key, raw):
    p = fake(name)
    assert p.macos_version() == version
    assert p.is_macos() == (version is not None)
    assert p.total_ram_bytes() == ram == total_ram_bytes(p)
    assert find_key(p) == key
    if key:
        assert read_limit(p, key) == raw


def test_parsers():
    assert parse_version("14.5\n") == (14, 5)
    assert parse_version("nope") is None
    assert parse_sysctl_int("hw.memsize: 34359738368\n", "hw.memsize") == 34359738368
    assert parse_sysctl_int("0\n") == 0
    assert parse_sysctl_int("") is None
    assert parse_meminfo_total("MemTotal:       1024 kB\n") == 1024 * 1024
    assert parse_meminfo_total("garbage") is None


def test_unknown_oid_is_missing_even_with_exit_zero():
    p = FakePlatform(
        responses={
            "sysctl -n iogpu.wired_limit_mb": CommandResult(
                0, "", "sysctl: unknown oid 'iogpu.wired_limit_mb'\n"
            )
        }
    )
    assert p.sysctl_read("iogpu.wired_limit_mb") is None


def test_real_platform_on_this_machine():
    p = RealPlatform()
    if sys.platform != "linux":
        pytest.skip("checks the Linux branch")
    assert p.system() == "Linux"
    assert not p.is_macos() and p.macos_version() is None
    assert find_key(p) is None
    assert p.total_ram_bytes() == parse_meminfo_total(Path("/proc/meminfo").read_text())
    assert p.run(["pocket-mlx-no-such-program"]).returncode == 127


# -- recommendation and value parsing -------------------------------------------------------------
def test_recommended_limit():
    assert recommended_limit_mb(32 * GiB) == 27852  # 32 GB - 15% (4.8 GB)
    assert recommended_limit_mb(16 * GiB) == 12288  # 16 GB - 4 GB minimum reserve
    assert recommended_limit_mb(32 * GiB, 8 * GiB) == 24 * 1024
    assert recommended_limit_mb(32 * GiB, 0) == 30 * 1024  # capped at RAM - 2 GB
    with pytest.raises(PocketError):
        recommended_limit_mb(4 * GiB, 4 * GiB)


def test_parse_limit_arg():
    assert parse_limit_arg("auto") is None
    assert parse_limit_arg(" 20000 ") == 20000
    for bad, words in [("-5", "positive"), ("0", "--reset"), ("1.5", "whole"), ("x", "whole")]:
        with pytest.raises(PocketError, match=words):
            parse_limit_arg(bad)


# -- show ------------------------------------------------------------------------------------------
def test_show_macos14():
    p = fake("macos14-32gb")
    rc, out, err = wired([], p)
    assert rc == 0 and err == ""
    assert "macOS 14.5" in out and "32.0 GiB" in out
    assert "system default (iogpu.wired_limit_mb = 0)" in out
    assert "21.3 GiB recommended by the GPU (Apple M2 Pro)" in out
    assert "Recommended limit:  27852 MiB = 27.2 GiB (32.0 GiB RAM - 4.80 GiB reserve)" in out
    assert "sudo sysctl iogpu.wired_limit_mb=27852" in out
    assert p.writes == []


def test_show_macos13_uses_bytes():
    rc, out, _ = wired([], fake("macos13-16gb"))
    assert rc == 0
    assert "system default (debug.iogpu.wired_limit = 0)" in out
    assert f"sudo sysctl debug.iogpu.wired_limit={12288 * 2**20}" in out


def test_show_macos15_current_limit_and_reserve():
    rc, out, _ = wired(["--reserve-gb", "8"], fake("macos15-64gb"))
    assert rc == 0
    assert "57344 MiB = 56.0 GiB (iogpu.wired_limit_mb = 57344)" in out
    assert "sudo sysctl iogpu.wired_limit_mb=57344" not in out
    assert "already applied" in out  # 64 GB - 8 GB = 57344 MB


def test_show_macos12_has_no_key():
    rc, out, _ = wired([], fake("macos12-16gb"))
    assert rc == 0 and "not adjustable on macOS 12.7.4" in out
    assert "sudo" not in out


def test_show_linux():
    rc, out, _ = wired([], fake("linux-64gb"))
    assert rc == 0
    assert "does not exist on Linux" in out


def test_show_without_gpu_info():
    p = fake("macos14-32gb")
    p.device_info = {}
    rc, out, _ = wired([], p)
    assert rc == 0 and "not reported" in out


# -- model footprint -------------------------------------------------------------------------------
QWEN35_35B_TEXT = {
    "num_hidden_layers": 40,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_size": 2048,
    "max_position_embeddings": 262144,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
QWEN35_35B_TEXT["layer_types"] = QWEN35_35B_TEXT["layer_types"] * 10


def test_kv_cache_35b_shape_nested_text_config():
    kv = kv_cache_bytes({"model_type": "qwen3_5_moe", "text_config": QWEN35_35B_TEXT})
    assert (kv.full_layers, kv.linear_layers, kv.context) == (10, 30, 262144)
    assert kv.full_bytes == 10 * 2 * 2 * 256 * 262144 * 2 == 5 * GiB
    conv_dim = 2 * 16 * 128 + 32 * 128
    assert kv.linear_bytes == 30 * (32 * 128 * 128 * 4 + 3 * conv_dim * 2)
    assert kv_cache_bytes(QWEN35_35B_TEXT, context=4096).full_bytes == 10 * 2 * 2 * 256 * 4096 * 2


def test_kv_cache_in_the_activation_dtype():
    """K, V and the conv window take the activation dtype's size (float32 on the CPU); the
    delta-rule state is float32 whatever it is; None means the checkpoint's dtype."""
    bf16, f32 = (kv_cache_bytes(QWEN35_35B_TEXT, 4096, n) for n in (2, 4))
    assert f32.full_bytes == 2 * bf16.full_bytes and (bf16.act_bytes, f32.act_bytes) == (2, 4)
    conv = 30 * 3 * (2 * 16 * 128 + 32 * 128)
    assert f32.linear_bytes - bf16.linear_bytes == conv * 2
    assert kv_cache_bytes(QWEN35_35B_TEXT, 4096) == bf16  # no dtype key: bfloat16
    assert kv_cache_bytes({**QWEN35_35B_TEXT, "torch_dtype": "float32"}, 4096) == f32
    assert kv_cache_bytes({"text_config": {**QWEN35_35B_TEXT, "dtype": "float16"}}, 4096) == bf16


def test_kv_cache_without_layer_types():
    cfg = {k: v for k, v in QWEN35_35B_TEXT.items() if k != "layer_types"}
    kv = kv_cache_bytes({**cfg, "full_attention_interval": 4})
    assert (kv.full_layers, kv.linear_layers) == (10, 30)
    # Neither given: Qwen3.5's rule, every 4th layer full attention (as the model builds it).
    assert (kv_cache_bytes(cfg).full_layers, kv_cache_bytes(cfg).linear_layers) == (10, 30)
    dense = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
             "full_attention_interval": 1}
    kv = kv_cache_bytes({**dense, "max_position_embeddings": 100})
    assert (kv.full_layers, kv.full_bytes) == (2, 2 * 2 * 4 * 64 * 100 * 2)


def test_kv_cache_missing_key():
    with pytest.raises(PocketError, match="max_position_embeddings"):
        kv_cache_bytes({"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8})


def test_model_footprint_and_show(tmp_path):
    # Real shards: the weights are the tensor bytes their headers declare (250 + 6 float32).
    mx.save_safetensors(str(tmp_path / "model-00001-of-00002.safetensors"),
                        {"a": mx.zeros((250,), mx.float32)})
    mx.save_safetensors(str(tmp_path / "model-00002-of-00002.safetensors"),
                        {"b": mx.zeros((6,), mx.float32)})
    (tmp_path / "config.json").write_text(json.dumps({"text_config": QWEN35_35B_TEXT}))
    fp = model_footprint(tmp_path)
    assert fp.weight_bytes == 1024
    assert fp.kv.act_bytes == 2  # GPU wired memory: the checkpoint's bf16, on any host
    assert fp.total == 1024 + fp.kv.total
    rc, out, _ = wired(["--model", str(tmp_path), "--context", "8192"], fake("macos14-32gb"))
    assert rc == 0
    assert "Model weights:      1.00 KiB" in out
    assert "KV cache:           221 MiB at 8192 tokens" in out


def test_model_that_does_not_fit(tmp_path):
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"a": mx.zeros((1,))})
    (tmp_path / "config.json").write_text(json.dumps({"text_config": QWEN35_35B_TEXT}))
    rc, out, _ = wired(["--model", str(tmp_path)], fake("macos13-16gb"))  # 5 GiB KV fits
    assert rc == 0 and "does not fit" not in out
    big = {**QWEN35_35B_TEXT, "max_position_embeddings": 262144 * 4}
    (tmp_path / "config.json").write_text(json.dumps(big))
    rc, out, _ = wired(["--model", str(tmp_path)], fake("macos13-16gb"))  # 20 GB KV
    assert rc == 0 and "does not fit" in out


def test_model_errors(tmp_path):
    assert "not a local model directory" in refused(
        ["--model", str(tmp_path / "nope")], fake("macos14-32gb")
    )
    assert "no *.safetensors" in refused(["--model", str(tmp_path)], fake("macos14-32gb"))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert "model.safetensors is not a valid safetensors file" in refused(
        ["--model", str(tmp_path)], fake("linux-64gb"))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"a": mx.zeros((1,))})
    rc, out, _ = wired(["--model", str(tmp_path)], fake("linux-64gb"))
    assert rc == 0 and "unknown (no config.json)" in out
    (tmp_path / "config.json").write_text("{")  # read by config.read_config, as everywhere
    assert "config.json is not valid JSON" in refused(["--model", str(tmp_path)],
                                                      fake("linux-64gb"))


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="bundled bf16 model not present")
def test_reference_model_footprint():
    fp = model_footprint(REFERENCE)
    # The tensors' bytes (as loaded), not the files' (those add the JSON headers).
    loaded = sum(v.nbytes for f in REFERENCE.glob("*.safetensors") for v in mx.load(str(f)).values())
    assert fp.weight_bytes == loaded
    assert loaded < sum(f.stat().st_size for f in REFERENCE.glob("*.safetensors"))
    assert fp.kv.full_bytes == 2 * 2 * 2 * 64 * 2048 * 2
    assert fp.kv.linear_bytes == 6 * (8 * 32 * 32 * 4 + 3 * (2 * 4 * 32 + 8 * 32) * 2)


# -- set / reset -----------------------------------------------------------------------------------
def test_set_yes_macos14():
    p = fake("macos14-32gb")
    rc, out, err = wired(["--set", "20000", "--yes"], p)
    assert rc == 0, err
    assert p.writes == ["iogpu.wired_limit_mb=20000"]
    assert "iogpu.wired_limit_mb: 0 -> 20000" in out
    assert "now 20000 MiB = 19.5 GiB" in out
    assert read_limit(p, KEY_MB) == 20000


@pytest.mark.parametrize(
    "extra, expected", [([], 27852), (["--reserve-gb", "8"], 24576), (["--reserve-gb", "0"], 30720)]
)
def test_set_auto(extra, expected):
    p = fake("macos14-32gb")
    rc, _, _ = wired(["--set", "auto", "--yes", *extra], p)
    assert rc == 0 and p.writes == [f"iogpu.wired_limit_mb={expected}"]


def test_set_macos13_converts_to_bytes():
    p = fake("macos13-16gb")
    rc, out, _ = wired(["--set", "12288", "-y"], p)
    assert rc == 0
    assert p.writes == [f"debug.iogpu.wired_limit={12288 * 2**20}"]
    assert "now 12288 MiB = 12.0 GiB" in out


def test_set_read_back_mismatch():
    p = fake("macos14-32gb", apply_writes=False)
    rc, _, err = wired(["--set", "20000", "--yes"], p)
    assert rc == 1
    assert p.writes == ["iogpu.wired_limit_mb=20000"]
    assert "reads back 0, not 20000" in err


def test_set_sudo_fails():
    p = fake("macos14-32gb", write_result=CommandResult(1, "", "sudo: a password is required\n"))
    with pytest.raises(PocketError, match="failed: sudo: a password is required"):
        wired(["--set", "20000", "--yes"], p)


def test_reset():
    p = fake("macos15-64gb")
    rc, out, _ = wired(["--reset", "--yes"], p)
    assert rc == 0 and p.writes == ["iogpu.wired_limit_mb=0"]
    assert "57344 -> 0" in out and "system default" in out


def test_dry_run():
    p = fake("macos14-32gb")
    rc, out, _ = wired(["--set", "auto", "--dry-run"], p)
    assert rc == 0 and p.writes == []
    assert out.strip() == "dry run: would run: sudo sysctl iogpu.wired_limit_mb=27852"
    rc, out, _ = wired(["--reset", "--dry-run"], p)
    assert rc == 0 and "iogpu.wired_limit_mb=0" in out and p.writes == []


@pytest.mark.parametrize(
    "answer, applied", [("n\n", False), ("\n", False), ("", False), ("y\n", True), ("YES\n", True)]
)
def test_prompt(answer, applied):
    p = fake("macos14-32gb")
    rc, _, err = wired(["--set", "20000"], p, stdin=answer)
    assert "Run `sudo sysctl iogpu.wired_limit_mb=20000`? [y/N]" in err
    assert rc == (0 if applied else 1)
    assert p.writes == (["iogpu.wired_limit_mb=20000"] if applied else [])
    if not applied:
        assert "not changed" in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--set", "-5"], "positive"),
        (["--set", "0"], "use --reset"),
        (["--set", "1.5"], "whole number"),
        (["--set", "lots"], "whole number"),
        (["--set", "30721"], "above total RAM"),
        (["--set", "40000", "--dry-run"], "above total RAM"),
        (["--dry-run"], "go with --set or --reset"),
        (["--yes"], "go with --set or --reset"),
        (["--print-launchd", "--reset"], "bootout"),
        (["--reserve-gb", "-1"], "must not be negative"),
        (["--set", "auto", "--reserve-gb", "32", "--yes"], "leaves nothing"),
        (["--context", "0"], "positive"),
    ],
)
def test_refusals(argv, words):
    assert words in refused(argv, fake("macos14-32gb"))


def test_largest_allowed_limit():
    p = fake("macos14-32gb")
    assert wired(["--set", "30720", "--yes"], p)[0] == 0  # exactly RAM - 2 GB


@pytest.mark.parametrize(
    "name, words", [("macos12-16gb", "has no GPU wired-limit sysctl"), ("linux-64gb", "Linux")]
)
@pytest.mark.parametrize("argv", [["--set", "1000"], ["--reset"], ["--print-launchd"]])
def test_refused_without_key(name, words, argv):
    message = refused(argv, fake(name))
    assert words in message


# -- launchd ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fixture, argv, arg",
    [
        ("macos14-32gb", [], "iogpu.wired_limit_mb=27852"),
        ("macos14-32gb", ["--set", "24576"], "iogpu.wired_limit_mb=24576"),
        ("macos13-16gb", [], f"debug.iogpu.wired_limit={12288 * 2**20}"),
    ],
)
def test_print_launchd(fixture, argv, arg):
    p = fake(fixture)
    rc, out, err = wired(["--print-launchd", *argv], p)
    assert rc == 0 and p.writes == []
    plist = plistlib.loads(out.encode())
    assert plist == {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": ["/usr/sbin/sysctl", arg],
        "RunAtLoad": True,
    }
    assert LAUNCHD_PATH == "/Library/LaunchDaemons/com.pocket-mlx.wired-limit.plist"
    assert f"sudo launchctl bootstrap system {LAUNCHD_PATH}" in err
    assert "bootout" in err


# -- the real CLI in a subprocess ------------------------------------------------------------------
def cli(
    argv: list[str], fixture: str | None = None, stdin: str = ""
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != FAKE_PLATFORM_ENV}
    if fixture:
        env[FAKE_PLATFORM_ENV] = str(FIXTURES / f"{fixture}.txt")
    return subprocess.run(
        [sys.executable, "-m", "pocket_mlx", "wired", *argv],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the real-platform check is the Linux one")
def test_cli_real_linux_show():
    proc = cli([])
    assert proc.returncode == 0, proc.stderr
    assert "does not exist on Linux" in proc.stdout
    assert proc.stderr == ""


@pytest.mark.skipif(sys.platform != "linux", reason="the real-platform check is the Linux one")
@pytest.mark.parametrize("argv", [["--set", "1000"], ["--set", "1000", "--yes"], ["--reset"]])
def test_cli_real_linux_set_refused(argv):
    proc = cli(argv)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("pocket-mlx wired: error:") and "does not exist on Linux" in lines[0]


def test_cli_fake_mac_prompt_declined():
    proc = cli(["--set", "auto"], fixture="macos14-32gb", stdin="n\n")
    assert proc.returncode == 1
    assert "[y/N]" in proc.stderr and "not changed" in proc.stderr


def test_cli_fake_mac_set_and_refusals():
    proc = cli(["--set", "20000", "--yes"], fixture="macos14-32gb")
    assert proc.returncode == 0, proc.stderr
    assert "iogpu.wired_limit_mb: 0 -> 20000" in proc.stdout
    for argv, words in [(["--set", "0"], "use --reset"), (["--set", "x"], "whole number")]:
        proc = cli(argv, fixture="macos14-32gb")
        assert proc.returncode == 2 and words in proc.stderr
        assert len(proc.stderr.splitlines()) == 1


def test_cli_usage_error_exit_2():
    proc = cli(["--set"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("budget", [0, 512 << 20, 4 << 30])
def test_serve_window_fits_with_the_prompt_cache(budget):
    """The window `serve` plans is the longest whose `serve_ram_bytes` (weights, cache, and
    the prompt cache's budget or a full-window snapshot, the larger) fits in usable RAM."""
    config = {"model_type": "qwen3_5_moe", "text_config": QWEN35_35B_TEXT}
    weights, ram = 6 << 30, 16 << 30
    usable = ram - default_reserve_bytes(ram)
    w = fitting_context(config, weights, ram, 4, budget)
    assert w > 0
    assert serve_ram_bytes(config, w, weights, 4, budget) <= usable
    assert serve_ram_bytes(config, w + 1, weights, 4, budget) > usable
    if budget:  # its share shrinks the window: never more than without it
        assert w < fitting_context(config, weights, ram, 4)

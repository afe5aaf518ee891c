"""The CLI as users run it: real subprocesses, one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ASSET


def cli(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, "-m", "pocket_mlx", *args], capture_output=True,
                          text=True, input=stdin, timeout=300,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(r, needle):
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and needle in lines[0], lines


def test_generate_json_on_bundled_model():
    r = cli("generate", "--prompt", "Tell me a fortune.", "-n", "12", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for k in ("text", "prompt_tokens", "generation_tokens", "prompt_tps", "generation_tps",
              "ttft_s", "peak_memory_gb", "bytes_per_token", "device"):
        assert k in out
    assert out["text"] and 0 < out["generation_tokens"] <= 12 and out["device"] == "cpu"


def test_generate_streams_text_and_prints_stats_line():
    r = cli("generate", "--prompt", "-", "--raw", "-n", "8", "--seed", "1", "--temp", "0.8",
            stdin="In the beginning")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tok/s" in r.stderr and "peak memory" in r.stderr


def test_python_m_and_console_script_agree():
    exe = shutil.which("pocket-mlx")
    if exe is None:
        pytest.skip("console script not on PATH")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "generate" in r.stdout


@pytest.fixture
def broken(tmp_path):
    def make(kind):
        d = tmp_path / kind
        shutil.copytree(ASSET, d)
        cfg = json.loads((d / "config.json").read_text())
        if kind == "unknown_type":
            cfg["model_type"] = "llama9"
        elif kind == "wrong_shape":
            cfg["hidden_size"] = 128
        elif kind == "missing_tensor":
            cfg["num_hidden_layers"] = 9
            cfg["layer_types"] = cfg["layer_types"] + ["linear_attention"]
        elif kind == "no_config":
            (d / "config.json").unlink()
        elif kind == "truncated":
            f = d / "model.safetensors"
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        if (d / "config.json").exists():
            (d / "config.json").write_text(json.dumps(cfg))
        return str(d)
    return make


@pytest.mark.parametrize("kind,needle", [
    ("no_config", "no config.json"),
    ("unknown_type", "unsupported model_type 'llama9'"),
    ("truncated", "truncated"),
    ("missing_tensor", "missing tensor: language_model.model.layers.8."),
    ("wrong_shape", "wrong shape for "),  # the head's or the trunk's tensor, whichever first
])
def test_broken_models_are_one_line_errors(broken, kind, needle):
    assert_one_line_error(cli("generate", "--model", broken(kind), "--prompt", "hi"), needle)


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/model", "--prompt", "hi"], "no such model folder"),
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt", "hi", "--temp", "-0.5"], "temperature"),
    (["--prompt", "hi", "--top-p", "0"], "top-p"),
    (["--prompt", "hi", "--top-p", "1.01"], "top-p"),
    (["--prompt", "In the beginning " * 1200], "does not fit the context"),
    (["--prompt", "hi", "--temp", "abc"], "expected a number"),
])
def test_bad_input_is_one_line_error(args, needle):
    assert_one_line_error(cli("generate", *args), needle)


def test_offline_repo_id_is_one_line_error(tmp_path):
    r = cli("generate", "--model", "nobody/no-such-model", "--prompt", "hi",
            env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert_one_line_error(r, "nobody/no-such-model")


def test_logging_is_set_up_once_with_the_commands_prefix(capsys):
    """cli/logs.py: a module's logger line reaches stderr as "pocket-mlx COMMAND: message",
    info included, once however often a command sets it up in one process."""
    import logging

    from pocket_mlx.cli.logs import ROOT, setup_logging

    root = logging.getLogger(ROOT)
    handlers, level = list(root.handlers), root.level
    try:
        setup_logging("chat")
        setup_logging("serve")
        logging.getLogger("pocket_mlx.server.engine").info("prefill req 1: done")
        logging.getLogger("pocket_mlx.tui.jobs").debug("not shown")
        logging.getLogger("elsewhere").info("not ours")
        assert capsys.readouterr().err == "pocket-mlx serve: prefill req 1: done\n"
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)

"""Models from the Hugging Face Hub.

The CLI runs as a real subprocess against a local stand-in for the Hub (tests/hub_standin.py,
127.0.0.1) through HF_ENDPOINT, with its own HF_HOME: first download, the cache reused without a
request, offline mode, the one-line errors, an interrupted download resumed by a rerun, and a
stray weights file beside the index (neither downloaded nor loaded).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import ASSET, ROOT
from hub_standin import StandInHub

from pocket_mlx.config import pick_weights, weight_files
from pocket_mlx.engine.hub import DownloadProgress
from pocket_mlx.engine.loader import load, resolve_model_path
from pocket_mlx.errors import PocketError

REPO = "pocket/tiny"
# What a download of the bundled model fetches: the index, its one shard, the metadata files.
FETCHED = {
    "model.safetensors.index.json", "model.safetensors", "config.json", "generation_config.json",
    "pocket.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json",
    "merges.txt",
}
GENERATE = ["generate", "--prompt", "hi", "--max-tokens", "2"]


def add_stray_weights(folder: Path) -> None:
    """A real safetensors file beside the index that the index does not name (as Mistral repos
    keep `consolidated.safetensors`): loading it fails with "unexpected tensor"."""
    mx.save_safetensors(str(folder / "consolidated.safetensors"),
                        {"output.weight": mx.zeros((4, 4))})


@pytest.fixture
def served(tmp_path) -> Path:
    folder = tmp_path / "served"
    shutil.copytree(ASSET, folder)
    add_stray_weights(folder)
    return folder


@pytest.fixture
def hub(served):
    with StandInHub() as hub:
        hub.add(REPO, served)
        yield hub


def cli(args: list[str], hub: StandInHub, hf_home: Path, **env: str):
    """`python -m pocket_mlx ARGS` with a clean Hugging Face environment pointed at `hub`."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    base.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1",
                NO_PROXY="127.0.0.1", PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "pocket_mlx", *args], env=base, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def repo_requests(hub: StandInHub) -> list[tuple[str, str]]:
    """Requests about the repo: its file list or its files."""
    return [r for r in hub.requests if REPO in r[1]]


def test_download_then_cache_then_offline(hub, tmp_path):
    local = cli([*GENERATE, "--model", str(ASSET)], hub, tmp_path / "hf")
    assert local.returncode == 0 and local.stdout.strip(), local.stderr

    first = cli([*GENERATE, "--model", REPO], hub, tmp_path / "hf")
    assert first.returncode == 0, first.stderr
    assert first.stdout == local.stdout  # the same model, loaded fine
    assert hub.downloaded() == FETCHED  # not consolidated.safetensors, README.md
    # Progress in bytes, as plain lines: stderr is a pipe here.
    assert "downloading pocket/tiny: 9 files, 10.4 MiB\n" in first.stderr
    assert "downloading pocket/tiny: 10.4 MiB/10.4 MiB (100%), " in first.stderr
    assert first.stderr.count(", done\n") == 1
    assert "\r" not in first.stderr

    hub.requests.clear()
    second = cli([*GENERATE, "--model", REPO], hub, tmp_path / "hf")
    assert second.returncode == 0, second.stderr
    assert second.stdout == local.stdout
    assert repo_requests(hub) == []  # the cache first: not even the file list
    assert "download" not in second.stderr

    offline = cli([*GENERATE, "--model", REPO], hub, tmp_path / "hf", HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == local.stdout and repo_requests(hub) == []


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_hub_errors_are_one_line(hub, served, tmp_path):
    hub.add("gated/tiny", served, gated=True)
    home = tmp_path / "hf"
    line = one_line_error(cli(["info", "--model", "nobody/nothing"], hub, home))
    assert line == ("pocket-mlx info: error: repository nobody/nothing not found on the Hub (or "
                    "it is private/gated: log in with `hf auth login` or set HF_TOKEN)")
    line = one_line_error(cli(["info", "--model", "gated/tiny"], hub, home))
    assert f"gated/tiny is gated on the Hub: accept its terms at {hub.url}/gated/tiny" in line
    assert "hf auth login" in line
    line = one_line_error(cli(["info", "--model", f"{REPO}@v9"], hub, home))
    assert "revision 'v9' not found in pocket/tiny" in line
    line = one_line_error(cli(["info", "--model", REPO], hub, home, HF_HUB_OFFLINE="1"))
    assert "offline (HF_HUB_OFFLINE=1) and pocket/tiny is not in the cache" in line
    assert hub.file_requests() == []


def test_pinned_revision(hub, tmp_path):
    commit = hub.repos[REPO].commit
    r = cli(["info", "--model", f"{REPO}@{commit}"], hub, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert f"snapshots/{commit}" in r.stdout


def test_interrupted_download_names_the_file_and_a_rerun_continues(hub, tmp_path):
    hub.repos[REPO].broken.add("model.safetensors")  # the connection drops, every retry
    failed = cli(["info", "--model", REPO], hub, tmp_path / "hf")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    last = failed.stderr.splitlines()[-1]
    assert last.startswith("pocket-mlx info: error: downloading model.safetensors of "
                           "pocket/tiny failed (")
    assert last.endswith("rerun the same command to continue: finished files are kept")

    hub.repos[REPO].broken.clear()
    hub.requests.clear()
    rerun = cli(["info", "--model", REPO], hub, tmp_path / "hf")
    assert rerun.returncode == 0, rerun.stderr
    assert hub.downloaded() == {"model.safetensors"}  # the finished files were kept
    assert "downloading pocket/tiny: 1 file, 9.66 MiB" in rerun.stderr


def test_unreachable_hub_is_one_line(tmp_path):
    with StandInHub() as hub:
        pass  # closed: nothing listens on its port any more
    line = one_line_error(cli(["info", "--model", REPO], hub, tmp_path / "hf"))
    assert line.startswith(f"pocket-mlx info: error: cannot get the file list of pocket/tiny "
                           f"from {hub.url} (")
    assert "HF_HUB_OFFLINE=1" in line


def test_names_the_hub_refuses_are_one_line():
    for name in ("a/b..c", "a/b--c"):
        with pytest.raises(PocketError, match=f"no such model folder: {name}; nor is it a valid"):
            resolve_model_path(name)
    with pytest.raises(PocketError, match="no such model folder: ./nope"):
        resolve_model_path("./nope")


# -- local folders: the same choice of weight files -----------------------------------------
def test_local_folder_loads_only_the_index_shards(served):
    assert weight_files(served) == [served / "model.safetensors"]
    model, tok = load(served)
    assert tok.eos_token_ids and model.path == served


def test_weight_choice_and_broken_indexes(tmp_path):
    assert pick_weights({"model.safetensors", "consolidated.safetensors"}, None, "x") == [
        "model.safetensors"]
    assert pick_weights({"a.safetensors", "b.safetensors", "c.bin"}, None, "x") == [
        "a.safetensors", "b.safetensors"]
    index = {"weight_map": {"w1": "model-2.safetensors", "w2": "model-1.safetensors",
                            "w3": "model-2.safetensors"}}
    assert pick_weights({"model.safetensors"}, index, "x") == [
        "model-1.safetensors", "model-2.safetensors"]
    for bad in ({"weight_map": {}}, {"weight_map": {"w": "../x.safetensors"}},
                {"weight_map": {"w": "model.bin"}}, []):
        with pytest.raises(PocketError):
            pick_weights(set(), bad, "x")
    folder = tmp_path / "m"
    shutil.copytree(ASSET, folder)
    (folder / "model.safetensors").rename(folder / "model-1.safetensors")
    with pytest.raises(PocketError, match="names model.safetensors, which is not in"):
        weight_files(folder)


# -- progress -------------------------------------------------------------------------------
def test_progress_lines_in_a_pipe(monkeypatch):
    monkeypatch.setenv("POCKET_MLX_PROGRESS_INTERVAL", "0")
    out = io.StringIO()
    p = DownloadProgress(REPO, 600_000_000, 2, stream=out)
    p.bar.t0 -= 10  # as if 10 s had passed: the lines say how fast and how long is left
    with p.bar_class("model-00001.safetensors")(total=480_000_000, initial=0) as b:
        b.update(120_000_000)
        b.update(360_000_000)
    p.bar_class("model-00002.safetensors")(total=120_000_000, initial=0).update(120_000_000)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "downloading pocket/tiny: 2 files, 572 MiB"
    assert lines[1] == ("downloading pocket/tiny: 114 MiB/572 MiB (20%), 10 s, 11.4 MiB/s, "
                        "0:40 left, model-00001.safetensors")
    assert lines[2].startswith("downloading pocket/tiny: 458 MiB/572 MiB (80%), 10 s, 45.8 "
                               "MiB/s, 0:02 left, model-00001.safetensors")
    assert lines[3] == "downloading pocket/tiny: 572 MiB/572 MiB (100%), 10 s, 57.2 MiB/s, done"
    assert len(lines) == 4


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal():
    out = _Terminal()
    p = DownloadProgress(REPO, 20_000_000_000, 1, stream=out)
    p.bar_class("model.safetensors")(total=20_000_000_000).update(5_000_000_000)
    p.bar.refresh()
    text = out.getvalue()
    assert text.startswith("downloading pocket/tiny: 1 file, 18.6 GiB\n")
    assert "\rdownloading pocket/tiny:  25%|" in text
    assert "| 4.66 GiB/18.6 GiB [" in text and "model.safetensors]" in text
    p.close()  # a failed download: the bar is cleared for the error that follows
    assert out.getvalue().endswith("\r")


def test_repo_id_resolves_from_the_hf_cache_offline(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--pocket--tiny"
    snap = repo / "snapshots" / commit
    shutil.copytree(ASSET, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model, tok = load("pocket/tiny")
    assert str(model.path).startswith(str(snap)) and tok.eos_token_ids

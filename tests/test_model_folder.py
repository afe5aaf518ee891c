"""A model folder is read once per load (issue 26, point 6): `serve`, `generate` and `chat`
resolve it once and hand one ModelFolder down, so config.json and the weight index are each
opened one time, however many steps (model, tokenizer, window, memory plan, prompt-cache
fingerprint, chat header) need them."""

from __future__ import annotations

import builtins
import io
import json
import shutil
from pathlib import Path

import pytest

from pocket_mlx.config import INDEX, SINGLE, ModelFolder, safetensors_header
from pocket_mlx.errors import PocketError
from pocket_mlx.paths import default_model_path

SHARD = "model-00001-of-00001.safetensors"
WATCHED = ("config.json", INDEX)


@pytest.fixture
def folder(tmp_path) -> Path:
    """The bundled model as a sharded checkpoint (weights behind an index), so the index's
    reads are counted too."""
    out = tmp_path / "model"
    shutil.copytree(default_model_path(), out)
    (out / SINGLE).rename(out / SHARD)
    _, header = safetensors_header(out / SHARD)
    wmap = {k: SHARD for k in header if k != "__metadata__"}
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return out


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The names of the watched files each time one is opened (by `open` or `Path.open`/
    `read_text`, which go through `io.open`), for the test's duration."""
    seen: list[str] = []
    real = io.open

    def counting_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name in WATCHED and "r" in mode:
            seen.append(Path(file).name)
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    return seen


def test_generate_load_reads_the_folder_once(folder, reads):
    from pocket_mlx.cli import generate
    from pocket_mlx.cli.main import build_parser
    from pocket_mlx.tui.model_info import model_info

    args = build_parser().parse_args(
        ["generate", "--model", str(folder), "--device", "cpu", "-p", "hi"]
    )
    _, model, tokenizer = generate.load_for(args)
    model_info(model)  # the chat header's recipe and size: from the same folder
    assert sorted(reads) == sorted(WATCHED)
    assert model.folder.path == folder and tokenizer.encode("hi")


def test_serve_load_reads_the_folder_once(folder, reads, tmp_path):
    from pocket_mlx.server.worker import ServeWorker

    # A prompt-cache store too: it fingerprints the weight files when it opens.
    engine = ServeWorker(
        str(folder),
        "cpu",
        max_queue=0,
        prompt_cache_mb=8,
        prompt_cache_dir=tmp_path / "prompt-cache",
    )
    engine.start()
    try:
        assert sorted(reads) == sorted(WATCHED)
        assert engine.model_id == folder.name and engine.context > 0
        assert engine.metrics.planned_ram_bytes > 0
    finally:
        engine.stop()


def test_chat_reads_the_folder_once(folder, reads, tmp_path, monkeypatch):
    from pocket_mlx.cli.chat import make_app
    from pocket_mlx.cli.main import build_parser

    monkeypatch.setenv("POCKET_MLX_HOME", str(tmp_path / "home"))
    app = make_app(
        build_parser().parse_args(["chat", "--model", str(folder), "--prompt-cache-mb", "0"])
    )
    model, _ = app._model._load()  # what the app's engine thread runs
    assert sorted(reads) == sorted(WATCHED)
    assert model.folder is app.model_path


def test_a_folder_without_config_is_one_line(tmp_path):
    with pytest.raises(PocketError, match="has no config.json"):
        ModelFolder.read(tmp_path)

"""Loading by Hugging Face repo id goes through huggingface_hub's cache (offline here)."""

from __future__ import annotations

import shutil

from conftest import ASSET

from pocket_mlx.engine.loader import load


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

"""engine/worker.py's ModelWorker: the model loads and runs on the worker's own thread, jobs
arrive in order until None, a non-blocking look finds EMPTY, a load error reaches `start`, and
`stopped` ends a wait. (Its --distributed side runs in tests/test_distributed.py.)"""

from __future__ import annotations

import threading

import pytest

from pocket_mlx.engine.generation import generate
from pocket_mlx.engine.loader import default_model_path, load
from pocket_mlx.engine.worker import EMPTY, ModelWorker
from pocket_mlx.errors import PocketError


def test_jobs_run_on_the_thread_that_loaded_the_model():
    seen: list[tuple[str, str]] = []
    threads: dict[str, int] = {}

    def setup(model, tok):
        threads["load"] = threading.get_ident()
        return model, tok

    def serve(state):
        model, tok = state
        assert worker.get(block=False) is EMPTY
        while (prompt := worker.get()) is not None:
            threads["serve"] = threading.get_ident()
            seen.append((prompt, generate(model, tok, prompt, max_tokens=4, temperature=0.0,
                                          device="cpu", raw=True)))

    worker = ModelWorker(lambda: load(default_model_path(), device="cpu"))
    worker.start(serve, setup, name="test-worker")
    assert worker.model is not None and worker.error is None
    worker.put("Once upon a time")
    worker.put("The king")
    worker.put(None)
    worker.join(timeout=60)
    assert [p for p, _ in seen] == ["Once upon a time", "The king"]
    assert all(text for _, text in seen)
    assert threads["load"] == threads["serve"] != threading.get_ident()


def test_a_load_error_is_raised_by_start(tmp_path):
    worker = ModelWorker(lambda: load(tmp_path / "missing", device="cpu"))
    with pytest.raises(PocketError):
        worker.start(lambda state: None, lambda m, t: (m, t))
    assert worker.ready.is_set() and isinstance(worker.error, PocketError)


def test_stopped_ends_a_wait():
    worker = ModelWorker(lambda: (None, None), poll_s=0.01)
    stop = threading.Event()
    got: list = []
    t = threading.Thread(target=lambda: got.append(worker.get(stopped=stop.is_set)))
    t.start()
    stop.set()
    t.join(timeout=10)
    assert got == [None]

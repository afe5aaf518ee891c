"""In-process wired limit (`pocket_mlx.system.memory`) with a fake GPU device-info and setter."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from pocket_mlx.system import memory
from pocket_mlx.system.host import FakePlatform, RealPlatform, gpu_device_info
from pocket_mlx.system.memory import (
    recommended_working_set,
    wired_limit,
    wired_limit_status,
)

FIXTURES = Path(__file__).parent / "fixtures" / "macos"
GiB = 1 << 30
M2_PRO = {"device_name": "Apple M2 Pro", "max_recommended_working_set_size": 20 * GiB}


@pytest.fixture(autouse=True)
def _fresh_warning():
    memory.reset_warning()
    yield
    memory.reset_warning()


class Setter:
    """Stands in for mx.set_wired_limit: records calls, returns the previous limit."""

    def __init__(self, current: int = 0, fail: Exception | None = None) -> None:
        self.current, self.fail, self.calls = current, fail, []

    def __call__(self, limit: int) -> int:
        self.calls.append(limit)
        if self.fail:
            raise self.fail
        old, self.current = self.current, limit
        return old


def test_sets_and_restores():
    setter, warnings = Setter(current=123), []
    with wired_limit(GiB, "gpu", device_info=M2_PRO, warn=warnings.append, setter=setter):
        assert setter.calls == [20 * GiB]
    assert setter.calls == [20 * GiB, 123] and setter.current == 123
    assert warnings == []


def test_restores_on_error():
    setter = Setter()
    with pytest.raises(RuntimeError):
        with wired_limit(GiB, "gpu", device_info=M2_PRO, warn=print, setter=setter):
            raise RuntimeError("boom")
    assert setter.calls == [20 * GiB, 0]


def test_warns_once_per_process():
    warnings: list[str] = []
    big = int(0.95 * 20 * GiB)
    for _ in range(3):
        with wired_limit(big, "gpu", device_info=M2_PRO, warn=warnings.append, setter=Setter()):
            pass
    assert len(warnings) == 1
    assert "pocket-mlx wired --set auto" in warnings[0]
    assert "19.0 GiB" in warnings[0] and "20.0 GiB" in warnings[0]


def test_no_warning_at_ninety_percent():
    warnings: list[str] = []
    exact = int(0.9 * 20 * GiB)
    with wired_limit(exact, "gpu", device_info=M2_PRO, warn=warnings.append, setter=Setter()):
        pass
    assert warnings == []


def test_noop_on_cpu():
    setter, warnings = Setter(), []
    with wired_limit(100 * GiB, "cpu", device_info=M2_PRO, warn=warnings.append, setter=setter):
        pass
    assert setter.calls == [] and warnings == []


@pytest.mark.parametrize(
    "info", [{}, {"device_name": "x"}, {"max_recommended_working_set_size": 0}]
)
def test_noop_without_recommended_size(info):
    setter, warnings = Setter(), []
    with wired_limit(100 * GiB, "gpu", device_info=info, warn=warnings.append, setter=setter):
        pass
    assert setter.calls == [] and warnings == []


def test_setter_failure_warns_and_continues():
    setter, warnings, ran = Setter(fail=ValueError("above system limit")), [], []
    with wired_limit(GiB, "gpu", device_info=M2_PRO, warn=warnings.append, setter=setter):
        ran.append(True)
    assert ran == [True] and setter.calls == [20 * GiB]
    assert len(warnings) == 1 and "above system limit" in warnings[0]


def test_recommended_working_set():
    assert recommended_working_set(M2_PRO) == 20 * GiB
    assert recommended_working_set({}) is None


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="checks the no-GPU machine")
def test_real_mlx_without_gpu_is_noop():
    assert gpu_device_info() == {}
    with wired_limit(100 * GiB, "gpu"):  # real device info and real mx.set_wired_limit
        pass
    assert mx.set_wired_limit(0) == 0  # untouched


def fake(name: str) -> FakePlatform:
    return FakePlatform.from_file(FIXTURES / f"{name}.txt")


def test_wired_limit_status():
    assert wired_limit_status(fake("macos14-32gb")) == "wired default (iogpu.wired_limit_mb)"
    assert wired_limit_status(fake("macos15-64gb")) == "wired 56.0 GiB (iogpu.wired_limit_mb)"
    mac13 = fake("macos13-16gb")
    mac13.sysctl_write("debug.iogpu.wired_limit", 12 * GiB)
    assert wired_limit_status(mac13) == "wired 12.0 GiB (debug.iogpu.wired_limit)"
    assert wired_limit_status(fake("macos12-16gb")) is None
    assert wired_limit_status(fake("linux-64gb")) is None


@pytest.mark.skipif(not RealPlatform().system() == "Linux", reason="Linux check")
def test_wired_limit_status_real_linux():
    assert wired_limit_status(RealPlatform()) is None


@pytest.mark.parametrize("streams", [None, "cpu"])
def test_real_setter_and_synchronize_path(streams):
    """The default setter (mx.set_wired_limit) and the synchronize-before-restore run cleanly."""
    streams = [mx.default_stream(mx.cpu)] if streams else None
    info = {"max_recommended_working_set_size": GiB}
    with wired_limit(1, "gpu", device_info=info, warn=pytest.fail, streams=streams):
        mx.eval(mx.ones(4) + 1)

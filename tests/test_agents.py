"""Claude Code (2.1.332, npm @anthropic-ai/claude-code) headless against a real `pocket-mlx serve`
(issue 50) serving tests/fixtures/agent-model (scripts/make_agent_model.py): a tiny model with a
64k window and a tool-rendering chat template, trained on Claude Code's real prompts to answer
in one short line (the bundled model's random replies run to hundreds of tokens, which would
make a continued session's reuse a matter of luck). Every request Claude Code makes must be
answered 200 (serve's log), the model's reply printed, exit 0; a second new session in the same
folder must come >= 90% from the prompt cache and a continued one (`--continue`) >= 98%.

Skipped, naming the install line, where node or Claude Code is missing (.ci/run installs it).
Claude Code runs with HOME in a temporary folder (no user config is read or written), telemetry
and non-essential traffic off, pointed at 127.0.0.1 only, each run under a timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ASSET, ROOT
from test_server import Server

INSTALL = "npm install -g @anthropic-ai/claude-code@2.1.332"
CLAUDE = shutil.which("claude")
pytestmark = pytest.mark.skipif(CLAUDE is None or shutil.which("node") is None,
                                reason=f"Claude Code is not installed: {INSTALL}")
FIXTURE = ROOT / "tests" / "fixtures" / "agent-model"
MODEL = "agent-model"
WINDOW = 65536
HELLO = "Hello from pocket-mlx."
ANSWERED = re.compile(r" 200 POST /v1/messages \(stream\): (\d+) prompt tokens \((\d+) cached\)")


def agent_model(folder: Path) -> Path:
    """The fixture with the bundled model's tokenizer beside it."""
    shutil.copytree(FIXTURE, folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSET / f, folder / f)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = agent_model(tmp_path_factory.mktemp("models") / MODEL)
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(model),
               "--device", "cpu")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("project")


def claude(server: Server, home: Path, folder: Path, *args: str,
           timeout: float = 420) -> tuple[subprocess.CompletedProcess, list[tuple[int, int]]]:
    """Run `claude ARGS` in `folder`; its result and the (prompt, cached) tokens of each
    request it made, from serve's log."""
    before = len(server.log.read_text())
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8",
           "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.port}",
           "ANTHROPIC_AUTH_TOKEN": "pocket-mlx", "ANTHROPIC_MODEL": MODEL,
           "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(WINDOW),
           "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    t0 = time.monotonic()
    r = subprocess.run([CLAUDE, *args], cwd=folder, env=env, capture_output=True, text=True,
                       timeout=timeout)
    r.seconds = time.monotonic() - t0
    server.wait_idle(30)
    log = server.log.read_text()[before:]
    refused = [line for line in log.splitlines() if re.search(r" [45]\d\d [A-Z]+ /", line)]
    assert not refused, f"requests refused: {refused}\n{r.stderr}"
    return r, [(int(a), int(b)) for a, b in ANSWERED.findall(log)]


def test_first_session_then_from_the_cache(server, home, folder):
    r, first = claude(server, home, folder, "-p", "Say hello.")
    print(f"first session: {r.seconds:.1f} s")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == HELLO, r.stderr  # the model's reply, printed
    assert first and first[0][0] > 10_000, first  # Claude Code's real prompt
    # A new session in the same folder: everything up to the question is shared.
    r, second = claude(server, home, folder, "-p", "What is two plus two?")
    assert r.returncode == 0 and r.stdout.strip() == HELLO, r.stderr
    prompt, cached = second[0]
    assert cached >= 0.9 * prompt, second
    # The session continued: its whole previous prompt (and reply) is reused.
    r, cont = claude(server, home, folder, "-p", "--continue", "And three?")
    assert r.returncode == 0 and r.stdout.strip() == HELLO, r.stderr
    prompt, cached = cont[0]
    assert cached >= second[-1][0] - 8, (second, cont)
    assert cached >= 0.98 * prompt, cont
    print(f"claude -p: {first}; a second session: {second}; --continue: {cont}")


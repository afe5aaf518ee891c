"""Claude Code 2.1.332, Codex CLI 0.171.0 and opencode 1.18.33, unmodified and headless,
against a real `pocket-mlx serve` (issue 50), with the settings `pocket-mlx launch` gives them
(cli/agents.py), each in a fresh HOME and work folder, pointed at 127.0.0.1 only.

The model: tests/fixtures/agent-model/CLIENT (scripts/make_agent_model.py), a tiny model with a
64k window per client, trained on the prompts that client really sends (9-16k tokens) to answer
its trigger phrase with a call of its own shell tool (Claude Code's `Bash`, Codex's
`exec_command`, opencode's `bash`), the tool's result with "The file is written.", and anything
else with "Hello from pocket-mlx." So each test checks the whole path: the client's request
parsed, its prompt rendered, the call parsed out of the model's text and sent in the client's
wire format, the client running the tool (the file appears in its work folder) and sending the
result back, the sentence printed.

Every test fails on any 4xx or 5xx the server sent (its /metrics counts responses by status),
even where the client's own fallback would then succeed. Each client is skipped, naming its
install line, where node or the client is missing (.ci/run installs the pinned versions).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ASSET, ROOT
from test_server import Server

sys.path.insert(0, str(ROOT / "scripts"))
from agent_recorder import (  # noqa: E402
    DONE,
    HELLO,
    MODEL,
    TRIGGERS,
    client_command,
    installed,
    session_args,
)

FIXTURE = ROOT / "tests" / "fixtures" / "agent-model"
# npm package, pinned version and the endpoint each client speaks.
CLIENTS = {"claude": ("@anthropic-ai/claude-code", "2.1.332", "/v1/messages"),
           "codex": ("@openai/codex", "0.171.0", "/v1/responses"),
           "opencode": ("opencode-ai", "1.18.33", "/v1/chat/completions")}
TIMEOUT_S = 300  # one client run; a 16k-token prompt prefills in seconds on this model
DONE_LINE = re.compile(r"^pocket-mlx serve: (\d{3}) (\w+) (\S+)(?: \(stream\))?: (\d+) prompt "
                       r"tokens \((\d+) cached\)", re.M)


def binary(name: str) -> str:
    """The client's command, or a skip naming how to install it."""
    package, version, _ = CLIENTS[name]
    install = f"npm install --prefix ~/.cache/pocket-mlx-ci/agents {package}@{version}"
    if shutil.which("node") is None:
        pytest.skip(f"node is not installed (then: {install})")
    try:
        return installed([name])[name]
    except SystemExit:
        pytest.skip(f"{name} is not installed: {install}")


@pytest.fixture(scope="module", params=list(CLIENTS))
def client(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(tmp_path_factory, client):
    """serve on the client's fixture, with the bundled model's tokenizer beside it."""
    binary(client)  # skip before starting a server for a client that is not installed
    folder = tmp_path_factory.mktemp("models") / MODEL
    shutil.copytree(FIXTURE / client, folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSET / f, folder / f)
    # --temp 0: none of the clients sends a temperature, and the tiny model's replies are
    # checked to the token (greedy: its learnt reply); a request's own value would still win.
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(folder),
               "--device", "cpu", "--temp", "0")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


def refusals(server: Server) -> list[str]:
    """Every response with a 4xx or 5xx status the server has sent, from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [line for line in text.splitlines()
            if line.startswith("pocket_mlx_requests_total")
            and re.search(r'status="[45]\d\d"', line)]


class Run:
    """One client run in `work`: its output and the requests it made (from serve's log)."""

    def __init__(self, server: Server, client: str, work: Path, prompt: str,
                 resume: bool = False, tools: bool = False) -> None:
        home = work.parent / "home"
        home.mkdir(exist_ok=True)
        argv, env = client_command(client, binary(client), f"http://127.0.0.1:{server.port}", home,
                                   session_args(client, prompt, resume, tools))
        env["PWD"] = str(work)  # opencode takes its folder from PWD
        start = len(server.log.read_text())
        self.proc = subprocess.run(argv, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True, timeout=TIMEOUT_S)
        server.wait_idle(30)
        self.log = server.log.read_text()[start:]
        # (path, prompt tokens, cached tokens) of each request answered 200.
        self.requests = [(m[2], int(m[3]), int(m[4])) for m in DONE_LINE.findall(self.log)
                         if m[0] == "200"]
        out = self.proc.stdout.strip()
        assert self.proc.returncode == 0, (out[-2000:], self.proc.stderr[-3000:])
        assert self.requests, self.log[-2000:]
        assert not refusals(server), (refusals(server), self.log[-3000:])
        assert {p for p, _, _ in self.requests} == {CLIENTS[client][2]}, self.requests
        self.out = out

    def main(self) -> tuple[int, int]:
        """(prompt, cached) of the run's largest request: the agent's turn (opencode also
        asks for a title, with a short prompt of its own)."""
        _, prompt, cached = max(self.requests, key=lambda r: r[1])
        return prompt, cached


def test_sessions_from_the_cache(server, tmp_path, client):
    """A question's reply printed; a second new session in the same folder reuses >= 90% of
    its prompt, a continued one (claude -p --continue, codex exec resume --last, opencode run
    --continue) >= 98%."""
    work = tmp_path / "work"
    work.mkdir()
    first = Run(server, client, work, "Say hi")
    assert HELLO in first.out, first.proc.stderr[-2000:]
    assert first.main()[0] > 8000  # the client's own prompt, rendered with its tools
    second = Run(server, client, work, "Say hi")
    assert HELLO in second.out
    prompt, cached = second.main()
    assert cached >= 0.9 * prompt, second.requests
    again = Run(server, client, work, "And again", resume=True)
    assert HELLO in again.out
    prompt2, cached2 = again.main()
    assert cached2 >= 0.98 * prompt2, again.requests
    print(f"{client}: first {first.main()}, second session {cached}/{prompt} cached, "
          f"continued {cached2}/{prompt2}")


def test_tool_loop(server, tmp_path, client):
    """The trigger phrase: the model calls the client's shell tool, the client runs it (the
    file appears in its work folder) and sends the result back, the model's sentence is
    printed."""
    work = tmp_path / "work"
    work.mkdir()
    run = Run(server, client, work, TRIGGERS[client], tools=True)
    made = work / "agent-file.txt"
    assert made.is_file(), (run.out, run.proc.stderr[-3000:])
    assert made.read_text() == "made by pocket-mlx\n"
    assert DONE in run.out, (run.out, run.proc.stderr[-2000:])
    # The call's request, then the one carrying the tool's result (opencode's title too).
    assert len([r for r in run.requests if r[1] > 8000]) == 2, run.requests

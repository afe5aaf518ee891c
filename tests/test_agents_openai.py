"""Codex CLI and opencode, unmodified, headless against a real `pocket-mlx serve`: each prints
the model's reply and exits 0, no request of theirs is answered with a 4xx or 5xx (the
server's /metrics counts every response by status), and a second session in the same folder
and a continued one come from the prompt cache (the server's log says how much).

The model: the bundled pocket-tiny with its window raised to 64k (its rotary encoding does not
depend on the number) and a chat template that renders tools (scripts/tool_template.jinja),
so that the agents' 9-12k-token prompts fit; its replies are random text, which is all these
tests read. The clients come from npm at pinned versions (.ci/run installs them, best effort);
each test skips naming the install line when node or its client is missing. Claude Code's
tests are in tests/test_anthropic_agents.py, `pocket-mlx launch`'s in tests/test_launch.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from conftest import ASSET, ROOT
from test_server import Server

MODEL = "agent-tiny"
WINDOW = 65536
TEMPLATE = ROOT / "scripts" / "tool_template.jinja"
# npm package and pinned version of each client's command.
CLIENTS = {"codex": ("@openai/codex", "0.171.0"), "opencode": ("opencode-ai", "1.18.33")}
# Where .ci/run installs the clients (it also puts the folder on PATH); a client is looked for
# on PATH, then there, then in a scratch install.
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path(os.environ.get("HOME", "/tmp")) / ".cache")
AGENTS = CACHE / "pocket-mlx-ci" / "agents"
AGENT_DIRS = [AGENTS / "node_modules" / ".bin", Path("/tmp/agents/node_modules/.bin")]
TIMEOUT_S = 600  # one client run: a 12k-token prompt prefills in ~20 s on two cores
DONE = re.compile(r"^pocket-mlx serve: (\d{3}) (\w+) (\S+)(?: \(stream\))?: (\d+) prompt tokens "
                  r"\((\d+) cached\)", re.M)


def client(name: str) -> str:
    """The client's command, or a skip naming how to install it."""
    package, version = CLIENTS[name]
    install = f"npm install --prefix {AGENTS} {package}@{version}"
    if shutil.which("node") is None:
        pytest.skip(f"node is not installed (then: {install})")
    found = shutil.which(name) or next((str(d / name) for d in AGENT_DIRS
                                        if (d / name).is_file()), None)
    if found is None:
        pytest.skip(f"{name} is not installed: {install}")
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / MODEL
    shutil.copytree(ASSET, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": WINDOW}))
    shutil.copyfile(TEMPLATE, folder / "chat_template.jinja")
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(folder),
               "--device", "cpu")
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
    """One client run: its output and the generation requests it made (from the log)."""

    def __init__(self, server: Server, args: list[str], cwd: Path, env: dict) -> None:
        start = len(server.log.read_text())
        self.proc = subprocess.run(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True, timeout=TIMEOUT_S)
        log = server.log.read_text()[start:]
        # (path, prompt tokens, cached tokens) of each request answered.
        self.requests = [(m[2], int(m[3]), int(m[4])) for m in DONE.findall(log)
                         if m[0] == "200"]
        self.log = log

    def check(self, server: Server) -> None:
        out = self.proc.stdout.strip()
        assert self.proc.returncode == 0, (self.proc.stdout[-2000:], self.proc.stderr[-3000:])
        assert out, f"no reply printed: {self.proc.stderr[-3000:]}"
        assert self.requests, self.log[-2000:]
        assert not refusals(server), (refusals(server), self.log[-3000:])

    def main(self) -> tuple[int, int]:
        """(prompt, cached) of the run's largest request: the agent's turn (opencode also
        asks for a title, with a short prompt of its own)."""
        _, prompt, cached = max(self.requests, key=lambda r: r[1])
        return prompt, cached


def sessions(server: Server, make, tmp_path: Path) -> tuple[Run, Run, Run]:
    """A first session, a second new one in the same folder, a continued one: each checked;
    the second reuses >= 90% of its prompt, the continued one at least everything before the
    previous reply (the reply itself when its re-encoded tokens are the ones the model wrote:
    see docs/AGENTS.md)."""
    work = tmp_path / "work"
    work.mkdir()
    first = make("Say hi", work, False)
    first.check(server)
    second = make("Say hi", work, False)
    second.check(server)
    prompt, cached = second.main()
    assert cached >= 0.9 * prompt, (prompt, cached)
    again = make("And again", work, True)
    again.check(server)
    prompt2, cached2 = again.main()
    assert cached2 >= 0.9 * prompt2 and cached2 >= cached, (prompt2, cached2, prompt, cached)
    print(f"second session: {cached}/{prompt} cached; continued: {cached2}/{prompt2}")
    return first, second, again


def test_codex_exec(server, tmp_path):
    codex = client("codex")
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(home / ".codex")}
    provider = (f'{{name="pocket-mlx",base_url="{server.url}",wire_api="responses"}}')
    settings = ["-c", "model_provider=pocket", "-c", f"model_providers.pocket={provider}",
                "-c", f"model={MODEL}", "-c", f"model_context_window={WINDOW}",
                "-c", "analytics.enabled=false", "-c", "check_for_update_on_startup=false"]

    def make(prompt: str, work: Path, resume: bool) -> Run:
        args = [codex, "exec", "--skip-git-repo-check", *settings]
        args += ["resume", "--last", prompt] if resume else [prompt]
        return Run(server, args, work, env)

    first, _, _ = sessions(server, make, tmp_path)
    assert all(path == "/v1/responses" for path, _, _ in first.requests)
    assert first.main()[0] > 8000  # Codex's own prompt, rendered with its tools


def test_opencode_run(server, tmp_path):
    opencode = client("opencode")
    home = tmp_path / "home"
    home.mkdir()
    config = {"$schema": "https://opencode.ai/config.json", "model": f"pocket/{MODEL}",
              "autoupdate": False, "share": "disabled",
              "provider": {"pocket": {
                  "npm": "@ai-sdk/openai-compatible", "name": "pocket-mlx",
                  "options": {"baseURL": server.url},
                  "models": {MODEL: {"name": MODEL,
                                     "limit": {"context": WINDOW, "output": 4096}}}}}}
    env = {**os.environ, "HOME": str(home), "OPENCODE_CONFIG_CONTENT": json.dumps(config),
           "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
           "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1"}

    def make(prompt: str, work: Path, resume: bool) -> Run:
        args = [opencode, "run", "--pure", *(["--continue"] if resume else []), prompt]
        return Run(server, args, work, env)

    first, _, _ = sessions(server, make, tmp_path)
    assert all(path == "/v1/chat/completions" for path, _, _ in first.requests)
    assert first.main()[0] > 8000

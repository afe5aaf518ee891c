"""`pocket-mlx launch claude|codex|opencode`: the real command line, with a fake agent on PATH
(a script that records its arguments and environment, and asks the server it was pointed at
for its model while it runs), then with the real Claude Code when it is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from test_server import ENV, Server, free_port

FAKE = """#!{python}
import json, os, sys, urllib.request
base = (os.environ.get("ANTHROPIC_BASE_URL") or os.environ.get("FAKE_URL"))
seen = None
if base:
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        seen = json.load(r)["data"][0]["id"]
keys = [k for k in os.environ if k.startswith(("ANTHROPIC_", "CLAUDE_CODE_", "DISABLE_",
                                               "OPENCODE_", "POCKET_MLX_API"))]
out = {{"argv": sys.argv[1:], "env": {{k: os.environ[k] for k in keys}}, "served": seen}}
with open(os.environ["FAKE_AGENT_OUT"], "w") as f:
    json.dump(out, f)
print("fake reply")
sys.exit(int(os.environ.get("FAKE_AGENT_RC", "0")))
"""


@pytest.fixture
def fake_path(tmp_path):
    """A folder on PATH with fake claude, codex and opencode (and nothing else of theirs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("claude", "codex", "opencode"):
        exe = bin_dir / name
        exe.write_text(FAKE.format(python=sys.executable))
        exe.chmod(0o755)
    return bin_dir


def launch(*args: str, path: str, out: Path, timeout: float = 180,
           **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "launch", *args], cwd=ROOT,
                          env={**ENV, "PATH": path, "FAKE_AGENT_OUT": str(out), **env},
                          capture_output=True, text=True, timeout=timeout)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_starts_a_server_runs_the_agent_and_stops_it(fake_path, tmp_path):
    port, out = free_port(), tmp_path / "agent.json"
    r = launch("claude", "--port", str(port), "--", "-p", "hi", path=f"{fake_path}:/usr/bin:/bin",
               out=out, FAKE_AGENT_RC="3")
    assert r.returncode == 3, r.stderr  # the agent's status
    assert r.stdout == "fake reply\n"
    got = json.loads(out.read_text())
    assert got["argv"] == ["-p", "hi"] and got["served"] == "pocket-tiny"
    env = got["env"]
    assert env["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "pocket-tiny"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536"  # the bundled model, raised
    assert env["ANTHROPIC_API_KEY"] == "" and env["ANTHROPIC_AUTH_TOKEN"]
    assert env["DISABLE_TELEMETRY"] == "1" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"]
    assert "starting pocket-mlx serve" in r.stderr and "stopped the server" in r.stderr
    assert port_is_free(port)
    Path(r.stderr.split("its log: ")[-1].split(")")[0]).unlink()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--device", "cpu")
    yield s
    s.stop()


def test_uses_a_running_server_for_each_agent(fake_path, tmp_path, server):
    path = f"{fake_path}:/usr/bin:/bin"
    url = f"http://127.0.0.1:{server.port}"
    for agent in ("claude", "codex", "opencode"):
        out = tmp_path / f"{agent}.json"
        r = launch(agent, "--port", str(server.port), "--", "exec", "hi there", path=path,
                   out=out, FAKE_URL=url)
        assert r.returncode == 0, r.stderr
        assert "using the server" in r.stderr and "starting" not in r.stderr
        got = json.loads(out.read_text())
        assert got["served"] == "pocket-tiny" and got["argv"][-2:] == ["exec", "hi there"]
        if agent == "claude":
            assert got["env"]["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "2048"  # the served window
        elif agent == "codex":
            overrides = dict(a.split("=", 1) for a in got["argv"][1:-2:2])
            assert got["argv"][:-2:2] == ["-c"] * len(overrides)
            assert overrides["model"] == '"pocket-tiny"'
            assert overrides["model_provider"] == '"pocket-mlx"'
            assert f'base_url = "{url}/v1"' in overrides["model_providers.pocket-mlx"]
            assert 'wire_api = "responses"' in overrides["model_providers.pocket-mlx"]
            assert overrides["model_context_window"] == "2048"
            assert got["env"]["POCKET_MLX_API_KEY"]
        else:
            config = json.loads(got["env"]["OPENCODE_CONFIG_CONTENT"])
            provider = config["provider"]["pocket-mlx"]
            assert config["model"] == "pocket-mlx/pocket-tiny"
            assert provider["options"]["baseURL"] == f"{url}/v1"
            assert provider["models"]["pocket-tiny"]["limit"]["context"] == 2048
    assert server.health()["status"] == "ok"  # not stopped: it was not launch's


@pytest.mark.parametrize("args,path_has_agent,words", [
    (["claude"], False, "npm install -g @anthropic-ai/claude-code"),
    (["codex"], False, "npm install -g @openai/codex"),
    (["opencode"], False, "npm install -g opencode-ai"),
    (["claude", "--model", "other-model"], True, "serves pocket-tiny, not other-model"),
    (["claude", "-p", "hi"], True, "the agent's own arguments go after --"),
])
def test_refusals_are_one_line(fake_path, tmp_path, server, args, path_has_agent, words):
    path = f"{fake_path}:/usr/bin:/bin" if path_has_agent else "/usr/bin:/bin"
    if not path_has_agent and shutil.which(args[0], path=path):
        pytest.skip(f"{args[0]} is installed system-wide")
    r = launch(*args, "--port", str(server.port), path=path, out=tmp_path / "x.json")
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


REAL = {"claude": (["-p", "hi"], "@anthropic-ai/claude-code@2.1.332", "/v1/messages"),
        "codex": (["exec", "--skip-git-repo-check", "hi"], "@openai/codex@0.171.0",
                  "/v1/responses"),
        "opencode": (["run", "--pure", "hi"], "opencode-ai@1.18.33", "/v1/chat/completions")}


@pytest.mark.parametrize("agent", list(REAL))
def test_real_agent_prints_a_reply(tmp_path, agent):
    """`pocket-mlx launch AGENT -- ARGS` as on a fresh clone: the bundled model, started and
    stopped by launch, the agent's reply printed, every request answered 200."""
    args, package, path = REAL[agent]
    if shutil.which(agent) is None:
        pytest.skip(f"{agent} is not installed: npm install -g {package}")
    home = tmp_path / "home"
    home.mkdir()
    env = {**ENV, "HOME": str(home), "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "launch", agent, "--port",
                        str(free_port()), "--", *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), r.stderr
    log = Path(r.stderr.split("its log: ")[-1].split(")")[0])
    text = log.read_text()
    log.unlink()
    assert f" 200 POST {path}" in text, text
    assert not re.search(r" [45]\d\d [A-Z]+ /", text), text

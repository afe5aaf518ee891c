"""`pocket-mlx launch`'s machinery: the local server an agent talks to (used if it answers,
else started and stopped: `LocalServer`) and each agent's command line and environment
(`agent_command`).

Why flags and environment only: an agent's own config files are the user's (their other
providers, their keys); launch passes what the session needs where each agent reads it last
(Claude Code: environment; Codex: `-c` overrides; opencode: OPENCODE_CONFIG_CONTENT), so
nothing outlives the session. The names were read from the agents themselves (Claude Code
2.1.332, Codex CLI 0.171.0, opencode 1.18.33); docs/AGENTS.md lists them.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pocket_mlx.errors import PocketError, one_line
from pocket_mlx.paths import BUNDLED_MODEL, default_model_path

# agent -> (executable, npm package)
INSTALL = {"claude": ("claude", "@anthropic-ai/claude-code"),
           "codex": ("codex", "@openai/codex"),
           "opencode": ("opencode", "opencode-ai")}
AGENT_WINDOW = 65536  # the bundled model's window for an agent's 10-26k-token prompts
START_TIMEOUT_S = 900  # loading a 35B model from a cold disk takes minutes
KEY = "pocket-mlx"  # what agents send when the server asks no key (they insist on one)


def say(text: str) -> None:
    print(f"pocket-mlx launch: {text}", file=sys.stderr, flush=True)


def find_agent(agent: str) -> str:
    """The agent's executable on PATH, or a one-line error naming its npm install line."""
    exe, package = INSTALL[agent]
    found = shutil.which(exe)
    if found is None:
        raise PocketError(f"{exe} is not installed (not on PATH); install it with: "
                          f"npm install -g {package}")
    return found


def get(host: str, port: int, path: str, key: str | None, timeout: float = 5) -> dict | None:
    """GET `path` as JSON; None when nothing listens on the port."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        r = conn.getresponse()
        body = r.read()
    except ConnectionRefusedError:
        return None
    except OSError as e:
        raise PocketError(f"port {port}: {one_line(e)}") from None
    finally:
        conn.close()
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise PocketError(f"something other than pocket-mlx serve answers on port {port} "
                          f"(HTTP {r.status}); pick another --port")
    if r.status == 401:
        raise PocketError(f"the server on port {port} asks for an API key: pass --api-key")
    return data


class LocalServer:
    """The server on 127.0.0.1:`port`: the one answering there, else one started for `model`
    (stopped on exit). `info()`: its URL, model name and window."""

    def __init__(self, port: int, model: str | None, key: str | None) -> None:
        self.host, self.port, self.model, self.key = "127.0.0.1", port, model, key
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> LocalServer:
        health = get(self.host, self.port, "/health", self.key)
        if health is None:
            self._start()
        else:
            self._check_model()
            say(f"using the server on http://{self.host}:{self.port} ({health.get('model')})")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            say(f"stopped the server (its log: {self.log})")
        if self._tmp is not None:
            self._tmp.cleanup()

    def models(self) -> list[dict]:
        got = get(self.host, self.port, "/v1/models", self.key) or {}
        return [m for m in got.get("data", []) if isinstance(m, dict)]

    def _check_model(self) -> None:
        """A --model other than the running server's is an error, not a silent switch."""
        if self.model is None:
            return
        names = [m.get("id") for m in self.models()]
        if self.model not in names and Path(self.model).name not in names:
            raise PocketError(f"the server on port {self.port} serves {', '.join(map(str, names))}"
                              f", not {self.model}: stop it, or pick another --port to start one")

    def _start(self) -> None:
        model = self.model or str(default_model_path())
        if Path(model).resolve() == BUNDLED_MODEL.resolve():
            model = self._bundled_for_agents()
        self.log = Path(tempfile.mkstemp(prefix="pocket-mlx-launch-serve-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pocket_mlx", "serve", "--model", model,
               "--port", str(self.port)] + (["--api-key", self.key] if self.key else [])
        say(f"starting pocket-mlx serve for {model} on http://{self.host}:{self.port} "
            f"(its log: {self.log})")
        with self.log.open("w") as out:
            # Its own session: Ctrl-C in the agent's terminal is the agent's, not the server's.
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
                self.proc = None
                raise PocketError(f"pocket-mlx serve exited: {one_line(' '.join(tail))} "
                                  f"(log: {self.log})")
            try:
                if get(self.host, self.port, "/health", self.key, timeout=2) is not None:
                    return
            except PocketError:
                pass
            time.sleep(0.25)
        raise PocketError(f"pocket-mlx serve did not answer in {START_TIMEOUT_S} s "
                          f"(log: {self.log})")

    def _bundled_for_agents(self) -> str:
        """The bundled model with its window raised from 2048 to AGENT_WINDOW tokens (a copy
        of its config beside links to its files): agents' prompts are 10-26k tokens. It is a
        demonstration model; its replies are not meant to make sense."""
        self._tmp = tempfile.TemporaryDirectory(prefix="pocket-mlx-launch-")
        folder = Path(self._tmp.name) / BUNDLED_MODEL.name
        folder.mkdir()
        for f in BUNDLED_MODEL.iterdir():
            if f.name != "config.json":
                (folder / f.name).symlink_to(f.resolve())
        config = json.loads((BUNDLED_MODEL / "config.json").read_text())
        config["max_position_embeddings"] = AGENT_WINDOW
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        say(f"the bundled model's window is raised to {AGENT_WINDOW} tokens for this session")
        return str(folder)

    def info(self) -> dict:
        """The URL, model name, window and key an agent needs."""
        models = self.models()
        if not models:
            raise PocketError(f"the server on port {self.port} lists no model (GET /v1/models)")
        m = models[0]
        return {"url": f"http://{self.host}:{self.port}", "model": m["id"],
                "context": int(m.get("context_length") or AGENT_WINDOW),
                "key": self.key or KEY}

    def run_agent(self, argv: list[str], env: dict[str, str]) -> int:
        """Run the agent in this terminal and wait for it; Ctrl-C is the agent's to handle."""
        proc = subprocess.Popen(argv, env=env)
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return proc.wait()
        finally:
            signal.signal(signal.SIGINT, old)


def agent_command(agent: str, binary: str, info: dict, extra: list[str]
                  ) -> tuple[list[str], dict[str, str]]:
    """The agent's argv and environment for the server `info` describes."""
    env = dict(os.environ)
    if agent == "claude":
        env.update(claude_env(info))
        return [binary, *extra], env
    if agent == "codex":
        env["POCKET_MLX_API_KEY"] = info["key"]
        return [binary, *codex_overrides(info), *extra], env
    env.update(opencode_env(info))
    return [binary, *extra], env


def claude_env(info: dict) -> dict[str, str]:
    """Claude Code: the Anthropic endpoint, every model role on the served model (its
    background and sub-agent requests too), the window (an unknown model is otherwise
    assumed to have 1M tokens and never compacts in time), no telemetry or update checks."""
    name = info["model"]
    return {
        "ANTHROPIC_BASE_URL": info["url"], "ANTHROPIC_AUTH_TOKEN": info["key"],
        "ANTHROPIC_API_KEY": "",  # a key of the user's is not sent to this server
        "ANTHROPIC_MODEL": name, "ANTHROPIC_SMALL_FAST_MODEL": name,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": name, "ANTHROPIC_DEFAULT_SONNET_MODEL": name,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": name, "CLAUDE_CODE_SUBAGENT_MODEL": name,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(info["context"]),
        "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def codex_overrides(info: dict) -> list[str]:
    """Codex: a `pocket-mlx` model provider on the Responses API (Codex speaks only that),
    chosen with the model, its window and a compaction limit below it, as `-c` overrides."""
    provider = (f'{{name = "pocket-mlx", base_url = {json.dumps(info["url"] + "/v1")}, '
                f'wire_api = "responses", env_key = "POCKET_MLX_API_KEY"}}')
    pairs = [("model_provider", '"pocket-mlx"'), ("model_providers.pocket-mlx", provider),
             ("model", json.dumps(info["model"])),
             ("model_context_window", str(info["context"])),
             ("model_auto_compact_token_limit", str(info["context"] * 9 // 10)),
             ("analytics.enabled", "false"), ("check_for_update_on_startup", "false")]
    return [arg for k, v in pairs for arg in ("-c", f"{k}={v}")]


def opencode_env(info: dict) -> dict[str, str]:
    """opencode: an OpenAI-compatible provider (Chat Completions) with the model and its
    limits, as OPENCODE_CONFIG_CONTENT (merged over the user's config); no sharing, no
    update check, no model-list fetch."""
    name = info["model"]
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"pocket-mlx": {
            "npm": "@ai-sdk/openai-compatible", "name": "pocket-mlx",
            "options": {"baseURL": info["url"] + "/v1", "apiKey": info["key"]},
            "models": {name: {"name": name, "limit": {"context": info["context"],
                                                      "output": info["context"] // 4}}}}},
        "model": f"pocket-mlx/{name}", "share": "disabled", "autoupdate": False,
    }
    return {"OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_SHARE": "1"}

"""Record what Claude Code, Codex CLI and opencode send a server, as the server renders it:
the real HTTP app (server/app.py) in front of a scripted worker that answers each request as
the agent test model is to answer it (`reply_for`) and keeps the prompt's token ids.

Why the real app and not a stand-in of each wire format: the ids the worker gets are exactly
what `pocket-mlx serve` would prefill (each client's own parser, `fit_system_messages`, the
volatile lines left out, the template), and the scripted replies go out through the same
renderers (tool calls parsed out of the text), so a client's later requests (the tool's
result, a continued session) are the ones it will send to the trained model.
scripts/make_agent_model.py trains on what this records.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "assets" / "pocket-tiny"
TEMPLATE = ROOT / "scripts" / "tool_template.jinja"
WINDOW = 65536
MODEL = "agent-model"

COMMAND = "echo made by pocket-mlx > agent-file.txt"
HELLO = "Hello from pocket-mlx."
DONE = "The file is written."
# Each client's trigger phrase and the call of its own shell tool the model answers it with,
# in the template's tool-call format.
TRIGGERS = {"claude": "Please run the pocket-mlx file test.",
            "codex": "Please run the pocket-mlx shell check.",
            "opencode": "Please run the pocket-mlx bash job."}


def _call(function: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


# (The tools' optional arguments are left out: the fewer places the calls differ, the less
# the tiny model has to learn to tell them apart.)
CALLS = {"claude": _call("Bash", command=COMMAND),
         "codex": _call("exec_command", cmd=COMMAND),
         "opencode": _call("bash", command=COMMAND)}


def last_user_turn(prompt: str) -> str:
    """The text of the prompt's last user turn (the template renders tool results there)."""
    turns = prompt.split("<|im_start|>user\n")
    return turns[-1].split("<|im_end|>")[0] if len(turns) > 1 else ""


def reply_for(prompt: str) -> str:
    """What the model is to answer after `prompt` (rendered): the sentence after a tool's
    result, a client's call after its trigger phrase, the greeting otherwise."""
    turn = last_user_turn(prompt)
    if "<tool_response>" in turn:
        return DONE
    for client, trigger in TRIGGERS.items():
        if turn.strip().strip('"').endswith(trigger):  # opencode quotes the message
            return CALLS[client]
    return HELLO


@dataclass
class Recorded:
    client: str
    session: str
    ids: list[int]
    reply: str


def model_folder(where: Path) -> Path:
    """The bundled model's files with the agents' window and the tool template: the
    tokenizer and template the trained fixture ships with."""
    folder = where / MODEL
    shutil.copytree(ASSET, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = WINDOW
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copyfile(TEMPLATE, folder / "chat_template.jinja")
    return folder


class Recorder:
    """The real app on 127.0.0.1 with a scripted worker; `records` grows per request."""

    def __init__(self, folder: Path) -> None:
        import uvicorn

        from pocket_mlx.server.app import create_app
        from pocket_mlx.server.jobs import Done, Job, Piece, Started
        from pocket_mlx.server.worker import ServeWorker

        records: list[Recorded] = []
        self.records, self.label = records, ("", "")

        recorder = self

        class Scripted(ServeWorker):
            def submit(self, ids, request, loop: asyncio.AbstractEventLoop) -> Job:
                job = Job(self, ids, request, loop)
                reply = reply_for(self.tokenizer.decode(ids, skip_special_tokens=False))
                records.append(Recorded(*recorder.label, list(ids), reply))
                n = len(self.tokenizer.encode(reply, add_special_tokens=False)) + 1
                job.emit(Started(len(ids), 0))
                job.emit(Piece(reply))
                job.emit(Done("eos", len(ids), n, 0))
                return job

        self.worker = Scripted(str(folder), "cpu")
        self.worker.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(self.worker)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not self.server.started:
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.should_exit = True
        self.worker.stop()


def client_command(client: str, binary: str, url: str, home: Path, args: list[str],
                   model: str = MODEL) -> tuple[list[str], dict]:
    """How the tests run each client: launch's settings (cli/agents.py), a fresh HOME."""
    from pocket_mlx.cli.agents import agent_command

    info = {"url": url, "model": model, "context": WINDOW, "key": "pocket-mlx"}
    argv, env = agent_command(client, binary, info, args)
    env = {**env, "HOME": str(home), "LANG": "C.UTF-8"}
    if client == "codex":
        env["CODEX_HOME"] = str(home / ".codex")
        (home / ".codex").mkdir(parents=True, exist_ok=True)
    if client == "opencode":
        env.update(OPENCODE_DISABLE_LSP_DOWNLOAD="1", OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
                   OPENCODE_DISABLE_CLAUDE_CODE="1")
    return argv, env


def session_args(client: str, prompt: str, resume: bool = False, tools: bool = False
                 ) -> list[str]:
    """One headless session's arguments (the tests' own)."""
    if client == "claude":
        return ["-p", *(["--continue"] if resume else []),
                *(["--allowedTools", "Bash"] if tools else []), "--", prompt]
    if client == "codex":
        flags = ["--skip-git-repo-check"]
        if tools:
            flags.append("--dangerously-bypass-approvals-and-sandbox")
        return ["exec", *flags, *(["resume", "--last"] if resume else []), prompt]
    return ["run", "--pure", *(["--continue"] if resume else []), prompt]


# What is recorded per client: (label, prompt, continue the last session, tools allowed).
SESSIONS = [("hello", "Say hi", False, False), ("again", "Say hi", False, False),
            ("continued", "And again", True, False)]


def record(clients: dict[str, str], timeout: float = 300) -> list[Recorded]:
    """Each client's sessions and its tool loop, in a fresh HOME and work folder each."""
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(model_folder(Path(tmp)))
        try:
            for client, binary in clients.items():
                home, work = Path(tmp) / f"home-{client}", Path(tmp) / f"work-{client}"
                home.mkdir()
                work.mkdir()
                plan = SESSIONS + [("tools", TRIGGERS[client], False, True)]
                for label, prompt, resume, tools in plan:
                    rec.label = (client, label)
                    argv, env = client_command(client, binary, rec.url, home,
                                               session_args(client, prompt, resume, tools))
                    env["PWD"] = str(work)  # opencode takes its folder from PWD, not getcwd
                    r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                                       timeout=timeout, stdin=subprocess.DEVNULL)
                    if r.returncode != 0:
                        raise SystemExit(f"{client} {label} failed ({r.returncode}): "
                                         f"{r.stdout[-500:]} {r.stderr[-1500:]}")
                    print(f"{client} {label}: {r.stdout.strip()[-200:]!r}")
                if not (work / "agent-file.txt").is_file():
                    raise SystemExit(f"{client}: the tool loop did not write its file")
        finally:
            rec.stop()
    return rec.records


def variants(text: str, n: int) -> list[str]:
    """`text` with its dates and temporary folders changed, `n` ways (what differs between
    the recording and a test run)."""
    out = []
    for i in range(n):
        t = re.sub(r"\b20\d\d-\d\d-\d\d\b", f"20{27 + i}-0{1 + i % 9}-{10 + 3 * i}", text)
        t = re.sub(r"/tmp/tmp[\w]+/", f"/tmp/pytest-of-user/pytest-{3 + 17 * i}/"
                   f"test_{['claude', 'codex', 'opencode', 'loop'][i % 4]}_{i}0/", t)
        out.append(t)
    return out


def installed(clients=("claude", "codex", "opencode")) -> dict[str, str]:
    """Each client's executable: on PATH or where .ci/run installs them."""
    bins = {}
    for c in clients:
        found = shutil.which(c) or next((str(d / c) for d in (
            Path.home() / ".cache/pocket-mlx-ci/agents/node_modules/.bin",
            Path("/tmp/agents/node_modules/.bin")) if (d / c).is_file()), None)
        if not found:
            raise SystemExit(f"{c} is not installed (.ci/run installs the pinned versions)")
        bins[c] = found
    return bins


def main() -> None:
    import argparse
    import pickle

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="where to write the records (pickle)")
    ap.add_argument("--clients", default="claude,codex,opencode")
    args = ap.parse_args()
    os.environ.setdefault("POCKET_MLX_KEEPALIVE_S", "10")
    records = record(installed(args.clients.split(",")))
    args.out.write_bytes(pickle.dumps(records))
    for r in records:
        print(f"{r.client:8} {r.session:9} {len(r.ids):6} tokens -> {r.reply[:40]!r}")


if __name__ == "__main__":
    main()

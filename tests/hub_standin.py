"""A small local stand-in for the Hugging Face Hub, for tests (127.0.0.1, any free port).

It speaks just what huggingface_hub's `model_info` and `hf_hub_download` use, as the Hub does:
  GET       /api/models/{repo}[/revision/{rev}]   repo info: sha (commit) and siblings with sizes
  HEAD, GET /{repo}/resolve/{rev}/{file}          ETag, X-Repo-Commit, Content-Length (+ Range)
with the Hub's error headers: 404 `X-Error-Code: RepoNotFound` for an unknown repo, 401
`GatedRepo` for a gated one, 404 `RevisionNotFound`, 404 `EntryNotFound`. Every request is
logged in `requests` as (method, path), so a test can say what was (not) fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    folder: Path
    commit: str
    gated: bool = False
    broken: set[str] = field(default_factory=set)  # files whose GET drops the connection

    def files(self) -> dict[str, Path]:
        return {p.name: p for p in sorted(self.folder.iterdir()) if p.is_file()}


class StandInHub:
    """`with StandInHub() as hub: hub.add("user/repo", folder); ... hub.url`"""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo: str, folder: Path, gated: bool = False) -> Repo:
        commit = hashlib.sha1(repo.encode()).hexdigest()  # 40 hex digits, like a git commit
        self.repos[repo] = Repo(Path(folder), commit, gated)
        return self.repos[repo]

    def log(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def file_requests(self) -> list[tuple[str, str]]:
        """Requests for files (HEAD or GET of /resolve/), not the repo-info API."""
        return [r for r in self.requests if "/resolve/" in r[1]]

    def downloaded(self) -> set[str]:
        """Names of the files whose content was requested (GET)."""
        return {p.rsplit("/", 1)[-1] for m, p in self.requests if m == "GET" and "/resolve/" in p}

    def __enter__(self) -> StandInHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: StandInHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: simple and enough

        def log_message(self, *args) -> None:  # quiet: the test reads `hub.requests`
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _error(self, status: int, code: str, message: str, commit: str | None = None):
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _repo(self, name: str, rev: str) -> Repo | None:
            repo = hub.repos.get(name)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
            elif repo.gated:
                self._error(401, "GatedRepo", f"Access to model {name} is restricted.")
            elif rev not in ("main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            else:
                return repo
            return None

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.log(self.command, path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) in (4, 6):
                rev = parts[5] if len(parts) == 6 else "main"
                if (repo := self._repo("/".join(parts[2:4]), rev)) is not None:
                    self._info("/".join(parts[2:4]), repo)
            elif len(parts) >= 5 and parts[2] == "resolve":
                if (repo := self._repo("/".join(parts[:2]), parts[3])) is not None:
                    self._file(repo, "/".join(parts[4:]), body)
            else:
                self._error(404, "NotFound", f"no route {path}")

        def _info(self, name: str, repo: Repo) -> None:
            siblings = [{"rfilename": n, "size": p.stat().st_size}
                        for n, p in repo.files().items()]
            data = json.dumps({"id": name, "sha": repo.commit, "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _file(self, repo: Repo, name: str, body: bool) -> None:
            file = repo.files().get(name)
            if file is None:
                self._error(404, "EntryNotFound", f"{name} does not exist", repo.commit)
                return
            data = file.read_bytes()
            start = 0
            rng = self.headers.get("Range", "")
            if body and rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
                start = int(rng[6:].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if name in repo.broken:  # the connection drops before the first byte
                self.close_connection = True
                return
            self.wfile.write(data[start:])

    return Handler

"""The server's layers: wire formats are pure parsers and renderers, the HTTP side never reaches
the model's thread, and a request is validated once, where its wire format is parsed.

Why: every wire format (OpenAI, Anthropic, Responses, Ollama) parses into server/requests.py's
`GenRequest` and renders server/jobs.py's reply events; if one imported MLX or the worker, the
HTTP side would load the model's stack to check a body, and a new format would copy the
engine's knowledge instead of the request model's.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from conftest import ROOT

from pocket_mlx.server.openai import parse_chat
from pocket_mlx.server.requests import ApiError, Sampling

SERVER = ROOT / "pocket_mlx" / "server"
# Parsers and renderers of a wire format, and what they share.
WIRE = ["openai", "anthropic", "responses", "ollama", "embeddings", "wire", "requests",
        "events"]
# The HTTP side: everything but the worker itself and the prompt code it calls.
HTTP = ["app", "routes_openai", "routes_anthropic", "routes_responses", "routes_ollama",
        "routes_embeddings", "replies", "streaming", "state", "errors", "auth", "page", "jobs",
        "metrics", "events"]


def imports(module: str) -> set[str]:
    """Every module a server module names in an import, anywhere in its source."""
    tree = ast.parse((SERVER / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def present(names: list[str]) -> list[str]:
    return [m for m in names if (SERVER / f"{m}.py").exists()]


@pytest.mark.parametrize("module", present(WIRE))
def test_wire_modules_import_no_mlx_and_no_engine(module):
    bad = sorted(n for n in imports(module)
                 if n.split(".")[0] == "mlx" or n.startswith("pocket_mlx.server.worker")
                 or (n.startswith("pocket_mlx.engine") and module != "requests"))
    assert not bad, f"server/{module}.py imports {bad}"


@pytest.mark.parametrize("module", present(HTTP))
def test_http_modules_do_not_import_the_worker(module):
    bad = sorted(n for n in imports(module) if n.startswith("pocket_mlx.server.worker"))
    assert not bad, f"server/{module}.py imports the serve worker's module: {bad}"


def test_importing_the_http_side_loads_no_mlx():
    """Transitively too: the app and every wire format import without MLX."""
    mods = [f"pocket_mlx.server.{m}" for m in present(WIRE + HTTP)]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods) +
            "bad = sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.') "
            "or m == 'pocket_mlx.server.worker')\nprint(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_sampling_is_typed_and_checked_at_parse_time():
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5,
                      "top_k": 3, "repeat_penalty": 1.1})
    assert req.sampling == Sampling(temperature=0.5, top_k=3, repetition_penalty=1.1)
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "temperature": -1})
    assert e.value.status == 400
    assert e.value.message == ("temperature: temperature must be a finite number >= 0 "
                               "(0 = greedy), got -1")
    with pytest.raises(AttributeError):  # frozen: nothing changes it after the check
        req.sampling.temperature = -1  # type: ignore[misc]


def test_the_worker_does_not_validate_sampling_again():
    """The worker builds the engine's SamplingParams from the checked values as they are."""
    source = (SERVER / "worker.py").read_text()
    assert "SamplingParams(**req.sampling.keywords())" in source
    assert ".validate()" not in source


def test_serve_sampling_defaults_fill_only_what_the_request_left_out():
    """`serve --temp 0 --top-k 5`: a request without them gets them, one that sets them keeps
    its own (as llama.cpp's server); the engine never sees the bookkeeping."""
    served = {"temperature": 0.0, "top_k": 5}
    bare = parse_chat({"messages": [{"role": "user", "content": "hi"}]}).sampling
    assert bare.temperature == 1.0 and bare.given == frozenset()
    assert bare.under(served).temperature == 0.0 and bare.under(served).top_k == 5
    own = parse_chat({"messages": [{"role": "user", "content": "hi"}],
                      "temperature": 0.7}).sampling
    assert own.given == {"temperature"}
    assert own.under(served).temperature == 0.7 and own.under(served).top_k == 5
    assert "given" not in own.keywords()


def test_serve_sampling_flags_are_checked_and_kept_for_launchd():
    from pocket_mlx.cli.main import build_parser
    from pocket_mlx.cli.serve import launchd_argv

    args = build_parser().parse_args(["serve", "--temp", "0", "--repeat-penalty", "1.1"])
    argv = launchd_argv(args)
    assert argv[argv.index("--temp") + 1] == "0.0" and "--repeat-penalty" in argv
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "serve", "--temp", "-1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--temp" in r.stderr and "Traceback" not in r.stderr

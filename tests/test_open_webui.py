"""Open WebUI 0.12.4 with only its Ollama connection, pointed at a real `pocket-mlx serve`, driven
in headless Chromium: the served model is listed and selected, and a typed message gets a
streamed reply (the reply's text grows over several DOM updates; serve logs a streamed
POST /api/chat).

Skipped unless POCKET_OPEN_WEBUI names an `open-webui` executable: Open WebUI installs ~7 GB
(torch, CUDA libraries, chromadb, ...), so it lives in a virtual environment of its own, never
in the project's:

    python3.11 -m venv /tmp/owui-venv && /tmp/owui-venv/bin/pip install open-webui==0.12.4
    POCKET_OPEN_WEBUI=/tmp/owui-venv/bin/open-webui python -m pytest tests/test_open_webui.py

Open WebUI runs offline (no model downloads, no update check, no telemetry), with a fresh data
folder and HOME, and Chromium resolves no host but 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request

import pytest
from test_chat_page import chromium
from test_server import Server, free_port

MODEL = "pocket-tiny"
EXE = os.environ.get("POCKET_OPEN_WEBUI")
pytestmark = pytest.mark.skipif(
    not EXE or not os.access(EXE, os.X_OK),
    reason="set POCKET_OPEN_WEBUI to an open-webui 0.12.4 executable (see the docstring)")


def owui_env(tmp, ollama_url: str) -> dict:
    home = tmp / "home"
    home.mkdir()
    return {
        "PATH": os.environ["PATH"], "HOME": str(home), "DATA_DIR": str(tmp / "data"),
        "WEBUI_AUTH": "False", "WEBUI_SECRET_KEY": "local-test-secret",
        "ENABLE_OLLAMA_API": "true", "OLLAMA_BASE_URL": ollama_url, "ENABLE_OPENAI_API": "false",
        "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "RAG_EMBEDDING_ENGINE": "ollama", "RAG_EMBEDDING_MODEL": f"{MODEL}:latest",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false", "RAG_RERANKING_MODEL_AUTO_UPDATE": "false",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "true", "WHISPER_MODEL_AUTO_UPDATE": "false",
        "ENABLE_VERSION_UPDATE_CHECK": "false", "ANONYMIZED_TELEMETRY": "false",
        "DO_NOT_TRACK": "true", "SCARF_NO_ANALYTICS": "true", "USER_AGENT": "pocket-mlx-test",
        "ENABLE_TITLE_GENERATION": "false", "ENABLE_FOLLOW_UP_GENERATION": "false",
        "ENABLE_TAGS_GENERATION": "false", "ENABLE_AUTOCOMPLETE_GENERATION": "false",
        "ENABLE_WEB_SEARCH": "false", "ENABLE_CODE_INTERPRETER": "false",
        "ENABLE_IMAGE_GENERATION": "false", "ENABLE_EVALUATION_ARENA_MODELS": "false",
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("owui")
    serve = Server(tmp / "serve.log", "--max-queue", "4")
    port = free_port()
    log = (tmp / "owui.log").open("w")
    proc = subprocess.Popen([EXE, "serve", "--host", "127.0.0.1", "--port", str(port)],
                            env=owui_env(tmp, f"http://127.0.0.1:{serve.port}"), cwd=tmp,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # its first start migrates a fresh database
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / "owui.log").read_text()[-3000:]
        try:
            if urllib.request.urlopen(url + "/api/config", timeout=5).status == 200:
                break
        except OSError:
            time.sleep(1)
    else:
        raise AssertionError("Open WebUI did not start in 300 s")
    yield url, serve
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    serve.stop()
    assert "Traceback" not in serve.log.read_text()


def test_open_webui_lists_the_model_and_streams_a_reply(stack):
    from playwright.sync_api import sync_playwright

    url, serve = stack
    exe = chromium()
    if exe is None:
        pytest.skip("needs a Chromium: apt-get install chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=[
            "--no-sandbox", "--disable-dev-shm-usage",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
        try:
            pg = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            pg.set_default_timeout(120_000)
            pg.goto(url + "/")
            pg.wait_for_selector("#chat-input")
            time.sleep(3)
            if pg.get_by_text("Okay, Let's Go!").count():  # the release notes, first visit
                pg.get_by_text("Okay, Let's Go!").click()
            # The model comes from serve's /api/tags, selected as Ollama names it.
            assert f"{MODEL}:latest" in pg.inner_text("body")
            pg.evaluate("""() => { window.lens = []; new MutationObserver(() => {
                const el = document.querySelector('#response-content-container');
                if (el && window.lens[window.lens.length - 1] !== el.innerText.length)
                    window.lens.push(el.innerText.length);
            }).observe(document.body, {childList: true, subtree: true, characterData: true});
            }""")
            pg.click("#chat-input")
            pg.keyboard.type("Tell me a long story about the sea.")
            pg.keyboard.press("Enter")
            deadline = time.monotonic() + 120  # serve logs the reply's end; then the page's
            while "POST /api/chat (stream)" not in serve.log.read_text():
                assert time.monotonic() < deadline, serve.log.read_text()[-2000:]
                time.sleep(0.2)
            pg.wait_for_function("n => window.lens.length && window.lens.at(-1) > 0", arg=0)
            time.sleep(2)
            reply = pg.inner_text("#response-content-container")
            lens = pg.evaluate("window.lens")
        finally:
            browser.close()
    assert reply.strip()
    # Streamed: the browser saw the reply grow through several lengths before its last.
    assert len([n for n in lens if 0 < n < lens[-1]]) >= 2, lens
    assert "POST /api/chat (stream)" in serve.log.read_text()

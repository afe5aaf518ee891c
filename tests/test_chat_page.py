"""The browser chat page of `pocket-mlx serve` (GET / and /chat, server/page.py): served as one
self-contained HTML file over plain HTTP, then driven in a real headless Chromium by Playwright
against a real server process on the bundled model.

The browser tests skip where Playwright or a Chromium is missing (apt-get install chromium;
pip install playwright): Playwright's own browser download is not used, the system Chromium is
launched by path. One keyless server and one --api-key server serve the whole module, each
started on first use."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time

import pytest
from conftest import ROOT
from test_server import MODEL, Server, scrape

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

KEY = "page-s3cret"
INSTALL = "install: apt-get install chromium && pip install playwright"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-default-apps",
]
# At temperature 0 the bundled model answers this with a reply past 300 tokens in both CPU
# layouts (panels and rows; "def main():" ended after 21 tokens with panels): time enough to
# press Stop mid-reply.
ENDLESS = "Count from 1 to 200."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("page") / "serve.log")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("page-key") / "serve.log", "--api-key", KEY)
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


# ---- plain HTTP: these always run ---------------------------------------------------------

# What a browser asks for; without text/html, GET / answers Ollama's liveness probe instead.
BROWSER = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


def test_page_served_at_root_and_chat(server):
    pages = [server.request("GET", path, headers=BROWSER) for path in ("/", "/chat")]
    for status, headers, body in pages:
        assert status == 200
        assert headers["content-type"] == "text/html; charset=utf-8"
        assert "connect-src 'self'" in headers["content-security-policy"]
        assert "<script>" in body["text"] and "/v1/chat/completions" in body["text"]
    assert pages[0][2] == pages[1][2]


def test_page_names_no_other_host(server):
    """Nothing in the page points off this server: no absolute URL, no protocol-relative
    src/href, no @import, so it works offline and tells no one else what is typed."""
    html = server.request("GET", "/", headers=BROWSER)[2]["text"]
    assert re.findall(r"(?i)\b(?:https?|wss?|ftp):", html) == []
    assert re.findall(r"""(?i)(?:src|href|action)\s*=\s*["']?//""", html) == []
    assert re.findall(r"(?i)@import|url\(", html) == []
    assert re.findall(r"(?i)\b(?:src|href)\s*=\s*[\"'](?!data:)", html) == []


def test_page_needs_no_key_but_the_api_does(keyed):
    for path in ("/", "/chat"):
        status, headers, _ = keyed.request("GET", path, headers=BROWSER)
        assert status == 200 and headers["content-type"].startswith("text/html")
    assert keyed.request("GET", "/v1/models")[0] == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert keyed.request("GET", "/v1/models", headers=auth)[0] == 200


def test_page_is_package_data():
    """A non-editable install carries the page: pyproject's package-data globs match it."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["pocket_mlx.server"]
    server_dir = ROOT / "pocket_mlx" / "server"
    shipped = {p for g in globs for p in server_dir.glob(g)}
    assert server_dir / "static" / "chat.html" in shipped


# ---- in a headless Chromium ------------------------------------------------------------------


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(f"the browser tests need Playwright; {INSTALL}")
    exe = chromium()
    if exe is None:
        pytest.skip(f"the browser tests need a Chromium; {INSTALL}")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A fresh browser context (its own localStorage) on the chat page, every request and
    script error recorded."""

    def __init__(self, browser, server: Server) -> None:
        self.origin = f"http://127.0.0.1:{server.port}"
        self.context = browser.new_context()
        self.page = self.context.new_page()
        self.page.set_default_timeout(20_000)
        self.requests: list = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(self.origin + "/")

    def wait_model(self) -> None:
        self.page.wait_for_function(
            f"() => document.getElementById('model').textContent === '{MODEL}'"
        )

    def settings(self, **values: str) -> None:
        self.page.click("#toggle-settings")
        for k, v in values.items():
            self.page.fill(f"#{k}", v)
        self.page.click("#toggle-settings")

    def send(self, *lines: str) -> None:
        """Typed key by key; Shift+Enter between lines, Enter at the end."""
        box = self.page.locator("#input")
        box.click()
        for i, line in enumerate(lines):
            if i:
                box.press("Shift+Enter")
            box.press_sequentially(line)
        box.press("Enter")

    def wait_done(self) -> None:
        self.page.wait_for_selector("#send:not([hidden])")

    def messages(self) -> list[tuple[str, str]]:
        return [
            tuple(m)
            for m in self.page.eval_on_selector_all(
                "#log .msg",
                "ns => ns.map(n => [n.classList[1], n.querySelector('.body').innerText])",
            )
        ]

    def stats(self) -> list[str]:
        return self.page.eval_on_selector_all("#log .msg .stats", "ns => ns.map(n => n.innerText)")

    def close(self) -> list[str]:
        """Every URL the page requested; all must be on this server."""
        self.context.close()
        assert self.errors == []
        urls = [r.url for r in self.requests]
        assert urls and all(u.startswith(self.origin + "/") for u in urls), urls
        return urls


@pytest.fixture
def page(browser, server):
    p = Page(browser, server)
    yield p
    p.close()


# As the TUI shows them; prefill needs the prompt's size, which only a finished reply's usage
# gives.
STATS = re.compile(
    r"^TTFT \d+\.\d\d s · (prefill [\d,]+ tok/s · )?decode \d+\.\d tok/s · "
    r"(\d+) tokens"
)


def test_streams_stops_and_keeps_the_conversation(page, server):
    pg = page.page
    page.wait_model()
    assert "2,048-token window" in pg.text_content("#window")
    page.settings(temperature="0")
    # Every change of the reply's text while it streams is one DOM mutation batch here.
    pg.evaluate("""() => { window.updates = 0; new MutationObserver(() => window.updates++)
        .observe(document.getElementById('log'), {childList: true, subtree: true}); }""")
    before = scrape(server)["pocket_mlx_cancelled_total"]
    page.send(ENDLESS)
    pg.wait_for_function("() => window.updates >= 8")
    assert pg.is_visible("#stop") and not pg.is_visible("#send")
    partial = page.messages()[-1][1]
    assert page.messages()[0] == ("user", ENDLESS) and len(partial) > 0
    pg.click("#stop")
    page.wait_done()
    deadline = time.monotonic() + 10
    while scrape(server)["pocket_mlx_cancelled_total"] < before + 1:
        assert time.monotonic() < deadline, "the server never counted the cancellation"
        time.sleep(0.05)
    server.wait_idle(5)
    assert "the client went away; stopped" in server.log.read_text()
    stopped = page.messages()[-1][1]
    assert len(stopped) >= len(partial)
    first = page.stats()[-1]
    assert STATS.match(first) and first.endswith(" tokens · stopped"), first

    # Shift+Enter breaks the line; Enter sends. A capped reply ends on its own.
    page.settings(max_tokens="12")
    page.send("Say hello", "in two words")
    page.wait_done()
    msgs = page.messages()
    assert msgs[2] == ("user", "Say hello\nin two words") and msgs[3][0] == "assistant"
    m = STATS.match(page.stats()[-1])
    assert m and m.group(1) and 1 <= int(m.group(2)) <= 12, page.stats()

    # A reload shows the same conversation, settings and chat list, from localStorage.
    pg.reload()
    page.wait_model()
    assert page.messages() == msgs
    assert pg.eval_on_selector_all("#chats li", "ns => ns.map(n => n.innerText)")[0].startswith(
        ENDLESS
    )
    assert pg.input_value("#temperature") == "0" and pg.input_value("#max_tokens") == "12"

    # New chat: an empty page and a second entry; the first one opens again.
    pg.click("#new")
    assert page.messages() == [] and pg.locator("#chats li").count() == 2
    pg.locator("#chats li", has_text=ENDLESS).click()
    assert page.messages() == msgs


def test_markdown_is_rendered_and_html_escaped(page):
    page.wait_model()
    src = (
        "## Plan\n\nSome **bold**, *italic*, *i* and `x < y` in a snake_case_name.\n\n"
        "- one\n- two\n\n3. first\n4. second\n\n```python\nif a < b:\n    print('<b>')\n```\n"
        '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
        '`<img src=y onerror="window.pwned=3">`'
    )
    got = page.page.evaluate(
        """src => {
        const d = document.createElement('div');
        d.innerHTML = window.pocketChat.renderMarkdown(src);
        document.body.append(d);
        const q = s => [...d.querySelectorAll(s)].map(n => n.textContent);
        return {h2: q('h2'), strong: q('strong'), em: q('em'), code: q('p code'),
                ul: q('ul li'), ol: q('ol li'), pre: q('pre code'),
                lang: d.querySelector('pre').dataset.lang, start: d.querySelector('ol').start,
                unsafe: d.querySelectorAll('img, script, [onerror]').length,
                text: d.textContent};
    }""",
        src,
    )
    assert got["h2"] == ["Plan"] and got["strong"] == ["bold"] and got["em"] == ["italic", "i"]
    assert got["code"] == ["x < y", '<img src=y onerror="window.pwned=3">']
    assert got["ul"] == ["one", "two"] and got["ol"] == ["first", "second"]
    assert got["start"] == 3
    assert got["pre"] == ["if a < b:\n    print('<b>')"] and got["lang"] == "python"
    assert got["unsafe"] == 0 and "<script>window.pwned=2</script>" in got["text"]
    assert "snake_case_name" in got["text"]
    page.page.wait_for_timeout(50)
    assert page.page.evaluate("() => window.pwned") is None


def test_asks_for_the_api_key_once(browser, keyed):
    p = Page(browser, keyed)
    pg = p.page
    pg.wait_for_selector("#keybox.open")
    pg.fill("#key", "wrong-key")
    pg.press("#key", "Enter")
    pg.wait_for_function("() => document.getElementById('keyerr').textContent.includes('refused')")
    pg.fill("#key", KEY)
    pg.press("#key", "Enter")
    p.wait_model()
    assert not pg.is_visible("#keybox")
    p.settings(temperature="0", max_tokens="8")  # greedy: the same reply every run
    p.send("Hello")
    p.wait_done()
    assert [role for role, _ in p.messages()] == ["user", "assistant"]
    assert STATS.match(p.stats()[-1]).group(1), p.stats()
    # Kept: a reload asks nothing.
    pg.reload()
    p.wait_model()
    assert not pg.is_visible("#keybox")
    api = [r for r in p.requests if "/v1/" in r.url]
    assert api[-1].headers.get("authorization") == f"Bearer {KEY}"
    assert {r.headers.get("authorization") for r in api} == {
        None,
        "Bearer wrong-key",
        f"Bearer {KEY}",
    }
    p.close()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The thinking test model (tests/fixtures/think-model, Qwen3.5's template)."""
    s = Server(tmp_path_factory.mktemp("page-think") / "serve.log", "--model",
               str(ROOT / "tests" / "fixtures" / "think-model"))
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


def test_reasoning_is_shown_apart_and_collapsed(browser, thinker):
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_think_model as tk

    page = Page(browser, thinker)
    pg = page.page
    pg.wait_for_function("() => document.getElementById('model').textContent === 'think-model'")
    page.settings(temperature="0")
    page.send(tk.ADD[0]["content"])
    page.wait_done()
    assert page.messages()[-1] == ("assistant", tk.ADD_ANSWER)  # no tags, no reasoning
    details = pg.locator("#log .msg.assistant details.thought")
    assert details.count() == 1 and details.get_attribute("open") is None  # collapsed
    assert details.locator(".reasoning").text_content() == tk.ADD_REASONING
    assert re.match(r"^Thought for \d+\.\d s, \d+ tokens$",
                    details.locator("summary").inner_text())
    details.locator("summary").click()
    assert details.get_attribute("open") is not None
    pg.reload()  # kept in the saved conversation
    pg.wait_for_selector("#log .msg.assistant details.thought")
    assert pg.locator("#log details.thought .reasoning").text_content() == tk.ADD_REASONING
    page.close()

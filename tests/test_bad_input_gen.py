"""Bad input to `generate` and `chat` (issue 16, items 3, 5, 6): every case is a real subprocess
of the CLI and must end with exit code 2, exactly one line on stderr that names the problem, no
traceback, nothing on stdout, and no file the user made changed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ASSET
from jinja2.exceptions import SecurityError

from pocket_mlx.engine.conversations import Conversation, ConversationStore, new_id
from pocket_mlx.engine.templates import render_template

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str | bytes, stdin: bytes | None = None, home: Path | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m pocket_mlx ARGS` with bytes kept as bytes (argv may hold non-UTF-8)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if home is not None:
        env["POCKET_MLX_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "pocket_mlx", *args], capture_output=True,
                          input=stdin if stdin is not None else b"", timeout=timeout, env=env)


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert r.stdout == b"", r.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def tree_hashes(folder: Path) -> dict[str, str]:
    """Every file under `folder` by its SHA-256 (and nothing new appears)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- sampling options (argparse type functions, before anything loads) ----------------------

SAMPLING_CASES = [
    (["--seed", "-1"], "seed must be an integer from 0 to 18446744073709551615"),
    (["--seed", str(2**70)], "seed must be an integer from 0"),
    (["--seed", str(2**64)], "seed must be an integer from 0"),
    (["--seed", "2**70"], "--seed: expected an integer"),
    (["--temp", "nan"], "temperature must be a finite number >= 0"),
    (["--temp", "inf"], "temperature must be a finite number >= 0"),
    (["--temp=-inf"], "temperature must be a finite number >= 0"),
    (["--temp", "-0.5"], "temperature must be a finite number >= 0"),
    (["--temp", "1e400"], "temperature must be a finite number >= 0"),
    (["--top-p", "0"], "top-p must be a number in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be a number in (0, 1]"),
    (["--top-p", "nan"], "top-p must be a number in (0, 1]"),
    (["--top-p", "-0.1"], "top-p must be a number in (0, 1]"),
    (["--top-k", "-1"], "top-k must be an integer >= 0"),
    (["--top-k", "2.5"], "--top-k: expected an integer"),
    (["--min-p", "-0.1"], "min-p must be a number in [0, 1]"),
    (["--min-p", "1.5"], "min-p must be a number in [0, 1]"),
    (["--min-p", "nan"], "min-p must be a number in [0, 1]"),
    (["--repetition-penalty", "0"], "repetition penalty must be a finite number > 0"),
    (["--repetition-penalty", "-1"], "repetition penalty must be a finite number > 0"),
    (["--repetition-penalty", "nan"], "repetition penalty must be a finite number > 0"),
    (["--repetition-penalty", "inf"], "repetition penalty must be a finite number > 0"),
    (["--max-tokens", "0"], "max tokens must be an integer >= 1"),
    (["--max-tokens", "-3"], "max tokens must be an integer >= 1"),
    (["-n", "many"], "expected an integer"),
    (["--stop", ""], "empty stop string"),
    (["--stop", "END", "--stop", ""], "empty stop string"),
    (["--raw", "--system", "be brief"], "--raw"),
]


@pytest.mark.parametrize("args,needle", SAMPLING_CASES, ids=[" ".join(a) for a, _ in SAMPLING_CASES])
def test_generate_refuses_bad_option(args, needle):
    assert_one_line_error(cli("generate", "--prompt", "hi", "--max-tokens", "2", *args), needle)


CHAT_CASES = [
    (["--temp", "nan"], "temperature must be a finite number"),
    (["--temp", "inf"], "temperature must be a finite number"),
    (["--top-p", "2"], "top-p must be a number in (0, 1]"),
    (["--max-tokens", "0"], "max tokens must be an integer >= 1"),
    (["--system", b"be \xff brief"], "--system: text is not valid UTF-8 (byte 0xff at offset 3)"),
]


@pytest.mark.parametrize("args,needle", CHAT_CASES, ids=[str(a[0]) + str(a[1]) for a, _ in CHAT_CASES])
def test_chat_refuses_bad_option(args, needle, tmp_path):
    assert_one_line_error(cli("chat", *args, home=tmp_path), needle)
    assert not any(tmp_path.iterdir())  # no conversation started or saved


def test_good_values_at_the_edges_are_accepted():
    """The edges the checks allow still run: seed 0 and 2**64 - 1, top-p 1, min-p 0, ..."""
    for args in (["--seed", "0"], ["--seed", str(2**64 - 1), "--temp", "0.7", "--top-p", "1",
                                   "--top-k", "0", "--min-p", "0", "--repetition-penalty", "1.1"]):
        r = cli("generate", "--prompt", "hi", "--max-tokens", "2", *args)
        assert r.returncode == 0, r.stderr.decode()


# ---- text that is not UTF-8 -------------------------------------------------------------------

@pytest.mark.parametrize("args,stdin,needle", [
    (["--prompt", b"caf\xe9"], None, "argument --prompt/-p: text is not valid UTF-8 (byte 0xe9 at offset 3)"),
    (["--prompt", b"\xff\xfe"], None, "--prompt/-p: text is not valid UTF-8 (byte 0xff at offset 0)"),
    (["--prompt", "hi", "--system", b"\xc3("], None, "argument --system: text is not valid UTF-8"),
    (["--prompt", "hi", "--stop", b"\x80"], None, "argument --stop: text is not valid UTF-8"),
    (["--prompt", "-"], b"Once upon a time \xff", "the prompt on stdin (--prompt -) is not valid UTF-8 (byte 0xff at offset 17)"),
    (["--prompt", "-", "--raw"], "café".encode("latin-1"), "stdin (--prompt -) is not valid UTF-8"),
], ids=["prompt-latin1", "prompt-bom16", "system", "stop", "stdin", "stdin-raw"])
def test_non_utf8_text_is_one_line_error(args, stdin, needle):
    assert_one_line_error(cli("generate", "--max-tokens", "2", *args, stdin=stdin), needle)


# ---- chat templates from the model folder -----------------------------------------------------

TEMPLATES = {
    # name: (template, what the error line must say)
    "huge-repeat": ("{{ 'a' * 200000000 }}", "SecurityError: repeating a str 200000000 times"),
    "huge-list": ("{{ ['ab'] * 100000000 }}", "SecurityError: repeating a list"),
    "huge-power": ("{{ 7 ** 100000000 }}", "SecurityError: 7 ** 100000000"),
    "huge-width": ("{{ '%0300000000d' % 1 }}", "SecurityError: a format width of 300000000"),
    "huge-center": ("{{ messages[0]['content'] | center(300000000) }}", "SecurityError"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                 "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "SecurityError: join()"),
    "long-output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
                    "SecurityError: the rendered template would exceed"),
    "security": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError: access to attribute"),
    "mutation": ("{% set l = [] %}{{ l.append(1) }}{{ messages }}", "SecurityError"),
    "syntax": ("{% for m in messages %}{{ m.content }", "(line 1): TemplateSyntaxError"),
    "undefined": ("{{ messages[0].content }}{{ tools.name }}", "UndefinedError: 'tools' is undefined"),
    "overflow": ("{{ 10.0 ** 400 }}", "OverflowError"),
    "zero-division": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    "recursion": ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "RecursionError"),
    "type-error": ("{{ messages + 1 }}", "TypeError"),
    "raise-exception": ("{{ raise_exception('System role not supported') }}",
                        "System role not supported"),
}


@pytest.fixture
def model_copy(tmp_path):
    """A copy of the bundled model whose chat template a test replaces."""
    def make(template: str | bytes, where: str = "jinja") -> Path:
        d = tmp_path / "model"
        shutil.copytree(ASSET, d)
        if where == "jinja":
            data = template if isinstance(template, bytes) else template.encode()
            (d / "chat_template.jinja").write_bytes(data)
        else:  # tokenizer_config.json's chat_template (no chat_template.jinja)
            (d / "chat_template.jinja").unlink()
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            cfg["chat_template"] = template
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        return d
    return make


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_generate_template_errors_are_one_line(name, model_copy):
    template, needle = TEMPLATES[name]
    d = model_copy(template)
    before = tree_hashes(d)
    t0 = time.monotonic()
    r = cli("generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "2")
    line = assert_one_line_error(r, f"chat template {d / 'chat_template.jinja'}", needle)
    assert ("refused the conversation" if name == "raise-exception" else "fix the template") in line
    assert time.monotonic() - t0 < 30  # limits fail fast, they do not allocate first
    assert tree_hashes(d) == before


@pytest.mark.parametrize("name", ["huge-repeat", "syntax", "undefined", "security"])
def test_template_in_tokenizer_config_is_named(name, model_copy):
    template, needle = TEMPLATES[name]
    d = model_copy(template, where="tokenizer_config")
    before = tree_hashes(d)
    r = cli("generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(r, f"{d / 'tokenizer_config.json'} (chat_template)", needle)
    assert tree_hashes(d) == before


@pytest.mark.parametrize("name", ["huge-repeat", "syntax", "overflow", "raise-exception"])
def test_chat_template_errors_stop_chat_before_the_app(name, model_copy, tmp_path):
    template, needle = TEMPLATES[name]
    d = model_copy(template)
    before = tree_hashes(d)
    home = tmp_path / "home"
    r = cli("chat", "--model", str(d), home=home)
    assert_one_line_error(r, "pocket-mlx chat: error: chat template", needle)
    assert tree_hashes(d) == before
    assert not home.exists() or not any(home.rglob("*.json"))


def test_template_file_not_utf8(model_copy):
    d = model_copy(b"{{ messages[0]['content'] }}\xff\xfe")
    before = tree_hashes(d)
    r = cli("generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(r, f"{d / 'chat_template.jinja'} is not valid UTF-8")
    assert tree_hashes(d) == before


def test_template_list_without_templates(model_copy):
    d = model_copy([{"name": "default"}], where="tokenizer_config")
    before = tree_hashes(d)
    r = cli("generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(r, "tokenizer_config.json: chat_template is a list")
    assert tree_hashes(d) == before


def test_limited_template_still_renders_the_real_one(model_copy):
    """The limits leave a real template alone: the bundled one, read from the copy, still runs."""
    d = model_copy((ASSET / "chat_template.jinja").read_bytes())
    r = cli("generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "2", "--json")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["prompt_tokens"] > 1


# ---- a resumed conversation's settings --------------------------------------------------------

@pytest.mark.parametrize("settings,needle", [
    ({"temperature": "hot"}, "invalid setting temperature='hot'"),
    ({"temperature": float("nan")}, "invalid setting temperature=nan"),
    ({"top_p": 7}, "invalid setting top_p=7"),
    ({"max_tokens": 0}, "invalid setting max_tokens=0"),
], ids=["hot", "nan", "top_p", "max_tokens"])
def test_chat_resume_with_bad_saved_settings(settings, needle, tmp_path):
    store = ConversationStore(tmp_path / "conversations")
    conv = Conversation(id=new_id(), model=str(ASSET), settings=settings,
                        messages=[{"role": "user", "content": "hi"}])
    store.save(conv)
    path = store.path_for(conv.id)
    before = path.read_bytes()
    r = cli("chat", "--resume", conv.id, home=tmp_path)
    line = assert_one_line_error(r, f"conversation {conv.id}", needle)
    assert str(path) in line
    assert path.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "conversations").iterdir()) == [path.name]


# ---- --help names every default ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "chat", "info", "convert", "eval-ppl", "bench",
                                     "wired"])
def test_help_names_every_default(command):
    """Each option's help block in `COMMAND --help` says its default (or that it is required);
    flags (on/off) are off unless given."""
    r = cli(command, "--help")
    assert r.returncode == 0, r.stderr.decode()
    text = r.stdout.decode()
    blocks: list[list[str]] = []
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            blocks.append([line])
        elif blocks and line.startswith("    "):
            blocks[-1].append(line)
    assert blocks
    missing = []
    for block in blocks:
        invocation = re.split(r"\s{2,}", block[0].strip())[0]  # "--top-p P", "--raw", ...
        if invocation.startswith("-h") or not any(" " in o for o in invocation.split(", ")):
            continue  # --help and on/off flags
        flat = " ".join(" ".join(block).split())
        if "default" not in flat and "required" not in flat:
            missing.append(flat)
    assert not missing, missing
    if command == "generate":
        for option in ("--max-tokens N, -n N", "--top-p P", "--top-k K", "--min-p P",
                       "--repetition-penalty R", "--seed S"):
            assert option in text


# ---- the limits themselves, in process (each vector must fail before it allocates) -----------

LIMIT_VECTORS = [
    "{{ 'a' * 200000000 }}", "{{ 200000000 * 'a' }}", "{{ ['a'] * 200000000 }}",
    "{{ 10 ** 100000000 }}", "{{ '%0200000000d' % 1 }}", "{{ '%*d' % (200000000, 1) }}",
    "{{ '%0300000000d' | format(1) }}", "{{ '{:>200000000}'.format(1) }}",
    "{{ '{:>{w}}'.format(1, w=200000000) }}", "{{ 'a' | center(200000000) }}",
    "{{ 'a'.ljust(200000000) }}", "{{ 'a'.zfill(200000000) }}",
    "{% set s = 'a' * 10000 %}{{ s.replace('', 'b' * 10000) }}",
    "{% set s = 'a' * 10000 %}{{ s | replace('a', 'b' * 10000) }}",
    "{% set s = '\t' * 100000 %}{{ s.expandtabs(1000) }}",
    "{% set s = '\n' * 1000000 %}{{ s | indent(1000) }}",
    "{% set s = 'a' * 10000000 %}{{ [s, s, s, s] | join }}",
    "{% set s = 'a' * 10000000 %}{{ ''.join([s, s, s, s]) }}",
    "{% set s = 'a' * 10000000 %}{% set x %}{% for i in range(100) %}{{ s }}{% endfor %}"
    "{% endset %}{{ x | length }}",
    "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s | length }}",
    "{% set ns = namespace(s=['a']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s | length }}",
    "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}{{ 1 }}",
    "{{ messages | tojson(indent=100000000) }}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
]


@pytest.mark.parametrize("source", LIMIT_VECTORS)
def test_template_limits_fail_fast(source):
    t0 = time.monotonic()
    with pytest.raises(SecurityError, match="would exceed the chat template limit"):
        render_template(source, messages=[{"role": "user", "content": "hi"}],
                        add_generation_prompt=True, bos_token="", eos_token="")
    assert time.monotonic() - t0 < 5


# ---- a tokenizer file the tokenizers library cannot parse (issue 28, item 7) -----------------

@pytest.fixture(scope="module")
def truncated_tokenizer_model(tmp_path_factory) -> Path:
    """A copy of the bundled model whose tokenizer.json is cut in half (a broken download)."""
    folder = tmp_path_factory.mktemp("broken-tok") / "model"
    shutil.copytree(ASSET, folder)
    tok = folder / "tokenizer.json"
    data = tok.read_bytes()
    tok.write_bytes(data[:len(data) // 2])
    return folder


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "{m}", "-p", "hi", "-n", "3"],
    ["chat", "--model", "{m}"],
    ["serve", "--model", "{m}", "--port", "{port}"],
    ["convert", "{m}", "{out}"],
    ["bench", "--model", "{m}"],
], ids=["generate", "chat", "serve", "convert", "bench"])
def test_truncated_tokenizer_json_is_one_line_exit_2(truncated_tokenizer_model, tmp_path, argv):
    m = truncated_tokenizer_model
    with socket.socket() as sock:  # a port free now: serve must fail on the tokenizer, not it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = cli(*[a.format(m=m, out=tmp_path / "out", port=port) for a in argv],
            home=tmp_path / "home")
    assert_one_line_error(r, str(m / "tokenizer.json"), "cannot read this tokenizer file")
    assert not (tmp_path / "out").exists()  # convert wrote nothing


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory) -> Path:
    """A random model of 300 tokens beside the bundled tokenizer (8192): a mismatched pair."""
    from conftest import hf_weights, tiny_config, write_checkpoint
    cfg = tiny_config()
    return write_checkpoint(tmp_path_factory.mktemp("small-vocab") / "model", cfg,
                            hf_weights(cfg, 1))


def test_prompt_ids_past_the_vocabulary_are_one_line_exit_2(small_vocab_model):
    """MLX's `take` does not check indices: ids past the embedding would read other memory
    (garbage that changed from run to run). `generate` names the id and the vocabulary."""
    r = cli("generate", "--model", str(small_vocab_model), "-p", "The quick brown fox", "--raw",
            "-n", "2")
    assert_one_line_error(r, "token id 6638", "vocabulary (300 tokens)",
                          "tokenizer does not match the model")
    # Ids inside the vocabulary (digits are single low ids in the bundled tokenizer) still run.
    ok = cli("generate", "--model", str(small_vocab_model), "-p", "0123456789", "--raw", "-n", "2")
    assert ok.returncode == 0, ok.stderr.decode()

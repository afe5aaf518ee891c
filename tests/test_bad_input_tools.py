"""Bad inputs to `convert`, `eval-ppl`, `bench` and `info`, each a real CLI subprocess.

Every case: exit code 2, exactly one line on stderr naming the problem, no traceback, and the
user's files untouched (the input folder hashed before and after; OUT absent or unchanged).
Plus the leftovers a conversion must not leave (dead temporary folders, `--force` onto a
file), remote-code keys, and progress that is plain lines when stderr is a pipe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parent.parent
ASSET = ROOT / "assets" / "pocket-tiny"
DATA = ROOT / "assets" / "text" / "en.val.txt"
GATE = "language_model.model.layers.0.mlp.switch_mlp.gate_proj"


def cli(*args: str, **kw) -> subprocess.Popen:
    """`python -m pocket_mlx ARGS` with stdout and stderr piped (never a terminal)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **kw.pop("env", {})}
    return subprocess.Popen([sys.executable, "-m", "pocket_mlx", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env, **kw)


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def assert_one_line_error(rc: int, out: str, err: str, needle: str, what: str = "") -> None:
    assert "Traceback" not in out + err, (what, err)
    assert rc == 2, (what, rc, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, (what, err)
    assert lines[0].startswith("pocket-mlx "), (what, lines[0])
    assert needle in lines[0], (what, needle, lines[0])


def tree_hash(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) by relative path -> sha256."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def copy_model(dst: Path) -> Path:
    shutil.copytree(ASSET, dst)
    return dst


def rewrite_weights(folder: Path, change) -> None:
    """Apply `change(weights)` to a copy's safetensors file and keep its index consistent."""
    w = dict(mx.load(str(folder / "model.safetensors")))
    change(w)
    mx.save_safetensors(str(folder / "model.safetensors"), w, metadata={"format": "mlx"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "model.safetensors" for k in sorted(w)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _float_weight(w: dict) -> None:  # packed uint32 stored as float32, same shape
    w[f"{GATE}.weight"] = w[f"{GATE}.weight"].astype(mx.float32)


def _no_scales(w: dict) -> None:
    del w[f"{GATE}.scales"]


def _short_scales(w: dict) -> None:  # one group too few for the config's group size
    w[f"{GATE}.scales"] = w[f"{GATE}.scales"][..., :-1]


def _integer_biases(w: dict) -> None:
    w[f"{GATE}.biases"] = w[f"{GATE}.biases"].astype(mx.uint32)


CORRUPTIONS = {
    "float weight": (_float_weight, f"{GATE}.weight is float32 but config.json quantizes it"),
    "missing scales": (_no_scales, f"missing tensor: {GATE}.scales"),
    "short scales": (_short_scales, f"wrong shape for {GATE}.scales"),
    "integer biases": (_integer_biases, f"{GATE}.biases is uint32; a float tensor belongs"),
}


def test_malformed_quantized_weights_fail_at_load_in_every_tool(tmp_path):
    """A quantized checkpoint whose tensors cannot work is refused by name when it is
    loaded (from the headers), before any forward, in each tool that opens it."""
    procs = {}
    hashes = {}
    for name, (change, needle) in CORRUPTIONS.items():
        folder = copy_model(tmp_path / name.replace(" ", "-"))
        rewrite_weights(folder, change)
        hashes[folder] = tree_hash(folder)
        commands = {
            "convert": ["convert", folder, tmp_path / f"out-{folder.name}"],
            "info": ["info", "--model", folder, "--json"],
            "eval-ppl": ["eval-ppl", "--model", folder, "--data", DATA, "--window", 64],
            "bench": ["bench", "--model", folder, "-p", 4, "-n", 2, "-r", 1],
        }
        for tool, args in commands.items():
            procs[(name, tool)] = (cli(*args), needle)
    for (name, tool), (p, needle) in procs.items():
        assert_one_line_error(*finish(p), needle, f"{tool} / {name}")
    for folder, h in hashes.items():
        assert tree_hash(folder) == h
    assert not list(tmp_path.glob("out-*")) and not list(tmp_path.glob(".out-*"))


def test_convert_output_under_a_file_or_in_a_missing_place(tmp_path):
    src = copy_model(tmp_path / "src")
    before = tree_hash(src)
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me\n")
    cases = {
        "under a regular file": (a_file / "out", f"{a_file} is a file, not a folder"),
        "deeper under a regular file": (a_file / "x" / "y" / "out",
                                        f"{a_file} is a file, not a folder"),
        "under /etc/passwd": (Path("/etc/passwd/x"), "/etc/passwd is a file, not a folder"),
    }
    if not Path("/etc/passwd").is_file():
        del cases["under /etc/passwd"]
    procs = {what: (cli("convert", src, out), needle) for what, (out, needle) in cases.items()}
    for what, (p, needle) in procs.items():
        assert_one_line_error(*finish(p), needle, what)
    assert a_file.read_text() == "keep me\n"
    assert tree_hash(src) == before


@contextlib.contextmanager
def read_only_folder():
    """A folder this process cannot create anything in: chmod 555, or (root ignores modes)
    the immutable attribute."""
    d = Path(tempfile.mkdtemp(prefix="pocket-ro-"))
    (d / "keep.txt").write_text("keep\n")
    immutable = False
    try:
        if os.geteuid() == 0:
            r = subprocess.run(["chattr", "+i", str(d)], capture_output=True)
            if r.returncode != 0:
                pytest.skip("running as root without chattr: no read-only folder to test")
            immutable = True
        else:
            d.chmod(0o555)
        yield d
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(d)], capture_output=True)
        d.chmod(0o755)
        shutil.rmtree(d, ignore_errors=True)


def test_convert_into_a_read_only_folder(tmp_path):
    src = copy_model(tmp_path / "src")
    before = tree_hash(src)
    with read_only_folder() as ro:
        for out in (ro / "out", ro / "sub" / "out"):
            assert_one_line_error(*finish(cli("convert", src, out)), f"{ro} is not writable",
                                  str(out))
        assert sorted(p.name for p in ro.iterdir()) == ["keep.txt"]
    assert tree_hash(src) == before


def test_convert_removes_temporary_folders_of_dead_conversions_only(tmp_path):
    """A conversion killed with -9 leaves `.OUT.tmp-*` with its owner record; the next run
    removes it (and one whose pid now belongs to another process), keeps a live one."""
    out = tmp_path / "out"
    killed = subprocess.run(
        [sys.executable, "-c",
         "import os, signal, sys\n"
         "from pathlib import Path\n"
         "from pocket_mlx.convert.writer import atomic_dir\n"
         "with atomic_dir(Path(sys.argv[1])) as tmp:\n"
         "    (tmp / 'model.safetensors').write_bytes(b'x' * 1000000)\n"
         "    os.kill(os.getpid(), signal.SIGKILL)\n", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    assert killed.returncode == -9
    (dead,) = tmp_path.glob(".out.tmp-*")
    owner = json.loads((dead / ".owner").read_text())
    assert owner["pid"] > 0 and owner["host"]

    live = tmp_path / ".out.tmp-live"  # this test process: running
    live.mkdir()
    from pocket_mlx.convert.writer import owner_record

    (live / ".owner").write_text(json.dumps(owner_record()))
    reused = tmp_path / ".out.tmp-reused"  # a running pid, but not the process that wrote it
    reused.mkdir()
    (reused / ".owner").write_text(json.dumps({**owner_record(), "started": "not-this-one"}))

    rc, stdout, err = finish(cli("convert", ASSET, out))
    assert rc == 0 and "Traceback" not in err, err
    assert not dead.exists() and not reused.exists()
    assert live.is_dir()
    assert err.count(f"removed {dead}") == 1
    assert err.count(f"{live} belongs to a write of out still running") == 1
    assert (out / "config.json").is_file() and not (out / ".owner").exists()


def test_force_onto_a_file_leaves_nothing_behind(tmp_path):
    target = tmp_path / "target"
    target.write_text("an old file\n")
    rc, _, err = finish(cli("convert", ASSET, target, "--force"))
    assert rc == 0, err
    assert (target / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]

    # Failure: a broken source, --force onto a file. The file stays; nothing else appears.
    broken = copy_model(tmp_path / "broken")
    rewrite_weights(broken, _no_scales)
    keep = tmp_path / "keep"
    keep.write_text("still here\n")
    assert_one_line_error(*finish(cli("convert", broken, keep, "--force")), "missing tensor")
    assert keep.read_text() == "still here\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "keep", "target"]


def test_convert_strips_remote_code_keys_and_says_so(tmp_path):
    src = copy_model(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(auto_map={"AutoModelForCausalLM": "modeling_evil.Model"}, trust_remote_code=True)
    (src / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok.update(auto_map={"AutoTokenizer": ["tok_evil.Tok", None]}, model_file="tok_evil.py")
    (src / "tokenizer_config.json").write_text(json.dumps(tok))
    out = tmp_path / "out"
    rc, _, err = finish(cli("convert", src, out))
    assert rc == 0, err
    notes = [line for line in err.splitlines() if "remote-code" in line]
    assert notes == ["note: removed remote-code keys auto_map, trust_remote_code from "
                     "config.json; auto_map, model_file from tokenizer_config.json "
                     "(not needed to run it)"]
    for name in ("config.json", "tokenizer_config.json"):
        text = (out / name).read_text()
        for key in ("auto_map", "trust_remote_code", "model_file"):
            assert key not in text, (name, key)
    new_tok = json.loads((out / "tokenizer_config.json").read_text())
    assert new_tok["eos_token"] == tok["eos_token"]  # the rest as it was


def test_eval_ppl_window_longer_than_the_context(tmp_path):
    before = tree_hash(ASSET)
    context = json.loads((ASSET / "config.json").read_text())["max_position_embeddings"]
    rc, out, err = finish(cli("eval-ppl", "--data", DATA, "--window", 100000))
    assert_one_line_error(rc, out, err, f"longer than the model's context of {context} tokens")
    assert f"--window {context} or less" in err
    assert out == "" and tree_hash(ASSET) == before


def test_bench_with_nothing_to_measure():
    rc, out, err = finish(cli("bench", "-p", 0, "-n", 0))
    assert_one_line_error(rc, out, err, "-p 0 and -n 0 leave nothing to measure")
    assert out == ""


def test_info_json_numbers_are_numbers():
    rc, out, err = finish(cli("info", "--json"))
    assert rc == 0, err
    d = json.loads(out)

    def strings(v, path=""):
        if isinstance(v, dict):
            for k, x in v.items():
                yield from strings(x, f"{path}.{k}")
        elif isinstance(v, list):
            for x in v:
                yield from strings(x, f"{path}[]")
        elif isinstance(v, str):
            yield path, v

    numeric = []
    for path, s in strings(d):
        with contextlib.suppress(ValueError):
            float(s)
            numeric.append((path, s))
    assert numeric == []
    q = d["quantization"]
    assert q["experts"]["bits"] and all(type(b) is int for f in q.values() for b in f["bits"])
    assert q["lm_head"]["bits"] == [6]


def test_progress_in_a_pipe_is_plain_lines(tmp_path):
    """convert and bench (and the synthetic build bench makes) on a pipe: whole lines, no
    carriage returns or terminal escapes, and convert is not silent."""
    conv = cli("convert", ASSET, tmp_path / "out", "--recipe", "uniform-4")
    bench = cli("bench", "--synthetic", "tiny", "-p", 8, "-n", 4, "-r", 1,
                env={"POCKET_MLX_CACHE": str(tmp_path / "cache")})
    for p, expect in ((conv, "quantize+write: "), (bench, "writing ")):
        rc, _, err = finish(p)
        assert rc == 0, err
        assert "\r" not in err and "\x1b" not in err, repr(err[:500])
        lines = [line for line in err.splitlines() if line.startswith(expect)]
        assert lines, err
        assert lines[-1].endswith("done"), lines

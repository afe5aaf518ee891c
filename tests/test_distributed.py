"""`generate --distributed pipeline|experts`: real `mlx.launch -n 2 --backend ring` runs on this
machine (two CPU processes over loopback TCP) against one process; failures of a peer."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, hf_weights, tiny_config, write_checkpoint
from mlx.utils import tree_flatten

from pocket_mlx.engine import distributed
from pocket_mlx.engine.loader import load

LAUNCH = Path(sys.executable).parent / "mlx.launch"
PROMPT = ("The quick brown fox jumps over the lazy dog while the cat watches from the warm "
          "windowsill and the rain keeps falling on the old roof of the house")
TOKENS = "12"

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), POCKET_MLX_THREADS="1")
    for k in ("MLX_RANK", "MLX_HOSTFILE"):
        env.pop(k, None)
    return env


def _free_ports(n: int) -> int:
    """A first port with `n` free ones after it (other test runs may share this machine)."""
    for _ in range(100):
        base = random.randint(20000, 60000)
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            for s in socks:
                s.close()
            return base
        except OSError:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def _generate(model: Path | None, mode: str | None, raw: bool) -> dict:
    args = ["-m", "pocket_mlx", "generate", "-p", PROMPT, "-n", TOKENS, "--device", "cpu",
            "--json"]
    args += ["--model", str(model)] if model else []
    args += ["--raw"] if raw else []
    if mode is None:
        cmd = [sys.executable, *args]
    else:
        cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port",
               str(_free_ports(2)), "--", sys.executable, *args, "--distributed", mode,
               "--distributed-timeout", "60"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout  # rank 0 alone prints
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def hybrid4(tmp_path_factory) -> Path:
    """A random float32 model with 2 full-attention and 2 Gated DeltaNet layers (MLX's ops),
    its vocabulary the bundled tokenizer's (8192): with tiny_config's 300 the prompt's ids ran
    past the embedding, whose rows MLX's `take` then read from whatever memory followed (the
    output differed from run to run, and between one process and pipeline in ~7% of runs)."""
    cfg = tiny_config(vocab_size=8192, layer_types=["linear_attention", "full_attention",
                                                    "linear_attention", "full_attention"])
    return write_checkpoint(tmp_path_factory.mktemp("dist") / "hybrid4", cfg, hf_weights(cfg, 3))


def _bytes(model) -> tuple[int, int]:
    """(all parameter bytes, routed experts' bytes) of a model as generate loads it."""
    total = experts = 0
    for k, v in tree_flatten(model.parameters()):
        if k.startswith("mtp."):  # the MTP head: dropped under --distributed (no speculation)
            continue
        total += v.nbytes
        experts += v.nbytes if ".switch_mlp." in k else 0
    return total, experts


@pytest.mark.parametrize("which", ["bundled", "hybrid4"])
def test_both_modes_match_one_process(which, hybrid4):
    """Greedy output token-identical to one process, and each rank holds its share, read from
    the arrays it loaded: pipeline about half of all bytes (every array on exactly one rank),
    experts the dense part plus half of the routed experts."""
    path = hybrid4 if which == "hybrid4" else None
    raw = which == "hybrid4"
    one = _generate(path, None, raw)
    model, _ = load(path, device="cpu", fuse=True)
    total, experts = _bytes(model)
    for mode in ("pipeline", "experts"):
        got = _generate(path, mode, raw)
        assert got["text"] == one["text"], mode
        assert got["generation_tokens"] == one["generation_tokens"] == int(TOKENS)
        d = got["distributed"]
        assert d["mode"] == mode and d["ranks"] == 2
        ranks = d["rank_weight_bytes"]
        if mode == "pipeline":
            assert sum(ranks) == total
            assert all(0.35 * total <= b <= 0.65 * total for b in ranks), (ranks, total)
            (lo0, hi0), (lo1, hi1) = d["layers"]
            assert lo1 == 0 and hi1 == lo0 and hi0 == model.args.num_hidden_layers
        else:
            # Half the experts, plus the all-zero expert each rank adds.
            E = model.args.num_experts
            assert ranks == [total - experts + experts * (E // 2 + 1) // E] * 2, (ranks, total)
            assert all(b < one["bytes_per_token"] for b in d["rank_bytes_per_token"])


def test_pipeline_ranges_follow_bytes_and_shares():
    layers = [10] * 8
    assert distributed.pipeline_ranges(layers, 0, 0, [1, 1]) == [(4, 8), (0, 4)]
    # The embedding counts with the first layers, lm_head with the last ones.
    assert distributed.pipeline_ranges(layers, 20, 0, [1, 1]) == [(3, 8), (0, 3)]
    assert distributed.pipeline_ranges(layers, 0, 0, [3, 1]) == [(2, 8), (0, 2)]
    # Every rank keeps at least one layer, whatever the shares.
    assert distributed.pipeline_ranges([10, 10], 1000, 0, [1, 1]) == [(1, 2), (0, 1)]
    with pytest.raises(Exception, match="at least 3 layers"):
        distributed.pipeline_ranges([1, 1], 0, 0, [1, 1, 1])


@pytest.mark.parametrize("surgery, extension", [("pipeline", True), ("experts", True),
                                                ("experts", False)])
def test_model_surgery_over_one_rank_gives_the_same_logits(surgery, extension, monkeypatch):
    """`Model.pipeline` / `Model.shard_experts` over MLX's group of one (no launcher): the
    forward then takes the distributed path (this rank's layers, or its experts plus the zero
    expert, all_sum, combine; with the CPU extension and with MLX's ops) and its prefill and
    decode logits equal the untouched model's bit for bit."""
    import mlx.core as mx

    from pocket_mlx import kernels

    for k in ("MLX_RANK", "MLX_HOSTFILE"):
        monkeypatch.delenv(k, raising=False)
    group = mx.distributed.init()
    assert group.size() == 1

    def cut(m) -> None:
        if surgery == "pipeline":
            m.pipeline(group, [(0, m.args.num_hidden_layers)])
        else:
            m.shard_experts(group)

    ref, _ = load(None, device="cpu", fuse=True)
    model, _ = load(None, device="cpu", fuse=True, shard=cut)
    assert (model.language_model.pipe is not None) == (surgery == "pipeline")
    assert all((layer.mlp.ep is not None) == (surgery == "experts") for layer in model.layers)
    kernels.set_enabled(extension)
    try:
        caches = ref.make_cache(), model.make_cache()
        for x in (mx.array([[1, 50, 300, 7, 99, 1000]]), mx.array([[42]])):
            want, got = ref(x, caches[0]), model(x, caches[1])
            assert mx.array_equal(want, got), (surgery, x.shape)
    finally:
        kernels.set_enabled(True)


def _rank(rank: int, hostfile: Path, cmd: list[str]) -> subprocess.Popen:
    env = dict(_env(), MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _hostfile(tmp_path: Path) -> Path:
    port = _free_ports(2)
    f = tmp_path / "hosts.json"
    f.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    return f


GEN = [sys.executable, "-m", "pocket_mlx", "generate", "-p", "hi", "-n", "4", "--device", "cpu",
       "--distributed", "experts"]


def test_a_rank_that_never_connects_is_an_error_not_a_hang(tmp_path):
    t0 = time.monotonic()
    p = _rank(0, _hostfile(tmp_path), [*GEN, "--distributed-timeout", "3"])
    out, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 30
    assert p.returncode != 0
    last = err.strip().splitlines()[-1]
    assert "rank 0: the other ranks did not connect within 3 s" in last
    assert out == ""


def test_a_rank_that_dies_is_a_one_line_error(tmp_path):
    hosts = _hostfile(tmp_path)
    p0 = _rank(0, hosts, [*GEN, "--distributed-timeout", "60"])
    # Rank 1 joins the group, then dies before any work.
    p1 = _rank(1, hosts, [sys.executable, "-c", "import mlx.core as mx, os; "
                                                "mx.distributed.init(strict=True); os._exit(1)"])
    p1.communicate(timeout=60)
    out, err = p0.communicate(timeout=60)
    assert p0.returncode == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("pocket-mlx generate: error: rank 0: lost the connection"), err
    assert out == ""


def test_distributed_outside_mlx_launch_says_how_to_start_it():
    r = subprocess.run(GEN, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "mlx.launch -n 2" in r.stderr


def test_info_ranks_estimate_from_the_models_bytes():
    """`info --ranks N --link L`: per-rank memory and bytes per token follow the model's own
    accounting (pipeline 1/N; experts: dense + 1/N of the routed experts), the collectives
    are one per MoE layer plus the token, and a slower link gives a slower estimate."""
    from pocket_mlx.analysis.info import describe, open_source
    from pocket_mlx.models.accounting import module_costs

    d = describe("synthetic:tiny", ranks=2, link="thunderbolt5", bandwidth_gbps=100.0)
    e = d["distributed"]

    costs = module_costs(open_source("synthetic:tiny").model)
    experts = sum(c.bytes for c in costs if ".switch_mlp." in c.path + ".")
    total = d["weights_bytes"]
    layers = d["architecture"]["layers"]
    E = d["experts_per_layer"]
    assert e["pipeline"]["memory_bytes_per_rank"] == total / 2
    assert e["experts"]["memory_bytes_per_rank"] == pytest.approx(
        total - experts / 2 + experts / E)
    assert e["experts"]["collectives_per_token"] == layers + 1
    assert e["experts"]["bytes_per_token_per_rank"] < d["bytes_per_token"]
    slow = describe("synthetic:tiny", ranks=2, link="1gbe", bandwidth_gbps=100.0)["distributed"]
    assert slow["experts"]["decode_tps"] < e["experts"]["decode_tps"]
    assert e["bandwidth_gbps"] == 100.0


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "1"], "--ranks must be 2 or more"),
    (["--link", "10gbe"], "add --ranks N"),
])
def test_info_ranks_bad_input_is_one_line(argv, message):
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "info", *argv], capture_output=True,
                       text=True, env=_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1


def test_bench_runs_distributed_and_rank_0_alone_reports():
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(_free_ports(2)),
           "--", sys.executable, "-m", "pocket_mlx", "bench", "-p", "16", "-n", "4", "-r", "1",
           "--device", "cpu", "-o", "json", "-q", "--distributed", "experts"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [row["test"] for row in rows] == ["pp16", "tg4"]
    assert all("[experts x2, rank 0]" in row["model"] and row["tps_mean"] > 0 for row in rows)


def test_moe_parts_summed_over_ranks_are_the_block_bit_for_bit(kernels_ext):
    """The extension's expert-parallel pieces: each rank's parts (its experts, the shared one on
    one rank) summed, then combined, equal `moe_block` exactly, for 2 and 3 ranks; a router
    that does not cover the held experts is refused."""
    import mlx.core as mx

    from pocket_mlx.kernels import ops

    model, _ = load(None, device="cpu", fuse=True)
    mlp = model.layers[1].mlp
    mats = mlp._quantized_mats()
    x = mx.random.normal((1, 3, model.args.hidden_size), key=mx.random.key(1))
    want = ops.moe_block(x, mats, mlp.top_k, True)
    E = model.args.num_experts
    for ranks in (2, 3):
        total, scores = None, None
        for r in range(ranks):
            lo, hi = distributed.split_evenly(E, ranks, r)
            mine = mats[:-3] + [(w[lo:hi], s[lo:hi], b[lo:hi], bits, gs)
                                for w, s, b, bits, gs in mats[-3:]]
            parts, sc = ops.moe_block_parts(x, mine, mlp.top_k, True, lo, r == 0)
            assert parts.shape == (1, 3, mlp.top_k + 1, x.shape[-1])
            total = parts if total is None else total + parts
            scores = sc if scores is None else scores
            assert mx.array_equal(sc, scores)
        assert mx.array_equal(ops.moe_combine(total, scores), want)
    last2 = mats[:-3] + [(w[E - 2:], s[E - 2:], b[E - 2:], bits, gs)
                         for w, s, b, bits, gs in mats[-3:]]
    assert ops.moe_block_parts(x, last2, mlp.top_k, True, E - 2, True) is not None
    assert ops.moe_block_parts(x, last2, mlp.top_k, True, E - 1, True) is None  # past the router


def _http(port: int, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def _wait_healthy(port: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a rank exited ({p.returncode}): {p.stderr.read()}")
        if _http(port, "/health", timeout=5)[0] == 200:
            return
        time.sleep(0.5)
    pytest.fail("the server did not come up")


def _cancel_a_stream(port: int) -> None:
    """Ask for a long streamed reply, read its first event, hang up."""
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    assert r.read(5) == b"data:"
    c.close()


@pytest.mark.parametrize("mode", ["pipeline", "experts"])
def test_serve_distributed_answers_as_one_process_and_stops_every_rank(mode, tmp_path):
    """`serve --distributed MODE` on 2 ring ranks: rank 0 serves HTTP, rank 1 follows; a real
    request's greedy text equals one-process `generate`; a client that hangs up mid-reply
    cancels it on both ranks (the next reply is still right); SIGTERM to rank 0 ends both
    ranks with exit code 0."""
    import signal

    one = _generate(None, None, raw=True)
    hosts = _hostfile(tmp_path)
    port = _free_ports(1)
    cmd = [sys.executable, "-m", "pocket_mlx", "serve", "--device", "cpu", "--port", str(port),
           "--distributed", mode, "--distributed-timeout", "60"]
    procs = [_rank(0, hosts, cmd), _rank(1, hosts, cmd)]
    try:
        _wait_healthy(port, procs)
        body = {"prompt": PROMPT, "max_tokens": int(TOKENS), "temperature": 0}
        status, text = _http(port, "/v1/completions", body)
        assert status == 200, text
        assert json.loads(text)["choices"][0]["text"] == one["text"]
        if mode == "experts":
            _cancel_a_stream(port)
            status, text = _http(port, "/v1/completions", body)
            assert status == 200 and json.loads(text)["choices"][0]["text"] == one["text"]
            status, metrics = _http(port, "/metrics")
            assert "pocket_mlx_cancelled_total 1" in metrics, metrics
        procs[0].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=60)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errs
        assert "rank 1 stopped" in errs[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_serve_distributed_refuses_batching():
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "serve", "--distributed", "experts",
                        "--max-concurrency", "2"], capture_output=True, text=True, env=_env(),
                       cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "lockstep; use 1" in r.stderr


@pytest.mark.parametrize("argv, says", [
    ([], "start rank 0 in your terminal with `pocket-mlx chat --distributed pipeline "
         "--hostfile hosts.json --rank 0`"),
    (["--hostfile", "HOSTS", "--rank", "0"], "rank 0 runs the chat app and has no terminal"),
    (["--hostfile", "HOSTS"], "--hostfile needs --rank R"),
    (["--hostfile", "HOSTS", "--rank", "2"], "--rank 2: the hostfile has 2 hosts"),
    (["--hostfile", "BAD", "--rank", "0"], "expected a list of 2 or more hosts"),
])
def test_chat_distributed_without_a_terminal_or_hostfile_is_one_line(argv, says, tmp_path):
    """Rank 0 of `chat --distributed` needs a terminal (mlx.launch gives it pipes): refused in
    one line saying how to start it, before joining any group; a bad hostfile or rank too."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"ranks": 2}')
    argv = [{"HOSTS": str(_hostfile(tmp_path)), "BAD": str(bad)}.get(a, a) for a in argv]
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "chat", "--distributed", "pipeline",
                        *argv], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


def _pty_rank0(cmd: list[str], env: dict) -> tuple[subprocess.Popen, int, list[bytes]]:
    """Start `cmd` with a pseudo-terminal (120 x 35) as stdin, stdout and stderr, as in a
    terminal window; a thread keeps reading what it draws into the returned list."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 35, 120, 0, 0))
    p = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
                         start_new_session=True)
    os.close(slave)
    screen: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            screen.append(data)

    threading.Thread(target=drain, daemon=True).start()
    return p, master, screen


def _wait(what: str, ok, procs: list[subprocess.Popen], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ok():
            return
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a rank exited ({p.returncode}) before {what}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def test_chat_distributed_rank_0_in_a_terminal_and_a_follower(tmp_path):
    """`chat --distributed experts --hostfile F --rank R`: rank 1 follows in the background,
    rank 0 runs the chat app in a pseudo-terminal. A message typed there gets the reply one
    process generates (greedy, same chat template), saved in the conversation; a second turn
    works too; ctrl+q ends both ranks with exit code 0."""
    one = _generate(None, None, raw=False)
    hosts = _hostfile(tmp_path)
    env = dict(_env(), POCKET_MLX_HOME=str(tmp_path / "home"), TERM="xterm-256color")
    cmd = [sys.executable, "-m", "pocket_mlx", "chat", "--device", "cpu", "-n", TOKENS,
           "--distributed", "experts", "--distributed-timeout", "60", "--hostfile", str(hosts),
           "--rank"]
    follower = subprocess.Popen([*cmd, "1"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    rank0, master, screen = _pty_rank0([*cmd, "0"], env)
    procs = [rank0, follower]
    convs = tmp_path / "home" / "conversations"

    def replies() -> list[str]:
        for f in convs.glob("*.json") if convs.is_dir() else []:
            try:
                msgs = json.loads(f.read_text())["messages"]
            except ValueError:
                return []  # being written
            return [m["content"] for m in msgs if m["role"] == "assistant" and m["content"]]
        return []

    try:
        _wait("the model to load", lambda: b"idle" in b"".join(screen), procs)
        os.write(master, PROMPT.encode() + b"\r")
        _wait("the reply", lambda: len(replies()) == 1, procs)
        assert replies()[0] == one["text"]
        os.write(master, b"Tell me more\r")
        _wait("the second reply", lambda: len(replies()) == 2, procs)
        os.write(master, b"\x11")  # ctrl+q
        follower_err = follower.communicate(timeout=60)[1]
        assert rank0.wait(timeout=60) == 0
        assert follower.returncode == 0, follower_err
        assert "rank 1 stopped" in follower_err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        os.close(master)


def test_serve_distributed_follower_that_dies_ends_rank_0_in_one_line(tmp_path):
    """Rank 0 cannot answer without its followers: it exits 2 with one line of its own."""
    hosts = _hostfile(tmp_path)
    port = _free_ports(1)
    cmd = [sys.executable, "-m", "pocket_mlx", "serve", "--device", "cpu", "--port", str(port),
           "--distributed", "pipeline", "--distributed-timeout", "60"]
    procs = [_rank(0, hosts, cmd), _rank(1, hosts, cmd)]
    try:
        _wait_healthy(port, procs)
        procs[1].kill()
        _, err = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 2
        last = err.strip().splitlines()[-1]
        assert last.startswith("pocket-mlx serve: error: rank 0: lost the connection"), err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


# ---- per-rank shards (pocket-mlx shard) ---------------------------------------------------------

BUNDLED = ROOT / "assets" / "pocket-tiny"


def _shard(out: Path, ranks: int, mode: str, src: Path = BUNDLED) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "shard", str(src), str(out),
                           "--ranks", str(ranks), "--mode", mode], capture_output=True,
                          text=True, env=_env(), cwd=ROOT, timeout=120)


def _headers(folder: Path) -> dict[str, dict]:
    """Every tensor's safetensors header entry in a folder's weight files."""
    from pocket_mlx.config import safetensors_header, weight_files

    out = {}
    for f in weight_files(folder):
        out.update({k: v for k, v in safetensors_header(f)[1].items() if k != "__metadata__"})
    return out


@pytest.mark.parametrize("mode", ["experts", "pipeline"])
def test_per_rank_shards_match_one_process_and_each_rank_reads_only_its_own(mode, tmp_path):
    """`shard --ranks 2 --mode MODE` of the bundled model, then `generate --distributed MODE`
    on it: greedy text identical to one process; each rank mapped exactly its own folder's
    files (reported from the loader), and those hold only its share: experts, half of every
    layer's experts and every dense tensor; pipeline, its own layers, the two ranks' tensors
    together being the whole checkpoint's, each once."""
    from pocket_mlx.config import disk_bytes

    out = tmp_path / "shards"
    r = _shard(out, 2, mode)
    assert r.returncode == 0, r.stderr
    one = _generate(None, None, raw=False)
    got = _generate(out, mode, raw=False)
    assert got["text"] == one["text"] and got["generation_tokens"] == one["generation_tokens"]
    d = got["distributed"]
    folders = [out / f"rank-{i}-of-2" for i in range(2)]
    assert d["rank_checkpoint_bytes"] == [disk_bytes(f) for f in folders]
    assert all(b < disk_bytes(BUNDLED) for b in d["rank_checkpoint_bytes"])
    # The MTP head's tensors go to no rank (--distributed drops the head: no speculation there).
    whole = {k: v for k, v in _headers(BUNDLED).items() if not k.startswith("mtp.")}
    assert len(whole) < len(_headers(BUNDLED))
    ranks = [_headers(f) for f in folders]
    E = 24
    if mode == "experts":
        for held in ranks:
            assert set(held) == set(whole)
            for k, v in held.items():
                if ".switch_mlp." in k:
                    assert v["shape"] == [E // 2, *whole[k]["shape"][1:]], k
                else:
                    assert v["shape"] == whole[k]["shape"], k
        assert d["experts"] == [[0, 12], [12, 24]]
    else:
        assert not set(ranks[0]) & set(ranks[1])
        assert set(ranks[0]) | set(ranks[1]) == set(whole)
        for held, (lo, hi) in zip(ranks, d["layers"]):
            layers = {int(k.split(".layers.")[1].split(".")[0]) for k in held if ".layers." in k}
            assert layers == set(range(lo, hi))
        assert "language_model.lm_head.weight" in ranks[0]
        assert "language_model.model.embed_tokens.weight" in ranks[1]


def _ranks_run(tmp_path: Path, cmd: list[str]) -> list[tuple[int, str, str]]:
    hosts = _hostfile(tmp_path)
    procs = [_rank(0, hosts, cmd), _rank(1, hosts, cmd)]
    out = []
    for p in procs:
        o, e = p.communicate(timeout=120)
        out.append((p.returncode, o, e))
    return out


@pytest.mark.parametrize("made, run", [((4, "experts"), "experts"), ((2, "experts"), "pipeline")])
def test_shards_for_another_layout_are_one_line_on_every_rank(made, run, tmp_path):
    """Shards for 4 ranks run on 2, or for experts run as pipeline: every rank exits 2 with one
    line naming both layouts (no traceback, no hang)."""
    out = tmp_path / "shards"
    assert _shard(out, *made).returncode == 0
    cmd = [*GEN[:-2], "--distributed", run, "--model", str(out), "--distributed-timeout", "60"]
    for i, (rc, o, e) in enumerate(_ranks_run(tmp_path, cmd)):
        assert rc == 2, e
        assert o == "" and e.count("\n") == 1, e
        assert (f"rank {i}: {out} holds shards for --distributed experts over {made[0]} ranks, "
                f"this run is --distributed {run} over 2 ranks") in e


def test_shards_outside_distributed_and_bad_shard_requests_are_one_line(tmp_path):
    """One process given shards (or one rank's folder) is told how to run them; `shard` refuses
    what cannot work and leaves nothing behind (it writes into a temporary folder renamed at
    the end)."""
    out = tmp_path / "shards"
    assert _shard(out, 2, "experts").returncode == 0
    for model, says in ((out, "run it under mlx.launch -n 2 with --distributed experts"),
                        (out / "rank-1-of-2", "is one rank's share")):
        r = subprocess.run([*GEN[:-2], "--model", str(model)], capture_output=True, text=True,
                           env=_env(), cwd=ROOT, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    again = _shard(out, 2, "pipeline")
    assert again.returncode == 2 and "already exists" in again.stderr
    assert json.loads((out / "shards.json").read_text())["mode"] == "experts"  # untouched
    bad = _shard(tmp_path / "bad", 30, "experts")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "needs at least 30 experts" in bad.stderr
    resharded = _shard(tmp_path / "again", 2, "experts", src=out)
    assert resharded.returncode == 2 and "already split" in resharded.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]


def test_hostfile_of_mlx_launch_becomes_the_rings_own(tmp_path, monkeypatch):
    """`--hostfile` with mlx.launch's format: the ring's file gets one "ip:port" per host,
    ports numbered as mlx.launch numbers them; the ring's own format is used as it is."""
    # setenv first: pytest's delenv of an unset variable records nothing, so what use_hostfile
    # sets would outlive the test (a later mx.distributed.init() would wait for the ring).
    for k in ("MLX_RANK", "MLX_HOSTFILE"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    f = tmp_path / "hosts.json"
    f.write_text(json.dumps([{"ssh": "mini1.local", "ips": ["10.10.0.1"]},
                             {"ssh": "mini2.local", "ips": ["10.10.0.2"]}]))
    ring = Path(distributed.use_hostfile(str(f), 1))
    assert os.environ["MLX_HOSTFILE"] == str(ring)
    try:
        assert json.loads(ring.read_text()) == [["10.10.0.1:32323"], ["10.10.0.2:32324"]]
        assert os.environ["MLX_RANK"] == "1" and distributed.launch_rank() == 1
    finally:
        ring.unlink()
    own = tmp_path / "ring.json"
    own.write_text('[["127.0.0.1:5000"], ["127.0.0.1:5001"]]')
    assert distributed.use_hostfile(str(own), 0) is None
    assert os.environ["MLX_HOSTFILE"] == str(own) and distributed.launch_rank() == 0

"""How many calibration tokens REAP pruning needs: the knee on the bundled reference (issue 29).

Why: the calibration pass costs time linear in tokens x layers (on the 35B ~145 s a layer per
2048 tokens here), so `--calib-tokens` should be the smallest count whose pruned build is as
good as a large one. One pass over the largest count gives the statistics of every smaller
count: the model is causal, so the first T tokens of each domain's stream are observed exactly
as `convert --calib-tokens T` observes them (T a multiple of the 512-token window, or T < 512:
the first T tokens of the first window), and the REAP sums are accumulated per token range.
Each count's statistics then prune the model with `convert` (the same code path as the CLI,
statistics given) and the build's perplexity is measured like scripts/quality_report.py.

    python scripts/calib_knee.py [--prune 24 16] [--tokens 256 512 ... 16384] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pocket_mlx.analysis.perplexity import perplexity  # noqa: E402
from pocket_mlx.config import read_config  # noqa: E402
from pocket_mlx.convert.calibrate import calibration_windows  # noqa: E402
from pocket_mlx.convert.pipeline import ConvertOptions, _run_dtype, convert  # noqa: E402
from pocket_mlx.convert.prune import ExpertStats, select_experts  # noqa: E402
from pocket_mlx.convert.recipes import load_recipe  # noqa: E402
from pocket_mlx.corpus import read_documents, token_stream, windows  # noqa: E402
from pocket_mlx.engine.loader import load_model  # noqa: E402
from pocket_mlx.engine.tokenizer import load_tokenizer  # noqa: E402

SRC = ROOT / "assets" / "pocket-tiny-bf16"
TEXT = ROOT / "assets" / "text"
DOMAINS = ("en", "zh", "code")
WINDOW = 512


def range_stats(tokens: list[int]) -> tuple[np.ndarray, np.ndarray, list[dict], float]:
    """freq and REAP sums [len(tokens), layers, experts]: row r holds what the tokens in
    [tokens[r-1], tokens[r]) of each domain's stream contributed (summed over domains)."""
    config = read_config(SRC)
    tok = load_tokenizer(SRC, config)
    files = [TEXT / f"{d}.calib.txt" for d in DOMAINS]
    chunks, infos = calibration_windows(files, tok, WINDOW, max(tokens))
    offsets = []  # each window's first position in its domain's stream
    for info in infos:
        offsets += [o for o in range(0, info.tokens, WINDOW) if info.tokens - o >= 2]
    assert len(offsets) == len(chunks), (len(offsets), len(chunks))
    model = load_model(SRC, config, dtype=_run_dtype(), lazy=True)
    lm = model.language_model
    layers = lm.model.layers
    n_l, n_e = len(layers), model.args.num_experts
    freq = np.zeros((len(tokens), n_l, n_e))
    reap = np.zeros((len(tokens), n_l, n_e))
    edges = np.array(tokens)
    cur = {"layer": 0, "offset": 0}

    def observe(x, inds, scores, experts) -> None:
        norms = mx.linalg.norm(experts.astype(mx.float32), axis=-1)
        contrib = np.array(scores.astype(mx.float32) * norms).reshape(-1, inds.shape[-1])
        ids = np.array(inds).reshape(-1, inds.shape[-1])
        pos = cur["offset"] + np.arange(ids.shape[0])
        rng = np.searchsorted(edges, pos, side="right")  # range r: tokens[r-1] <= pos < tokens[r]
        keep = rng < len(tokens)
        for r in np.unique(rng[keep]):
            sel = rng == r
            np.add.at(freq[r, cur["layer"]], ids[sel].reshape(-1), 1.0)
            np.add.at(reap[r, cur["layer"]], ids[sel].reshape(-1), contrib[sel].reshape(-1))

    t0 = time.perf_counter()
    hs = [lm.model.embed_tokens(mx.array(c, mx.int32)[None]) for c in chunks]
    mx.eval(hs)
    for i, layer in enumerate(layers):
        cur["layer"] = i
        layer.mlp.observer = observe
        for j, h in enumerate(hs):
            cur["offset"] = offsets[j]
            hs[j] = layer(h)
            mx.eval(hs[j])
        layer.mlp.observer = None
        print(f"  layer {i}: {time.perf_counter() - t0:.0f} s", flush=True)
    return freq, reap, [i.as_dict() for i in infos], time.perf_counter() - t0


def stats_at(freq: np.ndarray, reap: np.ndarray, r: int, tokens: int) -> ExpertStats:
    s = ExpertStats(freq.shape[1], freq.shape[2])
    s.freq = freq[:r + 1].sum(0)
    s.reap_sum = reap[:r + 1].sum(0)
    s.tokens = tokens
    return s


def val_ids(tokenizer, domain: str, n_windows: int) -> list[int]:
    """`n_windows` full windows spread evenly over the validation file (quality_report's)."""
    ids = token_stream(read_documents(TEXT / f"{domain}.val.txt"), tokenizer)
    full = [w for w in windows(ids, WINDOW) if len(w) == WINDOW]
    pick = np.linspace(0, len(full) - 1, min(n_windows, len(full))).round().astype(int)
    return [t for i in sorted(set(pick.tolist())) for t in full[i]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+",
                    default=[256, 512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--prune", type=int, nargs="+", default=[24, 16])
    ap.add_argument("--recipe", default="pocket-3bit")
    ap.add_argument("--windows", type=int, default=8, help="validation windows per domain")
    ap.add_argument("--out", type=Path, default=Path("calib_knee.json"))
    a = ap.parse_args()
    tokens = sorted(a.tokens)
    if any(t > WINDOW and t % WINDOW for t in tokens):
        ap.error(f"token counts above {WINDOW} must be multiples of {WINDOW}")
    res = json.loads(a.out.read_text()) if a.out.exists() else {}
    if "freq" not in res:
        freq, reap, infos, secs = range_stats(tokens)
        res.update(freq=freq.tolist(), reap=reap.tolist(), infos=infos, calib_seconds=secs)
        a.out.write_text(json.dumps(res))
    freq, reap = np.array(res["freq"]), np.array(res["reap"])
    tok = load_tokenizer(SRC)
    ids = {d: val_ids(tok, d, a.windows) for d in DOMAINS}
    if "bf16" not in res:
        m = load_model(SRC, dtype="float32")
        res["bf16"] = {d: perplexity(m, ids[d], WINDOW).ppl for d in DOMAINS}
        del m
    tmp = Path(tempfile.mkdtemp(prefix="calib-knee-"))
    builds = res.setdefault("builds", {})
    for k in a.prune:
        for r, t in enumerate(tokens):
            key = f"{k}/{t}"
            if key in builds:
                continue
            stats = stats_at(freq, reap, r, t)
            kept = select_experts(stats, k, "reap-sum", stats.num_layers, stats.num_experts)
            infos = [dict(i, tokens=min(t, i["tokens"])) for i in res["infos"]]
            opts = ConvertOptions(recipe=load_recipe(a.recipe), prune_to=k,
                                  calib=[TEXT / f"{d}.calib.txt" for d in DOMAINS],
                                  calib_tokens=t, force=True, progress=False)
            out = tmp / key.replace("/", "-")
            convert(str(SRC), out, opts, log=lambda m: None, stats=stats, calib_info=infos)
            m = load_model(out, dtype="float32")
            ppl = {d: perplexity(m, ids[d], WINDOW).ppl for d in DOMAINS}
            del m
            mx.clear_cache()
            builds[key] = {"kept": [list(map(int, x)) for x in kept], "ppl": ppl}
            print(key, {d: round(v, 3) for d, v in ppl.items()}, flush=True)
            a.out.write_text(json.dumps(res))
    report(res, a.prune, tokens)
    return 0


def report(res: dict, prunes: list[int], tokens: list[int]) -> None:
    """Markdown table: perplexity per domain (and vs the largest count), kept-expert overlap."""
    top = tokens[-1]
    print("| prune | tokens/domain | " + " | ".join(f"ppl {d}" for d in DOMAINS)
          + " | kept = largest's |")
    print("|---|---|" + "---|" * len(DOMAINS) + "---|")
    for k in prunes:
        ref = res["builds"][f"{k}/{top}"]
        for t in tokens:
            b = res["builds"][f"{k}/{t}"]
            same = sum(len(set(x) & set(y)) for x, y in zip(b["kept"], ref["kept"]))
            total = sum(len(y) for y in ref["kept"])
            cells = [f"{b['ppl'][d]:.2f} ({100 * (b['ppl'][d] / ref['ppl'][d] - 1):+.1f}%)"
                     for d in DOMAINS]
            print(f"| {k} | {t} | " + " | ".join(cells) + f" | {same}/{total} |")


if __name__ == "__main__":
    raise SystemExit(main())

"""Train a multi-token-prediction head for a frozen checkpoint, by self-distillation (issue 27).

Why: speculative decoding's `mtp` drafter needs a trained head (`mtp.*`), and no small model
ships one. The head learns the trunk's own distribution: from (the trunk's hidden at t, token
t+1) it must give what the trunk predicts at t+1, i.e. its distribution for token t+2
(soft cross-entropy against the trunk's softmax). Only the head trains; the trunk, its
embeddings and lm_head stay frozen, so the head can be added to a released checkpoint.

    python scripts/train_mtp.py assets/pocket-tiny-bf16 /tmp/with-head [--minutes 4]
        [--steps 600] [--tokens 49152] [--input post-norm|pre-norm] [--seed 0]
        [--text FILE ...] [--val FILE ...] [--json]

OUT is SRC plus the head in the layout Qwen3.5 ships it: `mtp.fc`, `mtp.pre_fc_norm_*`,
`mtp.layers.0.*` (gated full attention and an MoE block with per-expert
`mlp.experts.N.{gate,up,down}_proj`), `mtp.norm`, in SRC's float dtype, and
`mtp_num_hidden_layers: 1` in config.json; so `pocket-mlx convert` meets it as on a real
Qwen3.5 checkpoint. Norm weights follow SRC's convention (a transformers checkpoint stores
w - 1). SRC's own tensors are copied unchanged. `--val` reports the drafter's acceptance per
depth on the trunk's greedy continuation of each file's first document (see `acceptance`).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pocket_mlx import kernels  # noqa: E402
from pocket_mlx.convert.writer import atomic_dir, save_weights  # noqa: E402
from pocket_mlx.corpus import read_documents, token_stream, windows  # noqa: E402
from pocket_mlx.engine.loader import load, load_weights, open_model  # noqa: E402
from pocket_mlx.errors import PocketError  # noqa: E402
from pocket_mlx.models.qwen3_5_moe import MTP  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = [ROOT / "assets" / "text" / f"{d}.calib.txt" for d in ("en", "zh", "code")]
INPUTS = ("post-norm", "pre-norm")
NORMS = ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "input_layernorm",
         "post_attention_layernorm", "q_norm", "k_norm")


# ---- the trunk's side: hidden states, frozen --------------------------------------------------

def trunk_hidden(model, ids: mx.array) -> tuple[mx.array, mx.array]:
    """(pre-norm, post-norm) final hidden states of the trunk over `ids` [B, T]."""
    tm = model.language_model.model
    h = tm.embed_tokens(ids)
    for layer in tm.layers:
        h = layer(h)
    return h, tm.norm(h)


def trunk_data(model, tokenizer, files: list[Path], tokens: int, window: int):
    """Windows of `window` tokens (an equal share of `tokens` from each file) and the trunk's
    pre- and post-norm hidden states over them: ids [N, W], pre, post [N, W, H] float32."""
    per_file = max(window, tokens // max(len(files), 1))
    wins = []
    for f in files:
        ids = token_stream(read_documents(f), tokenizer)[:per_file]
        wins += [w for w in windows(ids, window) if len(w) == window]
    if not wins:
        raise PocketError(f"too little training text for windows of {window} tokens")
    ids = mx.array(wins, mx.uint32)
    pre, post = [], []
    for i in range(0, ids.shape[0], 8):
        a, b = trunk_hidden(model, ids[i:i + 8])
        mx.eval(a, b)
        pre.append(a)
        post.append(b)
    return ids, mx.concatenate(pre), mx.concatenate(post)


# ---- the head ----------------------------------------------------------------------------------

def init_head(model, seed: int) -> MTP:
    """A head whose layer starts as a copy of the trunk's last full-attention layer (attention
    and MoE), fc passing the (normed) hidden half through, and the trunk's final norm: at step 0
    it is the trunk's last layer applied once more, a better start than noise."""
    args = copy.copy(model.args)
    args.mtp_num_hidden_layers = 1
    mx.random.seed(seed)
    head = MTP(args)
    src = [layer for layer in model.layers if not layer.is_linear][-1]
    head.layers[0].update(src.parameters())
    H = args.hidden_size
    fc = mx.concatenate([0.01 * mx.random.normal((H, H)), mx.eye(H)], axis=1)
    head.fc.weight = fc.astype(mx.float32)
    head.norm.weight = mx.array(model.language_model.model.norm.weight)
    head.update(tree_map_float32(head.parameters()))
    mx.eval(head.parameters())
    return head


def tree_map_float32(tree):
    from mlx.utils import tree_map
    return tree_map(lambda a: a.astype(mx.float32), tree)


def head_forward(model, head: MTP, hidden: mx.array, next_ids: mx.array, cache=None, step=0,
                 pre_norm_out: bool = False):
    """The head as the model runs it (models/qwen3_5_moe.py MTP.__call__), returning also its
    hidden before `norm`: (post-norm out, pre-norm out)."""
    embeds = model.language_model.model.embed_tokens(next_ids)
    x = mx.concatenate([head.pre_fc_norm_embedding(embeds), head.pre_fc_norm_hidden(hidden)],
                       axis=-1)
    x = head.fc(x)
    x = head.layers[step % len(head.layers)](x, cache[0] if cache is not None else None)
    return head.norm(x), x


def train(model, head: MTP, ids, inp, post, steps: int, minutes: float, batch: int,
          lr: float, seed: int, log) -> list[tuple[float, float]]:
    """Adam on the soft cross-entropy against the trunk's next-token distribution at t+1.
    Returns (loss, KL to the trunk) of every step.

    The vocabulary product (lm_head and its gradient) runs in numpy: MLX's CPU matmul here is
    its reference BLAS, 25-50x slower than numpy's OpenBLAS for [tokens, H] x [H, vocab]. So
    a step is: the head's forward in MLX, loss and dL/dg in numpy, then MLX's gradient of
    sum(g * dL/dg) (the same parameter gradient as the loss's)."""
    W = np.array(model.language_model.lm_head.weight, np.float32)  # [V, H]
    opt = optim.Adam(learning_rate=optim.join_schedules(
        [optim.linear_schedule(lr / 10, lr, 20), optim.cosine_decay(lr, max(steps - 20, 1))],
        [20]))

    def surrogate(head, h, nxt, dg):
        return (head_forward(model, head, h, nxt)[0] * dg).sum()

    grad_fn = nn.value_and_grad(head, surrogate)
    rng = np.random.default_rng(seed)
    losses, t0 = [], time.monotonic()
    for s in range(steps):
        pick = mx.array(rng.choice(ids.shape[0], size=min(batch, ids.shape[0]), replace=False))
        h, nxt = inp[pick][:, :-1], ids[pick][:, 1:]
        g = head_forward(model, head, h, nxt)[0]
        loss, kl, dg = soft_ce(np.array(g), np.array(post[pick][:, 1:]), W)
        _, grads = grad_fn(head, h, nxt, mx.array(dg))
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state)
        losses.append((loss, kl))
        if s % 25 == 0 or s == steps - 1:
            log(f"step {s:4d}  loss {loss:.4f}  KL {kl:.4f}  {time.monotonic() - t0:.0f} s")
        if minutes and time.monotonic() - t0 > 60 * minutes:
            log(f"stopped at step {s} ({minutes:g} min)")
            break
    return losses


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def soft_ce(g: np.ndarray, target_hidden: np.ndarray, W: np.ndarray
            ) -> tuple[float, float, np.ndarray]:
    """Mean over positions of -sum p log q, q = softmax(g W^T) (the head), p = the trunk's
    softmax at the target positions; KL(p || q) (the same less p's entropy); and the
    gradient with respect to g."""
    shape = g.shape
    g, t = g.reshape(-1, shape[-1]), target_hidden.reshape(-1, shape[-1])
    p = _softmax(t @ W.T)
    z = g @ W.T
    z -= z.max(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    n = g.shape[0]
    loss = float(-(p * logq).sum() / n)
    entropy = float(-(p * np.log(np.maximum(p, 1e-30))).sum() / n)
    dg = ((np.exp(logq) - p) @ W) / n
    return loss, loss - entropy, dg.reshape(shape).astype(np.float32)


def agreement(model, head, ids, inp, post, windows: int = 16) -> float:
    """Share of positions (first `windows` windows) where the head's argmax equals the trunk's
    at t+1 (teacher forced)."""
    W = np.array(model.language_model.lm_head.weight, np.float32)
    g, _ = head_forward(model, head, inp[:windows][:, :-1], ids[:windows][:, 1:])
    a = (np.array(g) @ W.T).argmax(-1)
    b = (np.array(post[:windows][:, 1:]) @ W.T).argmax(-1)
    return float((a == b).mean())


# ---- acceptance per depth, as the drafter would see it ------------------------------------------

def acceptance(model, head, tokenizer, files: list[Path], input_kind: str, prompt: int = 64,
               n: int = 256, depth: int = 3) -> dict:
    """The drafter's acceptance per depth on each file's first document: the trunk continues
    its first `prompt` tokens greedily for `n` tokens; at every position of the reply the head
    drafts `depth` tokens as engine/mtp_drafter.py does (its cache holding one entry per
    position, built on the trunk's hidden; deeper drafts chained on its own hidden, their
    entries trimmed), and draft d counts as accepted when drafts 1..d equal the reply's next
    d tokens (what a greedy verify pass keeps). Returns per file and over all:
    {"reached": [..], "accepted": [..], "rate": [accepted_d / reached_d], "per_pass": ...}."""
    from pocket_mlx.models.cache import KVCache
    lm = model.language_model
    out = {}
    total = np.zeros((2, depth), int)
    for f in files:
        ids = token_stream(read_documents(f)[:1], tokenizer)[:prompt]
        cache = model.make_cache()
        logits = model(mx.array(ids)[None], cache=cache)
        seq = list(ids)
        for _ in range(n):
            tok = int(mx.argmax(logits[0, -1]).item())
            seq.append(tok)
            logits = model(mx.array([[tok]]), cache=cache)
        pre, post = trunk_hidden(model, mx.array(seq)[None])
        hid = post if input_kind == "post-norm" else pre
        hc = [KVCache()]
        counts = np.zeros((2, depth), int)
        for p in range(len(seq) - 2):
            g, x = head_forward(model, head, hid[:, p:p + 1], mx.array([[seq[p + 1]]]), hc)
            if p + 1 < len(ids) - 1:  # the pending token is still the prompt's
                mx.eval(hc[0].keys)
                continue
            mark = hc[0].offset
            drafts = []
            for d in range(depth):
                tok = mx.argmax(lm.logits(g)[0, -1])
                drafts.append(tok)
                if d + 1 < depth:
                    chain = g if input_kind == "post-norm" else x
                    g, x = head_forward(model, head, chain, tok.reshape(1, 1), hc, step=d + 1)
            drafts = [int(t) for t in mx.stack(drafts).tolist()]
            hc[0].trim(hc[0].offset - mark)
            ok = True
            for d, t in enumerate(drafts):
                if p + 2 + d >= len(seq):
                    break
                counts[0, d] += ok
                ok = ok and t == seq[p + 2 + d]
                counts[1, d] += ok
        total += counts
        out[f.name] = _rates(counts)
    out["all"] = _rates(total)
    return out


def _rates(c: np.ndarray) -> dict:
    rate = [round(float(a / r), 3) if r else 0.0 for r, a in zip(c[0], c[1])]
    return {"reached": c[0].tolist(), "accepted": c[1].tolist(), "rate": rate,
            "accepted_per_pass_k3": round(float(c[1].sum() / c[0][0]), 3) if c[0][0] else 0.0}


# ---- writing the head in Qwen3.5's layout ----------------------------------------------------------

def hf_head_tensors(head: MTP, dtype: mx.Dtype, hf_norms: bool) -> dict[str, mx.array]:
    """The head's tensors under the names Qwen3.5 ships: routed experts per expert
    (`mlp.experts.N.*`), norms as the checkpoint stores them (w - 1 in a transformers one)."""
    out = {}
    for name, v in tree_flatten(head.parameters()):
        key = "mtp." + name
        if ".switch_mlp." in key:
            prefix, proj = key.split(".switch_mlp.")
            proj = proj.removesuffix(".weight")
            for e in range(v.shape[0]):
                out[f"{prefix}.experts.{e}.{proj}.weight"] = v[e].astype(dtype)
            continue
        if key.split(".")[-2] in NORMS and v.ndim == 1:
            out[key] = (v - 1.0 if hf_norms else v).astype(mx.float32)
            continue
        out[key] = v.astype(dtype)
    return out


def write(src: Path, out: Path, head: MTP, force: bool, extra: dict) -> None:
    """OUT = SRC's files and tensors unchanged (any old head dropped), plus the new head."""
    folder = open_model(src)
    weights = {k: v for k, v in load_weights(folder).items()
               if not k.startswith(("mtp.", "model.mtp."))}
    dtype = next(v.dtype for k, v in weights.items() if k.endswith("embed_tokens.weight"))
    hf = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())
    weights.update(hf_head_tensors(head, dtype, hf))
    config = json.loads((src / "config.json").read_text())
    inner = config.get("text_config")
    (inner if isinstance(inner, dict) else config)["mtp_num_hidden_layers"] = 1
    with atomic_dir(out, force=force) as tmp:
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith("model") and f.suffix != ".safetensors":
                shutil.copyfile(f, tmp / f.name)
        save_weights(tmp, sorted(weights.items()),
                     expected_bytes=sum(v.nbytes for v in weights.values()))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "mtp_train.json").write_text(json.dumps(extra, indent=2) + "\n")


# ---- command line -------------------------------------------------------------------------------

def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="frozen checkpoint folder (float)")
    ap.add_argument("out", type=Path, help="output folder: SRC plus the head")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: no cap)")
    ap.add_argument("--tokens", type=int, default=12288, help="training tokens (all files)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--input", choices=INPUTS, default="post-norm",
                    help="the trunk hidden the head reads (default post-norm, as vLLM)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", type=Path, action="append",
                    help="training text (repeatable; default assets/text/{en,zh,code}.calib.txt)")
    ap.add_argument("--val", type=Path, action="append", default=[],
                    help="held-out text: report acceptance per depth (repeatable)")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    a = ap.parse_args(argv)
    for name in ("steps", "tokens", "window", "batch"):
        if getattr(a, name) < (2 if name == "window" else 1):
            ap.error(f"--{name} must be positive")
    if not (a.lr > 0 and math.isfinite(a.lr)) or not (a.minutes >= 0 and math.isfinite(a.minutes)):
        ap.error("--lr must be > 0 and --minutes >= 0")
    if not (a.src / "config.json").is_file():
        raise PocketError(f"{a.src} is not a model folder (no config.json)")
    if a.out.resolve() == a.src.resolve() and not a.force:
        raise PocketError("OUT is SRC: pass --force to add the head in place")
    for f in (a.text or DEFAULT_TEXT) + a.val:
        if not Path(f).is_file():
            raise PocketError(f"no such text file: {f}")
    return a


def main(argv=None) -> int:
    try:
        a = parse(argv)
        log = (lambda s: print(s, file=sys.stderr)) if a.json else print
        model, tok = load(a.src, device="cpu", dtype="float32")
        files = a.text or DEFAULT_TEXT
        t0 = time.monotonic()
        ids, pre, post = trunk_data(model, tok, files, a.tokens, a.window + 1)
        inp = post if a.input == "post-norm" else pre
        log(f"trunk: {ids.size} tokens in {ids.shape[0]} windows, {time.monotonic() - t0:.1f} s")
        kernels.set_enabled(False)  # gradients: MLX's own ops (the extension's have no VJP)
        head = init_head(model, a.seed)
        before = agreement(model, head, ids, inp, post)
        losses = train(model, head, ids, inp, post, a.steps, a.minutes, a.batch, a.lr, a.seed,
                       log)
        after = agreement(model, head, ids, inp, post)
        kernels.set_enabled(True)
        summary = {"input": a.input, "steps": len(losses), "tokens": int(ids.size), "lr": a.lr,
                   "batch": a.batch, "window": a.window,
                   "loss_first": round(losses[0][0], 4),
                   "loss_last": round(float(np.mean([x[0] for x in losses[-10:]])), 4),
                   "kl_first": round(losses[0][1], 4),
                   "kl_last": round(float(np.mean([x[1] for x in losses[-10:]])), 4),
                   "train_agreement_before": round(before, 4),
                   "train_agreement_after": round(after, 4),
                   "seconds": round(time.monotonic() - t0, 1), "seed": a.seed,
                   "text": [Path(f).name for f in files]}
        if a.val:
            summary["acceptance"] = acceptance(model, head, tok, a.val, a.input)
        write(a.src, a.out, head, a.force, summary)
        if a.json:
            print(json.dumps(summary))
        else:
            print(json.dumps(summary, indent=1))
        return 0
    except PocketError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

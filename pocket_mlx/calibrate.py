"""Calibration text and router statistics, computed one layer at a time.

The model is loaded lazily and run layer by layer over all calibration windows: each layer's
weights are read, used on every window, then dropped. Peak memory is one layer plus the hidden
states of the calibration windows, whatever the size of the checkpoint.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from .errors import PocketError
from .prune import ExpertStats

SEPARATOR = "<|endoftext|>"


@dataclass
class TextFile:
    name: str
    size: int
    sha256: str
    tokens: int  # tokens used (after any cap)

    def as_dict(self) -> dict:
        return asdict(self)


def read_documents(path: Path, separator: str = SEPARATOR) -> list[str]:
    """Documents of a text file, split on lines that are exactly `separator`."""
    path = Path(path)
    if not path.is_file():
        raise PocketError(f"no such text file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PocketError(f"cannot read {path} as UTF-8 text: {e}") from None
    docs, cur = [], []
    for line in text.splitlines(keepends=True):
        if line.strip() == separator:
            docs.append("".join(cur))
            cur = []
        else:
            cur.append(line)
    docs.append("".join(cur))
    docs = [d.strip("\n") for d in docs]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise PocketError(f"{path} has no text")
    return docs


def token_stream(docs: list[str], tokenizer, separator: str = SEPARATOR) -> list[int]:
    """All documents' tokens, joined by the separator token when the tokenizer has one."""
    sep = tokenizer.token_to_id(separator) if separator else None
    if sep is None:
        sep = tokenizer.token_to_id(SEPARATOR)
    ids: list[int] = []
    for i, d in enumerate(docs):
        if i and sep is not None:
            ids.append(sep)
        ids.extend(tokenizer.encode(d, add_special_tokens=False))
    return ids


def windows(ids: list[int], window: int, min_len: int = 2) -> list[list[int]]:
    """Consecutive non-overlapping windows; a last short one is kept if it has `min_len`."""
    out = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in out if len(w) >= min_len]


def file_info(path: Path, tokens: int) -> TextFile:
    data = Path(path).read_bytes()
    return TextFile(Path(path).name, len(data), hashlib.sha256(data).hexdigest(), tokens)


def calibration_windows(files: list[Path], tokenizer, window: int = 512,
                        max_tokens: int = 16384) -> tuple[list[list[int]], list[TextFile]]:
    """Windows from each file (at most `max_tokens` per file, so domains weigh equally)."""
    chunks, infos = [], []
    for f in files:
        f = Path(f)
        if not f.is_file():
            raise PocketError(f"calibration file {f} does not exist")
        if f.stat().st_size == 0:
            raise PocketError(f"calibration file {f} is empty")
        ids = token_stream(read_documents(f), tokenizer)[:max_tokens]
        if len(ids) < 2:
            raise PocketError(f"calibration file {f} has too little text")
        chunks += windows(ids, window)
        infos.append(file_info(f, len(ids)))
    return chunks, infos


def collect_stats(model, chunks: list[list[int]], progress: bool = True) -> ExpertStats:
    """Run the windows through a (lazily loaded) model layer by layer, observing each MoE
    block. The model's layers are dropped as they are done: do not use it afterwards."""
    from tqdm import tqdm

    if not chunks:
        raise PocketError("no calibration text")
    lm = model.language_model
    layers = lm.model.layers
    stats = ExpertStats(len(layers), model.args.num_experts)
    stats.tokens = sum(len(c) for c in chunks)
    hs = []
    for c in chunks:
        h = lm.model.embed_tokens(mx.array(c, mx.int32)[None])
        mx.eval(h)
        hs.append(h)
    for i in tqdm(range(len(layers)), desc="calibrate", unit="layer", disable=not progress,
                  leave=False):
        layer = layers[i]
        layer.mlp.observer = stats.observer(i)
        for j, h in enumerate(hs):
            hs[j] = layer(h)
            mx.eval(hs[j])
        layer.mlp.observer = None
        layers[i] = None  # drop this layer's weights
        del layer
    return stats

"""Text files as documents, a token stream and fixed windows: the corpus reading shared by
calibration (`convert`) and by perplexity and routing statistics (`analysis`).

Why its own module, at the bottom of the import order: both layers read text the same way, and
analysis should not import convert's calibration machinery (MLX, the recipes) for three small
functions.
"""

from __future__ import annotations

from pathlib import Path

from pocket_mlx.errors import PocketError

SEPARATOR = "<|endoftext|>"


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

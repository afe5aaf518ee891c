"""The embedding endpoints' wire formats: Ollama's POST /api/embed and its older
/api/embeddings, and OpenAI's POST /v1/embeddings, checked into one `EmbedRequest` and rendered
from the vectors (engine/embedding.py makes them: the model's final hidden states, mean-pooled
and L2-normalized, as llama.cpp's server does for a generative model).

Why one module for three: they differ only in field names and reply shapes. Pure data: no
MLX, no engine, no HTTP.
"""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from pocket_mlx.server.requests import ApiError
from pocket_mlx.server.wire import bool_field, type_field, unsupported

MAX_INPUTS = 256  # texts in one request


@dataclass
class EmbedRequest:
    model: str | None
    inputs: list[str | list[int]]  # texts, or token ids (OpenAI's)
    truncate: bool = True  # cut an input to the window (else a 400)
    dimensions: int | None = None  # keep the first N values (renormalized)
    base64: bool = False  # OpenAI's encoding_format "base64"
    ignored: list[str] = field(default_factory=list)


def _model(body: dict, required: bool) -> str | None:
    model = body.get("model")
    if model is None and not required:
        return None
    if not isinstance(model, str) or not model:
        raise ApiError(400, f"model is required (a model name), got {model!r}", param="model",
                       code="missing_required")
    return model


def _dimensions(body: dict) -> int | None:
    d = body.get("dimensions")
    if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
        raise ApiError(400, f"dimensions must be an integer >= 1, got {d!r}",
                       param="dimensions", code="invalid_value")
    return d


def _texts(value: Any, name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, f"{name} must be a string or a list of strings", param=name,
                       code="invalid_type")
    return texts


def _counted(inputs: list, name: str) -> list:
    if not inputs:
        raise ApiError(400, f"{name} is empty: nothing to embed", param=name,
                       code="invalid_value")
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"{name}: at most {MAX_INPUTS} inputs per request", param=name,
                       code="invalid_value")
    return inputs


def _unknown(body: dict, known: set[str]) -> list[str]:
    return sorted(set(body) - known)


def parse_ollama(body: dict) -> EmbedRequest:
    """/api/embed: `input` a string or a list of them; `truncate` (default true), `dimensions`,
    `options` and `keep_alive` (accepted)."""
    if "input" not in body or body["input"] is None:
        raise ApiError(400, "input is required", param="input", code="missing_required")
    inputs = _counted(_texts(body["input"], "input"), "input")
    truncate = True if body.get("truncate") is None else bool_field(body, "truncate")
    type_field(body, "options", (dict,), "an object")
    return EmbedRequest(_model(body, True), inputs, truncate, _dimensions(body),
                        ignored=_unknown(body, {"model", "input", "truncate", "options",
                                                "keep_alive", "dimensions"}))


def parse_ollama_legacy(body: dict) -> EmbedRequest:
    """/api/embeddings (Ollama's older endpoint): one `prompt`."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, f"prompt must be a string, got {prompt!r}", param="prompt",
                       code="invalid_type")
    type_field(body, "options", (dict,), "an object")
    return EmbedRequest(_model(body, True), _counted([prompt], "prompt"),
                        ignored=_unknown(body, {"model", "prompt", "options", "keep_alive"}))


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)


def parse_openai(body: dict) -> EmbedRequest:
    """/v1/embeddings: `input` a string, a list of strings, token ids or lists of them;
    `encoding_format` float or base64 (little-endian float32, the openai SDK's default);
    `dimensions`; `user` (accepted)."""
    raw = body.get("input")
    if raw is None:
        raise ApiError(400, "input is required", param="input", code="missing_required")
    if _token_ids(raw):
        inputs: list = [raw]
    elif isinstance(raw, list) and raw and all(_token_ids(x) for x in raw):
        inputs = list(raw)
    else:
        try:
            inputs = _texts(raw, "input")
        except ApiError:
            raise ApiError(400, "input must be a string, a list of strings, a list of token "
                                "ids or a list of such lists", param="input",
                           code="invalid_type") from None
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64", None):
        raise unsupported("encoding_format", f"{fmt!r} (float or base64)")
    return EmbedRequest(_model(body, False), _counted(inputs, "input"),
                        dimensions=_dimensions(body), base64=fmt == "base64",
                        ignored=_unknown(body, {"model", "input", "encoding_format",
                                                "dimensions", "user"}))


def shaped(vector: list[float], dimensions: int | None) -> list[float]:
    """`vector` cut to its first `dimensions` values and scaled back to unit length; a 400
    when the model's vectors are shorter."""
    if dimensions is None or dimensions == len(vector):
        return vector
    if dimensions > len(vector):
        raise ApiError(400, f"dimensions: this model's vectors have {len(vector)} values",
                       param="dimensions", code="invalid_value")
    cut = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / norm for x in cut]


def ollama_reply(model: str, vectors: list[list[float]], prompt_tokens: int,
                 total_ns: int, load_ns: int) -> dict:
    return {"model": model, "embeddings": vectors, "total_duration": total_ns,
            "load_duration": load_ns, "prompt_eval_count": prompt_tokens}


def openai_reply(model: str, vectors: list[list[float]], prompt_tokens: int,
                 as_base64: bool) -> dict:
    def value(v: list[float]):
        if not as_base64:
            return v
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")

    data = [{"object": "embedding", "index": i, "embedding": value(v)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

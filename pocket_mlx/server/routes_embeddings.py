"""The embedding endpoints: Ollama's POST /api/embed and /api/embeddings, OpenAI's POST
/v1/embeddings. The texts are tokenized here, the vectors made on the model's thread (the
worker's `embed`: engine/embedding.py, between two batch steps) and shaped by
server/embeddings.py.

Why a module of its own: the three endpoints share everything but their field names and reply
shapes, and belong to neither chat API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pocket_mlx.server import embeddings as wire
from pocket_mlx.server.ollama import ns
from pocket_mlx.server.replies import check_model, read_json
from pocket_mlx.server.requests import ApiError, GenRequest
from pocket_mlx.server.routes_ollama import served
from pocket_mlx.server.state import worker

log = logging.getLogger(__name__)


def token_ids(request: Request, er: wire.EmbedRequest) -> list[list[int]]:
    """Each input's token ids (texts tokenized as a completion's prompt, ids checked against
    the vocabulary), cut to the window when `truncate`, else a 400 past it."""
    w = worker(request)
    out = []
    for i, item in enumerate(er.inputs):
        where = f"input[{i}]" if len(er.inputs) > 1 else "input"
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{where}: the text holds a lone UTF-16 surrogate",
                               param="input", code="invalid_value") from None
            ids = list(w.tokenizer.encode(item))
        else:  # checked against the vocabulary by the prompt code (a 400 past the window)
            ids = w.encode(GenRequest(kind="completion", model=None, prompt=item))
        if not ids:
            raise ApiError(400, f"{where} is empty after tokenization: nothing to embed",
                           param="input", code="invalid_value")
        if len(ids) > w.context:
            if not er.truncate:
                raise ApiError(400, f"{where} is {len(ids)} tokens; this model's window is "
                                    f"{w.context} (send truncate: true to cut it)",
                               param="input", code="context_length_exceeded")
            ids = ids[:w.context]
        out.append(ids)
    return out


async def vectors(request: Request, er: wire.EmbedRequest) -> tuple[list[list[float]], int,
                                                                     float]:
    """(the vectors, shaped to `dimensions`; the tokens read; seconds on the model's thread)."""
    ids = await run_in_threadpool(token_ids, request, er)
    job = worker(request).embed(ids, asyncio.get_running_loop())
    try:
        got = await job.result
    finally:
        job.cancelled.set()  # (when the client left first: not run if still queued)
    log.info(f"200 {request.method} {request.url.path}: {len(ids)} input(s), "
             f"{sum(map(len, ids))} tokens, {job.seconds:.2f} s")
    return [wire.shaped(v, er.dimensions) for v in got], sum(map(len, ids)), job.seconds


def headers(er: wire.EmbedRequest) -> dict[str, str]:
    return {"X-Pocket-Fields-Ignored": ",".join(er.ignored)} if er.ignored else {}


async def ollama_embed(request: Request, parse: Callable[[dict], wire.EmbedRequest],
                       legacy: bool) -> Response:
    t0 = time.perf_counter()
    er = parse(await read_json(request))
    served(request, er.model)
    vecs, n, ran = await vectors(request, er)
    if legacy:
        return JSONResponse({"embedding": vecs[0]}, headers=headers(er))
    total = time.perf_counter() - t0
    return JSONResponse(wire.ollama_reply(er.model or "", vecs, n, ns(total),
                                          ns(max(0.0, total - ran))), headers=headers(er))


async def embed(request: Request) -> Response:
    """POST /api/embed."""
    return await ollama_embed(request, wire.parse_ollama, legacy=False)


async def embeddings(request: Request) -> Response:
    """POST /api/embeddings (Ollama's older endpoint): {"embedding": [...]}."""
    return await ollama_embed(request, wire.parse_ollama_legacy, legacy=True)


async def openai_embeddings(request: Request) -> Response:
    """POST /v1/embeddings."""
    er = wire.parse_openai(await read_json(request))
    check_model(request, er.model)
    vecs, n, _ = await vectors(request, er)
    return JSONResponse(wire.openai_reply(er.model or worker(request).model_id, vecs, n,
                                          er.base64), headers=headers(er))

"""OpenAI's Responses endpoint (POST /v1/responses) as a module-level handler reading
`request.app.state`; its refusals are OpenAI's error objects.

Why apart from responses.py: that module is the wire format only (bodies in, objects and
events out, no HTTP); this one runs the request and sends the events, each as an SSE
`event: <type>` line and its `data:` line, as OpenAI's server does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pocket_mlx.server import responses
from pocket_mlx.server.jobs import Call, Done, Failed, Reasoning, ReplyEvent, Text, Whole
from pocket_mlx.server.replies import answer, read_json
from pocket_mlx.server.state import worker
from pocket_mlx.server.streaming import event, keepalive_s, kept_alive

BEAT = "beat"  # what `kept_alive` hands over in a silence (reply events are never strings)


async def create(request: Request) -> Response:
    """POST /v1/responses."""
    parsed = responses.parse_responses(await read_json(request))
    reply = responses.Response(parsed, worker(request).model_id)

    def full(whole: Whole) -> dict:
        return reply.whole(whole)

    def stream(evs: AsyncIterator[ReplyEvent]) -> AsyncIterator[str]:
        return response_events(reply, evs)

    return await answer(request, parsed.req, "call_", full, stream)


async def response_events(reply: responses.Response, evs: AsyncIterator[ReplyEvent]
                          ) -> AsyncIterator[str]:
    """response.created and response.in_progress at once, then each output item's events as
    the reply arrives, then response.completed (or .incomplete, or .failed) with the whole
    response object and its usage. In a silence (a long prompt prefilling) response.in_progress
    again, a little more often than `sse`'s own beat, which then never comes."""
    for ev in reply.start():
        yield event(ev["type"], ev)
    async for ev in kept_alive(evs, BEAT, keepalive_s() * 0.8):
        if isinstance(ev, str):
            out = [reply.beat()]
        elif isinstance(ev, (Reasoning, Text, Call)):
            out = reply.feed(ev)
        elif isinstance(ev, Done):
            out = reply.end(ev)
        elif isinstance(ev, Failed):
            out = reply.failed(ev.error)
        else:
            continue
        for e in out:
            yield event(e["type"], e)

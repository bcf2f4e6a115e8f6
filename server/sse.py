"""Server-sent events: framing, keep-alives, and the response object every streaming API uses.

Framing (api.md section 0): ``Content-Type: text/event-stream``, ``Cache-Control: no-cache``,
``X-Accel-Buffering: no``, no Content-Length; one JSON document per ``data:`` line, a blank line
after each event, an ``event:`` line where the grammar names events. ``:`` comment lines are
keep-alives that every SDK ignores.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}
KEEPALIVE = b": keep-alive\n\n"


def event(data: Any, name: str | None = None) -> bytes:
    """One SSE event; `data` is JSON-encoded unless it is already a str (e.g. "[DONE]")."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {body}\n\n".encode()


async def with_keepalive(source: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """Yield `source`'s chunks, plus a keep-alive comment whenever it is silent for interval_s."""
    it = source.__aiter__()
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield chunk
    finally:
        if pending is not None and not pending.done():
            # the source is running inside `pending` (aclose() would raise "already running"); the
            # cancellation ends it from inside that task, running its finally blocks
            pending.cancel()
        else:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()


def sse_response(source: AsyncIterator[bytes], *, headers: dict[str, str] | None = None,
                 keepalive_s: float = 15.0) -> StreamingResponse:
    """A streaming response of SSE bytes with the standard headers and keep-alives."""
    return StreamingResponse(with_keepalive(source, keepalive_s), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **(headers or {})})

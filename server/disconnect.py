"""Client disconnects for responses that are not streams, and a guard for responses that are.

A non-streaming handler awaits the whole generation before it answers, so nothing notices a client
that closed the connection (Claude Code and Codex cancel by closing it, api.md §8). `until_disconnect`
runs the work while watching the receive channel; on http.disconnect it cancels the work (which
closes Service.generate, which cancels the request in the engine) and raises ClientGone.

`Guarded(response, cleanup)` runs `cleanup()` however an ASGI response ends (finished, client gone,
task cancelled), e.g. Service.release for a request submitted before its stream started.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> Any:
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientGone()


class Guarded:
    """An ASGI app wrapping a response; cleanup() runs when it ends, however it ends."""

    def __init__(self, response, cleanup: Callable[[], None]):
        self.response, self.cleanup = response, cleanup
        self.status_code = getattr(response, "status_code", 200)
        self.headers = getattr(response, "headers", None)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.cleanup()

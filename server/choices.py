"""n > 1 (OpenAI chat and completions): a request's n choices as n engine requests.

The prompt is rendered and tokenised once (Service.prepare); `copies` makes the n Prepared that share
it, choice i with seed + i when the request gave a seed (so the choices differ and a repeat of the
request gives the same n), else each with its own random seed. They are submitted together (one
refused -> the others are released and the refusal is the response), run concurrently, and `merged`
interleaves their deltas by arrival, tagged with the choice index. Usage counts the prompt once and the
completion tokens of every choice (as OpenAI's).
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing
from typing import AsyncIterator

from server.service import APIError, Delta, Prepared, Service

MAX_CHOICES = 128                      # OpenAI's bound on n


def copies(prepared: Prepared, n: int) -> list[Prepared]:
    """The n Prepared of a request (the first is `prepared` itself)."""
    out = [prepared]
    seed = prepared.params.seed
    for i in range(1, n):
        params = prepared.params
        if seed is not None:
            s = seed + i
            params = dataclasses.replace(params, seed=s - 2**64 if s >= 2**64 else s)
        out.append(dataclasses.replace(prepared, params=params, request_id=f"{prepared.request_id}.{i}",
                                       submitted=None, claimed=False, orphan_guard=None))
    return out


async def submit_all(service: Service, preps: list[Prepared]) -> None:
    """Submit every choice; when one is refused, release those already submitted and raise its error.
    More choices than the engine runs and queues at once (max_concurrency + max_pending) could never
    all be admitted, so that is a 400 naming n, not a 429 to retry for ever."""
    opts = getattr(service.engine, "options", None)          # (None: an engine without them, as in tests)
    limit = opts.max_concurrency + opts.max_pending if opts is not None else None
    if limit is not None and len(preps) > limit:
        raise APIError(400, "invalid_request", f"invalid value for 'n': {len(preps)} choices are more than the "
                       f"server runs and queues at once ({opts.max_concurrency} running + {opts.max_pending} "
                       f"waiting = {limit})", param="n")
    done = []
    try:
        for p in preps:
            await service.submit_async(p)
            done.append(p)
    except BaseException:
        release_all(service, done)
        raise


def release_all(service: Service, preps: list[Prepared]) -> None:
    for p in preps:
        service.release(p)


_END = object()


async def merged(service: Service, preps: list[Prepared]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every choice's Service.generate as they come; each choice's deltas in
    order, its Finish last. The first error of any choice is raised (the others are closed, which cancels
    them in the engine)."""
    if len(preps) == 1:
        async with aclosing(service.generate(preps[0])) as deltas:
            async for d in deltas:
                yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, p: Prepared) -> None:
        try:
            async with aclosing(service.generate(p)) as deltas:
                async for d in deltas:
                    await queue.put((i, d, None))
        except Exception as e:                      # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))
        finally:
            queue.put_nowait((i, _END, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(preps)]
    try:
        left = len(tasks)
        while left:
            i, d, err = await queue.get()
            if err is not None:
                raise err
            if d is _END:
                left -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def complete_all(service: Service, preps: list[Prepared]) -> list:
    """Service.complete of every choice, concurrently; the first error cancels the others."""
    tasks = [asyncio.create_task(service.complete(p)) for p in preps]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(usages: list[dict]) -> dict:
    """Usage of n choices: the prompt once, the completion (and reasoning) tokens of all."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    return {**first, "completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion,
            "reasoning_tokens": sum(u.get("reasoning_tokens", 0) for u in usages)}

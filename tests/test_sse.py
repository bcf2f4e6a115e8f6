"""server.sse.with_keepalive on its own: the chunks in order, keep-alives while the source is silent
(without disturbing it), the source's errors passed on, and its cleanup run when the stream is closed
early, wherever the source was (waiting for its next chunk, or holding one that was not taken)."""

from __future__ import annotations

import asyncio

import pytest

from server.sse import KEEPALIVE, with_keepalive


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_chunks_in_order_with_keepalives_in_the_silences():
    async def source():
        for i in range(5):
            if i in (2, 4):
                await asyncio.sleep(0.12)            # silent for several keep-alive intervals
            yield f"c{i}".encode()

    async def main():
        return [c async for c in with_keepalive(source(), 0.05)]
    out = run(main())
    assert [c for c in out if c != KEEPALIVE] == [b"c0", b"c1", b"c2", b"c3", b"c4"]
    first_gap = out[out.index(b"c1") + 1:out.index(b"c2")]
    assert first_gap and set(first_gap) == {KEEPALIVE}, out    # the source's sleep ran on through them
    assert out[:2] == [b"c0", b"c1"]


def test_a_source_error_comes_out_after_its_chunks():
    async def source():
        yield b"a"
        await asyncio.sleep(0)
        raise ValueError("boom")

    async def main():
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for c in with_keepalive(source(), 5.0):
                got.append(c)
        return got
    assert run(main()) == [b"a"]


@pytest.mark.parametrize("where", ["waiting", "holding"])
def test_closing_early_runs_the_source_cleanup(where):
    """`waiting`: the source is inside an await when the stream closes; `holding`: it has produced a
    chunk nobody took and waits to hand it over. Either way its finally block runs, and no task of the
    wrapper is left behind."""
    events = []

    async def source():
        try:
            yield b"first"
            if where == "waiting":
                await asyncio.sleep(30)
            yield b"second"
            yield b"third"
        finally:
            events.append("cleanup")

    async def main():
        before = len(asyncio.all_tasks())
        gen = with_keepalive(source(), 5.0)
        assert await gen.__anext__() == b"first"
        for _ in range(5):
            await asyncio.sleep(0)                    # let the source run ahead as far as it can
        await gen.aclose()
        for _ in range(20):
            if events and len(asyncio.all_tasks()) == before:
                break
            await asyncio.sleep(0.01)
        return len(asyncio.all_tasks()) - before
    assert run(main()) == 0
    assert events == ["cleanup"]


def test_a_consumer_cancelled_mid_wait_closes_the_source():
    events = []

    async def source():
        try:
            yield b"x"
            await asyncio.sleep(30)
            yield b"y"
        finally:
            events.append("cleanup")

    async def consume():
        async for _ in with_keepalive(source(), 0.02):
            pass

    async def main():
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)                      # past a few keep-alives
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(20):
            if events:
                break
            await asyncio.sleep(0.01)
    run(main())
    assert events == ["cleanup"]

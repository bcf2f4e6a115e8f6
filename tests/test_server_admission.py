"""Admission under a burst, on the real engine behind HTTP and ZeroMQ at once: with --max-concurrency C
and --max-pending P, N > C + P requests sent together get exactly N - C - P refusals (429 /
`rate_limited`) and the other C + P run to the end.

The burst arrives faster than the engine's steps: most of it is submitted before the step that
admits the first requests into their slots. Requests the free slots will take are not waiting for a
slot, so they do not count against max_pending (docs/serving.md); counting every request not yet in a
slot refused up to C of the burst too many (4-5 of 12 got in at C 2, P 4, instead of 6). Bursts are
sent as they come (twice), and once with the coordinator held off its inbox until every request of
the burst is answered: the whole burst within one engine step, which refused exactly C too many."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import httpx
import pytest

from runtime import Engine, EngineOptions
from runtime.tokenizer import Tokenizer, generation_defaults
from server.app import create_app
from server.service import Service
from server.zmq_api import ZmqServer
from server.zmq_client import AsyncZmqClient, ZmqAPIError
from tests.server_util import running, tiny_model_dir, wait_for

C, P, N = 2, 4, 12
# long enough that no request of a burst ends before the whole burst is answered (a wave of C takes
# about 0.25 s on the tiny model; a burst is answered within 5 ms over ZeroMQ, 25 ms over HTTP), short
# enough that the C + P admitted ones finish within a second
MAX_TOKENS = 96
MESSAGES = [{"role": "user", "content": "Write a python function that reverses a string."}]


@pytest.fixture(scope="module")
def server():
    d = tiny_model_dir()
    engine = Engine.start(d, options=EngineOptions(max_concurrency=C, max_pending=P, max_context=1024,
                                                   prefill_chunk=128, max_step_tokens=256, threads_per_rank=1))
    try:
        service = Service(engine, Tokenizer.from_dir(d), "tiny", 1024, generation_defaults(d))
        zmq_server = ZmqServer(service, "tcp://127.0.0.1:*")
        with running(create_app(service, attachments=(zmq_server,))) as url:
            yield url, zmq_server.endpoint, engine, service
    finally:
        engine.shutdown()


def _idle(engine, service) -> None:
    def idle():
        st = engine.stats()
        return st["running"] == 0 and st["waiting"] == 0 and st["slots_used"] == 0 and service.in_flight == 0
    wait_for(idle, timeout=30)


@contextlib.contextmanager
def _within_one_step(engine, held: bool):
    """held: the coordinator takes nothing from its inbox until the block ends (submissions queue
    there, as they do behind a long step), so none of the burst is admitted into a slot meanwhile."""
    if not held:
        yield
        return
    coordinator = engine._coordinator
    drain, entered, go = coordinator._drain, threading.Event(), threading.Event()

    def held_drain(block: bool) -> bool:
        entered.set()
        go.wait()
        return drain(block)
    coordinator._drain = held_drain
    try:
        assert entered.wait(10), "the coordinator loop did not come back to its inbox"
        yield
    finally:
        go.set()
        del coordinator._drain


async def _zmq_burst(endpoint: str, engine, held: bool) -> tuple[list, list]:
    """(results of the admitted requests, errors of the refused ones); all N sent before any is read."""
    async with AsyncZmqClient(endpoint, timeout_s=60) as c:
        async def one(i: int):
            try:
                return await c.chat(MESSAGES, max_tokens=MAX_TOKENS, ignore_eos=True, thinking=False, seed=i)
            except ZmqAPIError as e:
                return e
        with _within_one_step(engine, held):
            answers = await asyncio.gather(*(one(i) for i in range(N)))   # each returns at `start` or `error`
        refused = [a for a in answers if isinstance(a, ZmqAPIError)]
        results = []
        for stream in (a for a in answers if not isinstance(a, ZmqAPIError)):
            async for _ in stream:
                pass
            results.append(stream.result)
    return results, refused


async def _http_burst(url: str, engine, held: bool) -> tuple[list, list]:
    """(finish reasons and usages of the admitted streams, (status, retry-after) of the refused ones).
    Each stream is read on only once every request of the burst has its response status."""
    answered, everyone = [], asyncio.Event()
    limits = httpx.Limits(max_connections=N + 4, max_keepalive_connections=N + 4)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        async def one(i: int):
            body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True},
                    "max_tokens": MAX_TOKENS, "ignore_eos": True, "seed": i, "messages": MESSAGES}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                answered.append(r.status_code)
                if len(answered) == N:
                    everyone.set()
                await everyone.wait()
                if r.status_code != 200:
                    await r.aread()
                    return ("refused", r.status_code, r.headers.get("retry-after"), r.json())
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            return ("done", finish, chunks[-1]["usage"])
        burst = asyncio.gather(*(one(i) for i in range(N)))
        with _within_one_step(engine, held):     # until every request has its status (or one failed)
            await asyncio.wait([asyncio.ensure_future(everyone.wait()), burst], return_when=asyncio.FIRST_COMPLETED)
        answers = await burst
    return [a[1:] for a in answers if a[0] == "done"], [a[1:] for a in answers if a[0] == "refused"]


@pytest.mark.parametrize("held", [True, False], ids=["within-one-step", "as-it-comes"])
def test_a_zmq_burst_admits_exactly_max_concurrency_plus_max_pending(server, held):
    url, endpoint, engine, service = server
    for _ in range(1 if held else 2):            # held: the same count every time
        _idle(engine, service)
        results, refused = asyncio.run(_zmq_burst(endpoint, engine, held))
        assert len(refused) == N - C - P, (
            f"{len(refused)} of {N} refused, expected {N - C - P} (C {C} + P {P} admitted); "
            f"{[(e.status, str(e)) for e in refused]}")
        for e in refused:
            assert (e.status, e.kind) == (429, "rate_limited") and e.retry_after_s, e
        assert len(results) == C + P
        for r in results:
            assert r.finish_reason == "length" and r.usage["completion_tokens"] == MAX_TOKENS, r


@pytest.mark.parametrize("held", [True, False], ids=["within-one-step", "as-it-comes"])
def test_an_http_burst_admits_exactly_max_concurrency_plus_max_pending(server, held):
    url, endpoint, engine, service = server
    for _ in range(1 if held else 2):            # held: the same count every time
        _idle(engine, service)
        done, refused = asyncio.run(_http_burst(url, engine, held))
        assert len(refused) == N - C - P, f"{len(refused)} of {N} refused, expected {N - C - P}: {refused}"
        for status, retry_after, body in refused:
            assert status == 429 and retry_after and body["error"]["code"] == "rate_limit_exceeded", body
        assert len(done) == C + P
        for finish, usage in done:
            assert finish == ["length"] and usage["completion_tokens"] == MAX_TOKENS, (finish, usage)


def test_after_a_burst_nothing_is_left_and_a_slot_is_served_again(server):
    url, endpoint, engine, service = server
    _idle(engine, service)
    st = engine.stats()
    assert st["healthy"] and st["pages_used"] == 0 and st["failed"] == 0
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 4,
                                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_more_choices_than_run_and_wait_at_once_is_a_400_naming_n(server, route):
    """n > max_concurrency + max_pending could never be admitted (a 429 would be retried for ever); n at the
    limit runs on an idle server."""
    url, endpoint, engine, service = server
    _idle(engine, service)
    body = {"model": "tiny", "max_tokens": 4, "ignore_eos": True,
            **({"messages": MESSAGES} if "chat" in route else {"prompt": "count"})}
    r = httpx.post(url + route, json={**body, "n": C + P + 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert f"{C} running + {P} waiting" in r.json()["error"]["message"]
    r = httpx.post(url + route, json={**body, "n": C + P}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == C + P, r.text
    _idle(engine, service)
    assert engine.stats()["pages_used"] == 0

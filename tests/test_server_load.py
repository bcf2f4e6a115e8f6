"""64 concurrent streaming clients on the real engine (8 slots), a quarter of them hanging up mid-stream
(some while still queued, some while decoding): everyone else completes, the aborts are counted, and
afterwards nothing is left behind (no running request, no slot, no KV page)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from runtime import Engine, EngineOptions
from runtime.tokenizer import Tokenizer, generation_defaults
from server.app import create_app
from server.metrics import Metrics
from server.service import Service
from tests.server_util import running, tiny_model_dir, wait_for

CLIENTS = 64
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    engine = Engine.start(d, options=EngineOptions(max_concurrency=8, max_context=1024, max_pending=256,
                                                   prefill_chunk=256, max_step_tokens=512, threads_per_rank=1))
    try:
        service = Service(engine, tok, "tiny", 1024, generation_defaults(d))
        service.metrics = Metrics("tiny", service.stats, lambda: service.in_flight)
        with running(create_app(service)) as url:
            yield url, engine, service
    finally:
        engine.shutdown()


async def _client(http: httpx.AsyncClient, i: int, hang_up_after: int | None) -> dict:
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "seed": i, "temperature": 1.0,
            "messages": [{"role": "user", "content": f"client {i}: " + "tell me a story " * (i % 7 + 1)}]}
    events = []
    async with http.stream("POST", "/v1/chat/completions", json=body,
                           headers={"X-Tandem-Client": f"load/{i % 4}"}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if hang_up_after is not None and len(events) >= hang_up_after:
                return {"i": i, "aborted": True}
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return {"i": i, "aborted": False, "finish": finish, "usage": chunks[-1]["usage"],
            "ids": {c["id"] for c in chunks}}


async def _run_all(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        # every 4th client hangs up: half of them right after the role chunk (probably still queued),
        # half after a few tokens (decoding)
        plan = [None if i % 4 else (1 if i % 8 == 0 else 6) for i in range(CLIENTS)]
        return await asyncio.gather(*(_client(http, i, h) for i, h in enumerate(plan)))


def test_64_streams_with_a_quarter_hanging_up_leave_nothing_behind(server):
    url, engine, service = server
    results = asyncio.run(_run_all(url))
    done = [r for r in results if not r["aborted"]]
    assert len(done) == CLIENTS * 3 // 4
    for r in done:
        assert r["finish"] == ["length"] and len(r["ids"]) == 1
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
        assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + MAX_TOKENS
    assert httpx.get(url + "/health").json() == {"status": "ok"}

    def idle():
        st = engine.stats()
        return st["running"] == 0 and st["waiting"] == 0 and st["slots_used"] == 0 and st["pages_used"] == 0 \
            and service.in_flight == 0
    wait_for(idle, timeout=30)
    metrics = httpx.get(url + "/metrics").text
    assert 'vllm:num_requests_running{model_name="tiny"} 0.0' in metrics
    assert 'tandem_http_requests_in_flight{model_name="tiny"} 0.0' in metrics
    assert 'tandem_kv_pages_used{model_name="tiny"} 0.0' in metrics
    assert re.search(r'tandem_requests_aborted_total\{api="chat"\} 16\.0', metrics), metrics
    st = engine.stats()
    assert st["healthy"] and st["cancelled"] + st["finished"] == CLIENTS
    # and it still serves
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 4,
                                                  "ignore_eos": True}, timeout=60)
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_non_streaming_client_that_hangs_up_cancels_its_request(server, path):
    url, engine, service = server
    before = engine.stats()["cancelled"]
    body = {"model": "tiny", "max_tokens": 900, "ignore_eos": True}
    body.update({"messages": [{"role": "user", "content": "a long one"}]} if "chat" in path else {"prompt": "long"})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + path, json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: engine.stats()["cancelled"] == before + 1 and engine.stats()["running"] == 0
             and service.in_flight == 0, timeout=10)
    assert engine.stats()["pages_used"] == 0

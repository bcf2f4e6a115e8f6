"""server/zmq_api.py + server/zmq_client.py against a scripted fake Service (and once a real tiny engine).

The fake picks its script from the last user message: "hello" (reasoning + content), "tool" (one
tool call), "forever" (content every 5 ms until closed), "fail" (an APIError after the first delta),
"overflow" (prepare rejects the context), "lp" (TokenLogprobs before each of two content deltas, whether
the request asked for logprobs or not); anything else is echoed back as content.
"""

from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest
import zmq

from server.service import (APIError, ContentDelta, Finish, Prepared, ReasoningDelta, TextRequest, TokenLogprobs,
                            ToolCallArgs, ToolCallEnd, ToolCallStart, current_request)
from server.zmq_api import PROTOCOL_VERSION, ZmqServer
from server.zmq_client import AsyncZmqClient, ZmqAPIError, ZmqClient

WAIT_S = 10.0        # upper bound for events that happen within milliseconds


def lp_entry(text: str, logprob: float) -> dict:
    """A logprobs entry in the shape server.generation.logprob_entry makes (one alternative)."""
    one = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {**one, "top_logprobs": [dict(one)]}


LP_ENTRIES = [lp_entry("a", -0.25), lp_entry("é", -1.5)]


class FakeService:
    model_id = "fake-model"
    max_context = 4096

    def __init__(self):
        self.requests: list = []
        self.contexts: list = []                 # current_request as prepare() saw it
        self.opened = threading.Event()          # a "forever" generator started
        self.closed = threading.Event()          # ... and was closed before its Finish
        self.close_exc: list[str] = []
        self._n = 0

    def prepare(self, request) -> Prepared:
        self.requests.append(request)
        self.contexts.append(current_request.get())
        if isinstance(request, TextRequest):
            ids = request.prompt if isinstance(request.prompt, list) else [ord(c) for c in request.prompt]
            return self._prepared(request, ids, "content")
        text = request.messages[-1].get("content", "")
        if text == "overflow":
            raise APIError(400, "context_length_exceeded", "This model's maximum context length is 4096 tokens. "
                           "However, your request has 5000 input tokens.", param="messages")
        return self._prepared(request, list(range(len(text) + 3)), "reasoning")

    def _prepared(self, request, ids, start) -> Prepared:
        self._n += 1
        return Prepared(request, ids, request.max_tokens or 100, start, f"req-{self._n}")

    def count_tokens(self, request) -> int:
        return sum(len(m.get("content") or "") for m in request.messages) + 3

    async def generate(self, prepared: Prepared):
        usage = {"prompt_tokens": len(prepared.prompt_ids), "completion_tokens": 3, "reasoning_tokens": 1,
                 "cached_tokens": 0}
        timings = {"ttft_s": 0.001, "total_s": 0.002}
        request = prepared.request
        if isinstance(request, TextRequest):
            yield ContentDelta(" ".join(map(str, prepared.prompt_ids[: prepared.max_tokens])))
            yield Finish("length", usage, timings)
            return
        text = request.messages[-1]["content"]
        if text == "hello":
            for d in (ReasoningDelta("hmm"), ContentDelta("Hel"), ContentDelta("lo")):
                yield d
            yield Finish("stop", usage, timings)
        elif text == "tool":
            for d in (ToolCallStart(0, "call_1", "get_weather"), ToolCallArgs(0, '{"city": '),
                      ToolCallArgs(0, '"Paris"}'), ToolCallEnd(0)):
                yield d
            yield Finish("tool_calls", usage, timings)
        elif text == "forever":
            self.opened.set()
            try:
                while True:
                    yield ContentDelta("x")
                    await asyncio.sleep(0.005)
            except BaseException as e:
                self.close_exc.append(type(e).__name__)
                self.closed.set()
                raise
        elif text == "lp":
            for entry in LP_ENTRIES:
                yield TokenLogprobs([entry])
                yield ContentDelta(entry["token"])
            yield Finish("stop", usage, timings)
        elif text == "fail":
            yield ContentDelta("partial")
            raise APIError(503, "unavailable", "engine died", should_retry=True)
        else:
            yield ContentDelta(text)
            yield Finish("stop", usage, timings)


@pytest.fixture
def service():
    return FakeService()


@pytest.fixture
def server(service):
    srv = ZmqServer(service, "tcp://127.0.0.1:*")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with ZmqClient(server.endpoint, timeout_s=WAIT_S) as c:
        yield c


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def raw_exchange(endpoint: str, body: bytes) -> dict:
    """Send one raw frame from a fresh DEALER and return the first reply, decoded."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(body)
        assert sock.poll(int(WAIT_S * 1000)), "no reply"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()
        ctx.term()


def pack(**msg) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **msg})


# -------------------------------------------------------------------------------------------------


def test_chat_streams_start_deltas_and_finish(client, service):
    stream = client.chat(user("hello"), max_tokens=50, temperature=0.7, top_k=20, seed=3, stop="END",
                         thinking=False, thinking_budget=8, chat_template_kwargs={"enable_thinking": False},
                         client="bench-1")
    assert stream.start["type"] == "start" and stream.start["prompt_tokens"] == 8
    assert stream.start["request_id"].startswith("req-") and stream.start["model"] == "fake-model"
    deltas = [(d.kind, d.text) for d in stream]
    assert deltas == [("reasoning", "hmm"), ("content", "Hel"), ("content", "lo")]
    r = stream.result
    assert (r.reasoning, r.content, r.finish_reason) == ("hmm", "Hello", "stop")
    assert r.usage["prompt_tokens"] == 8 and r.timings["total_s"] == 0.002
    req = service.requests[-1]
    assert req.api == "zmq" and req.max_tokens == 50 and req.stop == ["END"]
    assert req.sampling.temperature == 0.7 and req.sampling.top_k == 20 and req.sampling.seed == 3
    assert req.thinking is False and req.thinking_budget == 8
    assert req.chat_template_kwargs == {"enable_thinking": False}
    ctx = service.contexts[-1]
    assert (ctx.client, ctx.path) == ("bench-1", "zmq:chat") and ctx.request_id


def test_tool_call_deltas_assemble_into_one_call(client):
    r = client.chat(user("tool"), stream=False, tools=[{"type": "function", "function": {"name": "get_weather"}}],
                    tool_choice="auto", parallel_tool_calls=False)
    assert r.finish_reason == "tool_calls"
    assert r.tool_calls == [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_tokens_request_takes_ids_or_text(client, service):
    r = client.tokens([5, 6, 7], stream=False, max_tokens=2, return_prompt_ids=True)
    assert (r.content, r.finish_reason, r.prompt_ids) == ("5 6", "length", [5, 6, 7])
    req = service.requests[-1]
    assert isinstance(req, TextRequest) and req.prompt == [5, 6, 7] and req.api == "zmq"
    assert client.tokens("AB", stream=False).content == "65 66"
    assert service.requests[-1].max_tokens == 16          # the /v1/completions default


def test_logit_bias_and_logprobs_reach_the_service_and_the_deltas(client, service):
    stream = client.chat(user("lp"), logprobs=2, logit_bias={5: 1.5, "7": -100, "0012": 0})
    deltas = [(d.kind, d.text, d.entries) for d in stream]
    assert deltas == [("logprobs", "", [LP_ENTRIES[0]]), ("content", "a", None),
                      ("logprobs", "", [LP_ENTRIES[1]]), ("content", "é", None)]
    assert stream.result.logprobs == LP_ENTRIES and stream.result.content == "aé"
    sampling = service.requests[-1].sampling
    assert sampling.logit_bias == ((5, 1.5), (7, -100.0), (12, 0.0)) and sampling.logprobs == 2
    assert all(isinstance(b, float) for _, b in sampling.logit_bias)

    r = client.tokens([1, 2], stream=False, logprobs=0, logit_bias={})        # {} / nil: no bias
    assert service.requests[-1].sampling.logit_bias is None and service.requests[-1].sampling.logprobs == 0
    assert r.logprobs == []                     # asked, none came: an empty list, not None
    client.tokens([1, 2], stream=False, logit_bias={i: -1 for i in range(300)})
    assert len(service.requests[-1].sampling.logit_bias) == 300

    async def main():
        async with AsyncZmqClient(client.endpoint, timeout_s=WAIT_S) as c:
            r = await c.chat(user("lp"), stream=False, logprobs=1)
            assert r.logprobs == LP_ENTRIES and r.content == "aé"
    asyncio.run(main())


def test_logprobs_deltas_go_only_to_a_request_that_asked(client, server):
    stream = client.chat(user("lp"))            # the fake yields TokenLogprobs anyway
    assert [(d.kind, d.text) for d in stream] == [("content", "a"), ("content", "é")]
    assert stream.result.logprobs is None and stream.result.finish_reason == "stop"
    ctx = zmq.Context()                                       # on the wire, too: no logprobs delta at all
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.endpoint)
        for rid, extra in ((1, {}), (2, {"logprobs": None}), (3, {"logprobs": 0})):
            sock.send(pack(type="chat", id=rid, messages=user("lp"), **extra))
            replies = []
            while not replies or replies[-1]["type"] not in ("finish", "error"):
                assert sock.poll(int(WAIT_S * 1000))
                replies.append(msgpack.unpackb(sock.recv(), raw=False))
            kinds = [m.get("kind") for m in replies if m["type"] == "delta"]
            assert kinds == (["logprobs", "content"] * 2 if rid == 3 else ["content"] * 2), (rid, replies)
            if rid == 3:
                assert replies[1] == {"v": PROTOCOL_VERSION, "type": "delta", "id": 3, "kind": "logprobs",
                                      "entries": [LP_ENTRIES[0]]}
    finally:
        sock.close()
        ctx.term()


def test_count_tokens_models_health(client):
    assert client.count_tokens(user("abcd")) == 7
    assert client.models() == [{"id": "fake-model", "max_context": 4096}]
    h = client.health()
    assert h["status"] == "ok" and h["protocol"] == PROTOCOL_VERSION and h["model"] == "fake-model"


def test_concurrent_requests_from_one_client_interleave(client, service):
    streams = [client.chat(user(f"echo {i}")) for i in range(6)] + [client.chat(user("forever"))]
    forever = streams.pop()
    first = [next(iter(forever)) for _ in range(3)]           # interleave with the infinite one
    for i, s in reversed(list(enumerate(streams))):
        assert [d.text for d in s] == [f"echo {i}"] and s.result.finish_reason == "stop"
    assert [d.text for d in first] == ["x"] * 3
    forever.close()
    assert service.closed.wait(WAIT_S)


def test_async_client_runs_requests_concurrently(server):
    async def main():
        async with AsyncZmqClient(server.endpoint, timeout_s=WAIT_S) as c:
            results = await asyncio.gather(*(c.chat(user(f"a{i}"), stream=False) for i in range(8)))
            assert [r.content for r in results] == [f"a{i}" for i in range(8)]
            stream = await c.chat(user("hello"))
            assert [d.text async for d in stream] == ["hmm", "Hel", "lo"]
            assert stream.result.finish_reason == "stop"
            assert await c.count_tokens(user("ab")) == 5
            with pytest.raises(ZmqAPIError) as e:
                await c.chat(user("overflow"))
            assert e.value.kind == "context_length_exceeded"
    asyncio.run(main())


def test_cancel_mid_stream_closes_the_generator(client, service):
    stream = client.chat(user("forever"))
    it = iter(stream)
    assert next(it).text == "x"
    stream.cancel()
    rest = list(it)                                            # ends with the server's finish
    assert all(d.text == "x" for d in rest)
    assert stream.result.finish_reason == "cancelled" and stream.result.usage["prompt_tokens"] == 10
    assert service.closed.wait(WAIT_S) and service.close_exc[0] in ("CancelledError", "GeneratorExit")
    assert client.chat(user("after"), stream=False).content == "after"


def test_cancel_before_the_request_runs_still_finishes(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.endpoint)
        sock.send_multipart([pack(type="chat", id=1, messages=user("forever"))])
        sock.send(pack(type="cancel", id=1))
        replies = []
        while not replies or replies[-1]["type"] not in ("finish", "error"):
            assert sock.poll(int(WAIT_S * 1000))
            replies.append(msgpack.unpackb(sock.recv(), raw=False))
        assert replies[-1]["type"] == "finish" and replies[-1]["finish_reason"] == "cancelled"
    finally:
        sock.close()
        ctx.term()


def test_client_disconnect_closes_the_generator(server, service):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    sock.send(pack(type="chat", id="gone", messages=user("forever")))
    assert sock.poll(int(WAIT_S * 1000)) and service.opened.wait(WAIT_S)
    sock.close()
    ctx.term()
    assert service.closed.wait(WAIT_S)
    assert service.close_exc == ["GeneratorExit"]             # closed at a yield by aclose()


@pytest.mark.parametrize("body, status, kind, param", [
    (b"\xc1\x00garbage", 400, "invalid_request", ""),
    (msgpack.packb([1, 2]), 400, "invalid_request", ""),
    (msgpack.packb({"v": 1, "type": "health"}), 400, "invalid_request", "id"),
    (pack(type="health", id=[1]), 400, "invalid_request", "id"),
    (msgpack.packb({"v": 99, "type": "health", "id": 1}), 400, "invalid_request", "v"),
    *[(msgpack.packb({"v": v, "type": "health", "id": 1}), 400, "invalid_request", "v")
      for v in (True, 1.0, "1")],                             # the version is the integer 1, nothing equal to it
    (pack(type="teleport", id=1), 404, "not_found", "type"),
    (pack(type="chat", id=1), 400, "invalid_request", "messages"),
    (pack(type="chat", id=1, messages=[{"content": "no role"}]), 400, "invalid_request", "messages.0"),
    (pack(type="chat", id=1, messages=user("x"), max_tokens=0), 400, "invalid_request", "max_tokens"),
    (pack(type="chat", id=1, messages=user("x"), temperature="hot"), 400, "invalid_request", "temperature"),
    (pack(type="chat", id=1, messages=user("x"), stop=["a", 3]), 400, "invalid_request", "stop.1"),
    *[(pack(type=t, id=1, messages=user("x"), prompt=[1], logprobs=v), 400, "invalid_request", "logprobs")
      for t in ("chat", "tokens") for v in (21, -1, "x", True, 2.0)],
    *[(pack(type=t, id=1, messages=user("x"), prompt=[1], logit_bias=v), 400, "invalid_request", "logit_bias")
      for t in ("chat", "tokens") for v in (
          [[5, 1.0]], "5:1", 7,                                    # not a map
          {5: 101}, {"5": -100.5}, {5: float("nan")}, {5: float("inf")}, {5: "1"}, {5: True}, {5: None},
          {"abc": 1}, {"-1": 1}, {-1: 1}, {"5.0": 1}, {"12345678901": 1}, {2**31: 1}, {True: 1}, {1.5: 1},
          {5: 1, "5": 2},                                          # one id twice
          {i: 1 for i in range(301)})],
    (pack(type="chat", id=1, messages=user("overflow")), 400, "context_length_exceeded", "messages"),
    (pack(type="tokens", id=1, prompt=[]), 400, "invalid_request", "prompt"),
    (pack(type="tokens", id=1, prompt=[1], skip_special_tokens="no"), 400, "invalid_request", "skip_special_tokens"),
    (pack(type="chat", id=1, messages=user("x"), skip_special_tokens=1), 400, "invalid_request", "skip_special_tokens"),
    (pack(type="tokens", id=1, prompt=[1, -2]), 400, "invalid_request", "prompt"),
    (pack(type="count_tokens", id=1, messages="hi"), 400, "invalid_request", "messages"),
    (pack(type="chat", id=1, messages=user("x"), client="has space"), 400, "invalid_request", "client"),
    (pack(type="chat", id=1, messages=user("x"), tools=[5]), 400, "invalid_request", "tools[0]"),
    (pack(type="chat", id=1, messages=user("x"), tools=[{"type": "function", "function": {}}]), 400,
     "invalid_request", "tools[0].function.name"),
    (pack(type="count_tokens", id=1, messages=user("x"), tools=[5]), 400, "invalid_request", "tools[0]"),
    (pack(type="chat", id=1, messages=user("x"), tool_choice="sometimes"), 400, "invalid_request", "tool_choice"),
    (pack(type="chat", id=1, messages=user("x"), response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}), 400, "invalid_request", "response_format.json_schema.schema"),
    (pack(type="chat", id=1, messages=user("x"), response_format={"type": "yaml"}), 400, "invalid_request",
     "response_format.type"),
    (pack(type="tokens", id=1, prompt=[1], guided_regex=5), 400, "invalid_request", "guided_regex"),
    (pack(type="tokens", id=1, prompt=[1], guided_choice=["a"], guided_regex="a+"), 400, "invalid_request",
     "guided_choice"),                                         # two constraints: the second (in GUIDED order) named
    (pack(type="chat", id=1, messages=user("x"), tool_choice="required"), 400, "invalid_request", "tool_choice"),
    (pack(type="chat", id=1, messages=user("x"), tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "nonexistent"}}), 400, "invalid_request",
     "tool_choice.function.name"),
])
def test_bad_request_gets_an_error_and_the_server_keeps_serving(server, client, body, status, kind, param):
    reply = raw_exchange(server.endpoint, body)
    assert reply["type"] == "error" and reply["v"] == PROTOCOL_VERSION
    assert (reply["status"], reply["kind"], reply["param"] or "") == (status, kind, param), reply
    assert reply["id"] == (1 if status == 404 or param not in ("", "id") else None)
    assert client.health()["status"] == "ok"


def _out_of_range(rng, lo, hi):
    """A fresh value outside [lo, hi] (either side where there is one), or a non-finite one."""
    pick = rng.randrange(4)
    if pick == 0:
        return float("inf") if hi is not None else -float("inf")
    if pick == 1:
        return float("nan")
    if hi is not None and (lo is None or pick == 2):
        return hi + rng.uniform(1e-6, 1e6)
    return lo - rng.uniform(1e-6, 1e6)


# the HTTP chat / completions ranges (server.openai_chat.sampling_fields)
HTTP_RANGES = {"temperature": (0, 2), "top_p": (0, 1), "min_p": (0, 1), "presence_penalty": (-2, 2),
               "frequency_penalty": (-2, 2), "repetition_penalty": (0, 10)}


@pytest.mark.parametrize("type_", ["chat", "tokens"])
@pytest.mark.parametrize("name", sorted(HTTP_RANGES))
def test_sampling_values_outside_the_http_ranges_are_400_naming_the_field(server, client, service, name, type_):
    """ZeroMQ carries the HTTP APIs' requests: a sampling value HTTP refuses (out of its range, inf, NaN)
    is a 400 naming the field, before anything reaches the engine; the bounds themselves are accepted."""
    import random
    rng = random.Random()
    lo, hi = HTTP_RANGES[name]
    value = _out_of_range(rng, lo, hi)
    reply = raw_exchange(server.endpoint, pack(type=type_, id=1, messages=user("x"), prompt=[1], **{name: value}))
    assert (reply["type"], reply["status"], reply["param"]) == ("error", 400, name), (value, reply)
    assert name in reply["message"]
    assert service.requests == []
    edge = lo if name not in ("top_p", "repetition_penalty") else hi     # (0, 1] and (0, 10]: lo is open
    ok = client.tokens([1], stream=False, **{name: edge}) if type_ == "tokens" else \
        client.chat(user("x"), stream=False, **{name: edge})
    assert ok.finish_reason in ("stop", "length")
    assert getattr(service.requests[-1].sampling, name) == edge


@pytest.mark.parametrize("name, value", [("top_p", 0), ("top_p", 0.0), ("repetition_penalty", 0),
                                         ("top_k", -2), ("seed", 2**64 - 1)])
def test_open_bounds_and_integer_ranges_follow_http(server, name, value):
    if name == "seed":                          # msgpack cannot carry 2**64; the largest uint64 is in range
        reply = raw_exchange(server.endpoint, pack(type="tokens", id=1, prompt=[1], seed=value))
        assert reply["type"] == "start", reply
        return
    reply = raw_exchange(server.endpoint, pack(type="tokens", id=1, prompt=[1], **{name: value}))
    assert (reply["type"], reply["status"], reply["param"]) == ("error", 400, name), reply


def test_top_k_minus_one_means_off_as_over_http(client, service):
    client.tokens([1], stream=False, top_k=-1)
    assert service.requests[-1].sampling.top_k in (-1, 0)


@pytest.mark.parametrize("body", [b"\xc1", b"\xc1\x00garbage", b"\x92\x01", msgpack.packb([1, 2]), b""])
def test_a_body_that_is_not_a_map_says_why_and_names_no_field(server, body):
    """Body-level errors (not msgpack, not a map) have param nil, as HTTP's null for an unreadable body,
    and a message that says what is wrong (msgpack's error for 0xc1 has no text of its own)."""
    reply = raw_exchange(server.endpoint, body)
    assert (reply["type"], reply["status"], reply["id"], reply["param"]) == ("error", 400, None, None), reply
    detail = reply["message"].split(":", 1)[1].strip() if ":" in reply["message"] else reply["message"]
    assert detail, reply["message"]


@pytest.mark.parametrize("value", ["yes", 1, [True], {"a": 1}])
def test_return_prompt_ids_must_be_a_boolean(server, service, value):
    reply = raw_exchange(server.endpoint, pack(type="tokens", id=1, prompt=[1], return_prompt_ids=value))
    assert (reply["type"], reply["status"], reply["param"]) == ("error", 400, "return_prompt_ids"), reply
    assert service.requests == []


def test_client_label_rule_is_the_http_one():
    from server import app, zmq_api
    assert zmq_api.CLIENT_LABEL.pattern == app.CLIENT_LABEL.pattern


def test_error_after_start_is_sent_in_band(client):
    stream = client.chat(user("fail"))
    it = iter(stream)
    assert next(it).text == "partial"
    with pytest.raises(ZmqAPIError) as e:
        next(it)
    assert (e.value.status, e.value.kind, e.value.should_retry) == (503, "unavailable", True)


def test_api_key_is_required_on_every_request(service):
    srv = ZmqServer(service, "tcp://127.0.0.1:*", api_key="s3cret")
    srv.start()
    try:
        for key in (None, "wrong"):
            with ZmqClient(srv.endpoint, api_key=key, timeout_s=WAIT_S) as c:
                for call in (c.health, lambda: c.chat(user("hello"))):
                    with pytest.raises(ZmqAPIError) as e:
                        call()
                    assert (e.value.status, e.value.kind) == (401, "authentication")
        with ZmqClient(srv.endpoint, api_key="s3cret", timeout_s=WAIT_S) as c:
            assert c.chat(user("hello"), stream=False).content == "Hello"
    finally:
        srv.stop()


def test_stop_ends_requests_in_flight_with_503(service):
    srv = ZmqServer(service, "tcp://127.0.0.1:*")
    srv.start()
    with ZmqClient(srv.endpoint, timeout_s=WAIT_S) as c:
        it = iter(c.chat(user("forever")))
        next(it)
        srv.stop()
        with pytest.raises(ZmqAPIError) as e:
            for _ in it:
                pass
        assert (e.value.status, e.value.kind) == (503, "unavailable")
    assert service.closed.is_set()


def test_start_inside_a_running_loop_serves_from_that_loop(service):
    async def main():
        srv = ZmqServer(service, "tcp://127.0.0.1:*")
        srv.start()
        assert srv._thread is None
        async with AsyncZmqClient(srv.endpoint, timeout_s=WAIT_S) as c:
            assert (await c.chat(user("hello"), stream=False)).content == "Hello"
        await srv.aclose()
    asyncio.run(main())


def test_bind_failure_raises_from_start(server, service):
    with pytest.raises(zmq.ZMQError):
        ZmqServer(service, server.endpoint).start()


@pytest.fixture
def tiny(tmp_path):
    """(engine, service, server): a real engine on a tiny random checkpoint, served with api key "k"."""
    from ranks.random_checkpoint import write_random_checkpoint
    from runtime import Engine, EngineOptions
    from runtime.tokenizer import Tokenizer, generation_defaults
    from server.service import Service

    write_random_checkpoint(tmp_path, "tiny", seed=0, dtype="float32", progress=False)
    options = EngineOptions(max_concurrency=4, max_context=1024, prefill_chunk=64, threads_per_rank=1)
    engine = Engine.start(tmp_path, tp=1, options=options)
    service = Service(engine, Tokenizer.from_dir(tmp_path), "tiny", 1024, generation_defaults(tmp_path))
    srv = ZmqServer(service, "tcp://127.0.0.1:*", api_key="k")
    try:
        srv.start()
        yield engine, service, srv
    finally:
        srv.stop()
        service.shutdown()


def test_real_tiny_engine_through_zmq(tiny):
    engine, service, srv = tiny
    with ZmqClient(srv.endpoint, api_key="k", timeout_s=60) as c:
        assert c.health()["model"] == "tiny" and c.models()[0]["id"] == "tiny"
        messages = user("Say hello")
        n_prompt = c.count_tokens(messages)
        greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
        whole = c.chat(messages, stream=False, **greedy)
        stream = c.chat(messages, **greedy)
        parts = list(stream)
        assert stream.result.prompt_tokens == whole.prompt_tokens == n_prompt
        assert "".join(d.text for d in parts if d.kind == "reasoning") == whole.reasoning == stream.result.reasoning
        assert stream.result.content == whole.content and whole.finish_reason == "length"
        assert whole.usage["completion_tokens"] == 12 and whole.usage["prompt_tokens"] == n_prompt

        out = c.tokens([1, 2, 3], stream=False, max_tokens=5, temperature=0, ignore_eos=True,
                       return_prompt_ids=True)
        assert out.prompt_ids == [1, 2, 3] and out.usage["completion_tokens"] == 5

        long = c.chat(messages, max_tokens=900, temperature=0, ignore_eos=True)
        next(iter(long))
        long.cancel()
        list(long)
        assert long.result.finish_reason == "cancelled"
        c.chat(messages, stream=False, **greedy)        # the engine drained the cancel before this one
        assert engine.stats()["cancelled"] == 1 and engine.stats()["running"] == 0

        with pytest.raises(ZmqAPIError) as e:
            c.chat(user("word " * 2000))
        assert (e.value.status, e.value.code) == (400, "context_length_exceeded")


def test_real_tiny_engine_logprobs_and_logit_bias(tiny):
    engine, service, srv = tiny
    tok = service.tokenizer
    prompt = [1, 2, 3]
    greedy = dict(max_tokens=10, temperature=0, ignore_eos=True)
    with ZmqClient(srv.endpoint, api_key="k", timeout_s=60) as c:
        plain = c.tokens(prompt, stream=False, **greedy)
        stream = c.tokens(prompt, logprobs=3, **greedy)
        kinds = [d.kind for d in stream]
        r = stream.result
        assert r.usage["completion_tokens"] == 10 and r.finish_reason == "length"
        assert len(r.logprobs) == 10 == kinds.count("logprobs") and kinds[0] == "logprobs"
        assert r.content == plain.content and plain.logprobs is None      # asking for logprobs changes nothing
        for e in r.logprobs:
            top = e["top_logprobs"]
            assert len(top) == 3 and e["logprob"] <= 0
            assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert (top[0]["bytes"], top[0]["logprob"], top[0]["token"]) == (e["bytes"], e["logprob"], e["token"])
            assert all(isinstance(b, int) and 0 <= b < 256 for t in (e, *top) for b in t["bytes"])
            assert e["token"] == bytes(e["bytes"]).decode("utf-8", errors="replace")
        zero = c.tokens(prompt, stream=False, logprobs=0, **greedy)
        assert [e["top_logprobs"] for e in zero.logprobs] == [[]] * 10
        assert [(e["bytes"], e["logprob"]) for e in zero.logprobs] == [(e["bytes"], e["logprob"]) for e in r.logprobs]

        # +100 on an id that is neither the unbiased first token nor EOS: it is generated first
        first = bytes(r.logprobs[0]["bytes"])
        target = next(i for i in range(33, 127) if tok.token_bytes(i) not in (first, b"")
                      and i not in service.stop_token_ids)
        for key in (target, str(target)):                  # an integer key, and a decimal string as JSON has
            forced = c.tokens(prompt, stream=False, logprobs=0, logit_bias={key: 100},
                              return_prompt_ids=True, **dict(greedy, max_tokens=1))
            assert forced.prompt_ids == prompt and forced.usage["completion_tokens"] == 1
            assert bytes(forced.logprobs[0]["bytes"]) == tok.token_bytes(target)
            assert forced.content == tok.decode([target])
        # -100 on the unbiased first token (every id with its bytes): something else comes first
        avoid = c.tokens(prompt, stream=False, logprobs=0, **dict(greedy, max_tokens=1),
                         logit_bias={i: -100 for i in range(tok.vocab_size) if tok.token_bytes(i) == first})
        assert bytes(avoid.logprobs[0]["bytes"]) != first

        # bad values: a 400 naming the field; the endpoint keeps serving
        bad = [("logprobs", v) for v in (21, -1, "x", True)] + [("logit_bias", v) for v in (
            [target, 1], "x", {target: 101}, {"abc": 1}, {i: 1 for i in range(301)},
            {engine.spec.vocab_size: 5}, {2**31 - 1: 1})]     # the last two: outside the vocabulary (submit's check)
        for name, value in bad:
            for call in (lambda: c.tokens(prompt, **{name: value}), lambda: c.chat(user("hi"), **{name: value})):
                with pytest.raises(ZmqAPIError) as e:
                    call()
                assert (e.value.status, e.value.kind, e.value.param) == (400, "invalid_request", name), (name, value)
        assert "outside the vocabulary" in e.value.message and e.value.message.startswith("logit_bias token id")
        assert c.health()["status"] == "ok"
        again = c.tokens(prompt, stream=False, logprobs=3, **greedy)
        assert again.content == r.content and again.logprobs == r.logprobs
        assert engine.stats()["running"] == 0


def test_output_formats_through_zmq_on_the_demo_model():
    """The HTTP APIs' output constraints (response_format, guided_*, structured_outputs) on `chat` and
    `tokens` requests: a JSON schema's document, a choice, a regex, on the real demo model (greedy)."""
    import json
    import re

    import jsonschema

    from ranks.demo import PACKAGED_DIR
    from runtime import Engine, EngineOptions
    from runtime.tokenizer import Tokenizer, generation_defaults
    from server.service import Service

    engine = Engine.start(PACKAGED_DIR, tp=1, options=EngineOptions(max_concurrency=4, max_context=2048,
                                                                     threads_per_rank=1))
    service = Service(engine, Tokenizer.from_dir(PACKAGED_DIR), "demo", 2048, generation_defaults(PACKAGED_DIR))
    srv = ZmqServer(service, "tcp://127.0.0.1:*")
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 9}}}
    try:
        srv.start()
        with ZmqClient(srv.endpoint, timeout_s=60) as c:
            doc = c.chat(user("Plan a trip as JSON."), stream=False, max_tokens=80, temperature=0, thinking=False,
                         response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}})
            jsonschema.validate(json.loads(doc.content), schema)
            assert doc.finish_reason == "stop"
            pick = c.chat(user("Pick a colour."), stream=False, max_tokens=20, temperature=0, thinking=False,
                          structured_outputs={"choice": ["red", "green", "blue"]})
            assert pick.content in ("red", "green", "blue")
            raw = c.tokens("The answer is", stream=False, max_tokens=12, temperature=0, guided_regex="[0-9]{2,4}")
            assert re.fullmatch("[0-9]{2,4}", raw.content), raw.content
            free = c.tokens("The answer is", stream=False, max_tokens=12, temperature=0, ignore_eos=True)
            assert not re.fullmatch("[0-9]{2,4}", free.content)         # unconstrained, it writes something else
            # an infinite temperature over a grammar's mask made NaN scores that failed the engine: refused now
            with pytest.raises(ZmqAPIError) as e:
                c.tokens("The answer is", stream=False, max_tokens=4, temperature=float("inf"),
                         guided_choice=["yes", "no"])
            assert (e.value.status, e.value.param) == (400, "temperature")
            assert c.health()["status"] == "ok"
            again = c.tokens("The answer is", stream=False, max_tokens=12, temperature=0, guided_regex="[0-9]{2,4}")
            assert again.content == raw.content
    finally:
        srv.stop()
        service.shutdown()


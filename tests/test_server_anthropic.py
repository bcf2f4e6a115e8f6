"""Anthropic Messages adapter (server/anthropic_messages.py) against a scripted Service, over real HTTP.

Pins the §4.1 stream grammar event by event, streamed == non-streamed, usage invariants, the tool-use
round trip, thinking modes and signatures, request validation and error shapes, keep-alive pings and
cancellation on disconnect. The official `anthropic` SDK is one of the clients.
"""

from __future__ import annotations

import copy
import json

import anthropic
import httpx
import pydantic
import pytest
from starlette.applications import Starlette

from server.anthropic_messages import routes
from server.app import create_app
from server.reasoning_seal import ReasoningSeal
from server.service import APIError, ContentDelta, Finish, ReasoningDelta
from tests.scripted_service import ALIAS, MODEL, SEAL, TOO_LONG, ScriptedService, script, serve, sse_events
from tests.server_util import wait_for

EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
USER = [{"role": "user", "content": "hello"}]
BASE = {"model": MODEL, "max_tokens": 64, "messages": USER}


@pytest.fixture(scope="module")
def server():
    svc = ScriptedService()
    with serve(create_app(svc)) as url:
        yield svc, url


@pytest.fixture
def svc(server) -> ScriptedService:
    server[0].reset()
    return server[0]


@pytest.fixture
def url(server) -> str:
    return server[1]


@pytest.fixture
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="test", max_retries=0)


def post(url: str, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10)


def stream(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=10) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache" and "content-length" not in r.headers
        return [e for e in sse_events(r.iter_lines()) if e[0] != ":"]


def accumulate(events: list[tuple[str, dict]]) -> dict:
    """Fold §4.1 events into the final message, asserting every MUST of the grammar on the way."""
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert names.count("message_delta") == 1 and names[-2] == "message_delta", names
    for name, data in events:
        assert data["type"] == name
        if name != "ping":
            EVENT.validate_python(data)                 # the SDK's own types, strictly
    msg = copy.deepcopy(events[0][1]["message"])
    assert msg["content"] == [] and msg["stop_reason"] is None and msg["stop_sequence"] is None
    open_index, next_index, partial = None, 0, ""
    body = [e for e in events[1:] if e[0] != "ping"]
    for k, (name, data) in enumerate(body):
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index, (k, data)
            open_index, partial = data["index"], ""
            msg["content"].append(copy.deepcopy(data["content_block"]))
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = msg["content"][open_index], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                assert body[k + 1] == ("content_block_stop", {"type": "content_block_stop", "index": open_index})
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial += delta["partial_json"]
            else:
                raise AssertionError(f"unknown delta {delta}")
        elif name == "content_block_stop":
            assert data["index"] == open_index
            block = msg["content"][open_index]
            if block["type"] == "tool_use":
                block["input"] = json.loads(partial) if partial else {}
            if block["type"] == "thinking":
                assert block["signature"], "a thinking block needs its signature_delta"
            open_index, next_index = None, next_index + 1
        elif name == "message_delta":
            assert open_index is None
            msg.update(data["delta"])
            msg["usage"].update(data["usage"])
    anthropic.types.Message.model_validate(msg)
    return msg


# ---- responses and the stream grammar -----------------------------------------------------------

def test_text_reply_has_message_shape_and_splits_cached_input(svc, client):
    svc.script = script(content="Hi there!")
    svc.cached_tokens = 5
    msg = client.messages.create(model=ALIAS, max_tokens=64, messages=USER)
    prompt = svc.count_tokens(svc.requests[-1])
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == ALIAS
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hi there!"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens == prompt - 5 and msg.usage.cache_read_input_tokens == 5
    assert msg.usage.cache_creation_input_tokens == 0
    assert msg.usage.output_tokens == svc.script[-1].usage["completion_tokens"]
    assert svc.requests[-1].api == "messages" and svc.requests[-1].tool_id_prefix == "toolu_"


def test_stream_grammar_thinking_text_tools_and_equals_non_streamed(svc, url):
    svc.script = script(reasoning="Let me think about it.", content="I will call two tools.",
                        calls=(("get_weather", '{"city": "Paris", "days": 3}'), ("noop", "{}")))
    svc.cached_tokens = 3
    events = stream(url, BASE)
    assert [n for n, _ in events[:2]] == ["message_start", "ping"]
    streamed = accumulate(events)
    kinds = [(n, d.get("delta", d.get("content_block", {})).get("type")) for n, d in events]
    assert kinds[2:5] == [("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
                          ("content_block_delta", "thinking_delta")]
    start_usage = events[0][1]["message"]["usage"]
    assert start_usage["input_tokens"] == svc.count_tokens(svc.requests[-1]) and start_usage["output_tokens"] == 1
    assert [b["type"] for b in streamed["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, call, noop = streamed["content"]
    assert thinking["thinking"] == "Let me think about it." and SEAL.open(thinking["signature"]) == thinking["thinking"]
    assert text["text"] == "I will call two tools."
    assert call["id"].startswith("toolu_0") and call["input"] == {"city": "Paris", "days": 3}
    assert noop["input"] == {} and noop["id"] != call["id"]
    assert streamed["stop_reason"] == "tool_use"
    u = streamed["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == \
        start_usage["input_tokens"]

    plain = post(url, BASE).json()
    for m in (plain, streamed):
        m.pop("id")
        for b in m["content"]:
            b.pop("id", None)
    assert plain == streamed


def test_sdk_stream_accumulates_to_the_non_streamed_message(svc, client):
    svc.script = script(reasoning="Hmm.", content="Answer.", calls=(("lookup", '{"q": "x"}'),))
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as s:
        final = s.get_final_message().model_dump(exclude_none=True)
    plain = client.messages.create(model=MODEL, max_tokens=64, messages=USER).model_dump(exclude_none=True)
    for m in (final, plain):
        m.pop("id")
        m["content"][-1].pop("id")
    assert final == plain


def test_count_tokens_equals_message_start_input(svc, client, url):
    svc.cached_tokens = 11
    svc.script = script(content="ok")
    body = {**BASE, "system": "be brief", "tools": [{"name": "t", "input_schema": {"type": "object"}}],
            "thinking": {"type": "disabled"}}
    counted = client.messages.count_tokens(model=MODEL, messages=USER, system="be brief",
                                           tools=[{"name": "t", "input_schema": {"type": "object"}}],
                                           thinking={"type": "disabled"})
    start = stream(url, body)[0][1]["message"]["usage"]
    assert counted.input_tokens == start["input_tokens"] + start["cache_read_input_tokens"] + \
        start["cache_creation_input_tokens"]
    for path in ("/v1/messages/count_tokens", "/v1/messages/count_tokens?beta=true"):
        r = post(url, {"model": MODEL, "messages": USER, "system": "be brief", "thinking": {"type": "disabled"},
                       "tools": [{"name": "t", "input_schema": {"type": "object"}}]}, path)
        assert r.json() == {"input_tokens": counted.input_tokens}


def test_beta_query_string_routes_to_messages(svc, url):
    svc.script = script(content="beta")
    r = post(url, BASE, "/v1/messages?beta=true")
    assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "beta"}]


@pytest.mark.parametrize("deltas, blocks", [
    ([ContentDelta("\n\n")], []),
    ([ContentDelta(" "), ContentDelta("\n"), ContentDelta("hi")], [{"type": "text", "text": " \nhi"}]),
    ([ReasoningDelta(""), ContentDelta(""), ContentDelta("x")], [{"type": "text", "text": "x"}]),
])
def test_no_empty_or_blank_text_block_is_sent(svc, url, deltas, blocks):
    svc.script = deltas + [Finish("stop", {"completion_tokens": 2}, {})]
    assert post(url, BASE).json()["content"] == blocks
    assert accumulate(stream(url, BASE))["content"] == blocks


@pytest.mark.parametrize("finish, matched, calls, stop_reason, stop_sequence", [
    ("stop", None, (), "end_turn", None),
    ("stop", "END", (), "stop_sequence", "END"),
    ("length", None, (), "max_tokens", None),
    ("tool_calls", None, (("f", "{}"),), "tool_use", None),
    ("tool_calls", None, (), "end_turn", None),
    ("length", None, (("f", '{"a": 1}'),), "max_tokens", None),
])
def test_stop_reason_mapping(svc, url, finish, matched, calls, stop_reason, stop_sequence):
    svc.script = script(content="text", calls=calls, finish=finish, matched=matched)
    for msg in (post(url, {**BASE, "stop_sequences": ["END"]}).json(),
                accumulate(stream(url, {**BASE, "stop_sequences": ["END"]}))):
        assert (msg["stop_reason"], msg["stop_sequence"]) == (stop_reason, stop_sequence)
    assert svc.requests[-1].stop == ["END"]


# ---- request mapping ----------------------------------------------------------------------------

def test_tool_use_round_trip_restores_reasoning_and_orders_tool_results(svc, client):
    reasoning = "  The user wants weather.\nI should call the tool.  "
    svc.script = script(reasoning=reasoning, content="Checking.", calls=(("get_weather", '{"city": "Paris"}'),))
    tools = [{"name": "get_weather", "description": "Weather by city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
              "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model=MODEL, max_tokens=64, messages=USER, tools=tools)
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    svc.script = script(content="It is sunny.")
    second = client.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=[
        *USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"},
                                     {"type": "text", "text": "thanks"}]}])
    assert second.content[0].text == "It is sunny."
    req = svc.requests[-1]
    assert req.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather by city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    assert req.messages == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": reasoning,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
        {"role": "user", "content": "thanks"}]


def test_system_blocks_roles_documents_and_tool_result_images(svc, url):
    svc.script = script(content="ok")
    body = {**BASE, "metadata": {"user_id": "u"}, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc;"},
        {"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},
                                         {"type": "text", "text": "read it"},
                                         {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                         "data": "DOC"}}]},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "zzz"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                                          "content": [{"type": "text", "text": "png:"},
                                                      {"type": "image", "source": {"type": "base64",
                                                                                   "media_type": "image/png",
                                                                                   "data": "AAAA"}}]}]},
            {"role": "system", "content": "mid-conversation note"},
            {"role": "ctx", "content": "unknown role"}]}
    assert post(url, body).status_code == 200
    assert svc.requests[-1].messages == [
        {"role": "system", "content": "You are helpful.\n\nBe brief."},
        {"role": "user", "content": "<system-reminder>r</system-reminder>\nread it\nDOC"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "png:\n[image omitted: this model reads text only]"},
        {"role": "system", "content": "mid-conversation note"},
        {"role": "user", "content": "unknown role"}]


@pytest.mark.parametrize("choice, expected, parallel", [
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "b", "disable_parallel_tool_use": True}, {"type": "function", "function": {"name": "b"}},
     False),
])
def test_tools_and_tool_choice_map_to_openai_shapes(svc, url, choice, expected, parallel):
    svc.script = script(content="ok")
    tools = [{"name": "a", "input_schema": {"type": "object", "properties": {}}, "strict": True},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
             {"type": "custom", "name": "b", "description": "B", "input_schema": {"type": "object"},
              "defer_loading": False}]
    assert post(url, {**BASE, "tools": tools, "tool_choice": choice}).status_code == 200
    req = svc.requests[-1]
    assert [t["function"]["name"] for t in req.tools] == ["a", "b"]
    assert req.tools[1] == {"type": "function", "function": {"name": "b", "description": "B",
                                                             "parameters": {"type": "object"}}}
    assert req.tool_choice == expected and req.parallel_tool_calls is parallel


@pytest.mark.parametrize("thinking, effort, expected", [
    (None, None, (None, None)),
    ({"type": "enabled", "budget_tokens": 2048}, None, (True, 2048)),
    ({"type": "enabled", "budget_tokens": 2048}, "low", (True, 2048)),
    ({"type": "adaptive"}, None, (True, None)),
    ({"type": "adaptive", "display": "summarized"}, "low", (True, 4096)),
    ({"type": "disabled"}, "high", (False, None)),
    (None, "minimal", (True, 1024)),
])
def test_thinking_config_maps_to_flag_and_budget(svc, url, thinking, effort, expected):
    svc.script = script(content="ok")
    body = {**BASE, **({"thinking": thinking} if thinking else {}),
            **({"output_config": {"effort": effort}} if effort else {})}
    assert post(url, body).status_code == 200
    assert (svc.requests[-1].thinking, svc.requests[-1].thinking_budget) == expected


def test_display_omitted_sends_signature_only_and_the_echo_restores_reasoning(svc, url):
    reasoning = "secret chain of thought"
    svc.script = script(reasoning=reasoning, content="done")
    body = {**BASE, "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}
    events = stream(url, body)
    assert not [d for n, d in events if n == "content_block_delta" and d["delta"]["type"] == "thinking_delta"]
    msg = accumulate(events)
    assert msg["content"][0]["thinking"] == "" and SEAL.open(msg["content"][0]["signature"]) == reasoning
    assert post(url, body).json()["content"][0] == msg["content"][0]

    svc.script = script(content="again")
    echo = {**body, "messages": [*USER, {"role": "assistant", "content": msg["content"]},
                                 {"role": "user", "content": "more"}]}
    assert post(url, echo).status_code == 200
    assert svc.requests[-1].messages[1]["reasoning_content"] == reasoning


def test_foreign_signature_falls_back_to_the_given_thinking_text(svc, url):
    svc.script = script(content="ok")
    forged = ReasoningSeal(b"other key").seal("not this")
    for signature in (forged, "EqQBCkgIARABGAIiQL", ""):
        body = {**BASE, "messages": [*USER, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "given text", "signature": signature},
            {"type": "text", "text": "a"}]}, {"role": "user", "content": "b"}]}
        assert post(url, body).status_code == 200
        assert svc.requests[-1].messages[1]["reasoning_content"] == "given text"


# ---- errors -------------------------------------------------------------------------------------

def _without(key):
    return lambda b: {k: v for k, v in b.items() if k != key}


@pytest.mark.parametrize("change, status, etype, words", [
    (_without("max_tokens"), 400, "invalid_request_error", "max_tokens"),
    (lambda b: {**b, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    (lambda b: {**b, "max_tokens": "64"}, 400, "invalid_request_error", "max_tokens"),
    (_without("model"), 400, "invalid_request_error", "model"),
    (lambda b: {**b, "model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
    (lambda b: {**b, "messages": "hello"}, 400, "invalid_request_error", "messages"),
    (lambda b: {**b, "messages": []}, 400, "invalid_request_error", "messages"),
    (lambda b: {**b, "messages": [{"role": "user"}]}, 400, "invalid_request_error", "messages.0.content"),
    (lambda b: {**b, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "invalid_request_error", "messages.0.content.0.text"),
    (lambda b: {**b, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]},
     400, "invalid_request_error", "images not supported"),
    (lambda b: {**b, "tools": [{"name": "t"}]}, 400, "invalid_request_error", "tools.0.input_schema"),
    (lambda b: {**b, "tools": [{"name": "t", "input_schema": {"type": "string"}}]}, 400, "invalid_request_error",
     "input_schema.type"),
    (lambda b: {**b, "tool_choice": {"type": "tool", "name": "missing"}}, 400, "invalid_request_error",
     "tool_choice.name"),
    (lambda b: {**b, "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice.type"),
    (lambda b: {**b, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "'any' but no tools"),
    (lambda b: {**b, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    (lambda b: {**b, "top_k": -1}, 400, "invalid_request_error", "top_k"),
    (lambda b: {**b, "stop_sequences": "END"}, 400, "invalid_request_error", "stop_sequences"),
    (lambda b: {**b, "thinking": {"type": "sometimes"}}, 400, "invalid_request_error", "thinking.type"),
    (lambda b: {**b, "thinking": {"type": "enabled"}}, 400, "invalid_request_error", "budget_tokens"),
    (lambda b: {**b, "thinking": {"type": "adaptive", "display": "full"}}, 400, "invalid_request_error",
     "thinking.display"),
    (lambda b: {**b, "messages": [{"role": "user", "content": TOO_LONG}]}, 400, "invalid_request_error",
     "prompt is too long: 200000 tokens > 100000 maximum"),
])
def test_bad_requests_get_anthropic_error_shapes(svc, url, change, status, etype, words):
    for body in (change(dict(BASE)), {**change(dict(BASE)), "stream": True}):
        r = post(url, body)
        assert r.status_code == status, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == etype and words in err["error"]["message"], err
        assert err["request_id"] == r.headers["request-id"]
    assert svc.started == [] and len(svc.rejected) == 2


def test_bad_json_and_sdk_error_classes(svc, url, client):
    r = httpx.post(url + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=0, messages=USER)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=USER)
    r = httpx.get(url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_api_key_is_taken_from_x_api_key():
    svc = ScriptedService()
    svc.script = script(content="ok")
    with serve(create_app(svc, api_key="sekret")) as url:
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**BASE)
        ok = anthropic.Anthropic(base_url=url, api_key="sekret", max_retries=0).messages.create(**BASE)
    assert ok.content[0].text == "ok"


def test_error_after_the_stream_started_is_sent_in_band(svc, url, client):
    svc.script = [ContentDelta("partial"), APIError(503, "overloaded", "engine overloaded", retry_after_s=1)]
    events = stream(url, BASE)
    assert events[-1] == ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                               "message": "engine overloaded"}})
    assert "message_stop" not in [n for n, _ in events]
    with pytest.raises(anthropic.APIStatusError):
        with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as s:
            s.get_final_message()
    r = post(url, BASE)
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    assert r.headers["retry-after"] == "1"


# ---- keep-alive and cancellation ----------------------------------------------------------------

def test_pings_keep_a_slow_stream_alive():
    svc = ScriptedService()
    svc.script = [0.3] + script(content="late")
    with serve(Starlette(routes=routes(svc, keepalive_s=0.05))) as url:
        events = stream(url, BASE)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names.count("ping") >= 3
    assert names.index("content_block_start") > 2 and accumulate(events)["content"][0]["text"] == "late"


def test_closing_the_stream_cancels_generation(svc, url):
    svc.script = [ContentDelta("first"), 30.0, ContentDelta("never")]
    with httpx.stream("POST", url + "/v1/messages", json={**BASE, "stream": True}, timeout=10) as r:
        for line in r.iter_lines():
            if "text_delta" in line:
                break
    assert svc.closed_event.wait(5), "the generator was not closed after the client went away"


def test_disconnect_cancels_a_non_streamed_request(svc, url):
    svc.script = [ContentDelta("first"), 30.0, ContentDelta("never")]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/messages", json=BASE, timeout=httpx.Timeout(10, read=0.5))
    assert svc.closed_event.wait(5), "the generator was not closed after the client went away"
    wait_for(lambda: svc.released, timeout=5)       # released just after the close, on the server's loop


# ---- the real app, Service and engine -----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_url(tmp_path_factory):
    from tests.scripted_service import SEAL, tiny_app

    with tiny_app(tmp_path_factory.mktemp("tiny")) as url:
        yield url


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}, {"type": "enabled", "budget_tokens": 4}])
def test_real_tiny_engine_streamed_equals_non_streamed(tiny_url, thinking):
    client = anthropic.Anthropic(base_url=tiny_url, api_key="k", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "system": "Be brief.", "tools": tools,
            "messages": [{"role": "user", "content": "Say hello"}], **({"thinking": thinking} if thinking else {})}
    sdk = {**{k: v for k, v in body.items() if k != "temperature"}, "extra_body": {"temperature": 0}}
    counted = client.messages.count_tokens(**{k: v for k, v in body.items() if k not in ("max_tokens", "temperature")})
    plain = client.messages.create(**sdk)
    with httpx.stream("POST", tiny_url + "/v1/messages?beta=true", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
        events = [e for e in sse_events(r.iter_lines()) if e[0] != ":"]
    streamed = accumulate(events)
    start = events[0][1]["message"]["usage"]
    assert start["input_tokens"] + start["cache_read_input_tokens"] == counted.input_tokens
    u = plain.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted.input_tokens
    assert 1 <= u.output_tokens <= 12 and plain.stop_reason in ("end_turn", "max_tokens", "tool_use")
    if thinking == {"type": "disabled"}:
        assert all(b.type != "thinking" for b in plain.content)
    with client.messages.stream(**sdk) as s:
        final = s.get_final_message()
    dumps = [m.model_dump(exclude_none=True) for m in (plain, anthropic.types.Message.model_validate(streamed), final)]
    for m in dumps:
        m.pop("id")
        m["usage"].pop("cache_read_input_tokens")
        m["usage"].pop("input_tokens")
        for b in m["content"]:
            b.pop("id", None)
    assert dumps[0] == dumps[1] == dumps[2]

    follow = client.messages.create(**{**sdk, "messages": [
        *body["messages"], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in plain.content]
                            or [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": "again"}]})
    assert follow.usage.output_tokens >= 1
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(**{**sdk, "model": "claude-unknown"})
    assert e.value.body["error"]["type"] == "not_found_error"


def test_tool_arguments_nested_deeper_than_json_decodes_give_an_empty_input():
    from server.anthropic_messages import _tool_input
    deep = "[" * 100_000 + "]" * 100_000           # past the recursion limit: RecursionError, not ValueError
    assert _tool_input('{"a": ' + deep + "}") == {} and _tool_input('{"a": [[1]]}') == {"a": [[1]]}

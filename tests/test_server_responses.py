"""OpenAI Responses adapter (server/openai_responses.py) against a scripted Service, over real HTTP.

Pins the §5.1 stream grammar (every event, sequence numbers, item ids equal to the final object's),
streamed == non-streamed, usage, incomplete responses, tool calls (function, custom, namespace) and their
round trip through previous_response_id or a stateless replay with encrypted_content, the store, request
validation and OpenAI error shapes, in-band failure and cancellation. The official `openai` SDK is one
of the clients (its stream helper checks item identities itself).
"""

from __future__ import annotations

import copy
import json

import httpx
import openai
import pydantic
import pytest

from server.app import create_app
from server.openai_responses import ResponseStore
from server.service import APIError, ContentDelta
from tests.scripted_service import MODEL, SEAL, TOO_LONG, ScriptedService, script, serve, sse_events

BASE = {"model": MODEL, "input": "hello"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather by city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": False}

EVENT = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
# per item type: the event types between output_item.added and output_item.done (deltas collapsed to one)
ITEM_EVENTS = {
    "message": ["response.content_part.added", "response.output_text.delta", "response.output_text.done",
                "response.content_part.done"],
    "reasoning_summary": ["response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
                          "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"],
    "reasoning_text": ["response.content_part.added", "response.reasoning_text.delta",
                       "response.reasoning_text.done", "response.content_part.done"],
    "function_call": ["response.function_call_arguments.delta", "response.function_call_arguments.done"],
    "custom_tool_call": ["response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"],
}


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
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0)


def post(url: str, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10)


def stream(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=10) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [e for e in sse_events(r.iter_lines()) if e[0] != ":"]


def check_stream(events: list[tuple[str, dict]]) -> dict:
    """Assert the §5.1 grammar and return the final response (whose items must equal the done items)."""
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"], names
    assert names[-1] in ("response.completed", "response.incomplete", "response.failed"), names
    assert "[DONE]" not in names
    for i, (name, data) in enumerate(events):
        assert data["type"] == name and data["sequence_number"] == i, (i, name, data)
        EVENT.validate_python(data)                     # the SDK's own types, strictly
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    final = events[-1][1]["response"]
    assert created["id"] == final["id"] == events[1][1]["response"]["id"]
    items, seen, open_index, buf = [], [], None, ""
    for name, data in events[2:-1]:
        if name == "response.output_item.added":
            assert open_index is None and data["output_index"] == len(items)
            assert data["item"]["status"] == "in_progress"
            items.append(data["item"])
            open_index, seen, buf = data["output_index"], [], ""
        elif name == "response.output_item.done":
            item = data["item"]
            assert data["output_index"] == open_index and item["id"] == items[open_index]["id"]
            kind = item["type"]
            if kind == "reasoning":
                kind = "reasoning_summary" if item["summary"] else "reasoning_text"
                text = (item["summary"] or item["content"])[0]["text"]
            else:
                text = {"message": lambda: item["content"][0]["text"], "function_call": lambda: item["arguments"],
                        "custom_tool_call": lambda: item["input"]}[kind]()
            collapsed = [n for k, n in enumerate(seen) if k == 0 or n != seen[k - 1] or not n.endswith(".delta")]
            expected = [n for n in ITEM_EVENTS[kind] if text or not n.endswith(".delta")]
            assert collapsed == expected, (kind, collapsed)
            assert buf == text
            items[open_index], open_index = item, None
        else:
            assert data["output_index"] == open_index and data["item_id"] == items[open_index]["id"], data
            seen.append(name)
            if name.endswith(".delta"):
                buf += data["delta"]
            elif name.endswith("arguments.done"):
                assert data["arguments"] == buf and data["name"] == items[open_index]["name"]
            elif name.endswith("input.done"):
                assert data["input"] == buf
            elif name.endswith("text.done"):
                assert data["text"] == buf
            elif name.endswith("part.done"):
                assert data["part"]["text"] == buf
    assert open_index is None
    assert final["output"] == items
    openai.types.responses.Response.model_validate(final)
    return final


def _strip(obj: dict) -> dict:
    """A response without what differs between two runs of one script (ids, times)."""
    obj = copy.deepcopy(obj)
    for key in ("id", "created_at", "completed_at"):
        obj.pop(key, None)
    for item in obj["output"]:
        item.pop("id", None)
        item.pop("call_id", None)
    return obj


# ---- responses and the stream grammar -----------------------------------------------------------

def test_text_reply_has_response_shape_and_usage(svc, client):
    svc.script = script(content="Hi there!")
    svc.cached_tokens = 4
    r = client.responses.create(model=MODEL, input="hello", instructions="be brief", temperature=0.5)
    prompt = svc.count_tokens(svc.requests[-1])
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hi there!" and r.error is None and r.incomplete_details is None
    (item,) = r.output
    assert item.type == "message" and item.id.startswith("msg_") and item.status == "completed"
    assert item.role == "assistant" and item.content[0].type == "output_text" and item.content[0].annotations == []
    assert r.instructions == "be brief" and r.temperature == 0.5 and r.model == MODEL
    assert r.usage.input_tokens == prompt and r.usage.input_tokens_details.cached_tokens == 4
    assert r.usage.output_tokens == svc.script[-1].usage["completion_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert svc.requests[-1].messages == [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hello"}]
    assert svc.requests[-1].api == "responses"


@pytest.mark.parametrize("summary", [None, "auto"])
def test_stream_grammar_and_equality_with_the_non_streamed_response(svc, url, summary):
    svc.script = script(reasoning="Think first.", content="Calling tools.",
                        calls=(("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')))
    body = {**BASE, "tools": [WEATHER], "reasoning": {"effort": "high", "summary": summary}}
    final = check_stream(stream(url, body))
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    rs, msg, fc1, fc2 = final["output"]
    assert rs["id"].startswith("rs_") and msg["id"].startswith("msg_") and fc1["id"].startswith("fc_")
    assert (rs["summary"][0]["text"] if summary else rs["content"][0]["text"]) == "Think first."
    assert fc1["call_id"].startswith("call_") and fc1["call_id"] != fc2["call_id"]
    assert json.loads(fc2["arguments"]) == {"city": "Rome"} and final["status"] == "completed"
    assert "encrypted_content" not in rs
    plain = post(url, body).json()
    assert _strip(plain) == _strip(final)


def test_sdk_stream_helper_accumulates_to_the_non_streamed_response(svc, client):
    svc.script = script(reasoning="Hmm.", content="Answer.", calls=(("get_weather", '{"city": "Oslo"}'),))
    with client.responses.stream(model=MODEL, input="hello", tools=[WEATHER]) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    plain = client.responses.create(model=MODEL, input="hello", tools=[WEATHER])
    assert "".join(deltas) == final.output_text == plain.output_text == "Answer."
    assert _strip(final.model_dump(exclude_none=True)) == _strip(plain.model_dump(exclude_none=True))


def test_max_output_tokens_ends_incomplete(svc, url, client):
    svc.script = script(content="cut off mid", finish="length")
    final = check_stream(stream(url, {**BASE, "max_output_tokens": 3}))
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][-1]["status"] == "incomplete" and final["max_output_tokens"] == 3
    r = client.responses.create(model=MODEL, input="hello", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert svc.requests[-1].max_tokens == 3


# ---- conversations ------------------------------------------------------------------------------

def test_function_call_round_trip_through_previous_response_id(svc, client):
    reasoning = "  I need the weather.\n"
    svc.script = script(reasoning=reasoning, calls=(("get_weather", '{"city": "Paris"}'),))
    first = client.responses.create(model=MODEL, input="weather?", instructions="old", tools=[WEATHER])
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    svc.script = script(content="Sunny.")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, instructions="new", tools=[WEATHER],
                                      input=[{"type": "function_call_output", "call_id": call.call_id,
                                              "output": "sunny"}])
    assert second.output_text == "Sunny." and second.previous_response_id == first.id
    assert svc.requests[-1].messages == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    svc.script = script(content="Bye.")
    client.responses.create(model=MODEL, previous_response_id=second.id, input="thanks")
    assert svc.requests[-1].messages[-2:] == [{"role": "assistant", "content": "Sunny."},
                                              {"role": "user", "content": "thanks"}]


def test_stateless_replay_restores_reasoning_from_encrypted_content(svc, url):
    reasoning = "exact reasoning, with  spacing\n"
    svc.script = script(reasoning=reasoning, content="Let me check.", calls=(("get_weather", '{"city": "Oslo"}'),))
    body = {**BASE, "store": False, "include": ["reasoning.encrypted_content"], "tools": [WEATHER],
            "reasoning": {"effort": "medium", "summary": "auto"}}
    first = check_stream(stream(url, body))
    rs = first["output"][0]
    assert SEAL.open(rs["encrypted_content"]) == reasoning
    assert httpx.get(f"{url}/v1/responses/{first['id']}").status_code == 404       # store: false
    replay = copy.deepcopy(first["output"])
    replay[0]["summary"] = [{"type": "summary_text", "text": "a client-side summary"}]
    svc.script = script(content="Done.")
    r = post(url, {**body, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
                                     *replay,
                                     {"type": "function_call_output", "call_id": replay[2]["call_id"],
                                      "output": [{"type": "input_text", "text": "cold"}]}]})
    assert r.status_code == 200, r.text
    assert svc.requests[-1].messages == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": reasoning, "tool_calls": [
            {"id": replay[2]["call_id"], "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": replay[2]["call_id"], "content": "cold"}]


def test_input_items_map_to_messages(svc, url):
    svc.script = script(content="ok")
    items = [
        {"role": "developer", "content": "dev rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "item_reference", "id": "msg_x"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "prior answer"}]},
        {"type": "reasoning", "id": "rs_x", "summary": [], "content": [{"type": "reasoning_text", "text": "r2"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_orphan", "output": "dropped"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        {"type": "compaction", "encrypted_content": "zzz"},
        {"role": "system", "content": "late system"},
        {"role": "user", "content": "c"}]
    assert post(url, {**BASE, "input": items, "tools": [WEATHER]}).status_code == 200
    assert svc.requests[-1].messages == [
        {"role": "system", "content": "dev rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "prior answer"},
        {"role": "assistant", "content": "", "reasoning_content": "r2", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "system", "content": "late system"},
        {"role": "user", "content": "c"}]


def test_retrieve_delete_and_unknown_ids(svc, url, client):
    svc.script = script(content="stored")
    created = client.responses.create(model=MODEL, input="hello")
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    client.responses.delete(created.id)
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{url}/v1/responses/{created.id}")
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(url, {**BASE, "previous_response_id": "resp_unknown"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


def test_store_is_lru_bounded_expires_and_keeps_chains():
    store = ResponseStore(capacity=2)
    store.put("a", {"id": "a"}, [{"role": "user", "content": "1"}], None)
    store.put("b", {"id": "b"}, [{"role": "user", "content": "2"}], store.get("a"))
    store.put("c", {"id": "c"}, [{"role": "user", "content": "3"}], None)
    assert store.get("a") is None                              # least recently used, evicted
    assert [m["content"] for m in store.get("b").conversation()] == ["1", "2"]    # the chain survives
    store.put("d", {"id": "d"}, [], None)                      # b was used last: c goes
    assert store.get("c") is None and store.get("b") is not None
    store.put("c", {"id": "c"}, [], None)
    assert store.delete("c") and not store.delete("c")
    expired = ResponseStore(ttl_s=-1.0)
    expired.put("x", {}, [], None)
    assert expired.get("x") is None


# ---- tools and options --------------------------------------------------------------------------

def test_custom_and_namespace_tools(svc, url):
    tools = [WEATHER,
             {"type": "custom", "name": "apply_patch", "description": "Edit files",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: PATCH"}},
             {"type": "namespace", "name": "mcp_fs", "description": "files",
              "tools": [{"type": "function", "name": "read_file",
                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
             {"type": "web_search"}]
    svc.script = script(calls=(("apply_patch", '{"input": "*** Begin Patch\\n*** End Patch"}'),
                               ("read_file", '{"path": "a.txt"}')))
    final = check_stream(stream(url, {**BASE, "tools": tools}))
    req = svc.requests[-1]
    assert [t["function"]["name"] for t in req.tools] == ["get_weather", "apply_patch", "read_file"]
    patch_params = req.tools[1]["function"]["parameters"]
    assert patch_params["required"] == ["input"]
    assert "start: PATCH" in patch_params["properties"]["input"]["description"]
    custom, fn = final["output"]
    assert custom["type"] == "custom_tool_call" and custom["input"] == "*** Begin Patch\n*** End Patch"
    assert fn["type"] == "function_call" and fn["namespace"] == "mcp_fs" and fn["name"] == "read_file"
    assert final["tools"] == tools

    svc.script = script(content="patched")
    replay = [{"role": "user", "content": "hello"}, *final["output"],
              {"type": "custom_tool_call_output", "call_id": custom["call_id"], "output": "Done!"},
              {"type": "function_call_output", "call_id": fn["call_id"], "output": "text"}]
    assert post(url, {**BASE, "input": replay, "tools": tools}).status_code == 200
    assistant = svc.requests[-1].messages[1]
    assert [json.loads(c["function"]["arguments"]) for c in assistant["tool_calls"]] == [
        {"input": "*** Begin Patch\n*** End Patch"}, {"path": "a.txt"}]
    assert [m["role"] for m in svc.requests[-1].messages] == ["user", "assistant", "tool", "tool"]


@pytest.mark.parametrize("choice, expected", [
    ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ({"type": "allowed_tools", "mode": "required", "tools": []}, "required"),
    ({"type": "web_search_preview"}, "auto"),
])
def test_tool_choice_maps_to_openai_chat_shapes(svc, url, choice, expected):
    svc.script = script(content="ok")
    r = post(url, {**BASE, "tools": [WEATHER], "tool_choice": choice, "parallel_tool_calls": False})
    assert r.status_code == 200 and r.json()["tool_choice"] == choice
    assert svc.requests[-1].tool_choice == expected and svc.requests[-1].parallel_tool_calls is False


@pytest.mark.parametrize("reasoning, expected", [
    (None, (None, None)), ({"effort": "none"}, (False, None)), ({"effort": "low"}, (True, 4096)),
    ({"effort": "high", "summary": "auto"}, (True, None)), ({"summary": "concise"}, (None, None)),
])
def test_reasoning_effort_maps_to_thinking(svc, url, reasoning, expected):
    svc.script = script(content="ok")
    assert post(url, {**BASE, **({"reasoning": reasoning} if reasoning else {})}).status_code == 200
    assert (svc.requests[-1].thinking, svc.requests[-1].thinking_budget) == expected


def test_input_tokens_counts_what_prepare_would_build(svc, url, client):
    body = {"model": MODEL, "input": "count me", "instructions": "sys", "tools": [WEATHER]}
    r = post(url, body, "/v1/responses/input_tokens")
    assert r.status_code == 200
    svc.script = script(content="ok")
    created = client.responses.create(**body)
    assert r.json() == {"object": "response.input_tokens", "input_tokens": created.usage.input_tokens}
    assert client.responses.input_tokens.count(**body).input_tokens == created.usage.input_tokens


# ---- errors and cancellation --------------------------------------------------------------------

@pytest.mark.parametrize("change, status, param, code", [
    (lambda b: {"input": "x"}, 400, "model", None),
    (lambda b: {**b, "model": "no-such-model"}, 404, "model", "model_not_found"),
    (lambda b: {**b, "input": 5}, 400, "input", None),
    (lambda b: {**b, "input": ["text"]}, 400, "input[0]", None),
    (lambda b: {**b, "input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role", None),
    (lambda b: {**b, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type", None),
    (lambda b: {**b, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input[0].call_id", None),
    (lambda b: {**b, "temperature": 3}, 400, "temperature", None),
    (lambda b: {**b, "top_p": "high"}, 400, "top_p", None),
    (lambda b: {**b, "max_output_tokens": 0}, 400, "max_output_tokens", None),
    (lambda b: {**b, "tools": [{"type": "function"}]}, 400, "tools[0].name", None),
    (lambda b: {**b, "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, 400,
     "tools[0].parameters.type", None),
    (lambda b: {**b, "tool_choice": {"type": "function", "name": "missing"}}, 400, "tool_choice.name", None),
    (lambda b: {**b, "tool_choice": "required"}, 400, "tool_choice", None),          # no tools: as Chat
    (lambda b: {**b, "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}}, 400, "tool_choice",
     None),
    (lambda b: {**b, "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", None),
    (lambda b: {**b, "input": TOO_LONG}, 400, "input", "context_length_exceeded"),
    (lambda b: {**b, "text": {"format": {"type": "xml"}}}, 400, "text.format.type", None),
    (lambda b: {**b, "text": {"format": "json"}}, 400, "text.format", None),
])
def test_bad_requests_get_openai_error_shapes(svc, url, change, status, param, code):
    for body in (change(dict(BASE)), {**change(dict(BASE)), "stream": True}):
        r = post(url, body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
        if code:
            assert err["code"] == code
        assert r.headers["x-request-id"].startswith("req_")
    assert svc.started == [] and len(svc.rejected) == 2


def test_bad_json_and_sdk_error_classes(svc, url, client):
    r = httpx.post(url + "/v1/responses", content=b"[1,", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")


def test_api_key_is_taken_from_the_bearer_header():
    svc = ScriptedService()
    svc.script = script(content="ok")
    with serve(create_app(svc, api_key="sekret")) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).responses.create(**BASE)
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0).responses.create(**BASE)
    assert ok.output_text == "ok"


def test_error_after_the_stream_started_fails_in_band(svc, url):
    svc.script = [ContentDelta("partial"),
                  APIError(400, "context_length_exceeded", "too long now", code="context_length_exceeded")]
    events = stream(url, BASE)
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.failed" and final["status"] == "failed"
    assert final["error"] == {"code": "context_length_exceeded", "message": "too long now"}
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    svc.script = [ContentDelta("partial"), APIError(503, "overloaded", "busy", retry_after_s=2)]
    r = post(url, BASE)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"


def test_closing_the_stream_cancels_generation(svc, url):
    svc.script = [ContentDelta("first"), 30.0, ContentDelta("never")]
    with httpx.stream("POST", url + "/v1/responses", json={**BASE, "stream": True}, timeout=10) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break
    assert svc.closed_event.wait(5), "the generator was not closed after the client went away"


def test_disconnect_cancels_a_non_streamed_request(svc, url):
    svc.script = [ContentDelta("first"), 30.0]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/responses", json=BASE, timeout=httpx.Timeout(10, read=0.5))
    assert svc.closed_event.wait(5)


# ---- the real app, Service and engine -----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_url(tmp_path_factory):
    from tests.scripted_service import SEAL, tiny_app

    with tiny_app(tmp_path_factory.mktemp("tiny")) as url:
        yield url


@pytest.mark.parametrize("reasoning", [None, {"effort": "none"}, {"effort": "low", "summary": "auto"}])
def test_real_tiny_engine_streamed_equals_non_streamed(tiny_url, reasoning):
    client = openai.OpenAI(base_url=tiny_url + "/v1", api_key="k", max_retries=0)
    body = {"model": "tiny", "input": "Say hello", "instructions": "Be brief.", "max_output_tokens": 12,
            "temperature": 0, "tools": [WEATHER], **({"reasoning": reasoning} if reasoning else {})}
    counted = client.responses.input_tokens.count(**{k: v for k, v in body.items()
                                                     if k not in ("max_output_tokens", "temperature")})
    plain = client.responses.create(**body)
    assert plain.usage.input_tokens == counted.input_tokens and 1 <= plain.usage.output_tokens <= 12
    assert plain.status in ("completed", "incomplete")
    with httpx.stream("POST", tiny_url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-request-id"].startswith("req_")
        streamed = check_stream([e for e in sse_events(r.iter_lines()) if e[0] != ":"])
    with client.responses.stream(**body) as s:
        terminal = [e for e in s][-1]                 # get_final_response() wants response.completed only
    assert terminal.type == f"response.{plain.status}"
    final = terminal.response
    dumps = [_strip(r.model_dump(exclude_none=True))
             for r in (plain, openai.types.responses.Response.model_validate(streamed), final)]
    for d in dumps:
        d["usage"]["input_tokens_details"].pop("cached_tokens")      # the prefix cache warms up
        for item in d["output"]:
            item.pop("parsed_arguments", None)
            for part in item.get("content", []):
                part.pop("parsed", None)
    assert dumps[0] == dumps[1] == dumps[2]

    follow = client.responses.create(**{**body, "input": "again", "previous_response_id": plain.id})
    assert follow.previous_response_id == plain.id and follow.usage.input_tokens > plain.usage.input_tokens
    assert client.responses.retrieve(plain.id).id == plain.id
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(**{**body, "model": "gpt-unknown"})
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("body", [
    {"model": MODEL, "input": [], "instructions": "You are Codex", "max_output_tokens": 1},
    {"model": MODEL, "max_output_tokens": 1},
])
def test_empty_input_probes_are_answered(svc, url, body):
    """Codex's empty-input probes (api.md section 5) get a response, the prompt an empty user turn."""
    svc.script = script(content="o")
    r = post(url, body)
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("completed", "incomplete")
    msgs = svc.requests[-1].messages
    assert msgs[-1] == {"role": "user", "content": ""}
    assert msgs[0] == ({"role": "system", "content": "You are Codex"} if "instructions" in body else msgs[-1])



def test_an_overflowing_number_is_refused_before_it_is_echoed(svc, url):
    """1e999 parses to inf; the Responses API echoes fields such as metadata, so it would have made the
    response invalid JSON (a 500, or Infinity in the stream): the body is refused as 400 instead."""
    for body in (b'{"model": "%s", "input": "hi", "metadata": {"a": 1e999}}' % MODEL.encode(),
                 b'{"model": "%s", "input": "hi", "user": -1e999, "stream": true}' % MODEL.encode()):
        r = httpx.post(url + "/v1/responses", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "out of range" in r.json()["error"]["message"], r.text
    assert svc.started == []


@pytest.mark.parametrize("arguments, fault", [("{bad", "is not valid JSON"), ("[1, 2]", "must be a JSON object")])
def test_bad_function_call_arguments_are_named_as_input_items(svc, url, arguments, fault):
    """A function_call item whose arguments are not a JSON object is refused naming the item's own field
    (input[1].arguments), not the Chat-shaped path the shared prompt code uses internally."""
    body = {"model": MODEL, "max_output_tokens": 2,
            "input": [{"role": "user", "content": "hi"},
                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
                      {"type": "function_call_output", "call_id": "c1", "output": "r"}]}
    r = post(url, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input[1].arguments", r.text
    assert "'input[1].arguments'" in err["message"] and fault in err["message"] and "messages" not in err["message"]
    assert svc.started == []


def test_custom_tool_input_nested_deeper_than_json_decodes_stays_text():
    from server.responses_output import CUSTOM_INPUT, _custom_input
    deep = "[" * 100_000 + "]" * 100_000           # past the recursion limit: RecursionError, not ValueError
    assert _custom_input(deep) == deep and _custom_input('{"%s": "patch"}' % CUSTOM_INPUT) == "patch"

"""The HTTP front door and the process: bad input, limits, auth, ids, client labels, health, metrics,
the request log, engine failure, and `tandem serve` as a process (SIGTERM, a dead rank, a bad model).

Most tests run on the scripted FakeEngine; engine failure and the process tests use the real engine on
a random tiny checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from runtime import Engine, EngineOptions
from runtime.engine import EngineError
from runtime.scheduler import Overloaded
from runtime.tokenizer import Tokenizer, generation_defaults
from server.app import create_app
from server.metrics import Metrics
from server.request_log import RequestLog
from server.service import Service
from tests.server_util import FakeEngine, ROOT, qwen_template, running, tiny_model_dir, wait_for

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 1 << 20
USER = [{"role": "user", "content": "Hello there"}]
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 8}


def _service(engine, tok, d, **kw) -> Service:
    service = Service(engine, tok, "tiny", 4096, generation_defaults(d), qwen_template(), **kw)
    service.metrics = Metrics("tiny", service.stats, lambda: service.in_flight)
    return service


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    engine = FakeEngine(tok)
    log_path = str(tmp_path_factory.mktemp("log") / "requests.jsonl")
    service = _service(engine, tok, d, request_log=RequestLog(log_path))
    app = create_app(service, api_key=KEY, max_body_bytes=MAX_BODY)
    with running(app) as url:
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
            yield SimpleNamespace(url=url, http=client, engine=engine, service=service, log=log_path, tok=tok)


def post(srv, path: str, body, headers: dict | None = None) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return srv.http.post(path, content=data, headers={"content-type": "application/json", **(headers or {})})


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_anthropic_error(r: httpx.Response, status: int, etype: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == etype and body["error"]["message"]
    return body


def assert_serving(srv) -> None:
    r = post(srv, "/v1/chat/completions", CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


# --------------------------------------------------------------------------------------------------
# Bad input: 400 (never 422) with the field's path; the server keeps serving


BAD_CHAT = [
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"messages": USER}, "model"),
    ({"model": 5, "messages": USER}, "model"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": {}, "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": ["hi"]}, "messages[0]"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({**CHAT, "messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "temperature": 2.5}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "top_k": "x"}, "top_k"),
    ({**CHAT, "min_p": 1.5}, "min_p"),
    ({**CHAT, "presence_penalty": -3}, "presence_penalty"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": "many"}, "max_completion_tokens"),
    ({**CHAT, "seed": "x"}, "seed"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "n": 129}, "n"),
    ({**CHAT, "n": "two"}, "n"),
    ({**CHAT, "logprobs": "yes"}, "logprobs"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),                     # needs logprobs: true
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": "y"}, "stream": True}, "stream_options.include_usage"),
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "stop": ["ok", 1]}, "stop[1]"),
    ({**CHAT, "tools": {"type": "function"}}, "tools"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters.type"),
    ({**CHAT, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    ({**CHAT, "tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice.function.name"),
    ({**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**CHAT, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({**CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
]
BAD_COMPLETIONS = [
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": 5}, "prompt"),
    ({"model": "tiny", "prompt": ["a", 5]}, "prompt[1]"),         # a batch (first item a string)
    ({"model": "tiny", "prompt": [1, "x"]}, "prompt[1]"),         # token ids (first item an integer)
    ({"model": "tiny", "prompt": [["a"]]}, "prompt[0][0]"),
    ({"model": "tiny", "prompt": [[1, True]]}, "prompt[0][1]"),
    ({"model": "tiny", "prompt": [1, 2**40]}, "prompt"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "tiny", "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"model": "tiny", "prompt": "x", "n": 1.5}, "n"),
    ({"model": "tiny", "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "echo": 1}, "echo"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_fields_are_400_naming_the_field(srv, body, param):
    assert_openai_error(post(srv, "/v1/chat/completions", body), 400, param=param)


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_fields_are_400_naming_the_field(srv, body, param):
    assert_openai_error(post(srv, "/v1/completions", body), 400, param=param)


# logit_bias: every malformed form is a 400 naming the field, on both routes (ids outside the
# vocabulary are the engine's check: tests/test_server_openai.py, on the real engine)
BAD_LOGIT_BIAS = [
    ("not an object", "5"), ("an array", [[5, 10]]), ("a number", 5), ("true", True),
    ("negative id", {"-1": 5}), ("not an id", {"abc": 5}), ("a float id", {"1.5": 5}), ("a padded id", {" 7": 5}),
    ("an empty key", {"": 5}), ("a signed id", {"+7": 5}), ("an exponent id", {"1e3": 5}),
    ("a unicode digit", {"\u0663": 5}), ("a huge id", {"9" * 5000: 5}), ("an id past 2**31", {"9999999999": 5}),
    ("over 100", {"5": 100.0001}), ("under -100", {"5": -101}),
    ("a string value", {"5": "10"}), ("a bool value", {"5": True}), ("a null value", {"5": None}),
    ("an object value", {"5": {"v": 1}}), ("the same id twice", {"7": 1, "07": 2}),
    ("301 ids", {str(i): 1 for i in range(301)}),
]


@pytest.mark.parametrize("value", [v for _, v in BAD_LOGIT_BIAS], ids=[n for n, _ in BAD_LOGIT_BIAS])
def test_bad_logit_bias_is_400_naming_the_field_and_the_server_keeps_serving(srv, value):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "tiny", "prompt": "x"})):
        submitted = len(srv.engine.submitted)
        err = assert_openai_error(post(srv, path, {**body, "logit_bias": value}), 400, param="logit_bias")
        assert err["type"] == "invalid_request_error" and "logit_bias" in err["message"], err
        assert len(srv.engine.submitted) == submitted, "a refused request reached the engine"
    assert_serving(srv)


def test_logit_bias_reaches_the_sampler(srv):
    """A valid logit_bias becomes SamplingParams.logit_bias, (id, float bias) pairs by id; null and {}
    are none; the bounds and 300 ids are allowed."""
    import random
    rng = random.Random()
    bias = {str(t): rng.choice([rng.uniform(-100, 100), rng.randint(-100, 100)]) for t in rng.sample(range(1024), 20)}
    bias[str(rng.randrange(1024, 2048))] = 100
    want = tuple(sorted((int(k), float(v)) for k, v in bias.items()))
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "tiny", "prompt": "x"})):
        r = post(srv, path, {**body, "logit_bias": bias})
        assert r.status_code == 200, r.text
        assert srv.engine.submitted[-1].params.logit_bias == want
        for none in (None, {}):
            assert post(srv, path, {**body, "logit_bias": none}).status_code == 200
            assert srv.engine.submitted[-1].params.logit_bias == ()
        edge = {**{str(i): -100 for i in range(299)}, "299": 100}
        assert post(srv, path, {**body, "logit_bias": edge}).status_code == 200
        p = srv.engine.submitted[-1].params.logit_bias
        assert len(p) == 300 and p[0] == (0, -100.0) and p[-1] == (299, 100.0)


@pytest.mark.parametrize("raw", [b"{not json", b'{"model": "\xff\xfe"}', b"[1, 2]", b"", b'{"model": NaN}',
                                 b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "user": 1e999}',
                                 b"[" * 100_000 + b"]" * 100_000, b'"just a string"',
                                 b'{"model": "tiny", "prompt": "\\ud800", "messages": [{"role": "user", "content": "\\udc00"}]}'],
                         ids=["malformed", "invalid-utf8", "array", "empty", "nan", "overflowing-number", "deep", "string",
                              "lone-surrogate"])
def test_undecodable_bodies_are_400_and_the_server_keeps_serving(srv, raw):
    for path in ("/v1/chat/completions", "/v1/completions"):
        err = assert_openai_error(post(srv, path, raw), 400)
        assert err["type"] == "invalid_request_error"
    assert_serving(srv)


# JSON carried inside a string field is parsed after the body's own depth check: a document nested past
# Python's recursion limit there was a RecursionError, answered 500 internal_error
DEEP_JSON_TEXT = "[" * 5000 + "]" * 5000
DEEP_IN_STRINGS = [
    ("/v1/chat/completions", {**CHAT, "messages": USER + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_JSON_TEXT}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {**CHAT, "guided_json": DEEP_JSON_TEXT}, "guided_json"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "structured_outputs": {"json": DEEP_JSON_TEXT}},
     "structured_outputs.json"),
    ("/v1/responses", {"model": "tiny", "input": [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_JSON_TEXT}]}, "input[1].arguments"),
]


@pytest.mark.parametrize("path,body,param", DEEP_IN_STRINGS, ids=[p for _, _, p in DEEP_IN_STRINGS])
def test_json_nested_too_deeply_inside_a_string_field_is_400_naming_it(srv, path, body, param):
    submitted = len(srv.engine.submitted)
    err = assert_openai_error(post(srv, path, body), 400, param=param)
    assert err["type"] == "invalid_request_error" and "nested too deeply" in err["message"], err
    assert len(srv.engine.submitted) == submitted, "a refused request reached the engine"
    assert_serving(srv)


def test_a_surrogate_pair_escape_is_fine(srv):
    r = post(srv, "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert r.status_code == 200, r.text


def test_unknown_model_is_404_model_not_found(srv):
    assert_openai_error(post(srv, "/v1/chat/completions", {**CHAT, "model": "gpt-9"}), 404, "model", "model_not_found")
    assert_openai_error(srv.http.get("/v1/models/gpt-9"), 404, code="model_not_found")


def test_a_trailing_slash_is_served_as_the_route_without_it(srv):
    r = post(srv, "/v1/chat/completions/", CHAT)
    assert r.status_code == 200, r.text                       # not a 307 redirect to the path without it
    assert r.json()["object"] == "chat.completion" and len(r.json()["choices"]) == 1
    r = srv.http.get("/v1/models//")
    assert r.status_code == 200 and r.json()["object"] == "list", r.text
    assert_openai_error(srv.http.get("/v1/nothing-here/"), 404, code="not_found")
    assert_serving(srv)


def test_unknown_routes_and_wrong_methods_use_the_family_shape(srv):
    assert_openai_error(srv.http.get("/v1/nothing-here"), 404, code="not_found")
    assert_openai_error(srv.http.post("/nope"), 404)
    assert_anthropic_error(srv.http.post("/v1/messages/nothing-here"), 404, "not_found_error")
    r = srv.http.get("/v1/chat/completions")
    assert_openai_error(r, 405)
    assert "POST" in r.headers["allow"]
    assert_openai_error(srv.http.delete("/v1/models"), 405)
    assert_serving(srv)


def test_oversized_bodies_are_413(srv):
    big = json.dumps({**CHAT, "padding": "x" * (MAX_BODY + 10)})
    assert_openai_error(post(srv, "/v1/chat/completions", big), 413, code="request_too_large")
    assert_anthropic_error(post(srv, "/v1/messages", big), 413, "request_too_large")

    def chunks():                                   # no Content-Length: counted while read
        for _ in range(40):
            yield b"x" * 65536

    r = srv.http.post("/v1/chat/completions", content=chunks())
    assert_openai_error(r, 413)
    assert_serving(srv)


def test_oversized_headers_are_refused_and_the_server_keeps_serving(srv):
    r = srv.http.get("/v1/models", headers={"x-padding": "y" * 40_000})
    assert_openai_error(r, 431)
    try:
        r = srv.http.get("/v1/models", headers={"x-padding": "y" * 400_000})
        assert r.status_code in (400, 431)
    except httpx.TransportError:                   # the HTTP layer may just drop such a connection
        pass
    assert_serving(srv)


@pytest.mark.parametrize("labels,ok", [(["ci/bench-1"], True), (["a@b+c:d.e-f_g"], True), (["x" * 64], True),
                                       (["x" * 65], False), (["bad label"], False), ([b"\xc3\xbc"], False), ([""], False),
                                       (["a", "b"], False)])
def test_client_label_is_validated(srv, labels, ok):
    headers = [("authorization", f"Bearer {KEY}"), ("content-type", "application/json")]
    headers += [("x-tandem-client", v) for v in labels]
    r = httpx.post(srv.url + "/v1/chat/completions", content=json.dumps(CHAT).encode(),
                   headers=httpx.Headers(headers), timeout=30)
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert_openai_error(r, 400, code="invalid_client_label")


def test_every_response_carries_request_ids(srv):
    responses = [post(srv, "/v1/chat/completions", CHAT), post(srv, "/v1/chat/completions", b"{"),
                 srv.http.get("/health"), srv.http.get("/v1/nope"), httpx.get(srv.url + "/v1/models"),
                 srv.http.get("/v1/models/tiny")]
    seen = set()
    for r in responses:
        assert r.headers["x-request-id"] == r.headers["request-id"] and r.headers["x-request-id"].startswith("req_")
        seen.add(r.headers["x-request-id"])
    assert len(seen) == len(responses)


def test_api_key_is_required_except_for_health_and_metrics(srv):
    plain = httpx.Client(base_url=srv.url, timeout=30)
    with plain:
        assert_openai_error(plain.post("/v1/chat/completions", json=CHAT), 401, code="invalid_api_key")
        assert_openai_error(plain.get("/v1/models"), 401)
        assert_openai_error(plain.post("/v1/chat/completions", json=CHAT,
                                       headers={"Authorization": "Bearer wrong"}), 401)
        assert_anthropic_error(plain.post("/v1/messages", json={}), 401, "authentication_error")
        assert plain.get("/health").status_code == 200 and plain.get("/metrics").status_code == 200
        assert plain.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": KEY}).status_code == 200
        assert plain.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"bearer {KEY}"}).status_code == 200
        assert plain.get("/v1/models", headers=AUTH).status_code == 200


def test_engine_refusals_are_429_and_503_with_retry_headers(srv):
    """...and each refusal is counted and logged once (it is recorded where the engine refuses, then
    passes the HTTP error handler)."""
    try:
        srv.engine.raise_on_submit = Overloaded("queue full")
        r = post(srv, "/v1/chat/completions", CHAT, headers={"X-Tandem-Client": "refused/429"})
        assert_openai_error(r, 429, code="rate_limit_exceeded")
        assert r.headers["retry-after"] == "1" and r.headers["retry-after-ms"] == "1000"
        srv.engine.raise_on_submit = EngineError("rank 0 died")
        r503 = post(srv, "/v1/chat/completions", {**CHAT, "stream": True}, headers={"X-Tandem-Client": "refused/503"})
        assert_openai_error(r503, 503)
    finally:
        srv.engine.raise_on_submit = None
    assert_serving(srv)
    text = srv.http.get("/metrics").text
    for client, status in (("refused/429", 429), ("refused/503", 503)):
        assert re.search(rf'tandem_requests_total\{{api="chat",client="{client}",status="{status}"\}} 1\.0', text), client
    events = [json.loads(line) for line in open(srv.log).read().splitlines()]
    for rid in (r.headers["x-request-id"], r503.headers["x-request-id"]):
        assert [e["event"] for e in events if e.get("request_id") == rid] == ["request_rejected"], rid


def test_metrics_report_requests_tokens_and_scheduler_gauges(srv):
    r = post(srv, "/v1/chat/completions", CHAT, headers={"X-Tandem-Client": "metrics/test"})
    usage = r.json()["usage"]
    text = srv.http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "tandem_kv_pages_used", "tandem_kv_pages_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:prefix_cache_hits_total",
                 "tandem_http_requests_in_flight", "tandem_engine_healthy"):
        assert name in text, name
    assert re.search(r'tandem_requests_total\{api="chat",client="metrics/test",status="200"\} 1\.0', text)
    assert re.search(r'tandem_requests_total\{api="chat",client="",status="400"\}', text)
    assert 'tandem_kv_pages_total{model_name="tiny"} 4096.0' in text
    assert usage["prompt_tokens"] > 0


def test_request_log_has_versioned_events_and_no_text(srv):
    secret_in, secret_out = "zebra-prompt-secret", "okapi-output-secret"
    srv.engine.script(f"thinking\n</think>\n\n{secret_out} <tool_call>\n<function=nope>\n</function>\n</tool_call>")
    body = {**CHAT, "messages": [{"role": "user", "content": secret_in}], "max_tokens": 200,
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    r = post(srv, "/v1/chat/completions", body, headers={"X-Tandem-Client": "log/test"})
    assert secret_out in r.json()["choices"][0]["message"]["content"]
    post(srv, "/v1/chat/completions", {**CHAT, "temperature": 9})
    text = open(srv.log).read()
    assert secret_in not in text and secret_out not in text
    events = [json.loads(line) for line in text.splitlines()]
    assert all(e["v"] == 1 and isinstance(e["ts"], float) for e in events)
    rid = r.headers["x-request-id"]
    mine = [e for e in events if e.get("request_id") == rid]
    assert [e["event"] for e in mine] == ["request_start", "request_done"]
    start, done = mine
    assert start["client"] == "log/test" and start["api"] == "chat" and start["tools"] == 1 and start["thinking"]
    assert done["status"] == 200 and done["finish_reason"] == "stop"
    assert done["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert done["completion_tokens"] == r.json()["usage"]["completion_tokens"] and done["reasoning_tokens"] > 0
    assert set(done["timings"]) >= {"queue_s", "ttft_s", "prefill_s", "decode_s", "total_s"}
    assert any("unknown function" in n for n in done["parser_notes"])
    rejected = [e for e in events if e["event"] == "request_rejected"]
    assert rejected and rejected[-1]["param"] == "temperature" and rejected[-1]["status"] == 400


def test_request_log_redacts_the_api_key():
    from server.request_log import redact_argv

    assert redact_argv(["serve", "--api-key", "s3cret", "--api-key=s3cret", "--port", "1"]) == \
        ["serve", "--api-key", "<redacted>", "--api-key=<redacted>", "--port", "1"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_request_log_on_a_full_disk_never_raises():
    """A full disk must not fail requests, nor turn a clean stop into a traceback and exit 1."""
    from server.request_log import RequestLog

    rl = RequestLog("/dev/full")
    rl.event("request_start", request_id="r")
    rl.close("signal")

def test_request_log_redacts_an_abbreviated_api_key_flag():
    """argparse takes any unambiguous prefix of --api-key (--api, --api-k=...): those values are the key too."""
    from server.cli import build_parser
    from server.request_log import redact_argv

    argv = ["serve", "--api", "s3cret", "--api-k=s3cret", "--port", "1"]
    assert build_parser().parse_args(argv).api_key == "s3cret"
    assert redact_argv(argv) == ["serve", "--api", "<redacted>", "--api-k=<redacted>", "--port", "1"]
    assert redact_argv(["serve", "--", "x", "--port", "2"]) == ["serve", "--", "x", "--port", "2"]


# --------------------------------------------------------------------------------------------------
# Health: loading, draining, engine failure


def test_health_while_loading_reports_the_weights_loaded_so_far():
    from server.load_progress import LoadProgress
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    release = threading.Event()
    service = _service(None, tok, d)
    progress = LoadProgress("tandem serve", stream=io.StringIO(), bar=False)
    service.load_progress = progress

    def load():
        release.wait(30)
        return FakeEngine(tok)

    with running(create_app(service, engine_loader=load)) as url:
        error = {"code": 503, "message": "Loading model", "type": "unavailable_error"}
        assert httpx.get(url + "/health").json() == {"error": error}        # no rank has reported yet
        progress(3 * 2**30, 20 * 2**30)
        r = httpx.get(url + "/health")
        assert r.status_code == 503
        assert r.json() == {"error": error, "loading": {"done_bytes": 3 * 2**30, "total_bytes": 20 * 2**30}}
        release.set()
        wait_for(lambda: httpx.get(url + "/health").status_code == 200)
        assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_health_is_503_while_loading_then_200():
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    release = threading.Event()
    engine = FakeEngine(tok)

    def load():
        release.wait(30)
        return engine

    service = _service(None, tok, d)
    with running(create_app(service, engine_loader=load)) as url:
        r = httpx.get(url + "/health")
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        assert_openai_error(httpx.post(url + "/v1/chat/completions", json=CHAT), 503)
        release.set()
        wait_for(lambda: httpx.get(url + "/health").status_code == 200)
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200
        service.begin_drain()
        assert httpx.get(url + "/health").json()["error"]["message"] == "Shutting down"
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert_openai_error(r, 503)
        assert "retry-after" in r.headers
    assert engine.shut_down


@pytest.mark.parametrize("error,words", [(RuntimeError("rank 0 could not load"), "could not load"),
                                         (MemoryError(), "MemoryError")], ids=["message", "no-message"])
def test_a_failed_engine_start_turns_health_503_and_is_fatal(error, words):
    """The loader's failure is in /health and the fatal reason; one whose text is empty (MemoryError()
    from a --kv-capacity far past the host's memory) is named by its type, not 'the engine failed to
    start: ' with nothing after it."""
    d = tiny_model_dir()
    fatal = []

    def load():
        raise error

    service = _service(None, Tokenizer.from_dir(d), d)
    with running(create_app(service, engine_loader=load, on_fatal=fatal.append)) as url:
        wait_for(lambda: fatal)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and words in r.json()["error"]["message"]
    assert words in fatal[0]


def test_killing_a_rank_fails_in_flight_requests_and_turns_health_503():
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    fatal = []
    engine_box = []

    def load():
        engine_box.append(Engine.start(d, options=EngineOptions(max_concurrency=2, max_context=4096,
                                                                threads_per_rank=1)))
        return engine_box[0]

    service = Service(None, tok, "tiny", 4096, generation_defaults(d))
    with running(create_app(service, engine_loader=load, on_fatal=fatal.append, fatal_grace_s=5)) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, timeout=60)
        pid = engine_box[0]._coordinator.procs[0].pid
        body = {"model": "tiny", "messages": USER, "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:                                   # decoding has started
                if line.startswith("data: ") and "reasoning" in line:
                    break
            os.kill(pid, signal.SIGKILL)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        last = json.loads(rest[-1][6:])
        assert "rank 0" in last["error"]["message"] and last["error"]["type"] == "server_error"
        wait_for(lambda: fatal, timeout=10)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "rank 0" in r.json()["error"]["message"]
        assert_openai_error(httpx.post(url + "/v1/chat/completions", json=CHAT), 503)
    assert not _alive(pid)


# --------------------------------------------------------------------------------------------------
# `tandem serve` as a process


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                    # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_pids(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"ranks.worker" in cmd:
            out.append(int(entry))
    return out


class ServeProcess:
    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("TANDEM_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", *args, "--port", "0",
                                      "--threads-per-rank", "1", "--model-id", "tiny"],
                                     cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.url = None
        self.lines: list[str] = []
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                break
        assert self.url, "".join(self.lines)
        self._drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._drain.start()

    def wait_healthy(self) -> None:
        wait_for(lambda: httpx.get(self.url + "/health").status_code == 200, timeout=60, interval=0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_serve_finishes_in_flight_work_on_sigterm_exits_0_and_leaves_no_rank_behind(tmp_path):
    log = tmp_path / "log.jsonl"
    zmq_endpoint = f"ipc://{tmp_path}/zmq.sock"
    p = ServeProcess(tiny_model_dir(), "--request-log-jsonl", str(log), "--api-key", "hush", "--max-context", "2048",
                     "--throughput-interval-s", "0.1", "--shutdown-timeout-s", "20", "--zmq-endpoint", zmq_endpoint)
    try:
        assert httpx.get(p.url + "/health").status_code in (200, 503)
        p.wait_healthy()
        from server.zmq_client import ZmqClient

        zc = ZmqClient(zmq_endpoint, api_key="hush", timeout_s=30)
        try:
            assert zc.health()["status"] == "ok"
            assert zc.chat(USER, stream=False, max_tokens=4).usage["completion_tokens"] >= 1
        finally:
            zc.close()
        ranks = _rank_pids(p.proc.pid)
        assert len(ranks) == 1
        r = httpx.post(p.url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": "hush"}, timeout=30)
        assert r.status_code == 200
        body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", p.url + "/v1/chat/completions", json=body, headers={"x-api-key": "hush"},
                          timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")            # the stream is open
            p.proc.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"                      # it was allowed to finish
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert p.proc.wait(30) == 0, "".join(p.lines)
        assert not any(_alive(pid) for pid in ranks)
    finally:
        p.close()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[0]["event"] == "server_start" and events[-1]["event"] == "server_stop"
    assert "hush" not in log.read_text() and "<redacted>" in events[0]["argv"]
    names = [e["event"] for e in events]
    assert names.count("request_done") == 3 and "throughput" in names
    tp = [e for e in events if e["event"] == "throughput" and "running" in e]     # (the first may predate the engine)
    assert tp and {"interval_s", "pages_total", "generated_tokens_delta"} <= set(tp[-1])
    busy = [e for e in tp if e.get("steps_delta", 0) > 0]
    assert busy and all(set(e["step_ms"]) == {"coordinator", "wait", "rank0"} and "steps_ahead_delta" in e
                        for e in busy)
    assert all(e["step_ms"]["wait"] > 0 and e["step_ms"]["rank0"] > 0 for e in busy)


def test_requests_still_running_at_the_shutdown_timeout_end_with_a_503_not_a_cut(tmp_path):
    """SIGTERM with --shutdown-timeout-s 3 and requests that would run far longer: before uvicorn's deadline
    the engine stops, the stream ends with an in-band error event ("shutting down"), the non-streamed
    request gets a JSON 503; exit 0, no rank left."""
    p = ServeProcess(tiny_model_dir(), "--max-context", "4096", "--shutdown-timeout-s", "3")
    try:
        p.wait_healthy()
        ranks = _rank_pids(p.proc.pid)
        long = {**CHAT, "max_tokens": 4000, "ignore_eos": True}
        result = {}

        def plain():
            result["r"] = httpx.post(p.url + "/v1/chat/completions", json=long, timeout=60)
        t = threading.Thread(target=plain)
        with httpx.stream("POST", p.url + "/v1/chat/completions", json={**long, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            t.start()
            time.sleep(0.5)
            t0 = time.monotonic()
            p.proc.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        t.join(30)
        assert time.monotonic() - t0 < 10
        err = json.loads(rest[-1][6:])["error"]             # api.md: an in-band error, then close
        assert "shutting down" in err["message"], err
        plain_r = result["r"]
        assert plain_r.status_code == 503 and "shutting down" in plain_r.json()["error"]["message"], plain_r.text
        assert p.proc.wait(30) == 0, "".join(p.lines)
        assert not any(_alive(pid) for pid in ranks)
    finally:
        p.close()


@contextlib.contextmanager
def _stream_then_sigterm(p):
    """A stream of thousands of tokens on the serve process p, then SIGTERM: yields the stream's line
    iterator (its first line read) while the server drains."""
    body = {**CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", p.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        p.proc.send_signal(signal.SIGTERM)
        yield lines


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_second_signal_ends_the_requests_still_running_at_once(tmp_path, second):
    """SIGTERM with --shutdown-timeout-s 60 and a stream that would run far longer, then a second signal:
    the stream ends at once with its in-band "shutting down" error (not a cut connection, not after the
    timeout); exit 0, no rank left."""
    p = ServeProcess(tiny_model_dir(), "--max-context", "4096", "--shutdown-timeout-s", "60")
    try:
        p.wait_healthy()
        ranks = _rank_pids(p.proc.pid)
        with _stream_then_sigterm(p) as lines:
            time.sleep(1.0)
            assert p.proc.poll() is None                  # draining: the stream still runs
            t0 = time.monotonic()
            p.proc.send_signal(second)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert time.monotonic() - t0 < 10
        err = json.loads(rest[-1][6:])["error"]
        assert "shutting down" in err["message"], err
        assert p.proc.wait(30) == 0, "".join(p.lines)
        assert not any(_alive(pid) for pid in ranks)
    finally:
        p.close()


def test_zmq_requests_in_flight_may_finish_after_sigterm_with_no_http_connection_open(tmp_path):
    """SIGTERM while only a ZeroMQ request runs (no HTTP connection, so uvicorn's graceful wait is
    over at once): the request still gets --shutdown-timeout-s to finish, as HTTP ones do; exit 0."""
    endpoint = f"ipc://{tmp_path}/zmq.sock"
    p = ServeProcess(tiny_model_dir(), "--max-context", "2048", "--shutdown-timeout-s", "20",
                     "--zmq-endpoint", endpoint)
    try:
        p.wait_healthy()
        from server.zmq_client import ZmqClient

        result = {}

        def run():
            with ZmqClient(endpoint, timeout_s=60) as zc:
                try:
                    result["r"] = zc.chat(USER, stream=False, max_tokens=400, ignore_eos=True)
                except Exception as e:                  # noqa: BLE001 - reported below
                    result["error"] = e
        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.5)
        p.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert "error" not in result, result
        r = result["r"]
        assert r.finish_reason == "length" and r.usage["completion_tokens"] == 400, r
        assert p.proc.wait(30) == 0, "".join(p.lines)
    finally:
        p.close()


def _tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment holds TANDEM_TEST_TAG=tag: a serve process's ranks, also once
    they were orphaned and reparented (which _rank_pids, going by the parent, would miss)."""
    out, needle = [], f"TANDEM_TEST_TAG={tag}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0") and _alive(int(entry)):
                        out.append(int(entry))
            except OSError:
                continue
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_right_after_the_listening_line_stops_serve_with_exit_0(tmp_path, monkeypatch, sig):
    """The signal comes in the moment between the "listening" line and uvicorn's own handlers, while the
    ranks are still starting: it is the server's graceful stop (exit 0, no rank left, the request log
    closed), not swallowed (the server ran on) and not fatal (killed by the signal, ranks orphaned)."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("TANDEM_TEST_TAG", tag)
    log = tmp_path / "log.jsonl"
    p = ServeProcess(tiny_model_dir(), "--max-context", "2048", "--request-log-jsonl", str(log))
    try:
        p.proc.send_signal(sig)
        assert p.proc.wait(30) == 0, "".join(p.lines)
        wait_for(lambda: not _tagged_pids(tag), timeout=10, interval=0.05)
    finally:
        p.close()
        for pid in _tagged_pids(tag):
            os.kill(pid, signal.SIGKILL)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[0]["event"] == "server_start" and events[-1]["event"] == "server_stop"


_SIGNAL_WHILE_BINDING = """
import os, signal, sys, time
import server.serve as serve
real = serve._bind
def bind(host, port):
    os.kill(os.getpid(), signal.SIG{name})      # comes while serve is starting: no socket, no rank yet
    time.sleep(20)
    return real(host, port)
serve._bind = bind
from server.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("name", ["TERM", "INT"])
def test_a_signal_while_serve_is_starting_ends_it_at_once_with_exit_0(tmp_path, name):
    """Before anything listens: exit 0 at once (not after the 20 s the patched bind would take, not
    killed by the signal) and a message that says so."""
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_BINDING.format(name=name), "serve", tiny_model_dir(),
                        "--port", "0", "--request-log-jsonl", str(log)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 15
    assert f"stopped by SIG{name} while starting" in r.stderr and "listening" not in r.stderr
    assert log.read_text() == ""        # as for an exit 2: the log starts with server_start, once bound


def test_a_rank_that_dies_while_requests_drain_still_exits_1(tmp_path):
    """SIGTERM, then a rank dies while a long stream drains: the stream ends with the engine's error, the
    request log records engine_failed and the process exits 1 (a failure, not a clean stop)."""
    log = tmp_path / "log.jsonl"
    p = ServeProcess(tiny_model_dir(), "--max-context", "4096", "--shutdown-timeout-s", "20",
                     "--request-log-jsonl", str(log))
    try:
        p.wait_healthy()
        ranks = _rank_pids(p.proc.pid)
        with _stream_then_sigterm(p) as lines:
            time.sleep(0.5)
            os.kill(ranks[0], signal.SIGKILL)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert "error" in json.loads(rest[-1][6:]), rest[-1]
        assert p.proc.wait(30) == 1, "".join(p.lines)
        assert not any(_alive(pid) for pid in ranks)
    finally:
        p.close()
    assert "engine_failed" in [json.loads(line)["event"] for line in log.read_text().splitlines()]


def test_serve_exits_nonzero_promptly_when_a_rank_dies():
    p = ServeProcess(tiny_model_dir(), "--max-context", "2048")
    try:
        p.wait_healthy()
        ranks = _rank_pids(p.proc.pid)
        os.kill(ranks[0], signal.SIGKILL)
        t0 = time.monotonic()
        code = p.proc.wait(30)
        assert code == 1, "".join(p.lines)
        assert time.monotonic() - t0 < 10
        assert "engine failure" in "".join(p.lines)
        assert not any(_alive(pid) for pid in ranks)
    finally:
        p.close()


def test_serve_refuses_a_bad_model_dir_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", str(tmp_path), "--port", "0"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot load" in r.stderr


@pytest.mark.parametrize("damage", ["missing_tensor", "truncated_shard"])
def test_serve_refuses_an_unloadable_checkpoint_with_exit_2_before_listening(tmp_path, damage):
    """A checkpoint that cannot load (a tensor missing, a shard cut short) exits 2 naming the problem
    before the port is bound, so systemd's RestartPreventExitStatus=2 stops a restart loop."""
    import json as _json
    import shutil
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), d)
    shard = next(d.glob("*.safetensors"))
    if damage == "truncated_shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) - 64])
        want = "truncated"
    else:
        from safetensors.torch import load_file, save_file
        tensors = load_file(str(shard))
        victim = sorted(k for k in tensors if "layers.0." in k)[0]
        del tensors[victim]
        save_file(tensors, str(shard), metadata={"format": "pt"})
        index = d / "model.safetensors.index.json"
        if index.exists():
            idx = _json.loads(index.read_text())
            idx["weight_map"].pop(victim, None)
            index.write_text(_json.dumps(idx))
        want = victim.split("layers.0.", 1)[1]
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", str(d), "--port", "0"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "cannot load" in r.stderr and want in r.stderr and "listening" not in r.stderr, r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without a usable GPU")
def test_serve_device_cuda_without_a_gpu_exits_2_before_listening():
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--device", "cuda", "--port", "0"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--device cuda: not usable here" in r.stderr and "listening" not in r.stderr, r.stderr



def test_serve_a_tp_the_model_cannot_split_exits_2_before_listening():
    """--tp 3 on the demo model (whose heads 3 does not divide): exit 2 (systemd does not restart it)
    naming the dimension, before the port is bound, as for any other configuration error."""
    from runtime.config import load_spec
    from ranks.demo import PACKAGED_DIR
    conflict = load_spec(PACKAGED_DIR).tp_conflict(3)
    assert conflict
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--tp", "3", "--port", "0"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--tp 3" in r.stderr and conflict in r.stderr and "listening" not in r.stderr, r.stderr


def test_a_body_shorter_than_its_content_length_is_a_408_not_a_hang():
    """Content-Length 200 and 20 bytes sent, then silence: the server answers 408 (the API's timeout
    error) after its body timeout instead of holding the connection; a whole request still works."""
    import socket
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    app = create_app(_service(FakeEngine(tok), tok, d), body_timeout_s=0.5)
    with running(app) as url:
        host, port = url.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 200\r\n\r\n" + b'{"model": "m", "mess')
            t0 = time.monotonic()
            reply = s.recv(65536).decode("latin-1")
            assert time.monotonic() - t0 < 5
        assert reply.startswith("HTTP/1.1 408"), reply
        body = json.loads(reply.split("\r\n\r\n", 1)[1])
        assert body["error"]["type"] == "timeout_error" and "Content-Length" in body["error"]["message"], body
        ok = httpx.get(url + "/health", timeout=10)
        assert ok.status_code in (200, 503)

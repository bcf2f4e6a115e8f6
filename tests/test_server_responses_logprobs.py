"""Log-probabilities in the OpenAI Responses API (server/openai_responses.py, server/responses_output.py).

Asking: include "message.output_text.logprobs" (k = top_logprobs or 0), or a top_logprobs > 0 alone
(lenient); a bad top_logprobs is a 400 naming it. Output: each output_text part's `logprobs` holds the
entries (chat shape) of the tokens of its text; `output_text.delta` events carry those of their text,
`output_text.done` / the final object the whole list; tokens of reasoning, tool calls and markup are in
no part. Checked on the real engine (a random tiny checkpoint: greedy tokens, alternatives, bytes, the
stream equal to the non-streamed object, the message entries equal to Chat Completions' entries after
a budgeted reasoning section) and on a scripted engine whose text is known (what is dropped where).
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest

from runtime.tokenizer import Tokenizer, generation_defaults
from server.app import create_app
from server.reasoning_seal import ReasoningSeal
from server.responses_output import ResponseBuilder, ToolSet
from server.service import EFFORT_BUDGETS, ContentDelta, Finish, ReasoningDelta, Service, TokenLogprobs
from tests.scripted_service import sse_events
from tests.server_util import FakeEngine, qwen_template, real_server, running, tiny_model_dir
from tests.test_server_responses import WEATHER, check_stream

CONTEXT = 512
INCLUDE = ["message.output_text.logprobs"]
BUDGET = 4                                     # reasoning effort "low" on these servers: 4 reasoning tokens


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=60)


def stream(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [e for e in sse_events(r.iter_lines()) if e[0] != ":"]


def messages(response: dict) -> list[dict]:
    """The output_text parts of a response object."""
    return [p for item in response["output"] if item["type"] == "message" for p in item["content"]]


def check_logprob_events(events: list[tuple[str, dict]]) -> dict:
    """The stream grammar (and the SDK's event types), plus: per output_text part, the deltas' logprobs
    concatenate to output_text.done's, content_part.done's and the final part's. Returns the final object."""
    final = check_stream(events)
    deltas: dict[str, list] = {}
    done: dict[str, list] = {}
    for name, data in events:
        if name == "response.output_text.delta":
            deltas.setdefault(data["item_id"], []).extend(data["logprobs"])
        elif name == "response.output_text.done":
            done[data["item_id"]] = data["logprobs"]
        elif name == "response.content_part.done" and data["part"]["type"] == "output_text":
            assert data["part"]["logprobs"] == done[data["item_id"]]
    for item in final["output"]:
        if item["type"] == "message":
            assert item["content"][0]["logprobs"] == done[item["id"]] == deltas.get(item["id"], [])
        else:
            assert item["id"] not in done
    return final


# ---- the real engine ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real():
    # no per-mode presets (their presence_penalty 1.5 in content would make temperature 0 pick a token
    # other than the raw distribution's best one after a repeat)
    with real_server(CONTEXT, qwen_template(), mode_sampling={},
                     effort_budgets={**EFFORT_BUDGETS, "low": BUDGET}) as srv:
        yield srv


# Greedy, thinking off: the seed-0 random model's 16 tokens are all message text (among them a literal
# <tool_call>: no tools are declared, so it stays text), never EOS (the response is incomplete), so
# every generated token has an entry and their bytes decode to the text.
GREEDY = {"model": "tiny", "input": "Say hello", "max_output_tokens": 16, "temperature": 0,
          "reasoning": {"effort": "none"}, "include": INCLUDE, "top_logprobs": 3}


def test_greedy_message_entries_one_per_token_with_alternatives(real):
    r = real.client.responses.create(**GREEDY)
    assert r.status == "incomplete" and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.top_logprobs == 3
    (item,) = r.output
    (part,) = item.content
    entries = part.logprobs
    assert len(entries) == r.usage.output_tokens == 16
    for e in entries:
        assert e.logprob <= 1e-9
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
        assert len(e.top_logprobs) == 3
        values = [a.logprob for a in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        best = e.top_logprobs[0]                          # greedy: the chosen token is the most likely one
        assert bytes(best.bytes) == bytes(e.bytes) and best.token == e.token and best.logprob == e.logprob
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace") == part.text == r.output_text


def test_stream_deltas_concatenate_to_the_non_streamed_list(real):
    plain = post(real.url, GREEDY).json()
    final = check_logprob_events(stream(real.url, GREEDY))
    (got,), (want,) = messages(final), messages(plain)
    assert got["text"] == want["text"] and len(want["logprobs"]) == 16
    assert got["logprobs"] == want["logprobs"]            # same tokens, bytes, values and alternatives


def test_include_alone_gives_no_alternatives_and_top_logprobs_alone_turns_them_on(real):
    body = {k: v for k, v in GREEDY.items() if k != "top_logprobs"}
    (part,) = messages(post(real.url, body).json())
    assert len(part["logprobs"]) == 16 and all(e["top_logprobs"] == [] for e in part["logprobs"])
    lenient = {**{k: v for k, v in GREEDY.items() if k != "include"}, "top_logprobs": 2}
    (part2,) = messages(post(real.url, lenient).json())
    assert [e["token"] for e in part2["logprobs"]] == [e["token"] for e in part["logprobs"]]
    assert all(len(e["top_logprobs"]) == 2 for e in part2["logprobs"])


@pytest.mark.parametrize("extra", [{}, {"top_logprobs": 0}, {"include": ["reasoning.encrypted_content"]}])
def test_requests_that_do_not_ask_get_empty_lists(real, extra):
    body = {**{k: v for k, v in GREEDY.items() if k not in ("include", "top_logprobs")}, **extra}
    plain = post(real.url, body).json()
    assert messages(plain) and all(p["logprobs"] == [] for p in messages(plain))
    events = stream(real.url, body)
    check_logprob_events(events)
    assert all(d["logprobs"] == [] for n, d in events if n.startswith("response.output_text."))


def test_budgeted_reasoning_entries_are_dropped(real):
    """Effort "low" = 4 reasoning tokens, then the engine inserts </think> (no entries): the message's
    entries are exactly Chat Completions' entries of the same greedy run after the reasoning tokens."""
    body = {"model": "tiny", "input": "Name three colours.", "max_output_tokens": 16, "temperature": 0,
            "reasoning": {"effort": "low"}, "include": INCLUDE, "top_logprobs": 2}
    plain = post(real.url, body).json()
    assert [i["type"] for i in plain["output"]] == ["reasoning", "message"]
    (part,) = messages(plain)
    chat = real.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"thinking_budget": BUDGET,
                                                   "chat_template_kwargs": {"enable_thinking": True}})
    assert chat.choices[0].message.content == part["text"]
    every = [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert len(every) == BUDGET + len(part["logprobs"]) and every[BUDGET:] == part["logprobs"]
    assert all(e["token"] != "</think>" for e in part["logprobs"])
    final = check_logprob_events(stream(real.url, body))
    assert messages(final)[0]["logprobs"] == part["logprobs"]


@pytest.mark.parametrize("value", [21, -1, "x", True, 2.5, [3]])
def test_bad_top_logprobs_is_a_400_naming_it(real, value):
    for body in ({**GREEDY, "top_logprobs": value}, {**GREEDY, "top_logprobs": value, "stream": True}):
        r = post(real.url, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "top_logprobs"
        assert "top_logprobs" in err["message"]
    with pytest.raises(openai.BadRequestError):
        real.client.responses.create(**{**GREEDY, "top_logprobs": value})
    ok = post(real.url, {**GREEDY, "max_output_tokens": 2})       # the server keeps serving
    assert ok.status_code == 200 and len(messages(ok.json())[0]["logprobs"]) == 2


# ---- a scripted engine: known text through the real detokenizer and parser ------------------------

class LogprobEngine(FakeEngine):
    """FakeEngine whose events carry logprob entries when the request asks: token t gets logprob
    -(position + 1) / 8 and alternatives t, t+1, ... (k of them, the first being t with its value)."""

    def logprobs_of(self, n: int, token: int, params) -> list | None:
        k = params.logprobs
        lp = -(n + 1) / 8
        return None if k is None else [[lp, [[token + j, lp - j] for j in range(k)]]]


@pytest.fixture(scope="module")
def scripted_server():
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    engine = LogprobEngine(tok)
    service = Service(engine, tok, "tiny", CONTEXT, generation_defaults(d), qwen_template())
    with running(create_app(service)) as url:
        yield SimpleNamespace(url=url, client=_client(url), tok=tok, engine=engine)


@pytest.fixture
def scripted(scripted_server):
    scripted_server.engine.outputs.clear()
    scripted_server.engine.submitted.clear()
    return scripted_server


def _token_texts(entries: list[dict]) -> bytes:
    return b"".join(bytes(e["bytes"]) for e in entries)


def _run_both(s, output: str, body: dict) -> dict:
    """The non-streamed object and the stream of one scripted output; they must agree. Returns the object."""
    s.engine.script(output, output)
    plain = post(s.url, body).json()
    final = check_logprob_events(stream(s.url, body))
    assert [p["logprobs"] for p in messages(final)] == [p["logprobs"] for p in messages(plain)]
    assert [p["text"] for p in messages(final)] == [p["text"] for p in messages(plain)]
    return plain


@pytest.mark.parametrize("ask, k", [({"include": INCLUDE}, 0), ({"include": INCLUDE, "top_logprobs": 5}, 5),
                                    ({"top_logprobs": 4}, 4), ({"top_logprobs": 0}, None), ({}, None),
                                    ({"include": ["reasoning.encrypted_content"], "top_logprobs": 0}, None)])
def test_what_the_engine_is_asked(scripted, ask, k):
    r = post(scripted.url, {"model": "tiny", "input": "hi", **ask})
    assert r.status_code == 200 and scripted.engine.submitted[-1].params.logprobs == k
    assert r.json()["top_logprobs"] == ask.get("top_logprobs")


def test_reasoning_and_markup_tokens_belong_to_no_part(scripted):
    text = "Hello wörld, naïve 😀 café"
    obj = _run_both(scripted, "I think.\n</think>\n\n" + text, {"model": "tiny", "input": "hi", "include": INCLUDE,
                                                                "top_logprobs": 2})
    assert [i["type"] for i in obj["output"]] == ["reasoning", "message"]
    (part,) = messages(obj)
    assert part["text"] == text
    assert _token_texts(part["logprobs"]) == text.encode()          # the text's tokens, nothing before them
    ids = scripted.tok.encode(text)
    assert [e["bytes"] for e in part["logprobs"]] == [list(scripted.tok.token_bytes(i)) for i in ids]
    for e in part["logprobs"]:
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"]


def test_tool_call_tokens_belong_to_no_part(scripted):
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    obj = _run_both(scripted, "Let me check. \n" + call,
                    {"model": "tiny", "input": "hi", "tools": [WEATHER], "reasoning": {"effort": "none"},
                     "include": INCLUDE})
    assert [i["type"] for i in obj["output"]] == ["message", "function_call"]
    (part,) = messages(obj)
    assert part["text"] == "Let me check."
    tokens = _token_texts(part["logprobs"]).decode()
    # the text's tokens; a token that also holds the trimmed whitespace after it counts with the text
    assert tokens.startswith("Let me check.") and not tokens[len("Let me check."):].strip()
    assert "tool_call" not in tokens


def test_leading_whitespace_and_a_literal_tag_in_the_text(scripted):
    obj = _run_both(scripted, "\n\n  a <b> <tool_call x \n c",
                    {"model": "tiny", "input": "hi", "reasoning": {"effort": "none"}, "include": INCLUDE})
    (part,) = messages(obj)
    assert part["text"] == "a <b> <tool_call x \n c"                # leading whitespace trimmed, tags kept as text
    assert _token_texts(part["logprobs"]).decode().lstrip() == part["text"]
    assert _token_texts(part["logprobs"]).decode().strip()[:1] == "a"


def test_no_logprobs_keep_empty_lists_with_a_scripted_reasoning_message_and_call(scripted):
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    obj = _run_both(scripted, "Hmm.\n</think>\n\nChecking.\n" + call,
                    {"model": "tiny", "input": "hi", "tools": [WEATHER]})
    assert [i["type"] for i in obj["output"]] == ["reasoning", "message", "function_call"]
    assert messages(obj)[0]["logprobs"] == [] and obj["top_logprobs"] is None


# ---- the builder alone: bytes that split characters -----------------------------------------------

def _entry(raw: bytes) -> dict:
    token = raw.decode("utf-8", errors="replace")
    return {"token": token, "logprob": -1.0, "bytes": list(raw), "top_logprobs": []}


def test_builder_gives_split_characters_to_the_text_they_complete():
    """Entries holding pieces of a character go with the delta that shows it, also the U+FFFD the
    generation's decoder flushes at the end for an incomplete one; reasoning entries go nowhere."""
    b = ResponseBuilder("resp_x", {}, ToolSet(), ReasoningSeal(b"k" * 32), summary=False, encrypted=False)
    think, end, nl = _entry(b"hm"), _entry(b"</think>"), _entry(b"\n\n")
    a, c1, c2, tail = _entry(b"a"), _entry("中".encode()[:2]), _entry("中".encode()[2:]), _entry(b"\xe4")
    events = []
    for d in (TokenLogprobs([think]), ReasoningDelta("hm"), TokenLogprobs([end, nl, a]), ContentDelta("a"),
              TokenLogprobs([c1]), TokenLogprobs([c2]), ContentDelta("中"), TokenLogprobs([tail]),
              ContentDelta("\ufffd")):
        events += b.feed(d)
    events += b.finish(Finish("length", {"prompt_tokens": 1, "completion_tokens": 7}, {}))
    deltas = [d["logprobs"] for n, d in events if n == "response.output_text.delta"]
    assert deltas == [[a], [c1, c2], [tail]]
    part = b.response()["output"][1]["content"][0]
    assert part["text"] == "a中\ufffd" and part["logprobs"] == [a, c1, c2, tail]
    (done,) = [d for n, d in events if n == "response.output_text.done"]
    assert done["logprobs"] == part["logprobs"]

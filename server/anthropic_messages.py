"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens (api.md §4).

The adapter parses an Anthropic request into a ChatRequest (OpenAI-shaped messages and tools), lets
Service.prepare validate it before any 200, then turns the Service's deltas into content blocks. One
builder produces both the stream events (§4.1) and the final message, so a streamed message accumulates
to exactly the non-streamed one.

Mapping (§4): system blocks join with a blank line (Claude Code's per-request billing header block is
dropped); user turns put their tool_result blocks first, as `tool` messages, then their text blocks
joined by newlines (documents with a text source count as text); assistant thinking
blocks become reasoning_content (restored byte-exactly from our signature when it verifies, §4.2),
tool_use blocks become tool_calls; unknown roles are users. Images are refused (the model reads text);
an image inside a tool_result becomes a text placeholder so an agent's history stays valid.
Usage: prompt = input + cache_read (+ cache_creation, always 0); message_start reports the whole prompt
as input_tokens, message_delta carries the split once the cache hit is known.
Structured outputs: output_config.format {type: "json_schema", schema} (or the beta's top-level
output_format) constrains the text (server.structured): reasoning stays free, and with tools the model
may call it is not applied; a schema that cannot be used is a 400 naming output_config.format.schema.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from server.disconnect import Guarded, until_disconnect
from server.generation import collect_into
from server.errors import anthropic_error_body
from server.params import read_json
from server.reasoning_seal import ReasoningSeal
from server.service import (EFFORTS, APIError, ChatRequest, ContentDelta, Finish, Prepared, ReasoningDelta, Sampling,
                            Service, ToolCallArgs, ToolCallEnd, ToolCallStart)
from server.sse import KEEPALIVE, SSE_HEADERS, event, with_keepalive
from server.structured import output_format

log = logging.getLogger(__name__)

BILLING_HEADER = "x-anthropic-billing-header"     # Claude Code's per-request system block (defeats the cache)
IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"
THINKING_TYPES = ("enabled", "adaptive", "disabled", "between_tools")
TOOL_CHOICES = ("auto", "any", "tool", "none")
_CONTEXT_NUMBERS = re.compile(r"maximum context length is (\d+) tokens\. However, your request has (\d+)")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ---- request parsing ----------------------------------------------------------------------------

@dataclass
class MessagesRequest:
    chat: ChatRequest
    model: str
    stream: bool
    omit_thinking: bool          # thinking.display == "omitted": empty thinking text, signature still sent
    effort: str | None           # output_config.effort: a thinking budget when thinking has none


def _bad(param: str, message: str) -> APIError:
    return APIError(400, "invalid_request", f"{param}: {message}", param=param)


def _get(obj: dict, key: str, types: tuple[type, ...], path: str, required: bool = False, what: str = "") -> Any:
    value = obj.get(key)
    if value is None:
        if required:
            raise _bad(f"{path}{key}", "Field required")
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        want = what or " or ".join({"str": "a string", "int": "an integer", "float": "a number", "list": "a list",
                                    "dict": "an object", "bool": "a boolean"}[t.__name__] for t in types)
        raise _bad(f"{path}{key}", f"must be {want}, got {type(value).__name__}")
    return value


def _number(obj: dict, key: str, lo: float, hi: float) -> float | None:
    value = _get(obj, key, (int, float), "", what="a number")
    if value is not None and not lo <= value <= hi:
        raise _bad(key, f"must be in [{lo:g}, {hi:g}], got {value}")
    return None if value is None else float(value)


def _blocks(content: Any, path: str) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(path, f"must be a string or a list of content blocks, got {type(content).__name__}")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{path}.{i}", "content block must be an object with a string 'type'")
    return content


def _text_of(block: dict, path: str) -> str:
    return _get(block, "text", (str,), path + ".", required=True)


def _document_text(block: dict, path: str) -> str:
    source = _get(block, "source", (dict,), path + ".", required=True)
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        return source["data"]
    if source.get("type") == "content":
        return "\n".join(_text_of(b, f"{path}.source.content.{i}")
                         for i, b in enumerate(_blocks(source.get("content"), path + ".source.content"))
                         if b["type"] == "text")
    raise _bad(path + ".source", "only text documents are supported")


def _tool_result_content(block: dict, path: str) -> str:
    content = block.get("content")
    if content is None:
        return ""
    parts = []
    for i, b in enumerate(_blocks(content, path + ".content")):
        if b["type"] == "text":
            parts.append(_text_of(b, f"{path}.content.{i}"))
        elif b["type"] == "image":
            parts.append(IMAGE_PLACEHOLDER)
        elif b["type"] == "document":
            parts.append(_document_text(b, f"{path}.content.{i}"))
    return "\n".join(parts)


def _user_turn(blocks: list[dict], path: str) -> list[dict]:
    """tool_result blocks -> tool messages (first), the rest -> one user message."""
    tools, texts = [], []
    for i, b in enumerate(blocks):
        kind, bpath = b["type"], f"{path}.{i}"
        if kind == "text":
            texts.append(_text_of(b, bpath))
        elif kind == "tool_result":
            tools.append({"role": "tool", "tool_call_id": _get(b, "tool_use_id", (str,), bpath + ".", required=True),
                          "content": _tool_result_content(b, bpath)})
        elif kind == "image":
            raise _bad(bpath, "images not supported: this model reads text only")
        elif kind == "document":
            texts.append(_document_text(b, bpath))
        else:
            log.debug("dropped %s block at %s", kind, bpath)
    out = list(tools)
    if texts or not tools:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(blocks: list[dict], path: str, seal: ReasoningSeal) -> dict:
    reasoning, texts, calls = [], [], []
    for i, b in enumerate(blocks):
        kind, bpath = b["type"], f"{path}.{i}"
        if kind == "text":
            texts.append(_text_of(b, bpath))
        elif kind == "thinking":
            given = _get(b, "thinking", (str,), bpath + ".", required=True)
            restored = seal.open(b.get("signature"))
            reasoning.append(restored if restored is not None else given)
        elif kind == "tool_use":
            tool_input = _get(b, "input", (dict,), bpath + ".", required=True, what="an object")
            calls.append({"id": _get(b, "id", (str,), bpath + ".", required=True), "type": "function",
                          "function": {"name": _get(b, "name", (str,), bpath + ".", required=True),
                                       "arguments": json.dumps(tool_input, ensure_ascii=False)}})
        elif kind == "image":
            raise _bad(bpath, "images not supported: this model reads text only")
        else:
            log.debug("dropped %s block at %s", kind, bpath)   # redacted_thinking, server tool blocks
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(raw: Any, seal: ReasoningSeal) -> list[dict]:
    if not isinstance(raw, list):
        raise _bad("messages", f"must be a list, got {type(raw).__name__}" if raw is not None else "Field required")
    if not raw:
        raise _bad("messages", "at least one message is required")
    out: list[dict] = []
    for i, m in enumerate(raw):
        path = f"messages.{i}"
        if not isinstance(m, dict):
            raise _bad(path, f"must be an object, got {type(m).__name__}")
        role = _get(m, "role", (str,), path + ".", required=True)
        if "content" not in m:
            raise _bad(path + ".content", "Field required")
        blocks = _blocks(m["content"], path + ".content")
        if role == "assistant":
            out.append(_assistant_turn(blocks, path + ".content", seal))
        elif role == "system":
            out.append({"role": "system", "content": "\n".join(_text_of(b, f"{path}.content.{j}")
                                                             for j, b in enumerate(blocks) if b["type"] == "text")})
        else:                                           # user, and unknown roles (Claude Code's ctx/msg)
            out += _user_turn(blocks, path + ".content")
    return out


def _system(raw: Any) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw or None
    texts = [_text_of(b, f"system.{i}") for i, b in enumerate(_blocks(raw, "system")) if b["type"] == "text"]
    texts = [t for t in texts if not t.startswith(BILLING_HEADER)]
    return "\n\n".join(texts) or None


def _tools(raw: Any) -> list[dict] | None:
    """Client (custom) tools -> OpenAI function tools, in client order, one fixed key order (cache-stable);
    server tools (web_search_*, bash_*, text_editor_*, ...) are ignored."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tools", f"must be a list, got {type(raw).__name__}")
    out = []
    for i, t in enumerate(raw):
        path = f"tools.{i}."
        if not isinstance(t, dict):
            raise _bad(f"tools.{i}", f"must be an object, got {type(t).__name__}")
        if t.get("type") not in (None, "custom"):
            continue
        name = _get(t, "name", (str,), path, required=True)
        if not name:
            raise _bad(path + "name", "must be non-empty")
        schema = _get(t, "input_schema", (dict,), path, required=True, what="an object (a JSON schema)")
        if schema.get("type", "object") != "object":
            raise _bad(path + "input_schema.type", f"must be 'object', got {schema.get('type')!r}")
        function: dict[str, Any] = {"name": name}
        description = _get(t, "description", (str,), path)
        if description is not None:
            function["description"] = description
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(raw: Any, tools: list[dict] | None) -> tuple[Any, bool]:
    if raw is None:
        return None, True
    if not isinstance(raw, dict):
        raise _bad("tool_choice", f"must be an object, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind not in TOOL_CHOICES:
        raise _bad("tool_choice.type", f"must be one of {', '.join(TOOL_CHOICES)}, got {kind!r}")
    parallel = not _get(raw, "disable_parallel_tool_use", (bool,), "tool_choice.")
    if kind == "tool":
        name = _get(raw, "name", (str,), "tool_choice.", required=True)
        if name not in {t["function"]["name"] for t in tools or ()}:
            raise _bad("tool_choice.name", f"no tool named {name!r} in tools")
        return {"type": "function", "function": {"name": name}}, parallel
    if kind == "any" and not tools:
        raise _bad("tool_choice.type", "is 'any' but no tools were given")
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _thinking(raw: Any) -> tuple[bool | None, int | None, bool]:
    """-> (thinking on/off/None = model default, budget tokens, omit thinking text)."""
    if raw is None:
        return None, None, False
    if not isinstance(raw, dict):
        raise _bad("thinking", f"must be an object, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind not in THINKING_TYPES:
        raise _bad("thinking.type", f"must be one of {', '.join(THINKING_TYPES)}, got {kind!r}")
    display = raw.get("display")
    if display not in (None, "summarized", "omitted"):
        raise _bad("thinking.display", f"must be 'summarized' or 'omitted', got {display!r}")
    if kind in ("disabled", "between_tools"):
        return False, None, False
    budget = None
    if kind == "enabled":
        budget = _get(raw, "budget_tokens", (int,), "thinking.", required=True)
        if budget < 1:
            raise _bad("thinking.budget_tokens", f"must be >= 1, got {budget}")
    return True, budget, display == "omitted"


def _output_format(body: dict, output_config: dict) -> str | None:
    """output_config.format ({type: "json_schema", schema}), or the structured-outputs beta's top-level
    output_format (the same object) -> a grammar (server.structured); at most one of them."""
    fmt = output_config.get("format")
    legacy = body.get("output_format")
    if fmt is not None and legacy is not None:
        raise _bad("output_format", "give the format once, in output_config.format")
    field = "output_config.format" if legacy is None else "output_format"
    value = legacy if legacy is not None else fmt
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(field, f"must be an object, got {type(value).__name__}")
    if value.get("type") not in ("json_schema", "json_object", "text"):
        raise _bad(f"{field}.type", f"must be 'json_schema' (or 'json_object', 'text'), got {value.get('type')!r}")
    return output_format(value, field)


def parse_request(body: Any, seal: ReasoningSeal, *, count_only: bool = False) -> MessagesRequest:
    """An Anthropic request body -> MessagesRequest. Raises APIError 400 naming the field.
    count_only: the count_tokens body (no max_tokens)."""
    if not isinstance(body, dict):
        raise APIError(400, "invalid_request", "request body must be a JSON object")
    model = _get(body, "model", (str,), "", required=True)
    max_tokens = None
    if not count_only:
        max_tokens = _get(body, "max_tokens", (int,), "", required=True)
        if max_tokens < 1:
            raise _bad("max_tokens", f"must be >= 1, got {max_tokens}")
    messages = _messages(body.get("messages"), seal)
    last = messages[-1]
    # a final assistant turn with text is a prefill: the reply continues it (as Anthropic's API does)
    prefill = last["role"] == "assistant" and bool(last["content"]) and not last.get("tool_calls")
    if prefill and last["content"] != last["content"].rstrip():
        raise _bad(f"messages.{len(body['messages']) - 1}.content",
                   "final assistant content cannot end with trailing whitespace")
    system = _system(body.get("system"))
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    tools = _tools(body.get("tools"))
    tool_choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    thinking, budget, omit = _thinking(body.get("thinking"))
    output_config = _get(body, "output_config", (dict,), "") or {}
    effort = _get(output_config, "effort", (str,), "output_config.")
    if effort is not None and effort not in EFFORTS:
        raise _bad("output_config.effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
    grammar = _output_format(body, output_config)
    stop = _get(body, "stop_sequences", (list,), "") or []
    if not all(isinstance(s, str) for s in stop):
        raise _bad("stop_sequences", "must be a list of strings")
    top_k = _get(body, "top_k", (int,), "")
    if top_k is not None and top_k < 0:
        raise _bad("top_k", f"must be >= 0, got {top_k}")
    sampling = Sampling(temperature=_number(body, "temperature", 0.0, 1.0), top_p=_number(body, "top_p", 0.0, 1.0),
                        top_k=top_k)
    chat = ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel,
                       thinking=thinking, thinking_budget=budget, max_tokens=max_tokens, stop=list(stop),
                       sampling=sampling, model=model, api="messages", tool_id_prefix="toolu_", grammar=grammar,
                       continue_final=prefill)
    chat.stream = bool(_get(body, "stream", (bool,), "")) and not count_only
    return MessagesRequest(chat=chat, model=model, stream=chat.stream, omit_thinking=omit, effort=effort)


# ---- deltas -> content blocks and stream events -------------------------------------------------

def _ev(kind: str, **data: Any) -> tuple[str, dict]:
    return kind, {"type": kind, **data}


def _tool_use_id(call_id: str) -> str:
    """The Service's call id (ChatRequest.tool_id_prefix is "toolu_") with Anthropic's prefix, whatever it had."""
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_" + (call_id[len("call_"):] if call_id.startswith("call_") else call_id)


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):        # RecursionError: nested deeper than json can decode
        log.warning("tool call arguments are not JSON; sending input {}: %.200r", arguments)
        return {}
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    """Service deltas -> Anthropic content blocks. feed()/finish() return the §4.1 events in order;
    message() is the final object (equal to what the events accumulate to).

    Blocks open lazily: a thinking block at the first reasoning text, a text block at the first
    non-whitespace content (leading whitespace is held, so no empty or blank text block is ever sent),
    a tool_use block at ToolCallStart. Opening a block closes the previous one; indices are dense.
    """

    def __init__(self, msg_id: str, model: str, prompt_tokens: int, seal: ReasoningSeal, omit_thinking: bool):
        self.msg_id, self.model, self.prompt_tokens = msg_id, model, prompt_tokens
        self.seal, self.omit_thinking = seal, omit_thinking
        self.blocks: list[dict] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] = {"input_tokens": prompt_tokens, "output_tokens": 0,
                                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        self._open: str | None = None            # thinking | text | tool_use
        self._parts: list[str] = []              # text of the open block
        self._call_index: int | None = None      # the service's index of the open tool call
        self._held = ""                          # leading whitespace before a text block opens

    def start(self) -> list[tuple[str, dict]]:
        message = {**self.message(), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {**self.usage, "output_tokens": 1}}
        return [_ev("message_start", message=message), _ev("ping")]

    def message(self) -> dict:
        return {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": self.usage}

    def feed(self, delta: Any) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if isinstance(delta, ReasoningDelta):
            if not delta.text:
                return out
            if self._open != "thinking":
                out += self._close()
                out += self._begin({"type": "thinking", "thinking": "", "signature": ""})
            self._parts.append(delta.text)
            if not self.omit_thinking:
                out.append(self._delta({"type": "thinking_delta", "thinking": delta.text}))
        elif isinstance(delta, ContentDelta):
            if not delta.text:
                return out
            if self._open == "text":
                self._parts.append(delta.text)
                out.append(self._delta({"type": "text_delta", "text": delta.text}))
                return out
            out += self._close()
            self._held += delta.text
            if self._held.strip():
                text, self._held = self._held, ""
                out += self._begin({"type": "text", "text": ""})
                self._parts.append(text)
                out.append(self._delta({"type": "text_delta", "text": text}))
        elif isinstance(delta, ToolCallStart):
            out += self._close()
            self._held = ""
            out += self._begin({"type": "tool_use", "id": _tool_use_id(delta.id), "name": delta.name, "input": {}})
            self._call_index = delta.index
        elif isinstance(delta, ToolCallArgs):
            if self._open != "tool_use" or delta.index != self._call_index:
                log.warning("arguments for tool call %d, which is not open; dropped", delta.index)
            elif delta.fragment:
                self._parts.append(delta.fragment)
                out.append(self._delta({"type": "input_json_delta", "partial_json": delta.fragment}))
        elif isinstance(delta, ToolCallEnd):
            if self._open == "tool_use" and delta.index == self._call_index:
                out += self._close()
        return out

    def finish(self, fin: Finish) -> list[tuple[str, dict]]:
        """Close the open block; set stop_reason and usage. A server-side cancel raises APIError (503)."""
        if fin.finish_reason == "cancelled":
            raise APIError(503, "unavailable", "the request was cancelled by the server", should_retry=True)
        out = self._close()
        has_tool = any(b["type"] == "tool_use" for b in self.blocks)
        if fin.finish_reason == "stop" and fin.matched_stop is not None:
            self.stop_reason, self.stop_sequence = "stop_sequence", fin.matched_stop
        elif has_tool and fin.finish_reason != "length":
            self.stop_reason = "tool_use"
        else:
            self.stop_reason = STOP_REASONS.get(fin.finish_reason, "end_turn")
            if self.stop_reason == "tool_use":
                self.stop_reason = "end_turn"            # finish said tool_calls but no call was parsed
        u = fin.usage
        prompt = u.get("prompt_tokens", self.prompt_tokens)
        cached = min(u.get("cached_tokens", 0) or 0, prompt)
        self.usage = {"input_tokens": prompt - cached, "output_tokens": u.get("completion_tokens", 0),
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                      "output_tokens_details": {"thinking_tokens": u.get("reasoning_tokens", 0) or 0}}
        out.append(_ev("message_delta", delta={"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                       usage=dict(self.usage)))
        out.append(_ev("message_stop"))
        return out

    def _begin(self, block: dict) -> list[tuple[str, dict]]:
        self.blocks.append(block)
        self._open, self._parts = block["type"], []
        return [_ev("content_block_start", index=len(self.blocks) - 1, content_block=dict(block))]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return _ev("content_block_delta", index=len(self.blocks) - 1, delta=delta)

    def _close(self) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        block, text, index = self.blocks[-1], "".join(self._parts), len(self.blocks) - 1
        out = []
        if self._open == "thinking":
            block["signature"] = self.seal.seal(text)
            block["thinking"] = "" if self.omit_thinking else text
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif self._open == "text":
            block["text"] = text
        else:
            block["input"] = _tool_input(text)
        self._open, self._parts, self._call_index = None, [], None
        out.append(_ev("content_block_stop", index=index))
        return out


# ---- routes -------------------------------------------------------------------------------------

def _worded(err: APIError) -> APIError:
    """A shared layer's error in this API's words: an over-long prompt as Anthropic says it, which agents
    (Claude Code) match to auto-compact; a bad field (the chat template's refusals, sampling values)
    prefixed with its name, as this adapter's own validation errors are."""
    m = _CONTEXT_NUMBERS.search(err.message) if err.kind == "context_length_exceeded" else None
    if m is not None:
        return APIError(err.status, err.kind, f"prompt is too long: {m[2]} tokens > {m[1]} maximum", param=err.param)
    if err.kind == "invalid_request" and err.param and not err.message.startswith(err.param):
        return APIError(err.status, err.kind, f"{err.param}: {err.message}", param=err.param,
                        retry_after_s=err.retry_after_s, should_retry=err.should_retry, code=err.code,
                        headers=err.headers)
    return err


class MessagesAPI:
    def __init__(self, service: Service, seal: ReasoningSeal, keepalive_s: float):
        self.service, self.seal, self.keepalive_s = service, seal, keepalive_s

    async def _parse(self, request: Request, count_only: bool) -> MessagesRequest:
        req = parse_request(await read_json(request), self.seal, count_only=count_only)
        chat = req.chat
        if req.effort is not None and chat.thinking is not False:
            thinking, budget = self.service.thinking_for_effort(req.effort)
            chat.thinking = chat.thinking if chat.thinking is not None else thinking
            chat.thinking_budget = chat.thinking_budget if chat.thinking_budget is not None else budget
        return req

    async def count_tokens(self, request: Request) -> Response:
        req = await self._parse(request, count_only=True)
        self.service.resolve_model(req.chat.model)          # 404 for an unknown model, as create does
        try:
            return JSONResponse({"input_tokens": self.service.count_tokens(req.chat)})
        except APIError as e:
            raise _worded(e) from None

    async def create(self, request: Request) -> Response:
        req = await self._parse(request, count_only=False)
        try:
            prepared = self.service.prepare(req.chat)
        except APIError as e:
            raise _worded(e) from None
        await self.service.submit_async(prepared)            # queue full / engine down: an HTTP error, before the 200
        builder = MessageBuilder("msg_" + secrets.token_hex(12), req.model, len(prepared.prompt_ids), self.seal,
                                 req.omit_thinking)
        if req.stream:
            return Guarded(StreamingResponse(self._pings(self._events(prepared, builder)),
                                             media_type="text/event-stream", headers=SSE_HEADERS),
                           lambda: self.service.release(prepared))
        try:
            await until_disconnect(request.receive, self._collect(prepared, builder))
        finally:
            self.service.release(prepared)
        return JSONResponse(builder.message())

    async def _collect(self, prepared: Prepared, builder: MessageBuilder) -> None:
        await collect_into(self.service, prepared, builder)

    async def _events(self, prepared: Prepared, builder: MessageBuilder) -> AsyncIterator[bytes]:
        agen = self.service.generate(prepared)
        try:
            for name, data in builder.start():
                yield event(data, name)
            async for delta in agen:
                events = builder.finish(delta) if isinstance(delta, Finish) else builder.feed(delta)
                for name, data in events:
                    yield event(data, name)
                if isinstance(delta, Finish):
                    return
            raise APIError(500, "internal", "generation ended without a finish")
        except APIError as e:
            yield event(anthropic_error_body(_worded(e)), "error")
        except Exception as e:
            log.exception("generation failed")
            yield event(anthropic_error_body(APIError(500, "internal", f"internal error: {e}")), "error")
        finally:
            await agen.aclose()

    async def _pings(self, source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Keep-alives as Anthropic `ping` events (every SDK ignores them anywhere after message_start)."""
        ping = event({"type": "ping"}, "ping")
        async for chunk in with_keepalive(source, self.keepalive_s):
            yield ping if chunk is KEEPALIVE else chunk


def routes(service: Service, *, seal: ReasoningSeal | None = None, keepalive_s: float = 10.0) -> list[Route]:
    """POST /v1/messages and /v1/messages/count_tokens (any query string, e.g. ?beta=true).

    seal: signs thinking blocks; default: the service's `reasoning_seal` if it has one (one key shared by
    both adapters, persistent across restarts if the key is), else a fresh random key. APIErrors raised
    before the response starts go to server.app, which answers in Anthropic's error shape for /v1/messages*.
    """
    seal = seal or getattr(service, "reasoning_seal", None) or ReasoningSeal()
    api = MessagesAPI(service, seal, keepalive_s)
    return [Route("/v1/messages", api.create, methods=["POST"]),
            Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"])]

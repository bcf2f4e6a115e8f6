"""Responses output: the Service's deltas -> output items, the §5.1 stream events and the response object.

One ResponseBuilder serves both paths: a stream sends the events it returns, a non-streamed request
returns response() at the end; so the ids in `output_item.done` are those of `response.completed`,
and a stream accumulates to exactly the non-streamed object (api.md §5, §5.1).

Log-probabilities (requests that ask, server.openai_responses): the Service's TokenLogprobs entries (the
chat shape {token, logprob, bytes, top_logprobs}) go to the `output_text` part whose text their tokens
made: each `response.output_text.delta` carries the entries of the tokens of its text, and
`output_text.done`, `content_part.done` and the part in the response object carry the part's whole
list (the deltas' lists concatenated). Which text a token made is found by decoding the entries' bytes
and locating each message text delta in that text (_LogprobTrack); entries of tokens that made reasoning,
a tool call, markup (`</think>`, `<tool_call>`) or trimmed whitespace belong to no part and are
dropped. A token whose bytes straddle message text and something else counts with the text.
Without logprobs no entries arrive and every part has `logprobs: []`.
"""

from __future__ import annotations

import codecs
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from server.reasoning_seal import ReasoningSeal
from server.service import (APIError, ContentDelta, Finish, ReasoningDelta, TokenLogprobs, ToolCallArgs, ToolCallEnd,
                            ToolCallStart)

log = logging.getLogger(__name__)

CUSTOM_INPUT = "input"           # the one string parameter a custom tool is presented with
# APIError.kind -> Responses error code in response.failed (Codex matches these)
FAILED_CODES = {"context_length_exceeded": "context_length_exceeded", "rate_limited": "rate_limit_exceeded",
                "overloaded": "server_is_overloaded", "unavailable": "server_is_overloaded"}


@dataclass
class ToolSet:
    """Client tools as the model sees them, and how to label the calls it makes."""
    functions: list[dict] = field(default_factory=list)      # OpenAI-shaped, client order
    custom: set[str] = field(default_factory=set)             # names of custom (free-form) tools
    namespace: dict[str, str] = field(default_factory=dict)   # exposed name -> namespace name


def item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class _LogprobTrack:
    """Which logprob entries made a piece of message text.

    The entries' bytes are decoded as the generation decodes the tokens (UTF-8, invalid bytes as U+FFFD),
    each entry keeping the span [lo, hi) of characters its bytes completed (an entry holding only the
    start of a character has lo == hi, the position of that character). take(text) finds the next message
    text in the decoded text from the cursor on and returns the entries not yet given out whose span meets
    it; what lies before the match (markup, trimmed whitespace) is passed over, with the entries that made
    only that. skip() passes over everything so far (reasoning, tool calls)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""                                   # decoded, from absolute position _base (the cursor)
        self._base = 0
        self._pending: list[tuple[dict, int, int]] = []   # (entry, lo, hi): not yet given out

    def add(self, entries: list[dict]) -> None:
        for entry in entries:
            lo = self._base + len(self._text)
            self._text += self._decoder.decode(bytes(entry["bytes"]))
            self._pending.append((entry, lo, self._base + len(self._text)))

    def skip(self) -> None:
        self._base += len(self._text)
        self._text, self._pending = "", []

    def take(self, text: str) -> list[dict]:
        if not self._pending and not self._text:          # no logprobs asked (or none since the last text)
            return []
        p = self._text.find(text)
        if p < 0:   # the generation flushes its decoder at the end: a held incomplete character -> U+FFFD
            self._text += self._decoder.decode(b"", final=True)
            p = self._text.find(text)
        if p < 0:   # not found (should not happen): the text takes what is pending
            taken = [entry for entry, _, _ in self._pending]
            self.skip()
            return taken
        start, end = self._base + p, self._base + p + len(text)
        taken = [entry for entry, lo, hi in self._pending
                 if (lo < end and hi > start if lo < hi else start <= lo < end)]
        self._pending = [x for x in self._pending if x[1] >= end]
        self._text = self._text[p + len(text):]
        self._base = end
        return taken


class ResponseBuilder:
    """Service deltas -> Responses output items. start()/feed()/finish()/fail() return the §5.1 events
    (sequence_number 0, 1, 2, ...); response() is the object as it stands (final after finish).

    Items open lazily and in order: reasoning at the first reasoning text, a message at the first
    non-whitespace content (leading whitespace is held, no blank message items), a function_call or
    custom_tool_call at ToolCallStart. Opening an item completes the previous one.
    """

    def __init__(self, response_id: str, echo: dict, tools: ToolSet, seal: ReasoningSeal, *, summary: bool,
                 encrypted: bool):
        self.id, self.echo, self.tools, self.seal = response_id, echo, tools, seal
        self.summary, self.encrypted = summary, encrypted
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.status, self.error, self.incomplete, self.usage = "in_progress", None, None, None
        self.completed_at: int | None = None
        self.reasoning_text = ""                  # raw, for the stored conversation
        self._seq = 0
        self._open: str | None = None             # reasoning | message | function_call | custom_tool_call
        self._parts: list[str] = []
        self._call_index: int | None = None
        self._held = ""
        self._logprobs = _LogprobTrack()
        self._part_logprobs: list[dict] = []      # the open output_text part's entries

    # -- the object --------------------------------------------------------------------------------

    def response(self) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "completed_at": self.completed_at, "error": self.error, "incomplete_details": self.incomplete,
                **self.echo, "output": self.output, "usage": self.usage}

    def as_messages(self) -> list[dict]:
        """The output as one assistant turn (for previous_response_id)."""
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        if self.reasoning_text:
            turn["reasoning_content"] = self.reasoning_text
        for item in self.output:
            if item["type"] == "message":
                turn["content"] += "".join(p["text"] for p in item["content"])
            elif item["type"] == "function_call":
                turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
            elif item["type"] == "custom_tool_call":
                turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": json.dumps({CUSTOM_INPUT: item["input"]}, ensure_ascii=False)}})
        return [turn]

    # -- events ------------------------------------------------------------------------------------

    def _ev(self, kind: str, **data: Any) -> tuple[str, dict]:
        self._seq += 1
        return kind, {"type": kind, "sequence_number": self._seq - 1, **data}

    def start(self) -> list[tuple[str, dict]]:
        return [self._ev("response.created", response=self.response()),
                self._ev("response.in_progress", response=self.response())]

    def feed(self, delta: Any) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if isinstance(delta, TokenLogprobs):
            self._logprobs.add(delta.entries)
        elif isinstance(delta, ReasoningDelta):
            if not delta.text:
                return out
            self._logprobs.skip()
            if self._open != "reasoning":
                out += self._close("completed")
                out += self._begin_reasoning()
            self._parts.append(delta.text)
            out.append(self._reasoning_delta(delta.text))
        elif isinstance(delta, ContentDelta):
            if not delta.text:
                return out
            if self._open != "message":
                out += self._close("completed")
                self._held += delta.text
                if not self._held.strip():
                    return out
                text, self._held = self._held, ""
                out += self._begin_message()
            else:
                text = delta.text
            self._parts.append(text)
            logprobs = self._logprobs.take(text)
            self._part_logprobs += logprobs
            out.append(self._ev("response.output_text.delta", item_id=self._item["id"], output_index=self._index,
                                content_index=0, delta=text, logprobs=logprobs))
        elif isinstance(delta, ToolCallStart):
            out += self._close("completed")
            self._held = ""
            self._logprobs.skip()
            out += self._begin_call(delta)
        elif isinstance(delta, ToolCallArgs):
            self._logprobs.skip()
            if self._open not in ("function_call", "custom_tool_call") or delta.index != self._call_index:
                log.warning("arguments for tool call %d, which is not open; dropped", delta.index)
            elif delta.fragment:
                self._parts.append(delta.fragment)
                if self._open == "function_call":
                    out.append(self._ev("response.function_call_arguments.delta", item_id=self._item["id"],
                                        output_index=self._index, delta=delta.fragment))
        elif isinstance(delta, ToolCallEnd):
            self._logprobs.skip()
            if self._open in ("function_call", "custom_tool_call") and delta.index == self._call_index:
                # a call the end of generation closed is incomplete (clients record completed items only)
                out += self._close("incomplete" if delta.cut_off else "completed")
        return out

    def finish(self, fin: Finish) -> list[tuple[str, dict]]:
        if fin.finish_reason == "cancelled":
            raise APIError(503, "unavailable", "the request was cancelled by the server", should_retry=True)
        # max_output_tokens (or the context) ended it: incomplete (api.md 5.1), also where whole calls were
        # parsed before the cut (chat's finish_reason says tool_calls there; their items stay completed)
        truncated = fin.finish_reason == "length" or fin.hit_limit
        out = self._close("incomplete" if truncated else "completed")
        u = fin.usage
        prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
        self.usage = {"input_tokens": prompt,
                      "input_tokens_details": {"cached_tokens": min(u.get("cached_tokens", 0) or 0, prompt),
                                               "cache_write_tokens": 0},
                      "output_tokens": completion,
                      "output_tokens_details": {"reasoning_tokens": u.get("reasoning_tokens", 0) or 0},
                      "total_tokens": prompt + completion}
        self.completed_at = int(time.time())
        if truncated:
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            out.append(self._ev("response.incomplete", response=self.response()))
        else:
            self.status = "completed"
            out.append(self._ev("response.completed", response=self.response()))
        return out

    def fail(self, err: APIError) -> list[tuple[str, dict]]:
        """The in-band end of a stream that failed after response.created."""
        self.status = "failed"
        self.error = {"code": getattr(err, "code", None) or FAILED_CODES.get(err.kind, "server_error"),
                      "message": err.message}
        return [self._ev("response.failed", response=self.response())]

    # -- items -------------------------------------------------------------------------------------

    @property
    def _item(self) -> dict:
        return self.output[-1]

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _added(self, item: dict) -> tuple[str, dict]:
        self.output.append(item)
        self._open, self._parts, self._part_logprobs = item["type"], [], []
        return self._ev("response.output_item.added", output_index=self._index, item=dict(item))

    def _begin_reasoning(self) -> list[tuple[str, dict]]:
        out = [self._added({"id": item_id("rs_"), "type": "reasoning", "summary": [], "status": "in_progress"})]
        ids = {"item_id": self._item["id"], "output_index": self._index}
        if self.summary:
            out.append(self._ev("response.reasoning_summary_part.added", **ids, summary_index=0,
                                part={"type": "summary_text", "text": ""}))
        else:
            out.append(self._ev("response.content_part.added", **ids, content_index=0,
                                part={"type": "reasoning_text", "text": ""}))
        return out

    def _reasoning_delta(self, text: str) -> tuple[str, dict]:
        ids = {"item_id": self._item["id"], "output_index": self._index}
        if self.summary:
            return self._ev("response.reasoning_summary_text.delta", **ids, summary_index=0, delta=text)
        return self._ev("response.reasoning_text.delta", **ids, content_index=0, delta=text)

    def _begin_message(self) -> list[tuple[str, dict]]:
        out = [self._added({"id": item_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                            "content": []})]
        out.append(self._ev("response.content_part.added", item_id=self._item["id"], output_index=self._index,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _begin_call(self, start: ToolCallStart) -> list[tuple[str, dict]]:
        call_id = start.id if start.id.startswith("call_") else "call_" + start.id
        if start.name in self.tools.custom:
            item = {"id": item_id("ctc_"), "type": "custom_tool_call", "status": "in_progress", "call_id": call_id,
                    "name": start.name, "input": ""}
        else:
            item = {"id": item_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                    "name": start.name, "arguments": ""}
        if start.name in self.tools.namespace:
            item["namespace"] = self.tools.namespace[start.name]
        self._call_index = start.index
        return [self._added(item)]

    def _close(self, status: str) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        item, text, kind = self._item, "".join(self._parts), self._open
        ids = {"item_id": item["id"], "output_index": self._index}
        out = []
        if kind == "reasoning":
            self.reasoning_text += text
            if self.summary:
                part = {"type": "summary_text", "text": text}
                out.append(self._ev("response.reasoning_summary_text.done", **ids, summary_index=0, text=text))
                out.append(self._ev("response.reasoning_summary_part.done", **ids, summary_index=0, part=part))
                item["summary"] = [part]
            else:
                part = {"type": "reasoning_text", "text": text}
                out.append(self._ev("response.reasoning_text.done", **ids, content_index=0, text=text))
                out.append(self._ev("response.content_part.done", **ids, content_index=0, part=part))
                item["content"] = [part]
            if self.encrypted:
                item["encrypted_content"] = self.seal.seal(text)
        elif kind == "message":
            logprobs = self._part_logprobs
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            out.append(self._ev("response.output_text.done", **ids, content_index=0, text=text,
                                logprobs=list(logprobs)))
            out.append(self._ev("response.content_part.done", **ids, content_index=0, part=part))
            item["content"] = [part]
        elif kind == "function_call":
            item["arguments"] = text
            out.append(self._ev("response.function_call_arguments.done", **ids, name=item["name"], arguments=text))
        else:
            item["input"] = _custom_input(text)
            if item["input"]:
                out.append(self._ev("response.custom_tool_call_input.delta", **ids, delta=item["input"]))
            out.append(self._ev("response.custom_tool_call_input.done", **ids, input=item["input"]))
        item["status"] = status
        out.append(self._ev("response.output_item.done", output_index=self._index, item=dict(item)))
        self._open, self._parts, self._call_index, self._part_logprobs = None, [], None, []
        return out


def _custom_input(arguments: str) -> str:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):        # RecursionError: nested deeper than json can decode
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments

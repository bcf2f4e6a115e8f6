"""A Python client for tandem's ZeroMQ protocol (docs/zmq-protocol.md). Needs only pyzmq and msgpack.

Synchronous::

    from server.zmq_client import ZmqClient
    with ZmqClient("tcp://127.0.0.1:5557", api_key=None) as client:
        print(client.health())                        # {'status': 'ok', 'model': ..., ...}
        for d in client.chat([{"role": "user", "content": "Hi"}], max_tokens=64, thinking=False):
            print(d.kind, d.text)                     # reasoning / content / tool_call_* (/ logprobs) deltas
        result = client.chat(messages, stream=False)  # a Result: content, reasoning, tool_calls, usage
        out = client.tokens([1, 2, 3], stream=False, max_tokens=8)   # raw prompt, no template

asyncio::

    async with AsyncZmqClient("tcp://127.0.0.1:5557") as client:
        stream = await client.chat(messages)          # raises ZmqAPIError here for a bad request
        async for d in stream: ...
        print(stream.result.usage)

chat/tokens keyword arguments are the request fields of the protocol (max_tokens, stop, temperature,
top_p, top_k, min_p, presence/frequency/repetition_penalty, seed, logit_bias, logprobs, ignore_eos,
tools, tool_choice, parallel_tool_calls, thinking, thinking_budget, preserve_thinking,
chat_template_kwargs, model, client, return_prompt_ids); None values are left out. logit_bias is a
dict {token id: bias in [-100, 100]}; logprobs=k (0..20) adds a `logprobs` Delta (its `entries`)
before each generated token's text, and Result.logprobs collects them (None when not asked). With
stream=True the call returns once the server has accepted the request (its `start`), so validation
errors raise ZmqAPIError from the call itself; errors after that raise from the iteration. To leave
a stream early, close() it or use it as a context manager (`with client.chat(...) as stream:`): that
cancels the request on the server; a stream merely abandoned keeps running there until it finishes.
A client is one DEALER socket: use it from one thread (the sync client) or one event loop (the async
client); any number of its requests may be in flight at once.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import msgpack
import zmq
import zmq.asyncio

PROTOCOL_VERSION = 1


class ZmqAPIError(Exception):
    """An `error` reply: the same status / kind as the HTTP API (docs/zmq-protocol.md, "Errors")."""

    def __init__(self, msg: dict[str, Any]):
        self.status: int = msg.get("status", 500)
        self.kind: str = msg.get("kind", "internal")
        self.code: str | None = msg.get("code")
        self.message: str = msg.get("message", "")
        self.param: str | None = msg.get("param")
        self.retry_after_s: float | None = msg.get("retry_after_s")
        self.should_retry: bool | None = msg.get("should_retry")
        self.id = msg.get("id")
        super().__init__(f"{self.status} {self.kind}: {self.message}" + (f" (param {self.param})" if self.param
                                                                          else ""))


@dataclass(frozen=True)
class Delta:
    """One piece of output. kind: reasoning | content | tool_call_start | tool_call_args | tool_call_end |
    logprobs; text for reasoning / content / tool_call_args (a JSON fragment); index, call_id, name for
    tool calls; entries for logprobs (only with the request's `logprobs` field): one map per generated
    token, {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}, bytes a list of ints."""
    kind: str
    text: str = ""
    index: int | None = None
    call_id: str | None = None
    name: str | None = None
    entries: list[dict[str, Any]] | None = None


@dataclass
class Result:
    """A whole generation: what the deltas add up to, and the `start` / `finish` fields."""
    id: Any
    request_id: str | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    prompt_ids: list[int] | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, str]] = field(default_factory=list)    # {"id", "name", "arguments"}
    finish_reason: str | None = None
    matched_stop: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float | None] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] | None = None    # the request's `logprobs` set: every logprobs entry, in order

    def _start(self, msg: dict) -> None:
        self.request_id, self.model = msg.get("request_id"), msg.get("model")
        self.prompt_tokens, self.prompt_ids = msg.get("prompt_tokens"), msg.get("prompt_ids")

    def _add(self, d: Delta) -> None:
        if d.kind == "content":
            self.content += d.text
        elif d.kind == "reasoning":
            self.reasoning += d.text
        elif d.kind == "tool_call_start":
            self.tool_calls.append({"id": d.call_id or "", "name": d.name or "", "arguments": ""})
        elif d.kind == "tool_call_args":
            self.tool_calls[d.index]["arguments"] += d.text
        elif d.kind == "logprobs":
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(d.entries or ())

    def _finish(self, msg: dict) -> None:
        self.finish_reason, self.matched_stop = msg.get("finish_reason"), msg.get("matched_stop")
        self.usage, self.timings = msg.get("usage") or {}, msg.get("timings") or {}


def _request(type_: str, rid: Any, api_key: str | None, fields: dict[str, Any]) -> bytes:
    msg = {"v": PROTOCOL_VERSION, "type": type_, "id": rid}
    if api_key is not None:
        msg["api_key"] = api_key
    msg.update((k, v) for k, v in fields.items() if v is not None)
    return msgpack.packb(msg, use_bin_type=True)


def _payload(msg: dict) -> dict:
    """A `result` message without its envelope fields (v, type, id)."""
    return {k: v for k, v in msg.items() if k not in ("v", "type", "id")}


def _delta(msg: dict) -> Delta:
    return Delta(msg.get("kind", ""), msg.get("text", ""), msg.get("index"), msg.get("call_id"), msg.get("name"),
                 msg.get("entries"))


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


# -------------------------------------------------------------------------------------------------
# Synchronous client


class _StreamState:
    """What a sync and an async stream share: the request's Result and the handling of one message."""

    def __init__(self, client, rid: Any, start: dict, logprobs: bool = False):
        self.id, self.start, self._client = rid, start, client
        self.result = Result(rid, logprobs=[] if logprobs else None)
        self.result._start(start)
        self.done = False

    def _take(self, msg: dict) -> Delta | None:
        """The delta a message carries (None for a finish or anything else); raises on an error."""
        kind = msg.get("type")
        if kind == "delta":
            d = _delta(msg)
            self.result._add(d)
            return d
        if kind == "finish":
            self.result._finish(msg)
            self._end()
        elif kind == "error":
            self._end()
            raise ZmqAPIError(msg)
        return None

    def _end(self) -> None:
        self.done = True
        self._client._queues.pop(self.id, None)


class Stream(_StreamState):
    """Deltas of one request (sync). `.result` fills in as it is iterated; `.cancel()` ends it early."""

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        while not self.done:
            d = self._take(self._client._next(self.id))
            if d is not None:
                return d
        raise StopIteration

    def cancel(self) -> None:
        """Ask the server to cancel; iteration then ends with finish_reason "cancelled"."""
        if not self.done:
            self._client.cancel(self.id)

    def close(self) -> None:
        """Cancel if unfinished and drop anything still to come."""
        if not self.done:
            self.cancel()
            self._end()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ZmqClient:
    """A synchronous client on one DEALER socket. timeout_s bounds the wait for each reply message
    (None: wait for ever); a timeout raises TimeoutError."""

    def __init__(self, endpoint: str, api_key: str | None = None, timeout_s: float | None = None):
        self.endpoint, self.api_key, self.timeout_s = endpoint, api_key, timeout_s
        self._ctx = zmq.Context()
        self._sock = _dealer(self._ctx, endpoint)
        self._ids = itertools.count(1)
        self._queues: dict[Any, collections.deque] = {}

    def chat(self, messages: list[dict], stream: bool = True, **fields: Any) -> Stream | Result:
        """A chat request; a Stream of Deltas (stream=True) or the whole Result."""
        return self._generate("chat", stream, {"messages": messages, **fields})

    def tokens(self, prompt: str | list[int], stream: bool = True, **fields: Any) -> Stream | Result:
        """A raw request: prompt text or token ids, no template, content deltas only."""
        return self._generate("tokens", stream, {"prompt": prompt, **fields})

    def cancel(self, rid: Any) -> None:
        """Cancel request `rid` of this client (no reply; the request ends with finish "cancelled")."""
        self._sock.send(_request("cancel", rid, self.api_key, {}))

    def count_tokens(self, messages: list[dict], **fields: Any) -> int:
        return self._unary("count_tokens", {"messages": messages, **fields}, self.timeout_s)["prompt_tokens"]

    def models(self) -> list[dict]:
        return self._unary("models", {}, self.timeout_s)["models"]

    def health(self, timeout_s: float | None = 5.0) -> dict:
        return self._unary("health", {}, timeout_s)

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> "ZmqClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _submit(self, type_: str, fields: dict) -> Any:
        rid = next(self._ids)
        self._queues[rid] = collections.deque()
        self._sock.send(_request(type_, rid, self.api_key, fields))
        return rid

    def _unary(self, type_: str, fields: dict, timeout_s: float | None) -> dict:
        rid = self._submit(type_, fields)
        try:
            msg = self._next(rid, timeout_s)
        finally:
            self._queues.pop(rid, None)
        if msg.get("type") == "error":
            raise ZmqAPIError(msg)
        return _payload(msg)

    def _generate(self, type_: str, stream: bool, fields: dict) -> Stream | Result:
        rid = self._submit(type_, fields)
        try:
            msg = self._next(rid)
        except BaseException:
            self._queues.pop(rid, None)
            self.cancel(rid)
            raise
        if msg.get("type") == "error":
            self._queues.pop(rid, None)
            raise ZmqAPIError(msg)
        s = Stream(self, rid, msg, fields.get("logprobs") is not None)
        if stream:
            return s
        for _ in s:
            pass
        return s.result

    def _next(self, rid: Any, timeout_s: float | None = ...) -> dict:
        """The next message for request rid; messages for other requests are queued for them."""
        timeout_s = self.timeout_s if timeout_s is ... else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        queue = self._queues[rid]
        while not queue:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sock.poll(None if wait is None else int(wait * 1000)):
                raise TimeoutError(f"no reply from {self.endpoint} for request {rid} within {timeout_s} s")
            msg = msgpack.unpackb(self._sock.recv(), raw=False, strict_map_key=False)
            target = self._queues.get(msg.get("id"))
            if target is not None:
                target.append(msg)
        return queue.popleft()


# -------------------------------------------------------------------------------------------------
# asyncio client


class AsyncStream(_StreamState):
    """Deltas of one request (asyncio). `.result` fills in as it is iterated."""

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        while not self.done:
            d = self._take(await self._client._next(self.id))
            if d is not None:
                return d
        raise StopAsyncIteration

    async def cancel(self) -> None:
        if not self.done:
            await self._client.cancel(self.id)

    async def close(self) -> None:
        if not self.done:
            await self.cancel()
            self._end()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncZmqClient:
    """The asyncio twin of ZmqClient: the same methods, awaited; a reader task routes replies."""

    def __init__(self, endpoint: str, api_key: str | None = None, timeout_s: float | None = None):
        self.endpoint, self.api_key, self.timeout_s = endpoint, api_key, timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = _dealer(self._ctx, endpoint)
        self._ids = itertools.count(1)
        self._queues: dict[Any, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def chat(self, messages: list[dict], stream: bool = True, **fields: Any) -> AsyncStream | Result:
        return await self._generate("chat", stream, {"messages": messages, **fields})

    async def tokens(self, prompt: str | list[int], stream: bool = True, **fields: Any) -> AsyncStream | Result:
        return await self._generate("tokens", stream, {"prompt": prompt, **fields})

    async def cancel(self, rid: Any) -> None:
        await self._sock.send(_request("cancel", rid, self.api_key, {}))

    async def count_tokens(self, messages: list[dict], **fields: Any) -> int:
        return (await self._unary("count_tokens", {"messages": messages, **fields}, self.timeout_s))["prompt_tokens"]

    async def models(self) -> list[dict]:
        return (await self._unary("models", {}, self.timeout_s))["models"]

    async def health(self, timeout_s: float | None = 5.0) -> dict:
        return await self._unary("health", {}, timeout_s)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> "AsyncZmqClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _read(self) -> None:
        while True:
            msg = msgpack.unpackb(await self._sock.recv(), raw=False, strict_map_key=False)
            queue = self._queues.get(msg.get("id"))
            if queue is not None:
                queue.put_nowait(msg)

    async def _submit(self, type_: str, fields: dict) -> Any:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="zmq-client-reader")
        rid = next(self._ids)
        self._queues[rid] = asyncio.Queue()
        await self._sock.send(_request(type_, rid, self.api_key, fields))
        return rid

    async def _next(self, rid: Any, timeout_s: float | None = ...) -> dict:
        timeout_s = self.timeout_s if timeout_s is ... else timeout_s
        try:
            return await asyncio.wait_for(self._queues[rid].get(), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply from {self.endpoint} for request {rid} within {timeout_s} s") from None

    async def _unary(self, type_: str, fields: dict, timeout_s: float | None) -> dict:
        rid = await self._submit(type_, fields)
        try:
            msg = await self._next(rid, timeout_s)
        finally:
            self._queues.pop(rid, None)
        if msg.get("type") == "error":
            raise ZmqAPIError(msg)
        return _payload(msg)

    async def _generate(self, type_: str, stream: bool, fields: dict) -> AsyncStream | Result:
        rid = await self._submit(type_, fields)
        try:
            msg = await self._next(rid)
        except BaseException:
            self._queues.pop(rid, None)
            await self.cancel(rid)
            raise
        if msg.get("type") == "error":
            self._queues.pop(rid, None)
            raise ZmqAPIError(msg)
        s = AsyncStream(self, rid, msg, fields.get("logprobs") is not None)
        if stream:
            return s
        async for _ in s:
            pass
        return s.result

"""The ZeroMQ client protocol: chat and raw-token generation over a ROUTER socket, msgpack bodies.

docs/zmq-protocol.md is the reference for clients; server/zmq_client.py is the Python client.

Wire: a client DEALER sends one frame, a msgpack map ``{"v": 1, "type": ..., "id": ..., ...}``; the
ROUTER sees ``[identity, body]`` and every reply goes back as ``[identity, body]`` with the same
``id``. Any frames before the body are echoed as the envelope, so a REQ socket works for the one-reply
requests (health, models, count_tokens). A generation request gets ``start``, ``delta``... and exactly
one terminal message, ``finish`` or ``error``; a unary request gets one ``result`` or ``error``.

Each generation runs in its own asyncio task keyed by (envelope, id), so one client may have many
requests in flight. ``cancel`` cancels that task: the Service's generate iterator is closed
(CancelledError at its await, or aclose() at a yield), which cancels the request in the engine,
and the request ends with ``finish`` / ``cancelled``. The socket is ROUTER_MANDATORY and sends never
block: a reply to a client that has gone away (EHOSTUNREACH) or stopped reading (its send queue of
SEND_HWM messages is full) closes the iterator the same way, without a reply.

Threading: the server is a zmq.asyncio socket in an asyncio loop. `start()` called inside a running
loop (the HTTP app's lifespan) binds at once and serves as a task of that loop, next to HTTP, so
the Service sees one loop; called with no running loop it serves from a private loop in a daemon
thread. `await serve()` runs it in the caller's task instead. `stop()` / `await aclose()` end it:
requests in flight get a 503 ``unavailable`` error.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import secrets
import threading
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from runtime.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from server import params, structured
from server.service import (APIError, ChatRequest, ContentDelta, Finish, ReasoningDelta, RequestContext, Sampling,
                            TextRequest, TokenLogprobs, ToolCallArgs, ToolCallEnd, ToolCallStart, current_request)

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
SEND_HWM = 100_000                    # queued replies per client before it counts as gone
MAX_MESSAGE_BYTES = 64 * 2**20        # a larger request body is answered with 413
REQUEST_TYPES = ("chat", "tokens", "cancel", "count_tokens", "models", "health")
CLIENT_LABEL = re.compile(r"[A-Za-z0-9._:/@+\-]{1,64}")     # the rule of HTTP's X-Tandem-Client (server.app)
_DECIMAL_ID = re.compile(r"[0-9]{1,10}")

# name -> (accepted Python types, lowest, highest, lowest excluded): the HTTP chat / completions ranges
# (server.openai_chat.sampling_fields); bool is rejected separately: it is an int to Python
_SAMPLING_FIELDS: dict[str, tuple[tuple[type, ...], float, float, bool]] = {
    "temperature": ((int, float), 0, 2, False), "top_p": ((int, float), 0, 1, True),
    "top_k": ((int,), -1, math.inf, False), "min_p": ((int, float), 0, 1, False),
    "presence_penalty": ((int, float), -2, 2, False), "frequency_penalty": ((int, float), -2, 2, False),
    "repetition_penalty": ((int, float), 0, 10, True), "seed": ((int,), -2**63, 2**64 - 1, False),
    "min_tokens": ((int,), 0, math.inf, False),
}


def _bad(param: str | None, message: str) -> APIError:
    return APIError(400, "invalid_request", message, param=param)


def _field(msg: dict, name: str, types: tuple[type, ...], default: Any = None, what: str = "") -> Any:
    """msg[name] if present and not None, checked against types; else default."""
    value = msg.get(name)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise _bad(name, f"{name} must be {what or ' or '.join(t.__name__ for t in types)}, "
                         f"got {type(value).__name__}")
    return value


def _sampling(msg: dict) -> Sampling:
    values = {}
    for name, (types, lo, hi, lo_open) in _SAMPLING_FIELDS.items():
        value = _field(msg, name, types)
        if value is not None and not ((lo < value if lo_open else lo <= value) and value <= hi):   # NaN too
            span = f"in {'(' if lo_open else '['}{lo}, {hi}]" if hi != math.inf else f">= {lo}"
            raise _bad(name, f"{name} must be {span}, got {value!r}")
        values[name] = float(value) if value is not None and float in types else value
    logprobs = _field(msg, "logprobs", (int,), None, "an integer")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise _bad("logprobs", f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    return Sampling(**values, logit_bias=_logit_bias(msg), logprobs=logprobs)


def _logit_bias(msg: dict) -> tuple[tuple[int, float], ...] | None:
    """logit_bias: a map {token id: bias in [-100, 100]}, ids as integers or decimal strings (as JSON
    clients send them), at most MAX_LOGIT_BIAS -> sorted (id, bias) pairs; None when absent, nil or
    empty. Whether the ids are in the vocabulary is the engine's check at submit (a 400 naming it too)."""
    bias = _field(msg, "logit_bias", (dict,), None, "a map {token id: bias}")
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"logit_bias may bias at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and _DECIMAL_ID.fullmatch(key):
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token = key
        else:
            raise _bad("logit_bias", f"logit_bias keys must be token ids (integers, or strings of at most 10 "
                                     f"decimal digits), got {key!r:.40}")
        if not 0 <= token < 2**31:
            raise _bad("logit_bias", f"logit_bias token id {token} is out of range [0, 2**31)")
        if token in out:
            raise _bad("logit_bias", f"logit_bias token id {token} appears twice")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -100 <= value <= 100:
            got = f"{value!r:.40}" if isinstance(value, (int, float)) and not isinstance(value, bool) \
                else type(value).__name__
            raise _bad("logit_bias", f"logit_bias[{token}] must be a number in [-100, 100], got {got}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _max_tokens(msg: dict, default: int | None) -> int | None:
    value = _field(msg, "max_tokens", (int,), default)
    if value is not None and value < 1:
        raise _bad("max_tokens", f"max_tokens must be >= 1, got {value}")
    return value


def _stop(msg: dict) -> list[str]:
    stop = _field(msg, "stop", (str, list), [], "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise _bad(f"stop.{i}", f"stop.{i} must be a string, got {type(s).__name__}")
    return [s for s in stop if s]


def parse_chat(msg: dict) -> ChatRequest:
    """A `chat` (or `count_tokens`) message -> ChatRequest; APIError 400 naming the bad field."""
    messages = msg.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages is required: a non-empty list of message maps")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages.{i}", f"messages.{i} must be a map with a string 'role'")
    budget = _field(msg, "thinking_budget", (int,))
    if budget is not None and budget < 0:
        raise _bad("thinking_budget", f"thinking_budget must be >= 0, got {budget}")
    tools = params.tools(msg.get("tools"))                    # the HTTP routes' checks (400 naming the field)
    tool_choice = params.tool_choice(msg.get("tool_choice"), tools)
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_field(msg, "parallel_tool_calls", (bool,), True),
        thinking=_field(msg, "thinking", (bool,)),
        preserve_thinking=_field(msg, "preserve_thinking", (bool,)),
        thinking_budget=budget,
        chat_template_kwargs=dict(_field(msg, "chat_template_kwargs", (dict,), {})),
        max_tokens=_max_tokens(msg, None),
        stop=_stop(msg),
        sampling=_sampling(msg),
        model=_field(msg, "model", (str,)),
        ignore_eos=_field(msg, "ignore_eos", (bool,), False),
        skip_special_tokens=_field(msg, "skip_special_tokens", (bool,), True),
        grammar=structured.openai_grammar(params.Fields(msg)),
        api="zmq", stream=True)


def parse_tokens(msg: dict) -> TextRequest:
    """A `tokens` message -> TextRequest (prompt text or token ids, no template, no parsing)."""
    prompt = msg.get("prompt")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise _bad("prompt", "prompt as token ids must be a non-empty list of non-negative integers")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "prompt is required: a non-empty string or a list of token ids")
    return TextRequest(prompt=prompt, max_tokens=_max_tokens(msg, 16), stop=_stop(msg), sampling=_sampling(msg),
                       model=_field(msg, "model", (str,)), ignore_eos=_field(msg, "ignore_eos", (bool,), False),
                       skip_special_tokens=_field(msg, "skip_special_tokens", (bool,), True),
                       grammar=structured.openai_grammar(params.Fields(msg)), api="zmq", stream=True)


def encode_delta(delta: Any) -> dict[str, Any]:
    """A Service delta (not Finish) -> the fields of a `delta` message."""
    if isinstance(delta, ContentDelta):
        return {"kind": "content", "text": delta.text}
    if isinstance(delta, ReasoningDelta):
        return {"kind": "reasoning", "text": delta.text}
    if isinstance(delta, ToolCallStart):
        return {"kind": "tool_call_start", "index": delta.index, "call_id": delta.id, "name": delta.name}
    if isinstance(delta, ToolCallArgs):
        return {"kind": "tool_call_args", "index": delta.index, "text": delta.fragment}
    if isinstance(delta, ToolCallEnd):
        return {"kind": "tool_call_end", "index": delta.index}
    if isinstance(delta, TokenLogprobs):
        return {"kind": "logprobs", "entries": delta.entries}
    raise TypeError(f"unknown delta type {type(delta).__name__}")


def error_fields(e: APIError) -> dict[str, Any]:
    """The fields of an `error` message; a bug (kind internal) is marked should_retry false."""
    should_retry = e.should_retry if e.should_retry is not None or e.kind != "internal" else False
    return {"status": e.status, "kind": e.kind, "code": getattr(e, "code", None), "message": e.message,
            "param": e.param, "retry_after_s": e.retry_after_s, "should_retry": should_retry}


class _Inflight:
    """One generation in flight: its task, why it was cancelled, whether its terminal reply went out."""
    __slots__ = ("task", "reason", "ended")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.reason: str | None = None          # "cancel" | "gone" | "shutdown"
        self.ended = False                      # finish / error sent, or the client is gone


class ZmqServer:
    """Serves `service` on a ZeroMQ ROUTER socket bound to `endpoint` (see the module docstring).

    endpoint: any ZeroMQ bind address (tcp://127.0.0.1:5557, ipc:///run/tandem.sock; tcp://host:*
    picks a free port, read it back from `.endpoint` after start). api_key: when set, every request
    must carry it as ``api_key``.
    """

    def __init__(self, service: Any, endpoint: str, api_key: str | None = None):
        self.service, self.api_key = service, api_key or None
        self.endpoint = endpoint
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._inflight: dict[tuple, _Inflight] = {}
        self._serve_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------------------------
    # Lifecycle

    def start(self) -> None:
        """Bind now (a bad endpoint raises zmq.ZMQError here) and serve in the background."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._bind()
            self._loop = loop
            self._serve_task = loop.create_task(self.serve(), name="zmq-api")
            return
        ready, failure = threading.Event(), []

        def main() -> None:
            async def run() -> None:
                try:
                    self._bind()
                    self._loop = asyncio.get_running_loop()
                    self._serve_task = asyncio.current_task()
                except BaseException as e:
                    failure.append(e)
                    return
                finally:
                    ready.set()
                try:
                    await self.serve()
                except asyncio.CancelledError:
                    pass
            asyncio.run(run())

        self._thread = threading.Thread(target=main, name="zmq-api", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving. From the serving loop's own thread this only schedules the stop (then
        `await aclose()` to wait for it); from any other thread it waits up to `timeout`."""
        loop, task = self._loop, self._serve_task
        if loop is None or task is None or loop.is_closed():
            return
        in_loop = False
        try:
            in_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            pass
        if in_loop:
            task.cancel()
            return
        try:
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:                        # the loop closed meanwhile
            return
        if self._thread is not None:
            self._thread.join(timeout)

    async def drain(self, timeout_s: float) -> None:
        """At shutdown (the service draining: new requests refused): wait up to timeout_s for the requests
        in flight to finish; ends early once the service stops draining (the shutdown deadline stopped
        the engine, or it failed)."""
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline and self.service.state == "draining":
            await asyncio.sleep(0.02)

    async def aclose(self) -> None:
        """Stop serving and wait until every in-flight request has ended and the socket is closed."""
        task = self._serve_task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _bind(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError:
            sock.close(0)
            self._ctx.term()
            raise
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("zmq api listening on %s", self.endpoint)

    async def serve(self) -> None:
        """Receive and dispatch until cancelled; then end every request in flight and close."""
        if self._sock is None:
            self._bind()
            self._loop, self._serve_task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            while True:
                frames = await self._sock.recv_multipart()
                self._dispatch(tuple(frames[:-1]), frames[-1])
        finally:
            pending = list(self._inflight.values())
            for entry in pending:
                if entry.reason is None:
                    entry.reason = "shutdown"
                    entry.task.cancel()
            if pending:
                await asyncio.gather(*(e.task for e in pending), return_exceptions=True)
            self._sock.close()
            self._ctx.term()
            self._sock = None
            log.info("zmq api stopped")

    # ---------------------------------------------------------------------------------------------
    # Requests

    def _send(self, envelope: tuple, rid: Any, type_: str, **fields: Any) -> bool:
        """Queue one reply without blocking; False when the client is gone or not reading."""
        body = msgpack.packb({"v": PROTOCOL_VERSION, "type": type_, "id": rid, **fields}, use_bin_type=True)
        done = self._sock.send_multipart([*envelope, body], flags=zmq.DONTWAIT)
        err = done.exception()
        if err is None:
            return True
        if isinstance(err, zmq.Again):
            log.warning("zmq client %r is not reading its replies (%d queued); dropping request %r",
                        envelope, SEND_HWM, rid)
        elif not (isinstance(err, zmq.ZMQError) and err.errno == zmq.EHOSTUNREACH):
            log.error("zmq send failed: %s", err)
        return False

    def _dispatch(self, envelope: tuple, body: bytes) -> None:
        rid = None
        try:
            if len(body) > MAX_MESSAGE_BYTES:
                raise APIError(413, "too_large", f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
            try:
                msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
            except Exception as e:              # msgpack's errors may have no text (a reserved byte, 0xc1)
                raise _bad(None, f"body is not valid msgpack: {str(e) or type(e).__name__}") from None
            if not isinstance(msg, dict):
                raise _bad(None, f"body must be a msgpack map, got {type(msg).__name__}")
            rid = msg.get("id")
            if rid is None or isinstance(rid, bool) or not isinstance(rid, (str, int)):
                rid = None
                raise _bad("id", "id is required: a string or an integer chosen by the client")
            if type(msg.get("v")) is not int or msg["v"] != PROTOCOL_VERSION:     # not true, not 1.0
                raise _bad("v", f"protocol version {msg.get('v')!r} is not supported; this server speaks "
                                f"v={PROTOCOL_VERSION}")
            if self.api_key is not None:
                key = msg.get("api_key")
                if not isinstance(key, str) or not hmac.compare_digest(key.encode(), self.api_key.encode()):
                    raise APIError(401, "authentication", "missing or invalid api_key")
            kind = msg.get("type")
            if kind in ("chat", "tokens"):
                self._start_generation(envelope, rid, msg)
            elif kind == "cancel":
                entry = self._inflight.get((envelope, rid))     # no reply: the request's own ends it
                if entry is not None and entry.reason is None:
                    entry.reason = "cancel"
                    entry.task.cancel()
            elif kind == "count_tokens":
                self._send(envelope, rid, "result", prompt_tokens=self.service.count_tokens(parse_chat(msg)))
            elif kind == "models":
                ids = self.service.model_ids() if hasattr(self.service, "model_ids") else [self.service.model_id]
                self._send(envelope, rid, "result",
                           models=[{"id": name, "max_context": self.service.max_context} for name in ids])
            elif kind == "health":
                ok, detail = self.service.health() if hasattr(self.service, "health") else (True, "ok")
                if not ok:
                    raise APIError(503, "unavailable", detail, retry_after_s=5)
                self._send(envelope, rid, "result", status="ok", model=self.service.model_id,
                           max_context=self.service.max_context, protocol=PROTOCOL_VERSION,
                           in_flight=len(self._inflight))
            else:
                raise APIError(404, "not_found", f"unknown request type {kind!r}; expected one of "
                                                 f"{', '.join(REQUEST_TYPES)}", param="type")
        except APIError as e:
            self._reject(envelope, rid, e)
        except Exception as e:
            log.exception("zmq request %r failed", rid)
            self._reject(envelope, rid, APIError(500, "internal", f"internal error: {e}"))

    def _reject(self, envelope: tuple, rid: Any, err: APIError) -> None:
        """An error before generation started: counted like an HTTP rejection, then sent."""
        record = getattr(self.service, "record_rejected", None)
        if record is not None:
            try:
                record(err, "zmq")
            except Exception:
                log.exception("recording a rejected zmq request failed")
        self._send(envelope, rid, "error", **error_fields(err))

    def _start_generation(self, envelope: tuple, rid: Any, msg: dict) -> None:
        key = (envelope, rid)
        if key in self._inflight:
            raise _bad("id", f"request id {rid!r} is already in flight on this connection")
        request = parse_chat(msg) if msg["type"] == "chat" else parse_tokens(msg)
        client = _field(msg, "client", (str,))
        if client is not None and not CLIENT_LABEL.fullmatch(client):
            raise APIError(400, "invalid_request", "client must be 1-64 characters of A-Za-z0-9._:/@+-",
                           param="client", code="invalid_client_label")
        return_prompt_ids = _field(msg, "return_prompt_ids", (bool,), False)
        entry = self._inflight[key] = _Inflight()
        context = RequestContext(request_id=secrets.token_hex(12), client=client, path=f"zmq:{msg['type']}")
        entry.task = asyncio.get_running_loop().create_task(
            self._generate(key, entry, request, context, return_prompt_ids), name=f"zmq-{rid}")
        entry.task.add_done_callback(lambda _t: self._ended(key, entry))

    def _terminal(self, entry: _Inflight, envelope: tuple, rid: Any, type_: str, **fields: Any) -> None:
        entry.ended = True
        self._send(envelope, rid, type_, **fields)

    def _ended(self, key: tuple, entry: _Inflight) -> None:
        """Task done callback: forget the request; a task cancelled before it ran still gets its reply."""
        self._inflight.pop(key, None)
        if entry.ended or self._sock is None:
            return
        envelope, rid = key
        if entry.reason == "cancel":
            self._terminal(entry, envelope, rid, "finish", finish_reason="cancelled", matched_stop=None,
                           usage={}, timings={})
        elif entry.reason == "shutdown":
            self._terminal(entry, envelope, rid, "error", **error_fields(
                APIError(503, "unavailable", "server shutting down", should_retry=True)))

    async def _generate(self, key: tuple, entry: _Inflight, request: ChatRequest | TextRequest,
                        context: RequestContext, return_prompt_ids: bool) -> None:
        """Run one request: prepare, `start`, deltas, one terminal reply (see the module docstring)."""
        envelope, rid = key
        t0 = time.monotonic()
        current_request.set(context)                # this task's own context: seen by prepare and the log
        agen = prepared = None
        usage: dict[str, int] = {}
        try:
            try:
                prepared = self.service.prepare(request)
            except (APIError, ValueError) as e:     # ValueError: input rejected without an APIError
                entry.ended = True
                self._reject(envelope, rid, e if isinstance(e, APIError) else APIError(400, "invalid_request", str(e)))
                return
            submit = getattr(self.service, "submit_async", None)
            if submit is not None:                  # engine refusals (429, 503) before `start`, as over HTTP
                try:
                    await submit(prepared)          # a grammar's parser is built off the event loop
                except APIError as e:               # Service.submit has recorded the rejection
                    self._terminal(entry, envelope, rid, "error", **error_fields(e))
                    return
            usage["prompt_tokens"] = len(prepared.prompt_ids)
            model = getattr(prepared, "model", "") or self.service.model_id
            start = {"request_id": prepared.request_id, "model": model, "prompt_tokens": len(prepared.prompt_ids),
                     "max_tokens": prepared.max_tokens}
            if return_prompt_ids:
                start["prompt_ids"] = list(prepared.prompt_ids)
            agen = self.service.generate(prepared)
            if not self._send(envelope, rid, "start", **start):
                entry.reason, entry.ended = "gone", True
                return
            async for delta in agen:
                if isinstance(delta, Finish):
                    self._terminal(entry, envelope, rid, "finish", finish_reason=delta.finish_reason,
                                   usage=delta.usage, timings=delta.timings, matched_stop=delta.matched_stop)
                    return
                if isinstance(delta, TokenLogprobs) and (request.sampling.logprobs is None or not delta.entries):
                    continue                        # the logprobs kind goes only to a request that asked
                if not self._send(envelope, rid, "delta", **encode_delta(delta)):
                    entry.reason, entry.ended = "gone", True
                    return
            raise APIError(500, "internal", "generation ended without a finish")
        except asyncio.CancelledError:
            if agen is not None and entry.reason is not None:
                await self._close(agen, rid)        # the engine hears of it before the client does
            if entry.reason == "cancel":
                self._terminal(entry, envelope, rid, "finish", finish_reason="cancelled", matched_stop=None,
                               usage=usage, timings={"total_s": time.monotonic() - t0})
            elif entry.reason == "shutdown":
                self._terminal(entry, envelope, rid, "error", **error_fields(
                    APIError(503, "unavailable", "server shutting down", should_retry=True)))
            elif entry.reason is None:
                raise
        except APIError as e:
            self._terminal(entry, envelope, rid, "error", **error_fields(e))
        except Exception as e:
            log.exception("zmq request %r failed", rid)
            self._terminal(entry, envelope, rid, "error",
                           **error_fields(APIError(500, "internal", f"internal error: {e}")))
        finally:
            if agen is not None:
                await self._close(agen, rid)
            release = getattr(self.service, "release", None)
            if prepared is not None and release is not None:
                release(prepared)                   # a submission generate() never took over
            if entry.reason == "gone":
                log.info("zmq request %r: client gone, generation cancelled", rid)

    @staticmethod
    async def _close(agen: Any, rid: Any) -> None:
        try:
            await agen.aclose()                     # a no-op once it has ended
        except Exception:
            log.exception("zmq request %r: closing the generator failed", rid)

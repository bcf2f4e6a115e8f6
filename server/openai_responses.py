"""OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id},
POST /v1/responses/input_tokens (api.md §5).

Input items become one OpenAI-shaped conversation: `instructions` -> the first system message;
developer/system messages -> system; a reasoning item, an assistant message and the function calls
after it -> one assistant turn (reasoning restored byte-exactly from our encrypted_content when it
verifies, §4.2); function_call_output -> a tool message (dropped when no earlier call has its
call_id); items the model cannot read (item_reference, compaction, web_search_call, ...) are dropped,
never refused. Tools: flat functions as they are, `custom` tools as a function with one string
parameter `input` (their calls come back as custom_tool_call items), `namespace` tools expose their
inner tools (calls carry the namespace); hosted tools are ignored.

server.responses_output.ResponseBuilder turns the Service's deltas into the §5.1 events and the final
response object, so the item ids of `output_item.done` are those of `response.completed` and
streamed == non-streamed.
`previous_response_id` chains through a bounded in-memory store (LRU + TTL) of stored responses; each
record keeps only its own turn and a reference to its parent record, so chains cost no copies.

Log-probabilities: `include` containing "message.output_text.logprobs" turns them on, with `top_logprobs`
(0..20, default 0) alternatives per token; a `top_logprobs` > 0 without that include turns them on too
(our leniency: OpenAI documents the include, and vLLM returns none without it). Each `output_text`
part's `logprobs` then lists its message text's tokens in the chat shape {token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}, under the model's raw distribution (before temperature and
filters, as Chat Completions); tokens of reasoning, tool calls and markup are in no part (see
server.responses_output). A `top_logprobs` out of range or not an integer is a 400 naming it; the
response object echoes `top_logprobs` as sent. Requests that do not ask get `logprobs: []`.

Structured outputs: `text.format` json_object or json_schema ({type, name, schema, strict}) constrains the
message text (server.structured; reasoning stays free, and with callable tools it is not applied); a
schema that cannot be used is a 400 naming text.format.schema.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.disconnect import Guarded, until_disconnect
from server.generation import collect_into
from server.params import read_json
from server.prompt import tool_arguments
from server.reasoning_seal import ReasoningSeal
from server.responses_output import CUSTOM_INPUT, ResponseBuilder, ToolSet, item_id
from server.service import EFFORTS, APIError, ChatRequest, Finish, Prepared, Sampling, Service
from runtime.sampling import MAX_TOP_LOGPROBS
from server.sse import event, sse_response
from server.structured import output_format

log = logging.getLogger(__name__)

ENCRYPTED_REASONING = "reasoning.encrypted_content"
OUTPUT_LOGPROBS = "message.output_text.logprobs"

@contextlib.contextmanager
def _input_errors():
    """Errors the shared prompt code raises about 'messages' are about this API's 'input'."""
    try:
        yield
    except APIError as e:
        if e.param and e.param.split("[")[0].split(".")[0] == "messages":
            e.param = "input"
            e.message = e.message.replace("'messages'", "'input'").replace("the messages", "the input")
            e.args = (e.message,)
        raise


def _bad(param: str, message: str) -> APIError:
    return APIError(400, "invalid_request", f"'{param}': {message}", param=param)


def _get(obj: dict, key: str, types: tuple[type, ...], path: str = "", required: bool = False) -> Any:
    value = obj.get(key)
    if value is None:
        if required:
            raise _bad(path + key, "required field is missing")
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = {"str": "a string", "int": "an integer", "float": "a number", "list": "an array",
                 "dict": "an object", "bool": "a boolean"}
        want = "a number" if float in types else " or ".join(names[t.__name__] for t in types)
        raise _bad(path + key, f"must be {want}, got {type(value).__name__}")
    return value


# ---- tools ----------------------------------------------------------------------------------------

def _add_tool(tools: ToolSet, t: Any, path: str, namespace: str | None) -> None:
    if not isinstance(t, dict):
        raise _bad(path, f"must be an object, got {type(t).__name__}")
    kind = t.get("type")
    if kind == "namespace":
        ns = _get(t, "name", (str,), path + ".", required=True)
        for j, inner in enumerate(_get(t, "tools", (list,), path + ".") or []):
            _add_tool(tools, inner, f"{path}.tools[{j}]", ns)
        return
    if kind not in ("function", "custom"):
        return                                            # hosted: web_search, file_search, mcp, ...
    name = _get(t, "name", (str,), path + ".", required=True)
    if not name:
        raise _bad(path + ".name", "must be a non-empty string")
    description = _get(t, "description", (str,), path + ".")
    if kind == "function":
        params = _get(t, "parameters", (dict,), path + ".") or {"type": "object", "properties": {}}
        if params.get("type", "object") != "object":
            raise _bad(path + ".parameters.type", f"must be 'object', got {params.get('type')!r}")
    else:
        tools.custom.add(name)
        fmt = t.get("format") if isinstance(t.get("format"), dict) else {}
        hint = "The raw input text (not JSON)."
        if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
            hint += f" It must match this {fmt.get('syntax', 'lark')} grammar:\n{fmt['definition']}"
        params = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": hint}},
                  "required": [CUSTOM_INPUT]}
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = params
    tools.functions.append({"type": "function", "function": function})
    if namespace is not None:
        tools.namespace[name] = namespace


def _tools(raw: Any) -> ToolSet:
    tools = ToolSet()
    if raw is None:
        return tools
    if not isinstance(raw, list):
        raise _bad("tools", f"must be an array, got {type(raw).__name__}")
    for i, t in enumerate(raw):
        _add_tool(tools, t, f"tools[{i}]", None)
    return tools


def _tool_choice(raw: Any, tools: ToolSet) -> Any:
    if raw == "required" or (isinstance(raw, dict) and raw.get("type") == "allowed_tools"
                             and raw.get("mode") == "required"):
        if not tools.functions:             # as Chat and Messages: a call that no tool can answer
            raise _bad("tool_choice", "is 'required' but no tools were given")
        return "required"
    if raw is None or raw in ("auto", "none"):
        return raw
    if not isinstance(raw, dict):
        raise _bad("tool_choice", f"must be 'none', 'auto', 'required' or an object, got {raw!r}")
    kind = raw.get("type")
    if kind in ("function", "custom"):
        name = _get(raw, "name", (str,), "tool_choice.", required=True)
        if name not in {f["function"]["name"] for f in tools.functions}:
            raise _bad("tool_choice.name", f"no tool named {name!r} in tools")
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        return "required" if raw.get("mode") == "required" else "auto"
    return "auto"                                          # a hosted tool: ours are all we have


# ---- input items -> messages ----------------------------------------------------------------------

def _parts_text(content: Any, path: str, *, output: bool) -> str:
    """Message content (str | parts) -> text; images and files are refused (text-only model)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(path, f"must be a string or an array of content parts, got {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        p = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise _bad(p, f"must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            out.append(_get(part, "text", (str,), p + ".", required=True))
        elif kind == "refusal":
            out.append(part.get("refusal") or "")
        elif kind in ("input_image", "input_file", "input_audio"):
            if output:                                     # a tool's output: keep the history valid
                out.append(f"[{kind[len('input_'):]} omitted: this model reads text only]")
            else:
                raise _bad(p + ".type", f"{kind} is not supported: this model reads text only")
    return "".join(out)


class _Conversation:
    """Builds the message list; groups reasoning, assistant text and calls into one assistant turn."""

    def __init__(self, known_calls: set[str], seal: ReasoningSeal):
        self.messages: list[dict] = []
        self.calls, self.seal = set(known_calls), seal
        self._turn: dict | None = None

    def flush(self) -> None:
        turn, self._turn = self._turn, None
        if turn is not None and (turn["content"] or turn.get("reasoning_content") or turn.get("tool_calls")):
            self.messages.append(turn)

    def _assistant(self, opens_turn: bool) -> dict:
        """The assistant turn being built; reasoning or text (opens_turn) after text or calls starts a new one."""
        said = self._turn is not None and (self._turn["content"] or self._turn.get("tool_calls"))
        if opens_turn and said:
            self.flush()
        if self._turn is None:
            self._turn = {"role": "assistant", "content": ""}
        return self._turn

    def add(self, item: dict, path: str) -> None:
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = _get(item, "role", (str,), path + ".", required=True)
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(path + ".role", f"must be user, system, developer or assistant, got {role!r}")
            text = _parts_text(item.get("content", ""), path + ".content", output=False)
            if role == "assistant":
                self._assistant(opens_turn=True)["content"] += text
            else:
                self.flush()
                self.messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            text = self.seal.open(item.get("encrypted_content"))
            if text is None:
                text = (_parts_text(item.get("content") or [], path + ".content", output=True)
                        or "\n\n".join(_parts_text([s], path + ".summary", output=True)
                                       for s in item.get("summary") or []))
            turn = self._assistant(opens_turn=True)
            if text:
                turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        elif kind in ("function_call", "custom_tool_call"):
            call_id = _get(item, "call_id", (str,), path + ".", required=True)
            name = _get(item, "name", (str,), path + ".", required=True)
            if kind == "function_call":
                arguments = _get(item, "arguments", (str,), path + ".") or "{}"
                tool_arguments(arguments, path + ".arguments")    # refused here, named as this API names it
            else:
                arguments = json.dumps({CUSTOM_INPUT: _get(item, "input", (str,), path + ".") or ""},
                                       ensure_ascii=False)
            turn = self._assistant(opens_turn=False)
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            self.calls.add(call_id)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self.flush()
            call_id = _get(item, "call_id", (str,), path + ".", required=True)
            if call_id not in self.calls:
                log.info("dropped %s at %s: no earlier call has call_id %r", kind, path, call_id)
                return
            output = item.get("output")
            text = _parts_text(output if output is not None else "", path + ".output", output=True)
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            log.debug("dropped %s item at %s", kind, path)


def _input_messages(raw: Any, known_calls: set[str], seal: ReasoningSeal) -> list[dict]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise _bad("input", f"must be a string or an array of items, got {type(raw).__name__}")
    conv = _Conversation(known_calls, seal)
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}]", f"must be an object, got {type(item).__name__}")
        conv.add(item, f"input[{i}]")
    conv.flush()
    return conv.messages


# ---- the store ------------------------------------------------------------------------------------

@dataclass
class Stored:
    response: dict                 # the response object, as GET returns it
    messages: list[dict]           # this turn: its input (without instructions) and its output, as messages
    parent: "Stored | None"        # the previous_response_id record (kept alive by this reference)
    expires_at: float

    def conversation(self) -> list[dict]:
        turns, node = [], self
        while node is not None:
            turns.append(node.messages)
            node = node.parent
        return [m for turn in reversed(turns) for m in turn]


class ResponseStore:
    """Stored responses by id: least recently used evicted past `capacity`, expired after ttl_s."""

    def __init__(self, capacity: int = 1024, ttl_s: float = 6 * 3600.0):
        self.capacity, self.ttl_s = capacity, ttl_s
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is None:
            return None
        if stored.expires_at < time.monotonic():
            del self._items[response_id]
            return None
        self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, response: dict, messages: list[dict], parent: Stored | None) -> None:
        self._items[response_id] = Stored(response, messages, parent, time.monotonic() + self.ttl_s)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


# ---- request parsing ------------------------------------------------------------------------------

@dataclass
class ResponsesRequest:
    chat: ChatRequest
    echo: dict                     # request fields the response object repeats
    turn: list[dict]               # this turn's input messages (stored for previous_response_id)
    previous: Stored | None
    tools: ToolSet
    stream: bool
    store: bool
    summary: bool                  # reasoning as summary parts (visible in Codex) rather than reasoning_text
    encrypted: bool                # include the restorable reasoning blob in encrypted_content
    effort: str | None


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = _get(body, key, (int, float))
    if value is not None and not lo <= value <= hi:
        raise _bad(key, f"must be in [{lo:g}, {hi:g}], got {value}")
    return None if value is None else float(value)


def _logprobs(body: dict, include: list) -> tuple[int | None, int | None]:
    """-> (alternatives per token for Sampling.logprobs, None when off; top_logprobs as sent, for the echo).
    On with include "message.output_text.logprobs" (then top_logprobs or 0 alternatives), or with a
    top_logprobs > 0 alone (lenient: a client that asks for alternatives wants the logprobs)."""
    top = _get(body, "top_logprobs", (int,))
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return ((top or 0) if OUTPUT_LOGPROBS in include or top else None), top


def parse_request(body: Any, store: ResponseStore, seal: ReasoningSeal, *, count_only: bool = False
                  ) -> ResponsesRequest:
    """A Responses request body -> ResponsesRequest; APIError 400 naming the field (param)."""
    if not isinstance(body, dict):
        raise APIError(400, "invalid_request", "request body must be a JSON object")
    model = _get(body, "model", (str,), required=not count_only)
    instructions = _get(body, "instructions", (str,))
    max_output = _get(body, "max_output_tokens", (int,))
    if max_output is not None and max_output < 1:
        raise _bad("max_output_tokens", f"must be >= 1, got {max_output}")
    text = _get(body, "text", (dict,))
    grammar = None
    if text is not None and text.get("format") is not None:      # structured outputs (server.structured)
        fmt = text["format"]
        if not isinstance(fmt, dict):
            raise _bad("text.format", f"must be an object, got {type(fmt).__name__}")
        if fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise _bad("text.format.type", f"must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}")
        grammar = output_format(fmt, "text.format")
    reasoning = _get(body, "reasoning", (dict,)) or {}
    effort = _get(reasoning, "effort", (str,), "reasoning.")
    if effort is not None and effort not in EFFORTS:
        raise _bad("reasoning.effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
    summary = _get(reasoning, "summary", (str,), "reasoning.") or _get(reasoning, "generate_summary", (str,),
                                                                        "reasoning.")
    include = _get(body, "include", (list,)) or []
    logprobs, top_logprobs = _logprobs(body, include)
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = _get(body, "parallel_tool_calls", (bool,))
    store_it = _get(body, "store", (bool,))
    previous_id = _get(body, "previous_response_id", (str,))
    previous = None
    if previous_id is not None:
        previous = store.get(previous_id)
        if previous is None:
            raise APIError(400, "invalid_request", f"Previous response with id '{previous_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
    history = previous.conversation() if previous else []
    known = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    turn = _input_messages(body.get("input"), known, seal)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + turn
    if not turn and not any(m.get("role") == "user" for m in history):
        # an empty-input probe (Codex sends input [] with max_output_tokens 1): answered, with an empty
        # user turn, since the chat template needs one (input with items but no user turn stays refused)
        messages.append({"role": "user", "content": ""})
    sampling = Sampling(temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0),
                        logprobs=logprobs)
    stream = bool(_get(body, "stream", (bool,))) and not count_only
    chat = ChatRequest(messages=messages, tools=tools.functions or None, tool_choice=tool_choice,
                       parallel_tool_calls=parallel is not False, max_tokens=max_output, sampling=sampling,
                       model=model, api="responses", stream=stream, grammar=grammar)
    echo = {"instructions": instructions, "max_output_tokens": max_output, "model": model,
            "parallel_tool_calls": parallel is not False, "previous_response_id": previous_id,
            "reasoning": {"effort": effort, "summary": summary}, "store": store_it is not False,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_logprobs": top_logprobs,
            "text": body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "truncation": body.get("truncation") or "disabled", "metadata": body.get("metadata") or {},
            "user": body.get("user"), "background": False}
    return ResponsesRequest(chat=chat, echo=echo, turn=turn, previous=previous, tools=tools, stream=stream,
                            store=store_it is not False, summary=summary not in (None, "none"),
                            encrypted=ENCRYPTED_REASONING in include, effort=effort)


# ---- routes ---------------------------------------------------------------------------------------

class ResponsesAPI:
    def __init__(self, service: Service, store: ResponseStore, seal: ReasoningSeal, keepalive_s: float):
        self.service, self.store, self.seal, self.keepalive_s = service, store, seal, keepalive_s

    async def _parse(self, request: Request, count_only: bool) -> ResponsesRequest:
        req = parse_request(await read_json(request), self.store, self.seal, count_only=count_only)
        if req.effort is not None:
            req.chat.thinking, req.chat.thinking_budget = self.service.thinking_for_effort(req.effort)
        return req

    async def input_tokens(self, request: Request) -> Response:
        req = await self._parse(request, count_only=True)
        self.service.resolve_model(req.chat.model)
        with _input_errors():
            n = self.service.count_tokens(req.chat)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": n})

    async def create(self, request: Request) -> Response:
        req = await self._parse(request, count_only=False)
        with _input_errors():
            prepared = self.service.prepare(req.chat)
        await self.service.submit_async(prepared)            # queue full / engine down: an HTTP error, before the 200
        builder = ResponseBuilder(item_id("resp_"), req.echo, req.tools, self.seal, summary=req.summary,
                                  encrypted=req.encrypted)
        if req.stream:
            return Guarded(sse_response(self._events(req, prepared, builder), keepalive_s=self.keepalive_s),
                           lambda: self.service.release(prepared))
        try:
            await until_disconnect(request.receive, self._collect(req, prepared, builder))
        finally:
            self.service.release(prepared)
        return JSONResponse(builder.response())

    async def retrieve(self, request: Request) -> Response:
        stored = self.store.get(request.path_params["response_id"])
        if stored is None:
            raise self._not_found(request.path_params["response_id"])
        return JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            raise self._not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @staticmethod
    def _not_found(response_id: str) -> APIError:
        return APIError(404, "not_found", f"Response with id '{response_id}' not found.", param="response_id")

    def _done(self, req: ResponsesRequest, builder: ResponseBuilder) -> None:
        if req.store and builder.status in ("completed", "incomplete"):
            self.store.put(builder.id, builder.response(), req.turn + builder.as_messages(), req.previous)

    async def _collect(self, req: ResponsesRequest, prepared: Prepared, builder: ResponseBuilder) -> None:
        await collect_into(self.service, prepared, builder)
        self._done(req, builder)

    async def _events(self, req: ResponsesRequest, prepared: Prepared, builder: ResponseBuilder
                      ) -> AsyncIterator[bytes]:
        agen = self.service.generate(prepared)
        try:
            for name, data in builder.start():
                yield event(data, name)
            async for delta in agen:
                if isinstance(delta, Finish):
                    events = builder.finish(delta)
                    self._done(req, builder)
                else:
                    events = builder.feed(delta)
                for name, data in events:
                    yield event(data, name)
                if isinstance(delta, Finish):
                    return
            raise APIError(500, "internal", "generation ended without a finish")
        except APIError as e:
            for name, data in builder.fail(e):
                yield event(data, name)
        except Exception as e:
            log.exception("generation failed")
            for name, data in builder.fail(APIError(500, "internal", f"internal error: {e}")):
                yield event(data, name)
        finally:
            await agen.aclose()


def routes(service: Service, *, store: ResponseStore | None = None, seal: ReasoningSeal | None = None,
           keepalive_s: float = 15.0) -> list[Route]:
    """The Responses routes. store: for previous_response_id / GET / DELETE (default 1024 responses, 6 h).
    seal: keys encrypted_content; default: the service's `reasoning_seal` if it has one, else a random key.
    APIErrors raised before the response starts go to server.app, which answers in OpenAI's error shape."""
    seal = seal or getattr(service, "reasoning_seal", None) or ReasoningSeal()
    api = ResponsesAPI(service, store or ResponseStore(), seal, keepalive_s)
    return [Route("/v1/responses", api.create, methods=["POST"]),
            Route("/v1/responses/input_tokens", api.input_tokens, methods=["POST"]),
            Route("/v1/responses/{response_id}", api.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", api.delete, methods=["DELETE"])]

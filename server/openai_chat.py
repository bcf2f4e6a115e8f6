"""POST /v1/chat/completions: OpenAI Chat Completions (api.md §1).

Request -> ChatRequest (every field checked, errors name its path) -> Service.prepare -> submit, all
before the 200. Non-streaming: one chat.completion object. Streaming (data-only SSE, `[DONE]` last):
role chunk {role: assistant, content: ""}; reasoning deltas (as reasoning_content and its alias
reasoning, per Service.reasoning_fields); content deltas; per tool call i a header delta {index, id,
type, function: {name, arguments: ""}} then argument fragments; one finish chunk (delta {}); a usage
chunk (choices []) when stream_options.include_usage; in-band errors as data: {"error": {...}}.
One chatcmpl- id for every chunk. Both paths run the same Service.generate, so a stream's deltas
concatenate to the non-streamed object.

logprobs: true (+ top_logprobs 0..20): each generated token's log-probability under the model's raw
distribution (before penalties, logit_bias, temperature and filters, as vLLM reports by default) and its
most likely alternatives, as choices[0].logprobs.content (streamed: on the chunk after each token; EOS
and tokens inserted without sampling are left out; reasoning and tool-call tokens are included).

n (1..128): n choices, each its own engine request over the one rendered prompt (server/choices.py:
seed + i per choice when a seed is given); streamed, their chunks interleave, each choice's role chunk
first and its finish chunk last; usage counts the prompt once.

Structured outputs (server/structured.py): response_format json_object / json_schema (the nested
{"json_schema": {"name", "schema", "strict"}} form; the flat {"schema"} too), or one of the vLLM / SGLang
extras guided_json, guided_regex, guided_choice, guided_grammar (Lark), structured_outputs {json | regex
| choice | grammar | json_object}, compiled at parse time (a schema that cannot be used is a 400 naming
its path; two constraints at once, a 400 naming the second). The content is then exactly the grammar's
text; reasoning stays free (the grammar applies after </think>), and with tools that the model may call
(tool_choice other than "none") the format is not applied.

Unsupported and refused with a 400 naming the field: non-function tools. logit_bias ({"token
id": bias in [-100, 100]}, at most 300 ids; null or {} for none) is added to those ids' raw logits
before penalties, temperature and filters, greedy included (as vLLM does); a malformed one, or an id
outside the vocabulary, is a 400 naming logit_bias.
"""

from __future__ import annotations

import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.sampling import MAX_TOP_LOGPROBS
from server import choices
from server import params as P
from server import sse
from server import structured
from server.disconnect import Guarded, until_disconnect
from server.errors import openai_error_body
from server.service import (EFFORTS, APIError, ChatRequest, ContentDelta, Finish, Prepared, ReasoningDelta,
                            Sampling, Service, TokenLogprobs, ToolCallArgs, ToolCallStart)

SYSTEM_FINGERPRINT = "tandem"


def routes(service: Service) -> list[Route]:
    async def endpoint(request: Request) -> Response:
        return await chat_completions(service, request)

    return [Route("/v1/chat/completions", endpoint, methods=["POST"])]


class Options:
    """Response-side options of one request."""

    def __init__(self, stream: bool, include_usage: bool, include_reasoning: bool, n: int = 1):
        self.stream, self.include_usage, self.include_reasoning = stream, include_usage, include_reasoning
        self.n = n


def sampling_fields(f: P.Fields) -> Sampling:
    """The sampling fields shared by chat and completions (OpenAI ranges; vLLM extras)."""
    top_k = f.integer("top_k", lo=-1)
    return Sampling(temperature=f.number("temperature", 0, 2), top_p=f.number("top_p", 0, 1, lo_open=True),
                    top_k=None if top_k is None else max(top_k, 0), min_p=f.number("min_p", 0, 1),
                    presence_penalty=f.number("presence_penalty", -2, 2),
                    frequency_penalty=f.number("frequency_penalty", -2, 2),
                    repetition_penalty=f.number("repetition_penalty", 0, 10, lo_open=True),
                    seed=f.integer("seed", lo=-2**63, hi=2**64 - 1), logit_bias=f.logit_bias("logit_bias"),
                    min_tokens=f.integer("min_tokens", lo=0))


def check_min_tokens(sampling: Sampling, max_tokens: int | None) -> None:
    """min_tokens above the request's max_tokens is a 400 naming it (as vLLM)."""
    if sampling.min_tokens and max_tokens is not None and sampling.min_tokens > max_tokens:
        raise P.bad(f"invalid value for 'min_tokens': {sampling.min_tokens} is more than max_tokens ({max_tokens})",
                    "min_tokens")


def choices_field(f: P.Fields) -> int:
    """n: how many choices (1..128, default 1), each an engine request (server/choices.py)."""
    return f.integer("n", lo=1, hi=choices.MAX_CHOICES) or 1


def chat_logprobs(f: P.Fields) -> int | None:
    """logprobs (boolean) and top_logprobs (0..20) -> alternatives per token, None when off. As OpenAI,
    top_logprobs > 0 without logprobs: true is an error."""
    on = f.boolean("logprobs")
    top = f.integer("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if top and not on:
        raise P.bad("invalid value for 'top_logprobs': it needs 'logprobs' set to true", "top_logprobs")
    return (top or 0) if on else None


def logprobs_object(entries: list | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def stream_options(f: P.Fields, stream: bool) -> bool:
    opts = f.object("stream_options")
    if opts is None:
        return False
    return bool(P.Fields(opts, "stream_options").boolean("include_usage")) and stream


def parse(body: dict[str, Any], service: Service) -> tuple[ChatRequest, Options]:
    f = P.Fields(body)
    model = f.string("model", required=True)
    messages = f.array("messages", required=True)
    if not messages:
        raise P.bad("'messages' must contain at least one message", "messages")
    stream = bool(f.boolean("stream"))
    include_usage = stream_options(f, stream)
    n = choices_field(f)
    sampling = sampling_fields(f)
    sampling.logprobs = chat_logprobs(f)
    max_tokens = f.integer("max_tokens", lo=1)
    mct = f.integer("max_completion_tokens", lo=1)
    check_min_tokens(sampling, mct if mct is not None else max_tokens)
    tools = P.tools(body.get("tools"))
    choice = P.tool_choice(body.get("tool_choice"), tools)
    parallel = f.boolean("parallel_tool_calls")
    grammar = structured.openai_grammar(f)
    effort = f.string("reasoning_effort", choices=EFFORTS)
    thinking, budget = service.thinking_for_effort(effort)
    enable = f.boolean("enable_thinking")                  # DashScope / Qwen convention, top level
    if enable is not None:
        thinking = enable
    top_budget = f.integer("thinking_budget", lo=0)
    if top_budget is not None:
        budget = top_budget
    kwargs = f.object("chat_template_kwargs") or {}
    for key in ("enable_thinking", "preserve_thinking"):
        if key in kwargs and kwargs[key] is not None and not isinstance(kwargs[key], bool):
            raise P.bad(f"invalid type for 'chat_template_kwargs.{key}': expected a boolean",
                        f"chat_template_kwargs.{key}")
    skip_special = f.boolean("skip_special_tokens")
    continue_final = bool(f.boolean("continue_final_message"))      # vLLM's: continue the last (assistant) turn
    if continue_final:
        last = messages[-1]
        if not (isinstance(last, dict) and last.get("role") == "assistant" and last.get("content")
                and not last.get("tool_calls")):
            raise P.bad("continue_final_message needs the last message to be an assistant message with text "
                        "content", "continue_final_message")
    include_reasoning = f.boolean("include_reasoning")
    req = ChatRequest(
        messages=messages, tools=tools, tool_choice=choice, parallel_tool_calls=parallel is not False,
        thinking=thinking, preserve_thinking=f.boolean("preserve_thinking"), thinking_budget=budget,
        chat_template_kwargs={k: v for k, v in kwargs.items() if v is not None},
        max_tokens=mct if mct is not None else max_tokens, stop=f.stop("stop"), sampling=sampling,
        model=model, api="chat", ignore_eos=bool(f.boolean("ignore_eos")),
        skip_special_tokens=skip_special is not False, continue_final=continue_final,
        stream=stream, grammar=grammar)
    return req, Options(stream, include_usage, include_reasoning is not False, n)


def usage_object(usage: dict[str, int]) -> dict[str, Any]:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)}}


async def chat_completions(service: Service, request: Request) -> Response:
    body = await P.read_json(request)
    req, opts = parse(body, service)
    prepared = service.prepare(req)
    preps = choices.copies(prepared, opts.n)
    await choices.submit_all(service, preps)
    cid = "chatcmpl-" + secrets.token_hex(12)
    if opts.stream:
        return Guarded(sse.sse_response(_stream(service, preps, opts, cid)), lambda: choices.release_all(service, preps))
    try:
        results = await until_disconnect(request.receive, choices.complete_all(service, preps))
    finally:
        choices.release_all(service, preps)
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": prepared.created, "model": prepared.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": i, "message": _message(service, opts, r), "logprobs": logprobs_object(r.logprobs),
                     "finish_reason": r.finish.finish_reason} for i, r in enumerate(results)],
        "usage": usage_object(choices.total_usage([r.finish.usage for r in results]))})


def _message(service: Service, opts: Options, result) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.content, "refusal": None}
    if result.reasoning is not None and opts.include_reasoning:
        for name in service.reasoning_fields:
            message[name] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in result.tool_calls]
    return message


async def _stream(service: Service, preps: list[Prepared], opts: Options, cid: str):
    prepared = preps[0]
    base = {"id": cid, "object": "chat.completion.chunk", "created": prepared.created, "model": prepared.model,
            "system_fingerprint": SYSTEM_FINGERPRINT}
    pending: list[list] = [[] for _ in preps]     # per choice: logprob entries that ride on its next chunk
    usages: list = [None] * len(preps)

    def chunk(i: int, delta: dict, finish: str | None = None) -> bytes:
        lp = logprobs_object(pending[i][:]) if pending[i] else None
        pending[i].clear()
        return sse.event({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}],
                          "usage": None})

    for i in range(len(preps)):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for i, d in choices.merged(service, preps):
            if isinstance(d, TokenLogprobs):
                pending[i] += d.entries
            elif isinstance(d, ContentDelta):
                yield chunk(i, {"content": d.text})
            elif isinstance(d, ReasoningDelta):
                if opts.include_reasoning:
                    yield chunk(i, {name: d.text for name in service.reasoning_fields})
            elif isinstance(d, ToolCallStart):
                yield chunk(i, {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                                "function": {"name": d.name, "arguments": ""}}]})
            elif isinstance(d, ToolCallArgs):
                yield chunk(i, {"tool_calls": [{"index": d.index, "function": {"arguments": d.fragment}}]})
            elif isinstance(d, Finish):
                yield chunk(i, {}, d.finish_reason)
                usages[i] = d.usage
        if opts.include_usage:
            yield sse.event({**base, "choices": [], "usage": usage_object(choices.total_usage(usages))})
    except APIError as e:
        yield sse.event(openai_error_body(e))
        return
    yield sse.event("[DONE]")

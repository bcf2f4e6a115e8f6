"""POST /v1/completions: OpenAI (legacy) Completions (api.md §2). No template, no parsing.

prompt: a string, a list of token ids, or a one-element list of either (batches of several prompts
are refused: send one request per prompt). max_tokens defaults to 16 as OpenAI's does. `echo`
prepends the prompt text (streaming: in the first chunk). Stream chunks and the final object are
`text_completion` objects with one cmpl- id; usage chunk with stream_options.include_usage; `[DONE]`.
Refused with a 400 naming the field: n / best_of > 1, logprobs, a non-empty suffix, logit_bias.
"""

from __future__ import annotations

import secrets
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server import params as P
from server import sse
from server.disconnect import Guarded, until_disconnect
from server.errors import openai_error_body
from server.openai_chat import refuse_unsupported, sampling_fields, stream_options
from server.service import APIError, ContentDelta, Finish, Prepared, Service, TextRequest

DEFAULT_MAX_TOKENS = 16


def routes(service: Service) -> list[Route]:
    async def endpoint(request: Request) -> Response:
        return await completions(service, request)

    return [Route("/v1/completions", endpoint, methods=["POST"])]


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        inner = value[0]                                   # ["text"] or [[ids]]
        if isinstance(inner, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in inner):
            raise P.bad("invalid type for 'prompt[0]': expected a list of token ids (integers)", "prompt[0]")
        value = inner
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if value and all(isinstance(v, str) for v in value):
            raise P.bad("batched prompts (a list of several strings) are not supported; send one request per "
                        "prompt", "prompt")
        if value and all(isinstance(v, list) for v in value):
            raise P.bad("batched prompts (several token lists) are not supported; send one request per prompt",
                        "prompt")
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, int):
                raise P.bad(f"invalid type for 'prompt[{i}]': expected a token id (integer)", f"prompt[{i}]")
        if not value:
            raise P.bad("'prompt' must not be empty", "prompt")
        return value
    if value is None:
        raise P.bad("you must provide 'prompt'", "prompt")
    raise P.bad("invalid type for 'prompt': expected a string, an array of strings or token ids", "prompt")


def parse(body: dict[str, Any]) -> tuple[TextRequest, bool]:
    f = P.Fields(body)
    model = f.string("model", required=True)
    prompt = _prompt(body.get("prompt"))
    stream = bool(f.boolean("stream"))
    include_usage = stream_options(f, stream)
    refuse_unsupported(f, logprobs_int=True)
    best_of = f.integer("best_of", lo=1, hi=128)
    if best_of is not None and best_of != 1:
        raise P.bad("best_of > 1 is not supported by this server", "best_of")
    if f.string("suffix"):
        raise P.bad("suffix is not supported by this model", "suffix")
    max_tokens = f.integer("max_tokens", lo=1)
    req = TextRequest(prompt=prompt, max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                      stop=f.stop("stop"), sampling=sampling_fields(f), echo=bool(f.boolean("echo")), model=model,
                      api="completions", ignore_eos=bool(f.boolean("ignore_eos")), stream=stream)
    return req, include_usage


def _usage(usage: dict[str, int]) -> dict[str, int]:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"]}


async def completions(service: Service, request: Request) -> Response:
    body = await P.read_json(request)
    req, include_usage = parse(body)
    prepared = service.prepare(req)
    service.submit(prepared)
    cid = "cmpl-" + secrets.token_hex(12)
    echo = _echo_text(service, prepared) if req.echo else ""
    if req.stream:
        return Guarded(sse.sse_response(_stream(service, prepared, cid, echo, include_usage)),
                       lambda: service.release(prepared))
    try:
        result = await until_disconnect(request.receive, service.complete(prepared))
    finally:
        service.release(prepared)
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": prepared.created, "model": prepared.model,
        "system_fingerprint": None,
        "choices": [{"text": echo + (result.content or ""), "index": 0, "logprobs": None,
                     "finish_reason": result.finish.finish_reason}],
        "usage": _usage(result.finish.usage)})


def _echo_text(service: Service, prepared: Prepared) -> str:
    if prepared.prompt_text is not None:
        return prepared.prompt_text
    return service.tokenizer.decode(prepared.prompt_ids)


async def _stream(service: Service, prepared: Prepared, cid: str, echo: str, include_usage: bool):
    base = {"id": cid, "object": "text_completion", "created": prepared.created, "model": prepared.model}

    def chunk(text: str, finish: str | None = None) -> bytes:
        return sse.event({**base, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
                          "usage": None})

    if echo:
        yield chunk(echo)
    try:
        async with aclosing(service.generate(prepared)) as deltas:
            async for d in deltas:
                if isinstance(d, ContentDelta):
                    yield chunk(d.text)
                elif isinstance(d, Finish):
                    yield chunk("", d.finish_reason)
                    if include_usage:
                        yield sse.event({**base, "choices": [], "usage": _usage(d.usage)})
    except APIError as e:
        yield sse.event(openai_error_body(e))
        return
    yield sse.event("[DONE]")

"""POST /v1/completions: OpenAI (legacy) Completions (api.md §2). No template, no parsing.

prompt: a string, a list of token ids, or a list of either: a batch, each prompt with its n choices
(choice index k n + j for prompt k; at most 128 choices in all; usage counts every prompt once).
max_tokens defaults to 16 as OpenAI's does. `echo`
prepends the prompt text (streaming: in the first chunk). Stream chunks and the final object are
`text_completion` objects with one cmpl- id; usage chunk with stream_options.include_usage; `[DONE]`.
n (1..128) choices as in chat completions (best_of only equal to n: choices are not ranked). Refused with
a 400 naming the field: best_of other than n, a non-empty suffix. logit_bias is applied as in chat
completions (server/openai_chat.py). logprobs (0..5): each generated token's log-probability under the
model's raw distribution and that many alternatives, as {tokens, token_logprobs, top_logprobs,
text_offset} (a stream chunk carries the tokens generated since the previous chunk). With echo, the
prompt's tokens come first (what scoring clients such as lm-eval's loglikelihood read): the first with
token_logprobs / top_logprobs null, each other given the tokens before it; streamed, the echo chunk
waits for the prefill and carries them. text_offset counts from the start of the echoed prompt.
Structured outputs as in chat completions (response_format, guided_*, structured_outputs): the
generated text (after any echo) follows the grammar from its first token.
"""

from __future__ import annotations

import codecs
import dataclasses
import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server import params as P
from server import sse
from server.disconnect import Guarded, until_disconnect
from server.errors import openai_error_body
from server import choices
from server import structured
from server.openai_chat import check_min_tokens, choices_field, sampling_fields, stream_options
from server.service import (APIError, ContentDelta, Finish, Prepared, PromptLogprobs, Service, TextRequest,
                            TokenLogprobs)

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 5                       # alternatives per token (OpenAI's limit for this API)


def routes(service: Service) -> list[Route]:
    async def endpoint(request: Request) -> Response:
        return await completions(service, request)

    return [Route("/v1/completions", endpoint, methods=["POST"])]


def _prompts(value: Any) -> list[str | list[int]]:
    """The request's prompts: a string, a list of token ids, or a list of either (a batch: each prompt
    becomes n choices, in order)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):     # a batch (by its first item)
        for i, v in enumerate(value):
            if isinstance(v, list):
                _token_ids(v, f"prompt[{i}]")
            elif not isinstance(v, str):
                raise P.bad(f"invalid type for 'prompt[{i}]': expected a string or a list of token ids "
                            "(a batch of prompts)", f"prompt[{i}]")
        return list(value)
    if isinstance(value, list):
        return [_token_ids(value, "prompt")]
    if value is None:
        raise P.bad("you must provide 'prompt'", "prompt")
    raise P.bad("invalid type for 'prompt': expected a string, an array of strings, token ids or arrays of "
                "token ids", "prompt")


def _token_ids(value: list, field: str) -> list[int]:
    if not value:
        raise P.bad(f"'{field}' must not be empty", field)
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise P.bad(f"invalid type for '{field}[{i}]': expected a token id (integer)", f"{field}[{i}]")
    return value


def parse(body: dict[str, Any]) -> tuple[list[TextRequest], bool, int]:
    """-> (one request per prompt, include_usage, n)."""
    f = P.Fields(body)
    model = f.string("model", required=True)
    prompts = _prompts(body.get("prompt"))
    stream = bool(f.boolean("stream"))
    include_usage = stream_options(f, stream)
    n = choices_field(f)
    if len(prompts) * n > choices.MAX_CHOICES:
        raise P.bad(f"{len(prompts)} prompts x n = {n} make {len(prompts) * n} choices; at most "
                    f"{choices.MAX_CHOICES} per request", "prompt")
    logprobs = f.integer("logprobs", lo=0, hi=MAX_LOGPROBS)
    echo = bool(f.boolean("echo"))
    best_of = f.integer("best_of", lo=1, hi=choices.MAX_CHOICES)
    if best_of is not None and best_of != n:                 # best_of = n returns every candidate: n choices
        raise P.bad("best_of other than n is not supported by this server (choices are not ranked); use n",
                    "best_of")
    if f.string("suffix"):
        raise P.bad("suffix is not supported by this model", "suffix")
    max_tokens = f.integer("max_tokens", lo=1)
    sampling = sampling_fields(f)
    check_min_tokens(sampling, DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    sampling.logprobs = logprobs
    sampling.prompt_logprobs = logprobs if echo else None      # echo + logprobs: the prompt's tokens too
    stop = f.stop("stop")
    grammar = structured.openai_grammar(f)
    skip_special = f.boolean("skip_special_tokens") is not False
    reqs = [TextRequest(prompt=p, max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                        stop=stop, sampling=dataclasses.replace(sampling), echo=echo, model=model,
                        api="completions", ignore_eos=bool(f.boolean("ignore_eos")), skip_special_tokens=skip_special,
                        stream=stream, grammar=grammar)
            for p in prompts]
    return reqs, include_usage, n


class TextOffsets:
    """Character offsets of consecutive tokens in their decoded text: a token starts at the characters
    its predecessors completed (one that starts inside a multi-byte character, at that character's
    start), whatever the U+FFFD placeholders in the tokens' own strings."""

    def __init__(self, start: int = 0):
        self.chars = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, token_bytes: bytes) -> int:
        """The offset of the token whose bytes follow, then taken into the text."""
        state = self._utf8.getstate()
        if state[0] and token_bytes and 0x80 <= token_bytes[0] <= 0xBF:
            at = self.chars                    # continues the character the text has not completed yet
        else:                                  # what is pending cannot complete: its U+FFFD come first
            flush = codecs.getincrementaldecoder("utf-8")(errors="replace")
            flush.setstate(state)
            at = self.chars + len(flush.decode(b"", final=True))
        self.chars += len(self._utf8.decode(token_bytes))
        return at


def logprobs_object(entries: list | None, offsets: TextOffsets) -> dict | None:
    """Chat-shaped logprob entries (server.generation.logprob_entry) -> the legacy completions object
    {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset} (text_offset: each token's
    character offset in the choice's text, continued across stream chunks through `offsets`;
    alternatives whose text is the same, e.g. two pieces of multi-byte characters, keep the best value)."""
    if entries is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        if e["top_logprobs"] is None:                # the prompt's first token (echo): nothing before it
            out["top_logprobs"].append(None)
        else:
            top: dict[str, float] = {}
            for a in e["top_logprobs"]:              # best first; ids with the same text keep the best value
                top.setdefault(a["token"], a["logprob"])
            out["top_logprobs"].append(top)
        out["text_offset"].append(offsets.next(bytes(e["bytes"])))
    return out


def _usage(usage: dict[str, int]) -> dict:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0) or 0}}


async def completions(service: Service, request: Request) -> Response:
    body = await P.read_json(request)
    reqs, include_usage, n = parse(body)
    preps: list[Prepared] = []
    echoes: list[str] = []
    for req in reqs:                                       # a batch: prompt k's choices are k n .. k n + n - 1
        prepared = service.prepare(req)
        preps += choices.copies(prepared, n)
        echoes += [_echo_text(service, prepared) if req.echo else ""] * n
    await choices.submit_all(service, preps)
    cid = "cmpl-" + secrets.token_hex(12)
    if reqs[0].stream:
        return Guarded(sse.sse_response(_stream(service, preps, cid, echoes, include_usage, n)),
                       lambda: choices.release_all(service, preps))
    try:
        results = await until_disconnect(request.receive, choices.complete_all(service, preps))
    finally:
        choices.release_all(service, preps)
    prepared = preps[0]
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": prepared.created, "model": prepared.model,
        "system_fingerprint": None,
        "choices": [{"text": echoes[i] + (r.content or ""), "index": i,
                     "logprobs": logprobs_object(None if r.logprobs is None else (r.prompt_logprobs or []) + r.logprobs,
                                                 TextOffsets(0 if r.prompt_logprobs is not None else len(echoes[i]))),
                     "finish_reason": r.finish.finish_reason} for i, r in enumerate(results)],
        "usage": _usage(_batch_usage([r.finish.usage for r in results], n))})


def _batch_usage(usages: list[dict], n: int) -> dict:
    """Usage of a batch of prompts with n choices each: every prompt once, every choice's completion."""
    groups = [choices.total_usage(usages[k:k + n]) for k in range(0, len(usages), n)]
    prompt = sum(g["prompt_tokens"] for g in groups)
    completion = sum(g["completion_tokens"] for g in groups)
    cached = sum(g.get("cached_tokens", 0) or 0 for g in groups)       # each prompt's first choice's
    return {**groups[0], "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "cached_tokens": cached}


def _echo_text(service: Service, prepared: Prepared) -> str:
    if prepared.prompt_text is not None:
        return prepared.prompt_text
    return service.tokenizer.decode(prepared.prompt_ids)


async def _stream(service: Service, preps: list[Prepared], cid: str, echoes: list[str], include_usage: bool,
                  n: int):
    prepared = preps[0]
    base = {"id": cid, "object": "text_completion", "created": prepared.created, "model": prepared.model}
    pending: list[list] = [[] for _ in preps]     # per choice: logprob entries that ride on its next chunk
    held = prepared.request.sampling.prompt_logprobs is not None    # echo + logprobs: echo with the prompt's
    offsets = [TextOffsets(0 if held else len(e)) for e in echoes]  # text_offset: from the prompt's tokens, or after it
    usages: list = [None] * len(preps)

    def chunk(i: int, text: str, finish: str | None = None) -> bytes:
        lp = None
        if pending[i]:
            lp = logprobs_object(pending[i][:], offsets[i])
            pending[i].clear()
        return sse.event({**base, "choices": [{"text": text, "index": i, "logprobs": lp, "finish_reason": finish}],
                          "usage": None})

    if not held:
        for i, echo in enumerate(echoes):
            if echo:
                yield chunk(i, echo)
    try:
        async for i, d in choices.merged(service, preps):
            if isinstance(d, PromptLogprobs):                          # the echo chunk, now with its logprobs
                pending[i] += d.entries
                yield chunk(i, echoes[i])
            elif isinstance(d, TokenLogprobs):
                pending[i] += d.entries
            elif isinstance(d, ContentDelta):
                yield chunk(i, d.text)
            elif isinstance(d, Finish):
                yield chunk(i, "", d.finish_reason)
                usages[i] = d.usage
        if include_usage:
            yield sse.event({**base, "choices": [], "usage": _usage(_batch_usage(usages, n))})
    except APIError as e:
        yield sse.event(openai_error_body(e))
        return
    yield sse.event("[DONE]")

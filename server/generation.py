"""One request's run: engine events -> text -> stop strings -> reasoning / content / tool-call deltas.

    token ids --IncrementalDecoder--> text --StopMatcher--> text --OutputParser--> deltas

`run(service, prepared)` is the body of Service.generate. EOS ids end the generation and are never
decoded. A stop string ends it at the match (text from the match on is dropped) and cancels the
request in the engine; so does the parser's stop_requested (parallel_tool_calls false). Closing the
iterator early (client disconnect) cancels the request in the engine and is recorded as aborted
(499 in logs and metrics). Usage counts every token the engine produced up to the end, EOS included.
A request whose output follows a grammar (structured outputs) gets server.structured.RawContent as its
parser: reasoning as usual, then the constrained content verbatim.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from runtime import grammar as G
from runtime import parsing
from server.service import (APIError, ChatRequest, ContentDelta, Delta, Finish, Prepared, PromptLogprobs,
                            ReasoningDelta, TokenLogprobs, ToolCallArgs, ToolCallEnd, ToolCallStart)
from server.structured import RawContent

log = logging.getLogger(__name__)

_DELTAS = {parsing.ReasoningDelta: lambda d: ReasoningDelta(d.text),
           parsing.ContentDelta: lambda d: ContentDelta(d.text),
           parsing.ToolCallStart: lambda d: ToolCallStart(d.index, d.id, d.name),
           parsing.ToolCallArgs: lambda d: ToolCallArgs(d.index, d.fragment),
           parsing.ToolCallEnd: lambda d: ToolCallEnd(d.index, d.cut_off)}


class StopMatcher:
    """Finds the first stop string in streamed text. push() returns the text that is certainly before
    any match, holding back a suffix that could still start one, and the matched string (or None).
    min_tokens: the text of the first that many tokens (push's `tokens`: the count so far) is not
    searched (vLLM's min_tokens: no stop before them)."""

    def __init__(self, stops: list[str], min_tokens: int = 0):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.min_tokens = min_tokens

    def push(self, text: str, tokens: int | None = None) -> tuple[str, str | None]:
        if not self.stops or (tokens is not None and tokens <= self.min_tokens):
            return text, None
        buf = self.buf + text
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.buf = ""
            return buf[:best[0]], best[1]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.buf = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


LOGPROB_FLOOR = -9999.0      # JSON has no -inf: a token the model gives no mass (OpenAI's convention)


def logprob_entry(tokenizer, token: int, entry: list) -> dict:
    """An engine logprob entry [logprob, [[id, logprob], ...]] -> the OpenAI chat shape {token, logprob,
    bytes, top_logprobs: [{token, logprob, bytes}]}; token is the token's bytes as UTF-8 (a piece of a
    multi-byte character shows as U+FFFD; bytes has the exact ones)."""
    lp, alts = entry
    return {**_token_fields(tokenizer, token, lp),
            "top_logprobs": [_token_fields(tokenizer, int(i), v) for i, v in alts]}


def _token_fields(tokenizer, token: int, lp: float | None) -> dict:
    b = tokenizer.token_bytes(token)
    return {"token": b.decode("utf-8", errors="replace"), "logprob": None if lp is None else max(lp, LOGPROB_FLOOR),
            "bytes": list(b)}


def prompt_entries(tokenizer, prompt_ids: list[int], entries: list | None) -> list[dict]:
    """The prompt's logprob entries: the first token's with logprob / top_logprobs None, then the
    engine's (Event.prompt_logprobs: one per prompt token after the first) in logprob_entry's shape."""
    first = {**_token_fields(tokenizer, prompt_ids[0], None), "top_logprobs": None}
    return [first] + [logprob_entry(tokenizer, t, e) for t, e in zip(prompt_ids[1:], entries or [])]


def engine_error(text: str, grammar: str | None = None) -> APIError:
    """An error event of the engine -> the APIError the client sees (grammar: the request's, whose
    field a structured-output failure names)."""
    if "waited more than" in text:
        return APIError(503, "overloaded", f"the server is overloaded: {text}", retry_after_s=2)
    if "shut down" in text:
        return APIError(503, "overloaded", "the server is shutting down", retry_after_s=5)   # draining: api.md §0.1
    if text.startswith("structured output failed"):
        # the request's grammar stopped matching mid-way (an llguidance limit the first mask did not reach):
        # the same request fails the same way, the engine serves on
        return _grammar_error(grammar, f"the output format could not be followed: {text}")
    return APIError(503, "unavailable", f"the engine failed: {text}")


def _grammar_error(grammar: str | None, message: str) -> APIError:
    """A 400 for the request's output format, naming the field it came from (runtime.grammar.Grammar)."""
    field = getattr(grammar, "field", None)
    return APIError(400, "invalid_request", f"{field}: {message}" if field else message, param=field)


def _parser(service, prepared: Prepared) -> parsing.OutputParser | RawContent | None:
    req = prepared.request
    if not isinstance(req, ChatRequest):
        return None
    if service.output_grammar(req) is not None:
        # structured outputs: the content is the grammar's text, verbatim (no tools: see Service.output_grammar)
        return RawContent(prepared.start, id_seed=prepared.request_id, id_prefix=req.tool_id_prefix)
    tools = [] if req.tool_choice == "none" or not req.tools else req.tools
    return parsing.OutputParser(prepared.start, tools, prepared.parallel_calls, id_seed=prepared.request_id,
                                id_prefix=req.tool_id_prefix)


def submit(service, prepared: Prepared) -> None:
    """Submit once (Service.submit); errors are recorded as rejections and raised as APIError."""
    from runtime import EngineError
    from runtime.scheduler import Overloaded

    if prepared.submitted is not None:
        return
    service._check_serving()
    req = prepared.request
    engine = service.engine
    try:
        stream = engine.submit(prepared.prompt_ids, prepared.params,
                               stop_token_ids=None if req.ignore_eos else service.stop_token_ids)
        prepared.submitted = (engine, stream)
        service.request_started(prepared)
        # a submission nobody runs or releases (an adapter that lost it) is cancelled when it is collected
        prepared.orphan_guard = weakref.finalize(prepared, _orphaned, service, engine, stream.id, prepared.request_id)
        return
    except Overloaded as e:
        err = APIError(429, "rate_limited", f"too many requests are waiting: {e}", retry_after_s=1)
    except EngineError as e:
        err = APIError(503, "unavailable", f"the engine is not serving: {e}")
    except G.GrammarError as e:
        # the output format, refused with the model's tokenizer (runtime.grammar.Constraint): name its field
        err = _grammar_error(prepared.params.grammar, str(e))
    except ValueError as e:
        # the engine's refusals name the field first where it is a request field ("logit_bias token id ...")
        err = APIError(400, "invalid_request", str(e), param="logit_bias" if str(e).startswith("logit_bias ") else None)
    service.record_rejected(err, req.api)
    raise err


# Structured-output requests are submitted from these threads: building the request's parser and its
# first mask takes from milliseconds to about a second for a pathological grammar (llguidance releases
# the GIL meanwhile), which must not stall the event loop's other requests. Bounded, so a flood of such
# requests queues here instead of taking every core.
_GRAMMAR_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tandem-grammar")


async def submit_async(service, prepared: Prepared) -> None:
    """submit() for the event loop: a request with an output grammar is submitted on a worker thread;
    others (microseconds) inline. A caller cancelled meanwhile (client gone) leaves nothing running:
    the submission is released once the thread is done."""
    if prepared.submitted is not None or prepared.params.grammar is None:
        submit(service, prepared)
        return
    future = _GRAMMAR_POOL.submit(submit, service, prepared)
    try:
        await asyncio.shield(asyncio.wrap_future(future))
    except asyncio.CancelledError:
        # run by the worker thread once the submission is made (or now, if it is): the loop may be gone
        future.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                                 else release(service, prepared))
        raise


def _orphaned(service, engine, stream_id: int, request_id: str) -> None:
    log.warning("request %s was submitted but never run or released; cancelled", request_id)
    engine.cancel(stream_id)
    with service._lock:
        service.in_flight -= 1


def _claim(prepared: Prepared) -> None:
    prepared.claimed = True
    guard = getattr(prepared, "orphan_guard", None)
    if guard is not None:
        guard.detach()


EVENT_END = object()         # between two engine events' deltas in coalesce()'s input


def coalesce(deltas: list) -> list:
    """Deltas with each run of text of one kind within one engine event (runs end at EVENT_END, which is
    dropped) merged: content with content, reasoning with reasoning, a tool call's argument fragments
    with the next ones of the same call. The token log-probabilities between them ride, in order, just
    before the merged delta (each API attaches them to the chunk that carries their text), so the stream
    says the same in fewer, larger chunks: a speculation round's tokens in one. Text of different events
    stays apart, so a stream's chunks keep the engine's pace."""
    items: list[list] = []                  # [entries before the delta, delta]
    entries: list = []
    barrier = True
    for d in deltas:
        if d is EVENT_END:
            barrier = True
            continue
        if isinstance(d, TokenLogprobs):
            entries += d.entries
            continue
        last = None if barrier else items[-1][1]
        barrier = False
        if (type(d) is type(last) and isinstance(d, (ContentDelta, ReasoningDelta))) or \
                (isinstance(d, ToolCallArgs) and isinstance(last, ToolCallArgs) and d.index == last.index):
            items[-1][0] += entries
            items[-1][1] = (ToolCallArgs(d.index, last.fragment + d.fragment) if isinstance(d, ToolCallArgs)
                            else type(d)(last.text + d.text))
        else:
            items.append([entries, d])
        entries = []
    out: list = []
    for before, d in items:
        if before:
            out.append(TokenLogprobs(before))
        out.append(d)
    if entries:
        out.append(TokenLogprobs(entries))
    return out


def release(service, prepared: Prepared) -> None:
    if prepared.submitted is not None and not prepared.claimed:
        _claim(prepared)
        engine, stream = prepared.submitted
        engine.cancel(stream.id)
        service.request_aborted(prepared, 0)
        service.request_closed(prepared)


async def run(service, prepared: Prepared) -> AsyncIterator[Delta]:
    req = prepared.request
    if prepared.claimed:
        raise RuntimeError(f"request {prepared.request_id} was already run or released")
    await submit_async(service, prepared)
    _claim(prepared)
    engine, stream = prepared.submitted
    stats = _Run(service, prepared)
    parser = _parser(service, prepared)
    stops = StopMatcher(req.stop, prepared.params.min_tokens)
    decoder = service.tokenizer.incremental_decoder(skip_special_tokens=req.skip_special_tokens)
    eos = frozenset() if req.ignore_eos else service.stop_token_ids
    want_logprobs = req.sampling.logprobs is not None
    want_prompt = req.sampling.prompt_logprobs is not None
    events = stream.batches()
    engine_done = False
    try:
        if parser is not None and prepared.forced_prefix:
            for d in stats.convert(parser.feed_forced(prepared.forced_prefix)):
                yield d
        reason, matched, engine_timings, engine_usage, engine_spec = None, None, {}, {}, None
        while reason is None:
            # every event queued by now (one wake-up for the steps a busy server fell behind on), token by
            # token as ever; each event's deltas go out coalesced (a speculation round's tokens in one chunk)
            out: list = []
            failure: APIError | None = None
            for ev in await events.__anext__():
                out.append(EVENT_END)           # coalesce() merges within one event, never across
                if ev.cached_tokens:            # a stop string may end the run before the last event's usage
                    engine_usage = {"cached_tokens": ev.cached_tokens}
                if want_prompt and (ev.tokens or ev.final):     # the prefill is done: all of the prompt's entries
                    want_prompt = False
                    out.append(PromptLogprobs(prompt_entries(service.tokenizer, prepared.prompt_ids,
                                                             ev.prompt_logprobs)))
                for i, tok in enumerate(ev.tokens):
                    stats.token(tok)
                    if tok in eos:
                        continue
                    if want_logprobs and ev.logprobs is not None and ev.logprobs[i] is not None:
                        out.append(TokenLogprobs([logprob_entry(service.tokenizer, tok, ev.logprobs[i])]))
                    text = decoder.push(tok)
                    if not text:
                        continue
                    text, matched = stops.push(text, stats.n_out)
                    out += stats.feed(parser, text)
                    if matched is not None:
                        reason = "stop"
                        break
                    if parser is not None and parser.stop_requested:
                        reason = "tool_calls"
                        break
                if reason is not None:
                    break
                if ev.error:
                    engine_done = True
                    failure = engine_error(ev.error, prepared.params.grammar)
                    break
                if ev.final:
                    engine_done = True
                    if ev.finish_reason == "cancelled":
                        failure = APIError(503, "overloaded", "the request was cancelled: the server is shutting "
                                           "down", retry_after_s=5)
                        break
                    reason, engine_timings, engine_usage = ev.finish_reason or "stop", ev.timings or {}, ev.usage or {}
                    engine_spec = ev.spec
            for d in coalesce(out):
                yield d
            if failure is not None:
                raise failure
        if matched is None and not (parser is not None and parser.stop_requested):
            text, matched = stops.push(decoder.flush())
            if matched is None:
                text += stops.flush()
            else:
                reason = "stop"
            for d in stats.feed(parser, text):
                yield d
        notes: list[str] = []
        hit_limit = reason == "length"          # before a parsed call turns it into tool_calls
        if parser is not None:
            for d in stats.convert(parser.finish()):
                yield d
            result = parser.result()
            notes = result.notes
            # a call cut off by max_tokens / the context keeps "length", by a stop string "stop": its
            # arguments are incomplete, and a client must not run it as if it were whole
            if result.tool_calls and not ((reason == "length" or matched is not None) and parser.cut_off):
                reason = "tool_calls"
        finish = stats.finish(reason, matched, notes, engine_timings, engine_usage, engine_spec, hit_limit)
        yield finish
    except APIError as e:
        stats.error(e)
        raise
    except Exception as e:                          # a bug; GeneratorExit / CancelledError: aborted below
        log.exception("request %s failed", prepared.request_id)
        err = APIError(500, "internal", f"internal error: {type(e).__name__}: {e}", should_retry=False)
        stats.error(err)
        raise err from e
    finally:
        if not engine_done:
            engine.cancel(stream.id)
        await events.aclose()
        stats.close()


class _Run:
    """Counters, timings and the accounting calls of one run."""

    def __init__(self, service, prepared: Prepared):
        self.service, self.prepared = service, prepared
        self.n_out = self.reasoning_tokens = 0
        self.in_reasoning = prepared.start == "reasoning"
        self.t_submit = time.monotonic()
        self.t_first: float | None = None
        self.recorded = False

    def token(self, tok: int) -> None:
        self.n_out += 1
        if self.t_first is None:
            self.t_first = time.monotonic()
        if self.in_reasoning:
            self.reasoning_tokens += 1
            if tok == self.service.think_end_id:
                self.in_reasoning = False

    def convert(self, deltas: list) -> list[Delta]:
        out = [_DELTAS[type(d)](d) for d in deltas]
        if self.in_reasoning and any(not isinstance(d, ReasoningDelta) for d in out):
            self.in_reasoning = False
        return out

    def feed(self, parser, text: str) -> list[Delta]:
        if not text:
            return []
        if parser is None:
            return [ContentDelta(text)]
        return self.convert(parser.feed(text))

    def finish(self, reason: str, matched: str | None, notes: list[str], engine_timings: dict,
               engine_usage: dict, engine_spec: dict | None = None, hit_limit: bool = False) -> Finish:
        now = time.monotonic()
        ttft = engine_timings.get("ttft_s")
        if ttft is None and self.t_first is not None:
            ttft = self.t_first - self.t_submit
        total = engine_timings.get("total_s") or (now - self.t_submit)
        queue = engine_timings.get("queue_s")
        ctx = self.prepared.context
        timings = dict(queue_s=queue, ttft_s=ttft,
                       prefill_s=(ttft - queue) if ttft is not None and queue is not None else None,
                       decode_s=(total - ttft) if ttft is not None else None, total_s=total,
                       e2e_s=(now - ctx.received_at) if ctx is not None else total)
        n_prompt = len(self.prepared.prompt_ids)
        usage = dict(prompt_tokens=n_prompt, completion_tokens=self.n_out, total_tokens=n_prompt + self.n_out,
                     reasoning_tokens=min(self.reasoning_tokens, self.n_out),
                     cached_tokens=int(engine_usage.get("cached_tokens", 0) or 0))
        finish = Finish(reason, usage, timings, matched, list(notes), spec=engine_spec, hit_limit=hit_limit)
        self.recorded = True
        self.service.request_done(self.prepared, finish)
        return finish

    def error(self, err: APIError) -> None:
        if not self.recorded:
            self.recorded = True
            self.service.request_failed(self.prepared, err, self.n_out)

    def close(self) -> None:
        if not self.recorded:
            self.recorded = True
            self.service.request_aborted(self.prepared, self.n_out)
        self.service.request_closed(self.prepared)


async def collect_into(service, prepared: Prepared, builder) -> None:
    """Run a request to its end, feeding every delta to `builder` (``feed(delta)``, then
    ``finish(Finish)``): the non-streaming path of the adapters that build a final object."""
    agen = service.generate(prepared)
    try:
        async for delta in agen:
            if isinstance(delta, Finish):
                builder.finish(delta)
                return
            builder.feed(delta)
    except APIError:
        raise
    except Exception as e:
        log.exception("generation failed")
        raise APIError(500, "internal", f"internal error: {e}") from e
    finally:
        await agen.aclose()
    raise APIError(500, "internal", "generation ended without a finish")

"""The protocol-independent core of every generation API.

Each API module (openai_chat, completions, openai_responses, anthropic_messages, zmq_api) is a thin
adapter: it parses its own request shape into a ChatRequest or TextRequest, validates it with
`Service.prepare` (before any 200 is sent: template render, tokenization, context length), then
iterates `Service.generate` and formats the normalized Deltas into its own stream grammar or final
object. Everything protocol-neutral lives here: chat-template rendering with thinking options,
tokenization, max_tokens clamping, stop strings, submission to the runtime Engine, incremental
detokenization, the reasoning / tool-call parser (runtime.parsing), thinking budgets, cancellation
on client disconnect, usage and timings, the request log and metrics.

Lifecycle: a Service may be built before its engine exists (`tandem serve` answers /health with 503
while the model loads); `attach_engine` makes it ready, `fail` marks the engine dead, `begin_drain`
refuses new work during shutdown. `state` is one of loading | ready | failed | draining | stopped.

Per-request context (request id, X-Tandem-Client label, API path) comes from the `current_request`
context variable that server.app sets for each HTTP request; adapters need not pass it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

from runtime.grammar import tool_name
from server.request_log import spec_log_record

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an HTTP status and a protocol-neutral kind; adapters map it to their shape.

    kind: invalid_request | context_length_exceeded | not_found | method_not_allowed | authentication |
          too_large | rate_limited | overloaded | unavailable | timeout | internal
    code: overrides the OpenAI error code of the kind (e.g. model_not_found, invalid_client_label).
    headers: extra response headers (e.g. Allow for 405).
    """

    def __init__(self, status: int, kind: str, message: str, param: str | None = None,
                 retry_after_s: float | None = None, should_retry: bool | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param
        self.retry_after_s, self.should_retry = retry_after_s, should_retry
        self.code, self.headers = code, headers
        self.recorded = False           # counted and logged (Service.record_rejected) already


@dataclass
class Sampling:
    """Sampling fields a client may send; None means 'omitted' (then generation_config defaults apply)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None     # (token id, bias) pairs (OpenAI logit_bias)
    logprobs: int | None = None         # each generated token's logprob + this many alternatives; None: off
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (completions echo); None: off
    min_tokens: int | None = None       # vLLM's: no stop id or stop string before this many tokens


@dataclass
class ChatRequest:
    """A chat-style request after protocol parsing.

    messages: OpenAI-shaped list ({"role": system|developer|user|assistant|tool, "content": str | parts,
    "reasoning_content"? / "reasoning"?, "tool_calls"? with arguments as dicts or JSON strings,
    "tool_call_id"?}); adapters convert Anthropic / Responses inputs into this shape. tools:
    OpenAI-shaped function tools. thinking: None = model default; True/False explicit.
    thinking_budget: max reasoning tokens (then the close-of-thinking tokens are inserted without
    sampling). tool_id_prefix: prefix of generated tool-call ids ("call_", Anthropic "toolu_").
    """
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None                 # "auto" | "none" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    thinking: bool | None = None
    preserve_thinking: bool | None = None
    thinking_budget: int | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None           # None = up to the context
    stop: list[str] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    model: str | None = None
    api: str = "chat"                       # for logs and metrics: chat | responses | messages | zmq
    tool_id_prefix: str = "call_"
    # the last message is an assistant turn whose text the model continues (Anthropic's prefill; chat's
    # continue_final_message): the prompt ends after that text, and the output is only what follows
    continue_final: bool = False
    ignore_eos: bool = False
    # special tokens (<|im_end|>, <|endoftext|>: the tokenizer's special added tokens) left out of the text;
    # the reasoning / tool-call tags are not special and always decode
    skip_special_tokens: bool = True
    stream: bool = False                    # for logs only
    # structured outputs: the request's output format compiled by server.structured (an llguidance grammar),
    # None for free text; applied after the reasoning, and only when the model may not call a tool
    grammar: str | None = None


@dataclass
class TextRequest:
    """A raw completion: prompt text or token ids, no template, no parsing (content only)."""
    prompt: str | list[int]
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    echo: bool = False
    model: str | None = None
    api: str = "completions"
    ignore_eos: bool = False
    skip_special_tokens: bool = True        # as ChatRequest's
    stream: bool = False
    grammar: str | None = None              # structured outputs (server.structured); None for free text


@dataclass
class RequestContext:
    """Who is asking: set per HTTP request by server.app (or by another frontend)."""
    request_id: str
    client: str | None = None
    path: str | None = None
    received_at: float = field(default_factory=time.monotonic)


current_request: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "tandem_current_request", default=None)


@dataclass
class Prepared:
    """A validated request, ready to run: prompt ids, clamped budget, parser start state."""
    request: ChatRequest | TextRequest
    prompt_ids: list[int]
    max_tokens: int
    start: Literal["reasoning", "content"]
    request_id: str
    prompt_text: str | None = None          # rendered chat prompt / completion prompt (never logged)
    forced_prefix: str = ""                 # generation prompt text that forces a tool call (tool_choice)
    params: Any = None                      # runtime.sampling.SamplingParams
    model: str = ""                         # the served model id the request resolved to
    context: RequestContext | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    submitted: Any = None                   # (engine, RequestStream) once submitted (Service.submit)
    claimed: bool = False                   # generate() took the submitted request over
    orphan_guard: Any = None                # cancels a submission that is never run nor released

    @property
    def parallel_calls(self) -> bool:
        """Whether the output may hold more than one tool call: parallel_tool_calls, except that a named
        tool_choice whose call the prompt opened (forced_prefix) is that one call."""
        req = self.request
        return bool(getattr(req, "parallel_tool_calls", False)) and not (
            isinstance(getattr(req, "tool_choice", None), dict) and self.forced_prefix)


# Deltas (what generate() yields)

@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArgs:
    index: int
    fragment: str


@dataclass
class ToolCallEnd:
    index: int
    cut_off: bool = False   # closed at the end of generation, not by the model (runtime.parsing.ToolCallEnd)


@dataclass
class TokenLogprobs:
    """Log-probabilities of generated tokens (requests with Sampling.logprobs set), in the order the
    tokens were generated, yielded after the text deltas of the tokens before them: one dict per token
    in the OpenAI chat shape {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]} (the
    model's raw distribution; EOS and tokens inserted without sampling are left out)."""
    entries: list[dict[str, Any]]


@dataclass
class PromptLogprobs:
    """Log-probabilities of the prompt's tokens (requests with Sampling.prompt_logprobs set), yielded once,
    before the first generated token's deltas: one entry per prompt token in the TokenLogprobs shape, the
    first token's with logprob and top_logprobs None (nothing comes before it)."""
    entries: list[dict[str, Any]]


@dataclass
class Finish:
    """Last delta. finish_reason: stop | length | tool_calls | cancelled; usage has prompt_tokens,
    completion_tokens, total_tokens, reasoning_tokens, cached_tokens; matched_stop: the stop string,
    if any; notes: why markup fell back to text (parser notes); spec: the engine's speculation statistics of
    this request (runtime.engine.Event.spec: rounds, drafted, accepted, accepted_hist [K+1],
    position_drafted [K], position_accepted [K], tokens_per_round), None when speculation did not run or
    the request ended before the engine's final event (a stop string or tool call matched here);
    hit_limit: the generation ran into max_tokens or the context's end, also where finish_reason says
    tool_calls because whole calls were parsed before the cut (chat's rule; the Responses API reports
    such a response incomplete, api.md section 5)."""
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float | None]
    matched_stop: str | None = None
    notes: list[str] = field(default_factory=list)
    spec: dict | None = None
    hit_limit: bool = False


Delta = (ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgs | ToolCallEnd | TokenLogprobs | PromptLogprobs
         | Finish)


@dataclass
class Result:
    """A whole generation, as `Service.complete` collects it (what non-streaming responses need)."""
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]        # [{"id", "name", "arguments"}], arguments a JSON object string
    finish: Finish
    logprobs: list[dict[str, Any]] | None = None    # Sampling.logprobs set: TokenLogprobs' entries, all of them
    prompt_logprobs: list[dict[str, Any]] | None = None   # Sampling.prompt_logprobs set: PromptLogprobs' entries


# Recommended sampling per mode (Qwen3.5/3.6 model cards): applied to fields the client omitted,
# over generation_config.json. "reasoning" = the prompt opens a <think> block, "content" = it does not.
QWEN_MODE_SAMPLING: dict[str, dict[str, float]] = {
    "reasoning": dict(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0),
    "content": dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=1.5),
}
# reasoning effort -> thinking budget in tokens (None: unlimited); "none" turns thinking off
EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 1024, "low": 4096, "medium": None, "high": None,
                                         "xhigh": None, "max": None}
EFFORTS = ("none",) + tuple(EFFORT_BUDGETS)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


class Service:
    """Owns the Engine, the tokenizer and the model's identity; shared by all API adapters.

    engine: a started runtime.Engine, or None until attach_engine (while loading).
    generation_defaults: runtime.tokenizer.generation_defaults(model_dir) (sampling defaults, eos ids).
    chat_template: template source overriding the tokenizer's (--chat-template FILE).
    request_log: server.request_log.RequestLog or None; metrics: server.metrics.Metrics or None.
    """

    model_id: str
    max_context: int

    def __init__(self, engine, tokenizer, model_id: str, max_context: int,
                 generation_defaults: dict[str, Any] | None = None, chat_template: str | None = None,
                 request_log=None, metrics=None, *, aliases: tuple[str, ...] = (), accept_any_model: bool = False,
                 default_thinking: bool | None = None, preserve_thinking: bool | None = None,
                 mode_sampling: dict[str, dict[str, float]] | None = QWEN_MODE_SAMPLING,
                 effort_budgets: dict[str, int | None] | None = None, default_max_tokens: int | None = None,
                 reasoning_fields: tuple[str, ...] = ("reasoning_content", "reasoning"),
                 thinking_close_text: str = "\n</think>\n\n"):
        from server.prompt import ChatTemplate        # server.prompt imports APIError from here

        self.tokenizer = tokenizer
        self.model_id, self.max_context = model_id, int(max_context)
        self.aliases, self.accept_any_model = tuple(a for a in aliases if a != model_id), accept_any_model
        self.defaults = dict(generation_defaults or {})
        self.request_log, self.metrics = request_log, metrics
        self.default_thinking, self.preserve_thinking = default_thinking, preserve_thinking
        self.mode_sampling = mode_sampling or {}
        self.effort_budgets = dict(EFFORT_BUDGETS if effort_budgets is None else effort_budgets)
        self.default_max_tokens = default_max_tokens
        self.reasoning_fields = tuple(reasoning_fields)
        self.created = int(time.time())
        source = chat_template if chat_template is not None else tokenizer.chat_template
        special = {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
        self.template = ChatTemplate(source, special) if source else None
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(self.defaults.get("eos_token_ids", ()))
        self.think_end_id = tokenizer.token_to_id("</think>")
        self.tool_call_id = tokenizer.token_to_id("<tool_call>")     # banned under tool_choice none
        self.tool_call_end_id = tokenizer.token_to_id("</tool_call>")
        self.thinking_close_ids = tuple(tokenizer.encode(thinking_close_text))
        self.engine = None
        self.state = "loading"
        self.load_progress = None            # server.load_progress.LoadProgress while serve loads the engine
        self.failure: str | None = None
        self.in_flight = 0
        self._lock = threading.Lock()
        self._engine_stopped: threading.Event | None = None   # set once a shutdown's engine.shutdown returned
        if engine is not None:
            self.attach_engine(engine)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def attach_engine(self, engine) -> bool:
        """Start serving with `engine`; False (engine not taken) once the service stopped or failed."""
        with self._lock:
            if self.state in ("stopped", "failed"):
                return False
            self.engine = engine
            if self.state == "loading":
                self.state = "ready"
        log.info("engine attached; serving %s (context %d)", self.model_id, self.max_context)
        return True

    def fail(self, reason: str) -> None:
        """The engine is dead (or never started): health turns 503, requests are refused."""
        with self._lock:
            if self.state in ("failed", "stopped"):
                return
            self.state, self.failure = "failed", reason
        log.error("engine failure: %s", reason)
        if self.request_log is not None:
            self.request_log.event("engine_failed", reason=reason)

    def begin_drain(self) -> None:
        with self._lock:
            if self.state in ("loading", "ready"):
                self.state = "draining"

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine (in-flight requests end as cancelled); blocking. A call while another thread's
        shutdown is under way waits for it (so the process does not exit under a rank shutdown)."""
        with self._lock:
            engine, self.engine = self.engine, None
            if self.state != "failed":
                self.state = "stopped"
            if engine is not None:
                self._engine_stopped = threading.Event()
            stopped = self._engine_stopped
        if engine is not None:
            try:
                engine.shutdown(timeout)
            finally:
                stopped.set()
        elif stopped is not None:
            stopped.wait(timeout + 5.0)

    def health(self) -> tuple[bool, str]:
        if self.state == "ready":
            stats = self.stats()
            if stats.get("healthy", True):
                return True, "ok"
            return False, f"Engine failed: {stats.get('failure') or 'unhealthy'}"
        return False, {"loading": "Loading model", "draining": "Shutting down", "stopped": "Shutting down",
                       "failed": f"Engine failed: {self.failure}"}[self.state]

    def loading(self) -> dict | None:
        """While the model loads: {"done_bytes", "total_bytes"} of the weights, once a rank has reported."""
        if self.state != "loading" or self.load_progress is None:
            return None
        return self.load_progress.snapshot()

    def stats(self) -> dict:
        engine = self.engine
        if engine is None:
            return {}
        try:
            return engine.stats()
        except Exception as e:          # a dead coordinator must not break /health or /metrics
            return {"healthy": False, "failure": f"stats failed: {e}"}

    # ---- models ------------------------------------------------------------------------------------

    def model_ids(self) -> list[str]:
        return [self.model_id, *self.aliases]

    def resolve_model(self, name: str | None) -> str:
        """The served model id for a requested name; APIError 404 model_not_found if unknown."""
        if name is None or name in self.model_ids() or self.accept_any_model:
            return self.model_id
        raise APIError(404, "not_found", f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def thinking_for_effort(self, effort: str | None) -> tuple[bool | None, int | None]:
        """reasoning effort -> (thinking flag, thinking budget); ("none" turns thinking off)."""
        if effort is None:
            return None, None
        if effort == "none":
            return False, None
        return True, self.effort_budgets.get(effort)

    # ---- prepare -----------------------------------------------------------------------------------

    def _check_serving(self) -> None:
        if self.state == "ready":
            return
        if self.state == "loading":
            raise APIError(503, "unavailable", "Loading model", retry_after_s=5)
        if self.state == "failed":
            raise APIError(503, "unavailable", f"the engine failed: {self.failure}")
        raise APIError(503, "overloaded", "the server is shutting down", retry_after_s=5)

    def prepare(self, request: ChatRequest | TextRequest) -> Prepared:
        """Render, tokenize, check the context, clamp max_tokens. Raises APIError (before any 200)."""
        self._check_serving()
        model = self.resolve_model(request.model)
        ctx = current_request.get()
        request_id = ctx.request_id if ctx is not None else secrets.token_hex(12)
        forced = ""
        if isinstance(request, ChatRequest):
            text, start, forced = self._render(request)
            ids, param = self.tokenizer.encode(text), "messages"
        else:
            text, ids, start, param = self._text_prompt(request)
        limit = self.max_context
        pages = self.stats().get("pages_total")
        if pages:                           # a pool smaller than one context bounds a request too
            from runtime.config import PAGE_SIZE
            limit = min(limit, pages * PAGE_SIZE)
        room = limit - len(ids)
        if room < 1:
            raise APIError(400, "context_length_exceeded",
                           f"This model's maximum context length is {limit} tokens. However, your request has "
                           f"{len(ids)} input tokens. Please reduce the length of the input.", param=param,
                           code="context_length_exceeded")
        cap = request.max_tokens if request.max_tokens is not None else self.default_max_tokens
        max_tokens = room if cap is None else max(1, min(int(cap), room))
        prepared = Prepared(request, ids, max_tokens, start, request_id, prompt_text=text, forced_prefix=forced,
                            model=model, context=ctx)
        prepared.params = self._sampling_params(prepared)
        return prepared

    def count_tokens(self, request: ChatRequest) -> int:
        """Prompt tokens of a chat request as prepare() would build it (no engine needed)."""
        text, _, _ = self._render(request)
        return len(self.tokenizer.encode(text))

    def _render(self, request: ChatRequest) -> tuple[str, str, str]:
        from runtime.parsing import start_from_prompt
        from server.prompt import normalize_messages

        if self.template is None:
            raise APIError(400, "invalid_request", "this model has no chat template; use /v1/completions "
                           "or start the server with --chat-template FILE", param="messages")
        messages = normalize_messages(request.messages)
        kwargs = dict(request.chat_template_kwargs or {})
        if "enable_thinking" not in kwargs:
            thinking = request.thinking if request.thinking is not None else self.default_thinking
            if thinking is not None:
                kwargs["enable_thinking"] = bool(thinking)
        if "preserve_thinking" not in kwargs:
            preserve = request.preserve_thinking if request.preserve_thinking is not None else self.preserve_thinking
            if preserve is not None:
                kwargs["preserve_thinking"] = bool(preserve)
        text = self.template.render(messages, request.tools or None, kwargs, continue_final=request.continue_final)
        start = start_from_prompt(text)
        forced = "" if request.continue_final else self._forced_call(request, start)
        return text + forced, start, forced

    def _forced_call(self, request: ChatRequest, start: str) -> str:
        """tool_choice required / named with thinking off: open the call in the prompt (the template's XML
        form), so the model can only continue it. Reasoning is never constrained (api.md §6.9)."""
        choice = request.tool_choice
        if start != "content" or not request.tools or self.template is None or not self.template.xml_tool_calls:
            return ""
        if choice == "required":
            names = [tool_name(t) for t in request.tools]
            if len(names) == 1 and names[0]:
                return f"<tool_call>\n<function={names[0]}>\n"      # one tool: the call is its call
            # not "<function=": byte-level BPE joins "=" to the name ("=get", "_weather"), so a prompt
            # ending on a lone "=" is a token sequence the model never wrote and it loses the call
            return "<tool_call>\n<function"
        if isinstance(choice, dict):
            name = tool_name(choice)
            if name:
                return f"<tool_call>\n<function={name}>\n"
        return ""

    def _text_prompt(self, request: TextRequest) -> tuple[str, list[int], str, str]:
        prompt = request.prompt
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            vocab = getattr(getattr(self.engine, "spec", None), "vocab_size", None) or self.tokenizer.vocab_size
            for i, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise APIError(400, "invalid_request", f"'prompt[{i}]' must be a token id in [0, {vocab}), "
                                   f"got {t!r}", param="prompt")
            ids, text = list(prompt), None
        if not ids:
            raise APIError(400, "invalid_request", "the prompt is empty: give at least one token", param="prompt")
        return text, ids, "content", "prompt"

    def _tool_grammar(self, prepared: Prepared) -> str | None:
        """tool_choice "required" / named with an XML-call template: the grammar of the call(s) (api.md
        section 6.9; runtime.grammar.tool_call_grammar), from where the prompt left the first call
        (Prepared.forced_prefix when thinking is off; after </think> when it is on: _sampling_params
        sets grammar_after). None where it does not apply, or where the tools give no usable grammar
        (the request then runs as before: the prompt's opened call only)."""
        req = prepared.request
        if (not isinstance(req, ChatRequest) or not req.tools or self.template is None
                or not self.template.xml_tool_calls or self.tool_call_id is None or self.tool_call_end_id is None):
            return None
        choice = req.tool_choice
        if choice == "required":
            only = None
        elif isinstance(choice, dict):
            only = tool_name(choice)
            if not only:
                return None
        else:
            return None
        from runtime import grammar as grammar_mod
        try:
            return grammar_mod.tool_call_grammar(req.tools, only, prepared.parallel_calls, prepared.forced_prefix,
                                                 self.tool_call_id, self.tool_call_end_id)
        except (grammar_mod.GrammarError, ValueError, TypeError, RuntimeError) as e:
            # an optional constraint: a tool set (or an llguidance) it cannot be built for runs as before
            log.warning("request %s: tool_choice not enforced by a grammar: %s", prepared.request_id, e)
            return None

    @staticmethod
    def output_grammar(req: ChatRequest | TextRequest) -> str | None:
        """The grammar the output must follow: the request's output format, except when tools are offered
        and tool_choice lets the model call one (a format would forbid the call's markup; the tool-call
        parser handles that output)."""
        grammar = getattr(req, "grammar", None)
        if grammar is None:
            return None
        if isinstance(req, ChatRequest) and req.tools and req.tool_choice != "none":
            return None
        return grammar

    def _sampling_params(self, prepared: Prepared):
        from runtime.sampling import SamplingParams

        req = prepared.request
        values: dict[str, Any] = {k: self.defaults[k] for k in SAMPLING_KEYS if k in self.defaults}
        if isinstance(req, ChatRequest):
            values.update(self.mode_sampling.get(prepared.start, {}))
        for k in SAMPLING_KEYS + ("seed",):
            v = getattr(req.sampling, k)
            if v is not None:
                values[k] = v
        if "top_k" in values:
            values["top_k"] = max(0, int(values["top_k"]))        # -1 (vLLM's "off") -> 0
        if getattr(req.sampling, "logit_bias", None):
            values["logit_bias"] = req.sampling.logit_bias
        if req.sampling.logprobs is not None:
            values["logprobs"] = req.sampling.logprobs
        if req.sampling.prompt_logprobs is not None:
            values["prompt_logprobs"] = req.sampling.prompt_logprobs
        values.update(max_new_tokens=prepared.max_tokens, ignore_eos=bool(req.ignore_eos))
        if req.sampling.min_tokens:                 # within what the context leaves (max_tokens is clamped so)
            values["min_tokens"] = min(req.sampling.min_tokens, prepared.max_tokens)
        if isinstance(req, ChatRequest) and req.tool_choice == "none" and req.tools and self.tool_call_id is not None:
            # the tools stay in the prompt (its cache), the call stays out of the output (api.md §6.9)
            values["banned_token_ids"] = (self.tool_call_id,)
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        grammar = self.output_grammar(req)
        if grammar is None:
            grammar = self._tool_grammar(prepared)
        if grammar is not None:
            values["grammar"] = grammar
            if prepared.start == "reasoning" and self.think_end_id is not None:
                values["grammar_after"] = (self.think_end_id,)      # reasoning is never constrained
        budget = getattr(req, "thinking_budget", None)
        if budget is not None and prepared.start == "reasoning" and "thinking_budget" in names \
                and self.think_end_id is not None:
            values.update(thinking_budget=int(budget), thinking_end_ids=(self.think_end_id,),
                          thinking_close_ids=self.thinking_close_ids)
        try:
            return SamplingParams(**{k: v for k, v in values.items() if k in names})
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise APIError(400, "invalid_request", str(e), param=name) from None

    # ---- generate ----------------------------------------------------------------------------------

    def submit(self, prepared: Prepared) -> None:
        """Optional: submit to the engine now, so that its refusals (429 queue full, 503 engine down) are
        HTTP errors raised before the response starts; generate() then runs this submission. Return the
        response through server.disconnect.Guarded(response, lambda: service.release(prepared)), so a
        response that never starts (client gone first) still cancels it."""
        from server.generation import submit

        submit(self, prepared)

    async def submit_async(self, prepared: Prepared) -> None:
        """submit() from a coroutine: a structured-output request's parser (up to ~1 s for a
        pathological grammar) is built on a worker thread, so the event loop serves on meanwhile."""
        from server.generation import submit_async

        await submit_async(self, prepared)

    def release(self, prepared: Prepared) -> None:
        """Cancel a submitted request that generate() never took over; a no-op otherwise."""
        from server.generation import release

        release(self, prepared)

    def generate(self, prepared: Prepared) -> AsyncIterator[Delta]:
        """Run the request; yield deltas, then one Finish. Closing the iterator early cancels the
        request in the engine. Errors after the start raise APIError (adapters send them in-band).
        (run's own async generator, not a wrapper around it: one hop less per delta.)"""
        from server.generation import run

        return run(self, prepared)

    async def complete(self, prepared: Prepared) -> Result:
        """generate() collected into one Result (non-streaming responses)."""
        from contextlib import aclosing

        reasoning, content, calls, finish = [], [], {}, None
        logprobs = [] if prepared.request.sampling.logprobs is not None else None
        prompt_logprobs = None
        async with aclosing(self.generate(prepared)) as deltas:
            async for d in deltas:
                if isinstance(d, PromptLogprobs):
                    prompt_logprobs = d.entries
                elif isinstance(d, TokenLogprobs):
                    if logprobs is not None:
                        logprobs += d.entries
                elif isinstance(d, ReasoningDelta):
                    reasoning.append(d.text)
                elif isinstance(d, ContentDelta):
                    content.append(d.text)
                elif isinstance(d, ToolCallStart):
                    calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
                elif isinstance(d, ToolCallArgs):
                    calls[d.index]["arguments"] += d.fragment
                elif isinstance(d, Finish):
                    finish = d
        return Result("".join(reasoning) or None, "".join(content) or None,
                      [calls[i] for i in sorted(calls)], finish, logprobs, prompt_logprobs)

    # ---- accounting (called by server.generation and server.app) -------------------------------------

    def _who(self, prepared: Prepared) -> dict[str, Any]:
        ctx = prepared.context
        return dict(request_id=prepared.request_id, client=ctx.client if ctx else None, api=prepared.request.api)

    def request_started(self, prepared: Prepared) -> None:
        with self._lock:
            self.in_flight += 1
        if self.request_log is None:
            return
        req, p = prepared.request, prepared.params
        fields: dict[str, Any] = dict(
            model=prepared.model, stream=req.stream, prompt_tokens=len(prepared.prompt_ids),
            max_tokens=prepared.max_tokens, requested_max_tokens=req.max_tokens, stop_strings=len(req.stop),
            sampling={k: getattr(p, k, None) for k in SAMPLING_KEYS + ("seed",)})
        if isinstance(req, ChatRequest):
            choice = req.tool_choice if isinstance(req.tool_choice, (str, type(None))) else "named"
            fields.update(thinking=prepared.start == "reasoning", thinking_budget=req.thinking_budget,
                          tools=len(req.tools or ()), tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
                          forced_call=bool(prepared.forced_prefix), messages=len(req.messages))
        if getattr(req, "grammar", None) is not None:
            # structured outputs: "not_applied" when the model may call a tool (Service.output_grammar)
            fields["output_format"] = "applied" if getattr(p, "grammar", None) else "not_applied"
        self.request_log.event("request_start", **self._who(prepared), **fields)

    def request_done(self, prepared: Prepared, finish: Finish) -> None:
        who = self._who(prepared)
        if self.metrics is not None:
            u, t = finish.usage, finish.timings
            self.metrics.request_finished(who["api"], who["client"], 200, u["prompt_tokens"], u["completion_tokens"],
                                          t.get("ttft_s"), t.get("e2e_s"), u.get("cached_tokens", 0) or 0)
            if finish.spec:
                self.metrics.spec_finished(finish.spec)
        if self.request_log is not None:
            extra = {"spec": spec_log_record(finish.spec)} if finish.spec else {}
            self.request_log.event("request_done", **who, status=200, finish_reason=finish.finish_reason,
                                   stop_string=finish.matched_stop is not None, **finish.usage,
                                   timings=finish.timings, parser_notes=finish.notes, **extra)

    def request_failed(self, prepared: Prepared, err: APIError, completion_tokens: int) -> None:
        who = self._who(prepared)
        if self.metrics is not None:
            self.metrics.request_finished(who["api"], who["client"], err.status, len(prepared.prompt_ids),
                                          completion_tokens, None, None)
        if self.request_log is not None:
            self.request_log.event("request_error", **who, status=err.status, kind=err.kind,
                                   message=err.message[:300], prompt_tokens=len(prepared.prompt_ids),
                                   completion_tokens=completion_tokens)

    def request_aborted(self, prepared: Prepared, completion_tokens: int) -> None:
        """The client went away (or the consumer closed the iterator) before the end: 499."""
        who = self._who(prepared)
        if self.metrics is not None:
            self.metrics.request_finished(who["api"], who["client"], 499, len(prepared.prompt_ids),
                                          completion_tokens, None, None)
        if self.request_log is not None:
            ctx = prepared.context
            self.request_log.event("request_done", **who, status=499, finish_reason="aborted",
                                   prompt_tokens=len(prepared.prompt_ids), completion_tokens=completion_tokens,
                                   timings=dict(e2e_s=time.monotonic() - ctx.received_at) if ctx else {})

    def request_closed(self, prepared: Prepared) -> None:
        with self._lock:
            self.in_flight -= 1

    def record_rejected(self, err: APIError, api: str | None = None) -> None:
        """Count and log a refusal, once per error: an engine refusal is recorded where it happens and
        then reaches the HTTP error handler, which records what reaches it."""
        if err.recorded:
            return
        err.recorded = True
        ctx = current_request.get()
        if self.metrics is not None:
            self.metrics.request_rejected(api or "other", ctx.client if ctx else None, err.status)
        if self.request_log is not None:
            self.request_log.event("request_rejected", request_id=ctx.request_id if ctx else None,
                                   client=ctx.client if ctx else None, path=ctx.path if ctx else None,
                                   api=api, status=err.status, kind=err.kind, param=err.param,
                                   message=err.message[:300])

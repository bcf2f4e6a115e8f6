"""The protocol-independent core of every generation API (INTERFACE; bodies to be implemented).

Each API module (openai_chat, completions, openai_responses, anthropic_messages, zmq_api) is a thin
adapter: it parses its own request shape into a ChatRequest or TextRequest, validates it with
`Service.prepare` (before any 200 is sent: template render, tokenization, context length), then
iterates `Service.generate` and formats the normalized Deltas into its own stream grammar or final
object. Everything protocol-neutral lives here: chat-template rendering with thinking options,
tokenization, max_tokens clamping, stop strings, submission to the runtime Engine, incremental
detokenization, the reasoning / tool-call parser (runtime.parsing), thinking budgets, cancellation
on client disconnect, usage and timings, the request log and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal


class APIError(Exception):
    """An error with an HTTP status and a protocol-neutral kind; adapters map it to their shape.

    kind: invalid_request | context_length_exceeded | not_found | authentication | too_large |
          rate_limited | overloaded | unavailable | timeout | internal
    """

    def __init__(self, status: int, kind: str, message: str, param: str | None = None,
                 retry_after_s: float | None = None, should_retry: bool | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param
        self.retry_after_s, self.should_retry = retry_after_s, should_retry


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


@dataclass
class ChatRequest:
    """A chat-style request after protocol parsing.

    messages: OpenAI-shaped list ({"role": system|user|assistant|tool, "content": str | parts,
    "reasoning_content"?, "tool_calls"? with arguments as dicts or JSON strings, "tool_call_id"?});
    adapters convert Anthropic / Responses inputs into this shape. tools: OpenAI-shaped function
    tools. thinking: None = model default; True/False explicit. thinking_budget: max reasoning tokens
    (then the close-of-thinking tokens are inserted without sampling).
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


@dataclass
class Prepared:
    """A validated request, ready to run: prompt ids, clamped budget, parser start state."""
    request: ChatRequest | TextRequest
    prompt_ids: list[int]
    max_tokens: int
    start: Literal["reasoning", "content"]
    request_id: str


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


@dataclass
class Finish:
    """Last delta. finish_reason: stop | length | tool_calls | cancelled; usage has prompt_tokens,
    completion_tokens, reasoning_tokens, cached_tokens; matched_stop: the stop string, if any."""
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float | None]
    matched_stop: str | None = None


Delta = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgs | ToolCallEnd | Finish


class Service:
    """Owns the Engine, the tokenizer and the model's identity; shared by all API adapters."""

    model_id: str
    max_context: int

    def prepare(self, request: ChatRequest | TextRequest) -> Prepared:
        """Render, tokenize, check the context, clamp max_tokens. Raises APIError (before any 200)."""
        raise NotImplementedError

    def count_tokens(self, request: ChatRequest) -> int:
        """Prompt tokens of a chat request as prepare() would build it."""
        raise NotImplementedError

    async def generate(self, prepared: Prepared) -> AsyncIterator[Delta]:
        """Run the request; yield deltas, then one Finish. Closing the iterator early cancels the
        request in the engine. Errors after the start raise APIError (adapters send them in-band)."""
        raise NotImplementedError
        yield  # pragma: no cover

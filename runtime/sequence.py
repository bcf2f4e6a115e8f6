"""One request's token state, budget and stop conditions (coordinator side; no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.sampling import SamplingParams


class Status(enum.IntEnum):
    """Order matters: everything from FINISHED on is terminal."""
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    CANCELLED = 3
    FAILED = 4


@dataclass
class Sequence:
    """Tokens of one request. ``computed`` tokens are in the ranks' KV / GDN state; the next step
    feeds ``tokens[computed:computed + n]``. A step that feeds the last known token samples one."""
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int                # params.max_new_tokens clamped to the context left
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    computed: int = 0
    status: Status = Status.WAITING
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    thinking: bool = False             # inside a budgeted reasoning section
    reasoning_tokens: int = 0
    drafts: list[int] = field(default_factory=list)    # speculation: MTP drafts for the next round
    spec: dict | None = None           # speculation statistics (SpecStats.as_dict layout)
    # params.logprobs set: the entries of tokens appended since the coordinator last took them, one per
    # token ([logprob, [[id, logprob], ...]], or None for a token inserted without sampling)
    new_logprobs: list | None = None
    # params.prompt_logprobs set: prompt entries (position 1 on) reported by the ranks, not yet in an event
    new_prompt_logprobs: list | None = None
    # params.grammar set: the parser that gives each sampled token's allowed ids (runtime.grammar.Constraint)
    constraint: Any = None
    # prefix cache (runtime/prefix_cache.py): prompt tokens taken from an entry (not computed), the
    # frontiers where this sequence leaves entries (ascending), whether its lookup was counted
    cached_tokens: int = 0
    save_at: list[int] = field(default_factory=list)
    cache_counted: bool = False

    def __post_init__(self) -> None:
        self.thinking = self.params.thinking_budget is not None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def unfed(self) -> int:
        """Known tokens not yet in the ranks' state (1 after a sample; more after forced tokens)."""
        return self.length - self.computed

    @property
    def done(self) -> bool:
        return self.status >= Status.FINISHED

    def token(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    def spec_record(self, k: int, drafted: int, accepted: int) -> None:
        """Count one speculation round: `drafted` draft columns, the first `accepted` of them kept."""
        if self.spec is None:
            self.spec = new_spec_stats(k)
        record_round(self.spec, drafted, accepted)


    def append(self, token: int) -> str | None:
        """Add a token; return the finish reason if the sequence is now complete."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.output.append(token)
        if token in self.stop_ids:
            return "stop"
        if len(self.output) >= self.max_new_tokens:
            return "length"
        return None

    def accept(self, sampled: int) -> tuple[list[int], str | None]:
        """Take a sampled token, applying the thinking budget: returns (tokens added, finish reason).

        Inside a budgeted reasoning section, a token that ends reasoning ends it; once the budget is
        spent, the sampled token is replaced by the close-of-thinking tokens (not sampled).
        """
        p = self.params
        tokens = [sampled]
        if self.thinking:
            if sampled in p.thinking_end_ids:
                self.thinking = False
            elif self.reasoning_tokens >= (p.thinking_budget or 0):
                tokens, self.thinking = list(p.thinking_close_ids), False
            else:
                self.reasoning_tokens += 1
        added = []
        for t in tokens:
            added.append(t)
            reason = self.append(t)
            if reason is not None:
                return added, reason
        return added, None


def new_spec_stats(k: int) -> dict:
    """Speculation statistics: rounds, draft tokens fed, drafts accepted, a histogram of accepted
    drafts per round (0..k), and per draft position how often it was fed and accepted."""
    return dict(rounds=0, drafted=0, accepted=0, accepted_hist=[0] * (k + 1), position_drafted=[0] * k,
                position_accepted=[0] * k)


def record_round(st: dict, drafted: int, accepted: int) -> None:
    """Add one round to statistics made by new_spec_stats."""
    st["rounds"] += 1
    st["drafted"] += drafted
    st["accepted"] += accepted
    st["accepted_hist"][accepted] += 1
    for i in range(drafted):
        st["position_drafted"][i] += 1
        st["position_accepted"][i] += int(i < accepted)

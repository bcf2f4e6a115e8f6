"""SamplingParams: what a request asks of the sampler, validated at the boundary.

The maths runs on the ranks (kernels.reference.sample and its CUDA twin); this module only holds
and checks the numbers, so the frontend and the coordinator can refuse bad values early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGIT_BIAS = 300               # entries of logit_bias (OpenAI's limit)
MAX_TOP_LOGPROBS = 20              # alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax, ties to the lower token id)."""
    temperature: float = 1.0
    top_k: int = 0                 # 0 = off
    top_p: float = 1.0             # 1 = off
    min_p: float = 0.0             # 0 = off
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0 # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt+output tokens
    seed: int | None = None
    max_new_tokens: int = 256
    # vLLM's min_tokens: the stop ids (EOS unless ignore_eos, stop_token_ids) are not sampled before this
    # many tokens are generated (the server also leaves stop strings unmatched in their text)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default=())
    banned_token_ids: tuple[int, ...] = field(default=())   # never sampled (e.g. <tool_call> for tool_choice none)
    # OpenAI logit_bias: (token id, bias in [-100, 100]) pairs, each bias added to that id's raw logit
    # before penalties, temperature and filters (as vLLM does); a dict {id: bias} is taken too
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    # logprobs: None = off; k (0..MAX_TOP_LOGPROBS) = each generated token's log-probability under the
    # model's raw distribution and its k most likely alternatives (runtime.engine.Event.logprobs)
    logprobs: int | None = None
    # prompt_logprobs: None = off; k = the log-probability of every prompt token after the first (given
    # the ones before it) and its k most likely alternatives (runtime.engine.Event.prompt_logprobs)
    prompt_logprobs: int | None = None
    # Thinking budget: after `thinking_budget` generated tokens without one of `thinking_end_ids`
    # (e.g. the id of "</think>"), the next token is replaced by `thinking_close_ids` (e.g. the ids of
    # "\n</think>\n\n"), inserted without sampling. None = no budget.
    thinking_budget: int | None = None
    thinking_end_ids: tuple[int, ...] = field(default=())
    thinking_close_ids: tuple[int, ...] = field(default=())
    # Structured outputs: an llguidance grammar (runtime.grammar.compile_format: the APIs' json_object /
    # json_schema formats) that every sampled token must follow, from the first token or, when
    # grammar_after is set, after the first of those ids in the output (e.g. "</think>": reasoning is
    # not constrained). Once the grammar is complete only end-of-sequence ids may follow.
    grammar: str | None = None
    grammar_after: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        # finite: an infinite temperature turns a masked (-inf) logit into NaN (grammar masks, bans)
        _check(0.0 <= self.temperature < math.inf, "temperature", self.temperature, ">= 0 and finite")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "an integer >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", self.repetition_penalty, "in (0, 10]")
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens",
               self.max_new_tokens, "an integer >= 1")
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool) and self.min_tokens >= 0,
               "min_tokens", self.min_tokens, "an integer >= 0")
        # the seed travels to the ranks in msgpack, whose integers are 64-bit
        _check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64), "seed", self.seed,
               "an integer in [-2**63, 2**64)")

        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.banned_token_ids),
               "banned_token_ids", self.banned_token_ids, "token ids (integers >= 0)")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            _check(k is None or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_TOP_LOGPROBS),
                   name, k, f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        _check(self.thinking_budget is None or (isinstance(self.thinking_budget, int) and self.thinking_budget >= 0),
               "thinking_budget", self.thinking_budget, "an integer >= 0")
        _check(self.grammar is None or (isinstance(self.grammar, str) and bool(self.grammar)), "grammar",
               self.grammar if not isinstance(self.grammar, str) else "''", "None or a grammar (runtime.grammar)")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.grammar_after),
               "grammar_after", self.grammar_after, "token ids (integers >= 0)")
        _check(self.thinking_budget is None or bool(self.thinking_close_ids), "thinking_close_ids",
               self.thinking_close_ids, "non-empty when thinking_budget is set")

    @property
    def has_penalties(self) -> bool:
        """Presence, frequency or repetition penalties (the samplers count every token they see)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, float bias) pairs; ValueError naming the field when malformed."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(t, v) for t, v in items]
    except (TypeError, ValueError):
        pairs = None
    ok = (pairs is not None and len(pairs) <= MAX_LOGIT_BIAS
          and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                  and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and -100 <= v <= 100
                  for t, v in pairs)
          and len({t for t, _ in pairs}) == len(pairs))
    _check(ok, "logit_bias", value if pairs is None or len(pairs) <= 8 else f"<{len(pairs)} entries>",
           f"at most {MAX_LOGIT_BIAS} distinct (token id >= 0, bias in [-100, 100]) pairs")
    return tuple(sorted((t, float(v)) for t, v in pairs))


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")

"""The prompt-prefix cache (coordinator side; bookkeeping only): a later request whose prompt begins
with an earlier prompt's first F + 1 tokens starts at position F, on the earlier request's KV pages and
a copy of its GDN state.

A hybrid model's state at position F is not just KV: every GDN layer holds a conv window and a
recurrent state that summarise the whole prefix. So an entry is a *frontier*: F, a multiple of the
page size CACHE_MARGIN or more tokens before the prompt's end (and, when the prompt branches off an
entry's tokens after a page or more, also the last page boundary before the branch); while a request
prefills, the ranks copy its slot's GDN state as it stands after token F - 1 into a snapshot slot
(`StepPlan.snapshot_saves`): mid-step where F falls inside a prefill chunk of more than
IN_STEP_SAVE_MIN_COLUMNS columns (`Batch.saves`: the GDN rule is split there), else the chunk is cut
at F and the copy follows that step; the entry keeps the F / PAGE_SIZE full KV pages of [0, F) (shared, by
reference count, with whoever else holds them) and the tokens [0, F] it stands for. A request whose
prompt matches an entry's tokens and is longer than F + 1 is admitted on those pages plus fresh ones,
its slot loaded from the snapshot before its first step (`StepPlan.snapshot_loads`), and prefills from
F: `cached_tokens` = F in its usage.

Why token F too, and why a margin: with MTP speculation the MTP layer's KV at position F - 1 is made
from token F (the MTP layer reads the next token), so an entry only serves prompts that agree up to
and including token F; and a chat's next turn re-renders the previous one's prompt up to its last few
tokens (the generation prompt, "<|im_start|>assistant\\n<think>\\n", is not how the history renders
the answer), so the frontier sits at least CACHE_MARGIN tokens before the prompt's end, where the next
turn still agrees. Agent loops that resend a growing conversation then prefill only what is new
since the last turn's frontier. The branch frontier serves conversations that share only a beginning
(a long system prompt and tool list): the second one computes it once more and leaves an entry at the
branch, and every later one starts there.

A request whose prompt a running prefill is about to serve further than any entry (the n > 1
copies of one request, the same prompt sent again before the first finished) waits in the queue
until that frontier is saved, then starts from it (Scheduler._coming), rather than compute the same
prefix alongside.

Entries are evicted least recently used: when a snapshot slot is needed for a new entry, and when
admission needs pages that only entries hold. Requests with prompt_logprobs take no hit (they need
every prompt position's logits) but may leave an entry.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from runtime.config import PAGE_SIZE

CACHE_MARGIN = 8           # the frontier sits at least this many tokens before the prompt's end


@dataclass
class Entry:
    frontier: int             # F: positions [0, F) are in the pages and the snapshot
    tokens: list[int]         # prompt[0 : F + 1]
    pages: list[int]          # the F // PAGE_SIZE KV pages of [0, F)
    snap: int                 # the ranks' snapshot slot
    used: int = 0             # last use (a counter, for LRU)
    hits: int = 0


@dataclass
class PrefixCache:
    """At most `capacity` entries (one snapshot slot each)."""
    capacity: int
    entries: list[Entry] = field(default_factory=list)
    free_snaps: list[int] = field(default_factory=list)
    _clock: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.free_snaps = list(range(self.capacity - 1, -1, -1))

    @staticmethod
    def frontier(prompt_len: int) -> int:
        """Where a prompt of this length would leave an entry (0: too short for one)."""
        return max(0, (prompt_len - 1 - CACHE_MARGIN) // PAGE_SIZE * PAGE_SIZE)

    def lookup(self, prompt: list[int]) -> Entry | None:
        """The entry with the furthest frontier whose tokens begin `prompt`, leaving at least one
        prompt token to compute after token F."""
        best = None
        for e in self.entries:
            if len(prompt) >= e.frontier + 2 and (best is None or e.frontier > best.frontier) \
                    and prompt[:e.frontier + 1] == e.tokens:
                best = e
        return best

    def branch(self, prompt: list[int]) -> int:
        """The frontier where `prompt` branches off the entries: the last page boundary F such that
        prompt and some entry's tokens agree on [0, F] (0 when none shares a page). Saving one there
        lets later prompts that share only that part (a system prompt and tools, say) start from it."""
        common = max((_common_prefix(prompt, e.tokens) for e in self.entries), default=0)
        return max(0, (common - 1) // PAGE_SIZE * PAGE_SIZE)

    def touch(self, e: Entry, hit: bool = False) -> None:
        e.used = next(self._clock)
        e.hits += hit

    def find(self, tokens: list[int]) -> Entry | None:
        """The entry standing for exactly these tokens (a frontier already saved)."""
        return next((e for e in self.entries if e.frontier + 1 == len(tokens) and e.tokens == tokens), None)

    def lru(self, keep: Entry | None = None) -> Entry | None:
        candidates = [e for e in self.entries if e is not keep]
        return min(candidates, key=lambda e: e.used) if candidates else None

    def remove(self, e: Entry) -> None:
        self.entries.remove(e)
        self.free_snaps.append(e.snap)

    def add(self, frontier: int, tokens: list[int], pages: list[int], snap: int) -> Entry:
        e = Entry(frontier, tokens, pages, snap)
        self.touch(e)
        self.entries.append(e)
        return e


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of a and b (list slices compare at C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n                       # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo

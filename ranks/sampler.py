"""Sampling after the vocabulary-split head, on every rank, with rank 0's answer reported.

Each rank holds logits for its vocabulary shard [S, V/N]. Every sampler is written as a Gumbel-max:
``token = argmax_v (score_v + G_v)`` with ``score = log p`` of the filtered, tempered distribution
and Gumbel noise G keyed by (seed, position, purpose), never by batch composition, so the same seed
and prompt give the same text whatever else is running. The noise is a counter-based hash of (key,
token id) in torch integer ops (`keyed_uniforms`): computed on the device that holds the logits
(no host work per sampled row on a GPU rank), only for the ids a rank needs, with the same bits on
every device. Greedy is the same argmax
without noise. Where the score of a token depends only on its own logit (greedy, plain temperature,
penalties), each rank takes the argmax over its shard and the ranks exchange one (value, index)
candidate per row; on a GPU all such rows of a step go through one batch of device operations (the
noise of every row at once: `gumbel_rows`) and one copy to the host. top-k / top-p / min-p need the whole
distribution, so those rows gather the logits first, one row at a time. Ties go to the lower token id.

Penalties follow the common server semantics: repetition (divide positive logits, multiply
negative ones) over prompt and output tokens; presence and frequency (subtract) over output tokens.
A logit_bias (OpenAI's) is added to the raw logits before them, as vLLM does; greedy rows see it too.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from runtime.grammar import mask_shard
from runtime.sampling import MAX_TOP_LOGPROBS

Tensor = torch.Tensor
Gather = Callable[[Tensor], Tensor]          # [*shape] -> [N, *shape] (row r = rank r's tensor)

PURPOSE_SAMPLE = 0        # the token drawn at a position (plain steps, bonus tokens)
PURPOSE_ACCEPT = 1        # speculation: the uniform that accepts or rejects a draft
PURPOSE_RESIDUAL = 2      # speculation: the draw from the residual distribution after a rejection


@dataclass
class SeqSampler:
    """One sequence's sampling parameters and the token counts its penalties need."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    prompt_len: int = 0
    seen: dict[int, int] = field(default_factory=dict)       # token -> count in prompt + output
    output: dict[int, int] = field(default_factory=dict)     # token -> count in output
    banned: tuple[int, ...] = ()                             # ids never sampled (their logits -> -inf)
    bias: tuple[tuple[int, float], ...] = ()                 # (id, value): logit_bias, added to the raw logit
    logprobs: int = -1                                       # -1: none; k >= 0: the token's logprob + k alternatives
    prompt_logprobs: int = -1                                # the same for every prompt token after the first
    allow: bytes | None = None                               # structured outputs: this step's allowed ids (bitmask)

    def __post_init__(self) -> None:
        self.banned = tuple(int(t) for t in self.banned)     # msgpack brings a list
        self.bias = tuple((int(t), float(v)) for t, v in (self.bias.items() if isinstance(self.bias, dict)
                                                          else self.bias))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def needs_full_distribution(self) -> bool:
        return not self.greedy and (0 < self.top_k or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether apply_penalties changes this sequence's logits (penalties with counts, banned ids, a bias)."""
        return (self.has_penalties and bool(self.seen)) or bool(self.banned) or bool(self.bias) \
            or self.allow is not None

    def observe(self, tokens: list[int], first_position: int) -> None:
        """Count the input tokens of one step (positions from first_position on)."""
        if not self.has_penalties:
            return
        for i, t in enumerate(tokens):
            self.seen[t] = self.seen.get(t, 0) + 1
            if first_position + i >= self.prompt_len:
                self.output[t] = self.output.get(t, 0) + 1


def _key(seed: int, position: int, purpose: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{position}:{purpose}".encode(), digest_size=8).digest(), "little")


def _generator(seed: int, position: int, purpose: int) -> torch.Generator:
    return torch.Generator().manual_seed(_key(seed, position, purpose) & (2**63 - 1))


_M32 = 0xFFFF_FFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35       # MurmurHash3's 32-bit finaliser constants


def _mul32(h: Tensor, c: int) -> Tensor:
    """(h * c) mod 2**32 for int64 h in [0, 2**32), in halves so no product leaves int64."""
    return (h * (c & 0xFFFF) + ((h * (c >> 16)) & 0xFFFF) * 65536) & _M32


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection of [0, 2**32) that mixes every bit into every bit),
    on int64 tensors holding 32-bit values (any device)."""
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    """The same finaliser on numpy uint32 (wrapping arithmetic): the fast path for CPU tensors."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(_C1)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(_C2)
    return h ^ (h >> np.uint32(16))


def keyed_uniforms(seed: int, position: int, purpose: int, lo: int, hi: int,
                   device: torch.device | str = "cpu") -> Tensor:
    """U(0, 1) float64 draws for token ids lo .. hi-1, keyed by (seed, position, purpose): a counter-based
    hash of (key, counter), two 32-bit counters per id (27 + 26 = 53 bits), three keyed rounds of
    MurmurHash3's finaliser. Any slice of the vocabulary is computed on its own, on any device, with
    the same bits everywhere: a rank's shard needs only its slice, and a GPU rank draws on its GPU
    with no host work (torch int64 ops there, numpy uint32 ones on the CPU)."""
    key = _key(seed, position, purpose)
    if torch.device(device).type == "cpu":
        return _uniforms_np(key, lo, hi)
    return _uniforms_torch(key, lo, hi, device)


def _uniforms_np(key: int, lo: int, hi: int) -> Tensor:
    k0, k1 = np.uint32(key & _M32), np.uint32(key >> 32)
    with np.errstate(over="ignore"):
        c = (np.arange(2 * lo, 2 * hi, dtype=np.uint64) & np.uint64(_M32)).astype(np.uint32)
        h = _fmix32_np(_fmix32_np(_fmix32_np(c ^ k0) + k1) ^ k0).astype(np.uint64)
    bits = ((h[0::2] >> np.uint64(5)) << np.uint64(26)) + (h[1::2] >> np.uint64(6))
    return (torch.from_numpy(bits.astype(np.float64)) + 0.5) * 2.0 ** -53


def _uniforms_torch(key: int, lo: int, hi: int, device: torch.device | str) -> Tensor:
    return _uniforms_torch_rows([key], lo, hi, device)[0]


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A small host list as a tensor on `device` without waiting for it: through pinned memory on a
    GPU (a copy from pageable memory synchronises the stream, which device-fed steps must not)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _uniforms_torch_rows(keys: list[int], lo: int, hi: int, device: torch.device | str) -> Tensor:
    """The torch form of the hash for several keys at once: [len(keys), hi - lo], row r the bits of
    keys[r] (int64 ops holding 32-bit values, broadcast over the rows)."""
    k0 = to_device([k & _M32 for k in keys], torch.int64, device)[:, None]
    k1 = to_device([k >> 32 for k in keys], torch.int64, device)[:, None]
    c = (torch.arange(2 * lo, 2 * hi, dtype=torch.int64, device=device) & _M32)[None, :]
    h = _fmix32(_fmix32((_fmix32(c ^ k0) + k1) & _M32) ^ k0).view(len(keys), -1, 2)
    return (((h[..., 0] >> 5) * 67108864 + (h[..., 1] >> 6)).double() + 0.5) * 2.0 ** -53


def gumbel_rows(seeds: list[int], positions: list[int], lo: int, hi: int, device: torch.device | str = "cpu",
                purpose: int = PURPOSE_SAMPLE) -> Tensor:
    """[R, hi - lo] Gumbel noise, row r = gumbel_noise(seeds[r], positions[r], hi, device, purpose, lo=lo)
    bit for bit, in one batch of device operations on a GPU (one pass of numpy per row on the CPU)."""
    keys = [_key(s, p, purpose) for s, p in zip(seeds, positions)]
    if torch.device(device).type == "cpu":
        u = torch.stack([_uniforms_np(k, lo, hi) for k in keys]) if keys else torch.empty(0, hi - lo,
                                                                                           dtype=torch.float64)
    else:
        u = _uniforms_torch_rows(keys, lo, hi, device)
    return -torch.log(-torch.log(u.clamp_(1e-300, 1.0 - 1e-16)))


def gumbel_noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu",
                 purpose: int = PURPOSE_SAMPLE, lo: int = 0) -> Tensor:
    """Gumbel(0, 1) noise for token ids lo .. vocab-1 (all of them by default), keyed by (seed,
    position, purpose): the same on every rank, batch and device, computed where it is used."""
    u = keyed_uniforms(seed, position, purpose, lo, vocab, device).clamp_(1e-300, 1.0 - 1e-16)
    return -torch.log(-torch.log(u))


def keyed_uniform(seed: int, position: int, purpose: int = PURPOSE_ACCEPT) -> float:
    """One U(0, 1) draw keyed by (seed, position, purpose)."""
    return float(torch.rand(1, generator=_generator(seed, position, purpose), dtype=torch.float64))


def apply_penalties(logits: Tensor, s: SeqSampler, offset: int) -> Tensor:
    """Penalised copy of one row of logits for the shard that starts at token id `offset`: the
    logit_bias is added to the raw logits first (as vLLM does), banned ids and (structured outputs)
    the ids outside the step's grammar mask get -inf, then the repetition, presence and frequency
    penalties act on the biased logits."""
    if not s.adjusts_logits:
        return logits
    out = logits.clone()
    n = out.shape[-1]
    if s.allow is not None:
        keep = torch.from_numpy(mask_shard(s.allow, offset, n))
        if out.device.type == "cuda":                # pinned, so the copy does not wait for the stream
            keep = keep.pin_memory().to(out.device, non_blocking=True)
        out.masked_fill_(~keep, float("-inf"))
    if s.bias:
        pairs = [(t - offset, v) for t, v in s.bias if offset <= t < offset + n]
        if pairs:                        # index_add_ with device tensors: no host synchronisation
            out.index_add_(0, to_device([p[0] for p in pairs], torch.long, out.device),
                           to_device([p[1] for p in pairs], out.dtype, out.device))
    if s.banned:
        ids = [t - offset for t in s.banned if offset <= t < offset + n]
        if ids:
            # index_fill_, not out[ids] = -inf: a Python scalar put through an index is copied to the
            # device from pageable memory, which waits for the stream
            out.index_fill_(0, to_device(ids, torch.long, out.device), float("-inf"))
    if not s.has_penalties or not s.seen:
        return out
    if s.repetition_penalty != 1.0:
        ids = to_device([t - offset for t in s.seen if offset <= t < offset + n], torch.long, out.device)
        if ids.numel():
            v = out[ids]
            out[ids] = torch.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
    if s.output and (s.presence_penalty or s.frequency_penalty):
        pairs = [(t - offset, c) for t, c in s.output.items() if offset <= t < offset + n]
        if pairs:
            ids = to_device([p[0] for p in pairs], torch.long, out.device)
            counts = to_device([p[1] for p in pairs], out.dtype, out.device)
            out[ids] -= s.presence_penalty + s.frequency_penalty * counts
    return out


def filtered_log_probs(logits: Tensor, s: SeqSampler) -> Tensor:
    """log p of the tempered distribution after top-k, top-p and min-p (-inf outside). logits [V]."""
    x = logits.double() / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    if s.top_p < 1.0:
        sorted_lp, order = torch.sort(logp, descending=True)
        before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()       # mass strictly before each token
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= s.top_p)
        logp = logp.masked_fill(drop, float("-inf"))
    if s.min_p > 0.0:
        logp = logp.masked_fill(logp < logp.max() + torch.log(torch.tensor(s.min_p, dtype=logp.dtype)),
                                float("-inf"))
    return logp


class NonFiniteLogits(FloatingPointError):
    """The model produced NaN logits (a broken checkpoint or a numerical fault): no token can be chosen."""


def _nan_row(row: int) -> NonFiniteLogits:
    return NonFiniteLogits(f"the model produced NaN logits (batch row {row}): no token can be sampled; check the "
                           "checkpoint's weights for NaN / inf values")


def _argmax_lowest(values: Tensor) -> int:
    """Index of the maximum, ties to the lower index (torch.argmax returns the first maximum)."""
    return int(torch.argmax(values))


def local_candidates(logits: Tensor, samplers: list[SeqSampler], positions: list[int], rows: list[int], offset: int,
                     batched: bool | None = None, on_host: bool = True) -> Tensor:
    """[L, 2] float32 on the CPU: (score, offset + index) of the best token of each of `rows` in this
    shard, the score float32(penalised logits / T + Gumbel(seed, position)) (greedy: no noise), ties to
    the lower index (a NaN counts as the maximum). samplers / positions: one per row. on_host=False
    (batched only): left on the logits' device, no host synchronisation (device-fed steps).

    batched (default: the logits are on a GPU): every row in one batch of device operations (each
    row's noise at once: gumbel_rows) and one copy to the host, instead of a few launches and two host
    syncs per row; on the CPU the row-at-a-time loop is the faster (measured at 248k ids: 3.4 against
    8.1 ms for 8 greedy rows), with the same results bit for bit."""
    n = logits.shape[-1]
    if batched is None:
        batched = logits.device.type != "cpu"
    if not batched:
        cand = torch.empty(len(rows), 2, dtype=torch.float32)
        for j, (i, s) in enumerate(zip(rows, samplers)):
            row = apply_penalties(logits[i].double(), s, offset)
            if not s.greedy:
                row = row / s.temperature + gumbel_noise(s.seed, positions[j], offset + n, row.device, lo=offset)
            row = row.float()            # the exchange carries float32: decide on float32 at any tp
            k = _argmax_lowest(row)
            cand[j, 0], cand[j, 1] = row[k], offset + k
        return cand
    x = take_rows(logits, rows).double()
    for j, s in enumerate(samplers):
        if s.adjusts_logits:
            x[j] = apply_penalties(x[j], s, offset)
    hot = [j for j, s in enumerate(samplers) if not s.greedy]
    if hot:
        temps = to_device([samplers[j].temperature for j in hot], torch.float64, x.device)
        noise = gumbel_rows([samplers[j].seed for j in hot], [positions[j] for j in hot], offset, offset + n, x.device)
        if len(hot) == len(rows):
            x.div_(temps[:, None]).add_(noise)
        else:
            at = to_device(hot, torch.int64, x.device)
            x.index_copy_(0, at, x.index_select(0, at) / temps[:, None] + noise)
    score = x.float()                    # the exchange carries float32: decide on float32 at any tp
    k = torch.argmax(score, dim=-1)      # the first maximum: ties to the lower index (a NaN counts as one)
    cand = torch.stack([score.gather(-1, k[:, None])[:, 0], (k + offset).float()], dim=1)
    return cand.cpu() if on_host else cand


def merge_on_device(cand: Tensor, rank: int, tp: int, all_reduce: Callable[[Tensor], Tensor]) -> Tensor:
    """Every rank's candidates [L, 2] (local_candidates) -> [L, 2] float32 (best score, token id), the
    same on every rank and on the candidates' device, with no host synchronisation: each rank puts
    its candidates in its own slot of an otherwise zero [tp, L, 2] buffer and one all-reduce (a sum:
    x + 0 = x exactly, ids < 2**24 exact in float32) hands every rank all of them; the largest score
    wins, ties to the lower id: what sample_rows decides on the host. A NaN score leaves the id
    +inf (the caller checks the score). Collective (tp > 1)."""
    if tp == 1:
        return cand
    buf = cand.new_zeros((tp, *cand.shape))
    buf[rank] = cand
    return torch.stack(merge_slots(all_reduce(buf.view(-1)).view(buf.shape)), dim=1)


def merge_slots(allc: Tensor) -> tuple[Tensor, Tensor]:
    """Every rank's (score, id) candidates [tp, L, 2] -> (best score [L], its id [L], float32): the
    largest score, ties to the lower id (a NaN best leaves the id +inf)."""
    vals, ids = allc[..., 0], allc[..., 1]
    best = vals.max(0).values
    return best, torch.where(vals == best, ids, torch.full_like(ids, float("inf"))).min(0).values


def take_rows(t: Tensor, rows: list[int]) -> Tensor:
    """t[rows] without waiting for the device: no index when the rows are all of t's in order (a decode
    step), else an index tensor through pinned memory (a Python list index copies from pageable memory,
    which synchronises the stream)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, to_device(rows, torch.int64, t.device))


def sample_rows(logits: Tensor, samplers: list[SeqSampler], positions: list[int], *, rank: int, tp: int,
                gather: Gather) -> list[int]:
    """One token per row. logits [S, V/N] (this rank's shard), positions [S] of the sampled token.

    Collective: every rank must call it with the same rows in the same order.
    """
    S, n = logits.shape
    offset = rank * n
    tokens: list[int] = [0] * S
    # 1) rows whose score is per-token: local candidate (value, global index), then one exchange
    local = [i for i in range(S) if not samplers[i].needs_full_distribution]
    if local:
        cand = local_candidates(logits, [samplers[i] for i in local], [positions[i] for i in local], local, offset)
        allc = gather(cand) if tp > 1 else cand[None]                 # [N, L, 2]
        for j, i in enumerate(local):
            vals, ids = allc[:, j, 0], allc[:, j, 1]
            best = vals.max()
            if torch.isnan(best):                      # argmax picks a NaN; it equals nothing
                raise _nan_row(i)
            tokens[i] = int(ids[vals == best].min())
    # 2) rows that need the whole distribution: gather the (penalised) logits
    full = [i for i in range(S) if samplers[i].needs_full_distribution]
    if full:
        mine = torch.stack([apply_penalties(logits[i].double(), samplers[i], offset) for i in full]).float()
        # gathered rows come back to the logits' device: filtering a 248k-id row sorts it (a GPU's job)
        rows = gather(mine).to(mine.device) if tp > 1 else mine[None]          # [N, F, n]
        rows = rows.permute(1, 0, 2).reshape(len(full), -1)             # [F, V]
        for j, i in enumerate(full):
            s = samplers[i]
            score = filtered_log_probs(rows[j], s) + gumbel_noise(s.seed, positions[i], rows.shape[-1], rows.device)
            k = _argmax_lowest(score)
            if torch.isnan(score[k]):
                raise _nan_row(i)
            tokens[i] = k
    return tokens


# --------------------------------------------------------------------------------------------------
# Speculative decoding (MTP drafts): collectives and the acceptance rule


def argmax_rows(logits: Tensor, *, rank: int, tp: int, gather: Gather) -> list[int]:
    """Plain argmax per row over the whole vocabulary, ties to the lower id; one (value, index)
    candidate per row crosses the exchange (the MTP drafts). Collective."""
    if logits.shape[0] == 0:
        return []
    return sample_rows(logits, [SeqSampler(temperature=0.0)] * logits.shape[0], [0] * logits.shape[0],
                       rank=rank, tp=tp, gather=gather)


def gather_log_probs(logits: Tensor, samplers: list[SeqSampler], *, rank: int, tp: int,
                     gather: Gather) -> Tensor:
    """log p [S, V] (float64) of each row's target distribution (penalties, temperature, top-k,
    top-p, min-p) from the vocabulary shards [S, V/N]: the logits are gathered (float32, as the
    plain sampler does), so every rank gets the same rows. Collective."""
    S, n = logits.shape
    offset = rank * n
    mine = torch.stack([apply_penalties(logits[i].double(), samplers[i], offset) for i in range(S)]).float()
    rows = gather(mine).to(mine.device) if tp > 1 else mine[None]
    rows = rows.permute(1, 0, 2).reshape(S, -1)
    return torch.stack([filtered_log_probs(rows[i], samplers[i]) for i in range(S)])


def with_tokens(s: SeqSampler, tokens: list[int], first_position: int) -> SeqSampler:
    """The sampler as it would be after observing `tokens` (a copy when penalties need counts: every
    field carried over, the counts copied)."""
    if not s.has_penalties or not tokens:
        return s
    c = dataclasses.replace(s, seen=dict(s.seen), output=dict(s.output))
    c.observe(tokens, first_position)
    return c


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """Longest prefix of drafts equal to the target argmax, plus the target's correction / bonus.
    targets [n+1]: the argmax after each verification column; drafts [n]."""
    out = []
    for i, d in enumerate(drafts):
        if d != targets[i]:
            break
        out.append(d)
    out.append(targets[len(out)])
    return out


def accept_sampled(logp: Tensor, drafts: list[int], seed: int, positions: list[int]) -> list[int]:
    """Speculative sampling with point-mass drafts (argmax proposals, q = one-hot at d).

    logp [n+1, V] target log-probs after each verification column; positions[i] is the position of
    the token column i decides. Draft d at column i is accepted with probability min(1, p(d)/q(d)) =
    p(d) (uniform keyed by (seed, position, ACCEPT)); on rejection the token is drawn from the
    normalised max(p - q, 0) = p with d removed (Gumbel keyed by (seed, position, RESIDUAL)); when
    every draft is accepted the bonus is drawn from the last column's p (keyed like a plain step).
    Each emitted token is therefore distributed exactly as p given the accepted prefix.
    """
    V = logp.shape[-1]
    logp = logp.double()
    logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)    # top-k/p and min-p leave rows unnormalised
    out = []
    for i, d in enumerate(drafts):
        p_d = float(logp[i, d].exp())
        if keyed_uniform(seed, positions[i], PURPOSE_ACCEPT) < p_d:
            out.append(d)
            continue
        rest = logp[i].clone()
        rest[d] = float("-inf")
        if not bool(torch.isfinite(rest).any()):                  # p(d) = 1 up to rounding
            out.append(d)
            continue
        score = rest + gumbel_noise(seed, positions[i], V, logp.device, purpose=PURPOSE_RESIDUAL)
        out.append(_argmax_lowest(score))
        return out
    n = len(drafts)
    out.append(_argmax_lowest(logp[n] + gumbel_noise(seed, positions[n], V, logp.device)))
    return out


# --------------------------------------------------------------------------------------------------
# Log-probabilities of the chosen tokens (the APIs' logprobs / top_logprobs)

def token_logprobs(logits: Tensor, tokens: list[int], tops: list[int], *, rank: int, tp: int,
                   gather: Gather) -> list[list]:
    """The log-probability of each row's chosen token and its `tops[r]` most likely alternatives, under
    the model's own distribution (log_softmax of the raw logits: before penalties, logit_bias,
    temperature and filters, as vLLM reports them by default). logits [R, V/N] this rank's shard.

    Each rank sends, per row, its shard's logsumexp, the chosen token's logit (-inf when the id is
    another rank's) and its shard's top max(tops) (logit, id) pairs, float32, in one exchange; the
    merge (float64) is the same on every rank. Returns per row [logprob, [[id, logprob], ...]], the
    alternatives by decreasing logprob, equal values by id (which of several ids tied at the k-th
    value make the list is torch.topk's choice on each shard). Collective."""
    R, n = logits.shape
    if R == 0:
        return []
    offset = rank * n
    K = max(1, min(max(tops), MAX_TOP_LOGPROBS, n))
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)                                             # [R]
    local = [t - offset if offset <= t < offset + n else -1 for t in tokens]
    idx = to_device([max(i, 0) for i in local], torch.int64, x.device)
    chosen = x.gather(1, idx[:, None])[:, 0]
    mine = to_device([i >= 0 for i in local], torch.bool, x.device)
    chosen = torch.where(mine, chosen, torch.full_like(chosen, float("-inf")))
    top = torch.topk(x, K, dim=-1)
    pack = torch.cat([lse[:, None], chosen[:, None], top.values, (top.indices + offset).float()], dim=1)
    allp = (gather(pack) if tp > 1 else pack[None]).double().cpu()                # [N, R, 2 + 2K]
    total = torch.logsumexp(allp[:, :, 0], dim=0)                                # [R]
    best = allp[:, :, 1].max(0).values
    out = []
    for r in range(R):
        vals = allp[:, r, 2:2 + K].reshape(-1).tolist()
        ids = allp[:, r, 2 + K:].reshape(-1).tolist()
        z = float(total[r])
        order = sorted(range(len(vals)), key=lambda j: (-vals[j], ids[j]))[:tops[r]]
        out.append([float(best[r]) - z, [[int(ids[j]), vals[j] - z] for j in order]])
    return out

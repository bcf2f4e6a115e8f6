"""ranks.sampler: the Gumbel-max sampler against independent float64 formulas.

* Distribution: sample_rows on one fixed logits row with 20,000 different (seed, position) keys
  draws from softmax(logits / T) truncated by top-k / top-p / min-p and renormalised, computed
  here in numpy float64 without the sampler's code; checked with a chi-square test (p > 1e-4) and
  an exact support check, at tp 1 and at a simulated tp 2 (two threads, each with its vocabulary
  shard, and a gather that stacks the shards), whose draws must equal tp 1's token for token.
* Greedy is the exact argmax, ties to the lower id (also across shards).
* top-p keeps the smallest prefix whose mass reaches p; min-p keeps p >= min_p * p_max.
* Penalties (repetition over prompt + output, presence / frequency over output) against values
  computed by hand, on a whole row and on shards.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from ranks.sampler import SeqSampler, apply_penalties, filtered_log_probs, gumbel_noise, sample_rows

try:                                    # scipy is not a test dependency: fall back to the formulas below
    from scipy import stats
except ImportError:                     # pragma: no cover - depends on the environment
    stats = None

V = 64
DRAWS = 20_000
P_MIN = 1e-4


# --------------------------------------------------------------------------------------------------
# Helpers


def expected_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> np.ndarray:
    """The intended distribution in float64: softmax(l / T), then top-k, top-p and min-p, renormalised."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if 0 < top_k < p.size:
        keep[np.argsort(-p, kind="stable")[top_k:]] = False
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        n = int(np.searchsorted(cum, top_p) + 1)          # smallest prefix whose mass reaches top_p
        drop = order[n:]
        p[drop] = 0.0
        p /= p.sum()
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def chi2_sf(x: float, dof: int) -> float:
    """P(chi-square(dof) >= x) = Q(dof / 2, x / 2), the regularized upper incomplete gamma function
    (series below a + 1, Lentz's continued fraction above; Numerical Recipes 6.2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_front = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1:
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-16 and n < 10_000:
            n += 1
            term *= z / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def ks_pvalue(sample: np.ndarray, cdf) -> float:
    """One-sample Kolmogorov-Smirnov p-value (asymptotic Kolmogorov distribution, Stephens' correction)."""
    x = np.sort(sample)
    n = x.size
    f = cdf(x)
    d = max(float((np.arange(1, n + 1) / n - f).max()), float((f - np.arange(n) / n).max()))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, p))


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square over the support, bins with expected count < 5 pooled together."""
    n = counts.sum()
    support = probs > 0
    exp, obs = probs[support] * n, counts[support]
    big = exp >= 5
    e, o = list(exp[big]), list(obs[big])
    if (~big).any():
        e.append(exp[~big].sum()), o.append(obs[~big].sum())
        if e[-1] < 5 and len(e) > 2:                   # fold a thin remainder into the smallest bin
            i = int(np.argmin(e[:-1]))
            e[i] += e.pop()
            o[i] += o.pop()
    o, e = np.array(o, dtype=float), np.array(e, dtype=float)
    if stats is not None:
        return float(stats.chisquare(o, e).pvalue)
    return chi2_sf(float(((o - e) ** 2 / e).sum()), len(e) - 1)


class StackGather:
    """A gather for `tp` threads: every rank gets [tp, *shape] with row r from rank r."""

    def __init__(self, tp: int):
        self.tp, self.parts, self.barrier = tp, [None] * tp, threading.Barrier(tp, timeout=120)

    def for_rank(self, r: int):
        def gather(t: torch.Tensor) -> torch.Tensor:
            self.parts[r] = t.clone()
            self.barrier.wait()
            out = torch.stack(self.parts)
            self.barrier.wait()
            return out
        return gather


def on_ranks(tp: int, fn) -> list:
    """fn(r, gather) on `tp` simulated ranks (threads) sharing a StackGather; every rank's result."""
    g = StackGather(tp)
    out: list = [None] * tp
    errors: list = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r, g.for_rank(r))
        except BaseException as e:       # pragma: no cover - reported below
            errors.append(e)
            g.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def sample_tp(logits: torch.Tensor, make_samplers, positions: list[int], tp: int) -> list[list[int]]:
    """sample_rows on `tp` simulated ranks (threads), each with its vocabulary shard; every rank's tokens."""
    if tp == 1:
        return [sample_rows(logits, make_samplers(), positions, rank=0, tp=1, gather=None)]
    n = logits.shape[1] // tp
    return on_ranks(tp, lambda r, gather: sample_rows(logits[:, r * n:(r + 1) * n].contiguous(), make_samplers(),
                                                      positions, rank=r, tp=tp, gather=gather))


def fixed_row(seed: int) -> torch.Tensor:
    """A logits row with a spread-out distribution (evenly spaced values, jittered and shuffled:
    no ties, and every filter below keeps several tokens whatever the seed)."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.linspace(3.0, -3.0, V, dtype=torch.float64) + 0.03 * torch.randn(V, generator=gen, dtype=torch.float64)
    return row[torch.randperm(V, generator=gen)].float()


def keys(seed: int, n: int) -> tuple[list[int], list[int]]:
    """n distinct (seed, position) keys: seeds and positions both vary."""
    seeds = [seed * 1000 + i // 8 for i in range(n)]
    positions = [(i % 8) * 131 + (i // 8) % 5 for i in range(n)]
    return seeds, positions


# --------------------------------------------------------------------------------------------------
# Distribution


CASES = [
    dict(temperature=0.6),                           # per-token path: local candidates, one exchange
    dict(temperature=1.3, top_k=7),                  # full-distribution path from here on
    dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.0, min_p=0.08),
    dict(temperature=1.2, top_k=20, top_p=0.9, min_p=0.02),
]
# tp 2 runs in two threads under one GIL (twice the cost of tp 1): all keys for the combined case,
# the first TP2_SUBSET keys (token-for-token equal to tp 1, hence the same distribution) for the others
TP2_SUBSET = 5000


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampling_draws_from_the_intended_distribution(case, seed):
    row = fixed_row(seed)
    probs = expected_probs(row.numpy(), case["temperature"], case.get("top_k", 0), case.get("top_p", 1.0),
                           case.get("min_p", 0.0))
    assert (probs > 0).sum() >= 3, "degenerate case: too few tokens survive to test a distribution"
    seeds, positions = keys(seed, DRAWS)
    logits = row.expand(DRAWS, V).contiguous()

    def make():
        return [SeqSampler(seed=s, **case) for s in seeds]

    tp1 = sample_tp(logits, make, positions, 1)[0]
    counts = np.bincount(tp1, minlength=V)
    outside = np.flatnonzero((counts > 0) & (probs == 0))
    assert outside.size == 0, f"drew tokens {outside.tolist()} that the filters remove"
    pv = chi_square_pvalue(counts, probs)
    assert pv > P_MIN, f"{case}: chi-square p-value {pv:.2e} (observed {counts[probs > 0].tolist()}, " \
                       f"expected {(probs[probs > 0] * DRAWS).round(1).tolist()})"

    m = DRAWS if case is CASES[-1] else TP2_SUBSET
    ranks = sample_tp(logits[:m], lambda: make()[:m], positions[:m], 2)
    assert ranks[0] == ranks[1], "the two ranks disagree"
    assert ranks[0] == tp1[:m], "tp 2 draws differ from tp 1 for the same (seed, position) keys"
    if m == DRAWS:
        pv2 = chi_square_pvalue(np.bincount(ranks[0], minlength=V), probs)
        assert pv2 > P_MIN, f"{case}: tp 2 chi-square p-value {pv2:.2e}"


def test_draws_depend_only_on_seed_and_position(seed):
    """The same key gives the same token whatever the row order or the rest of the batch."""
    row = fixed_row(seed)
    n = 200
    seeds, positions = keys(seed, n)
    case = dict(temperature=1.0, top_p=0.95)
    logits = row.expand(n, V).contiguous()
    a = sample_rows(logits, [SeqSampler(seed=s, **case) for s in seeds], positions, rank=0, tp=1, gather=None)
    perm = np.random.default_rng(seed).permutation(n)
    b = sample_rows(logits, [SeqSampler(seed=seeds[i], **case) for i in perm], [positions[i] for i in perm], rank=0,
                    tp=1, gather=None)
    assert [a[i] for i in perm] == b
    # mixed batches: greedy and other filters next to it change nothing
    mixed = [SeqSampler(seed=s, **case) if i % 2 else SeqSampler(temperature=0.0) for i, s in enumerate(seeds)]
    c = sample_rows(logits, mixed, positions, rank=0, tp=1, gather=None)
    assert [c[i] for i in range(1, n, 2)] == [a[i] for i in range(1, n, 2)]
    assert len(set(a)) > 5, "different keys must give different draws"


def test_gumbel_noise_is_keyed_and_standard(seed):
    g = gumbel_noise(seed, 5, 50_000)
    assert torch.equal(g, gumbel_noise(seed, 5, 50_000))
    assert not torch.equal(g, gumbel_noise(seed, 6, 50_000)) and not torch.equal(g, gumbel_noise(seed + 1, 5, 50_000))
    assert torch.equal(gumbel_noise(seed, 5, 100), g[:100]), "a prefix of the vocabulary must see the same noise"
    # Gumbel(0, 1): compare the empirical CDF with exp(-exp(-x)) (Kolmogorov-Smirnov)
    pv = ks_pvalue(g.numpy(), lambda x: np.exp(-np.exp(-x)))
    assert pv > P_MIN


def test_keyed_uniforms_slices_and_uniformity(seed):
    """Any slice of the ids is the same draws as the whole vocabulary's; the draws are U(0, 1) (KS)
    and lag-1 uncorrelated, and every purpose has its own stream."""
    from ranks.sampler import keyed_uniforms
    u = keyed_uniforms(seed, 17, 0, 0, 60_000)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(keyed_uniforms(seed, 17, 0, 12_345, 40_000), u[12_345:40_000])
    assert ks_pvalue(u.numpy(), lambda x: np.clip(x, 0.0, 1.0)) > P_MIN
    z = float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) * len(u) ** 0.5
    assert abs(z) < 4.5, z
    assert not torch.equal(keyed_uniforms(seed, 17, 1, 0, 100), u[:100])


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 4099), (777, 20_000), (2**31 - 10, 2**31 + 10)])
def test_keyed_uniforms_torch_path_equals_the_numpy_path(lo, hi, seed):
    """GPU ranks hash with torch int64 ops (split 32-bit multiplies), CPU tensors with numpy uint32
    wrapping ones: run the torch path here on the CPU, bit for bit against the numpy one (counters
    past 2**32 wrap the same way)."""
    from ranks.sampler import _key, _uniforms_np, _uniforms_torch
    for purpose in (0, 1, 2):
        key = _key(seed, 1234, purpose)
        assert torch.equal(_uniforms_torch(key, lo, hi, "cpu"), _uniforms_np(key, lo, hi))


def test_gumbel_rows_equal_the_noise_of_each_row_alone(seed):
    """The batched noise of sample_rows: row r is gumbel_noise(seeds[r], positions[r]) bit for bit, on
    the numpy path (CPU tensors) and on the torch path a GPU takes (run here on the CPU)."""
    from ranks.sampler import _key, _uniforms_np, _uniforms_torch_rows, gumbel_rows
    rng = np.random.default_rng(seed)
    seeds = [int(v) for v in rng.integers(0, 2**62, 5)]
    positions = [int(v) for v in rng.integers(0, 100_000, 5)]
    for lo, hi in [(0, 300), (4099, 8197)]:
        want = torch.stack([gumbel_noise(s, p, hi, lo=lo) for s, p in zip(seeds, positions)])
        assert torch.equal(gumbel_rows(seeds, positions, lo, hi), want)
        keys = [_key(s, p, 0) for s, p in zip(seeds, positions)]
        assert torch.equal(_uniforms_torch_rows(keys, lo, hi, "cpu"), torch.stack([_uniforms_np(k, lo, hi) for k in keys]))
    assert gumbel_rows([], [], 0, 10).shape == (0, 10)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_batch_samples_every_row_as_the_per_row_formula(tp, seed):
    """sample_rows takes the rows whose score is per token in one batch: each row's token must be the
    one of its own formula, argmax(float32(penalised logits / T + Gumbel(seed, position))) with ties to
    the lower id (greedy: no noise), computed here one row at a time. 48 rows of mixed samplers (greedy,
    temperatures 0.3 .. 2.5, penalties, top-p rows that need the whole distribution in between), so a
    row that took another row's temperature, key or penalties would change tokens."""
    R = 48
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(R, V, generator=gen) * 2.0
    rows[5, 10] = rows[5, 50] = float(rows[5].max()) + 1.0          # a greedy tie across shards: 10 wins
    temps = [0.0, 0.3, 0.7, 1.3, 2.5, 0.0, 1.0, 0.9]
    positions = [int(v) for v in np.random.default_rng(seed).integers(0, 2**20, R)]

    def samplers():
        out = []
        for i in range(R):
            kw = dict(temperature=temps[i % len(temps)], seed=seed + i)
            if i % 8 == 7:
                kw["top_p"] = 0.8                                  # needs the whole distribution
            if i % 5 == 2:
                kw.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, prompt_len=2)
            s = SeqSampler(**kw)
            s.observe([int(rows[i].argmax()), 5, 5, 40, 63], 0)
            out.append(s)
        return out

    got = sample_tp(rows, samplers, positions, tp)
    want = []
    for i, s in enumerate(samplers()):
        if s.needs_full_distribution:
            want.append(got[0][i])                                   # another test's subject
            continue
        x = apply_penalties(rows[i].double(), s, 0)
        if not s.greedy:
            x = x / s.temperature + gumbel_noise(s.seed, positions[i], V)
        x = x.float().numpy()
        want.append(int(np.flatnonzero(x == x.max())[0]))
    assert want[5] == 10
    assert all(g == want for g in got), f"{got} != {want}"


@pytest.mark.parametrize("offset", [0, 4096])
def test_batched_candidates_equal_the_row_at_a_time_loop(offset, seed):
    """local_candidates' two forms (one batch of tensor operations, a GPU's default; a loop over rows,
    the CPU's) give the same (score, index) bits for mixed rows: greedy, five temperatures, penalties,
    all rows hot and some; and a NaN row comes out as NaN at the same index from both."""
    from ranks.sampler import local_candidates
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(12, 300, generator=gen) * 2.0).to(torch.bfloat16)
    temps = [0.0, 0.3, 0.7, 1.3, 2.5, 1.0]
    samplers = []
    for i in range(12):
        s = SeqSampler(temperature=temps[i % 6], seed=seed + i, repetition_penalty=1.2 if i % 4 == 1 else 1.0,
                       presence_penalty=0.4 if i % 4 == 1 else 0.0)
        s.observe([offset + 3, offset + 3, offset + 250, 7], 0)
        samplers.append(s)
    positions = list(range(50, 62))
    for rows in (list(range(12)), [1, 2, 3, 4, 5, 7, 8, 9, 10, 11], [0, 5, 6]):   # mixed, all hot, mixed
        sub = [samplers[i] for i in rows]
        pos = [positions[i] for i in rows]
        a = local_candidates(logits, sub, pos, rows, offset, batched=True)
        b = local_candidates(logits, sub, pos, rows, offset, batched=False)
        assert torch.equal(a, b), (rows, a, b)
        assert a[:, 1].min() >= offset and a[:, 1].max() < offset + 300
    bad = logits.clone()
    bad[2, 77] = float("nan")
    for batched in (True, False):
        c = local_candidates(bad, samplers[:3], positions[:3], [0, 1, 2], offset, batched=batched)
        assert torch.isnan(c[2, 0]) and int(c[2, 1]) == offset + 77 and not torch.isnan(c[:2, 0]).any()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_candidates_merged_on_the_device_equal_the_host_merge(tp, seed):
    """Device-fed steps (ranks/worker.py) choose tokens without the host: each rank's candidates stay on
    its device and one all-reduce of disjoint slots merges them (merge_on_device). The ids must be
    sample_rows' (the host merge) for greedy rows with ties across and inside shards, temperatures and
    penalties; the score must be the winning candidate's; a NaN row must show as a NaN score."""
    from ranks.sampler import local_candidates, merge_on_device
    R = 24
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(R, V, generator=gen) * 2.0
    best = float(rows.max()) + 1.0
    rows[1, 40] = rows[1, 3] = best                      # tie across shards: 3 wins
    rows[2, 17] = rows[2, 9] = best                      # tie inside a shard: 9 wins
    rows[3, :] = -float("inf")
    rows[3, 50] = rows[3, 60] = -1.0                     # all but two -inf: 50
    temps = [0.0, 0.0, 0.0, 0.0, 0.4, 1.0, 1.7, 0.0]
    positions = [int(v) for v in np.random.default_rng(seed).integers(0, 2**20, R)]

    def samplers():
        out = []
        for i in range(R):
            kw = dict(temperature=temps[i % len(temps)], seed=seed + 7 * i)
            if i % 3 == 1 and i > 3:                     # rows 1-3 keep their ties
                kw.update(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.1, prompt_len=1)
            smp = SeqSampler(**kw)
            smp.observe([int(rows[i].argmax()), 11, 11, 12], 0)
            out.append(smp)
        return out

    want = sample_tp(rows, samplers, positions, tp)[0]
    n = V // tp

    def rank(r: int, gather):
        shard = rows[:, r * n:(r + 1) * n].contiguous()
        cand = local_candidates(shard, samplers(), positions, list(range(R)), r * n, batched=True, on_host=False)
        return merge_on_device(cand, r, tp, lambda t: gather(t).sum(0))
    got = on_ranks(tp, rank)
    for r in range(tp):
        assert torch.equal(got[r], got[0]), f"rank {r} merged otherwise than rank 0"
        assert got[r][:, 1].long().tolist() == want, (got[r][:, 1].tolist(), want)
    assert want[1] == 3 and want[2] == 9 and want[3] == 50
    # the score is the winner's own: greedy rows' is the (penalised) logit itself
    full = local_candidates(rows, samplers(), positions, list(range(R)), 0, batched=True, on_host=False)
    assert torch.equal(got[0], full), "the merged (score, id) differs from one rank over the whole vocabulary"
    bad = rows.clone()
    bad[5, 21] = float("nan")
    cand = local_candidates(bad, samplers(), positions, list(range(R)), 0, batched=True, on_host=False)
    m = merge_on_device(cand, 0, 1, lambda t: t)
    assert torch.isnan(m[5, 0]) and not torch.isnan(m[torch.arange(R) != 5, 0]).any()


@pytest.mark.parametrize("tp", [1, 2])
def test_banned_ids_are_never_sampled(tp, seed):
    """SeqSampler.banned (tool_choice none bans <tool_call>): a banned id is never chosen, greedy or
    sampled, per-token or whole-distribution rows, even where it is the row's clear maximum; and a ban
    changes nothing else: each row's token is the one the same sampler picks from the logits with the
    banned ids set to -inf by hand, penalties included."""
    from ranks.sampler import local_candidates
    R = 12
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(R, V, generator=gen) * 1.5
    banned = (7, 40)                                   # one id in each shard at tp 2
    rows[:, 7] = rows.max() + 5.0                      # the banned id would win every greedy row
    rows[::3, 40] = rows.max() + 5.0
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_p=0.9),
             dict(temperature=0.7, top_k=5), dict(temperature=0.0, repetition_penalty=1.3)]
    positions = list(range(100, 100 + R))

    def samplers(ban):
        out = []
        for i in range(R):
            smp = SeqSampler(seed=seed + i, banned=ban, **kinds[i % len(kinds)])
            smp.observe([3, 3, 50], 0)
            out.append(smp)
        return out

    got = sample_tp(rows, lambda: samplers(banned), positions, tp)
    masked = rows.clone()
    masked[:, list(banned)] = float("-inf")
    want = sample_tp(masked, lambda: samplers(()), positions, tp)[0]
    for g in got:
        assert g == want and not set(g) & set(banned), (g, want)
    # the device path's candidates (device-fed steps) honour the ban too
    cand = local_candidates(rows, samplers(banned), positions, list(range(R)), 0, batched=True, on_host=False)
    per_token = [i for i, smp in enumerate(samplers(())) if not smp.needs_full_distribution]
    assert [int(cand[i, 1]) for i in per_token] == [want[i] for i in per_token]


def _random_bias(rng: np.random.Generator, n: int, vocab: int, lo: float = -100.0, hi: float = 100.0,
                 must: tuple[int, ...] = ()) -> dict[int, float]:
    ids = set(must) | {int(t) for t in rng.choice(vocab, size=n, replace=False)}
    return {t: float(rng.uniform(lo, hi)) for t in sorted(ids)}


def test_logit_bias_is_added_to_the_raw_logits_on_every_shard(seed):
    """SeqSampler.bias (OpenAI logit_bias): apply_penalties adds each value to its id's logit, on a whole
    row and on vocabulary shards (offset != 0) whose concatenation is the whole-row result; the bias
    comes before the penalties (vLLM's order: repetition divides / multiplies the biased logit,
    presence / frequency subtract from it) and a banned id stays -inf; the input is not modified."""
    rng = np.random.default_rng(seed)
    row = torch.from_numpy(rng.normal(0.0, 2.0, V))                       # float64
    bias = _random_bias(rng, 12, V, must=(0, V // 2 - 1, V // 2, V - 1))  # shard edges at tp 2
    want = row.numpy().copy()
    for t, v in bias.items():
        want[t] += v                                                      # the independent formula
    before = row.clone()
    # the forms the sampler is built from: pairs, a dict, msgpack's list of lists
    for form in (tuple(bias.items()), bias, [[t, v] for t, v in bias.items()]):
        s = SeqSampler(temperature=0.0, bias=form)
        assert s.bias == tuple(bias.items()) and s.adjusts_logits and not s.has_penalties
        got = apply_penalties(row, s, 0)
        assert np.array_equal(got.numpy(), want), np.abs(got.numpy() - want).max()
        for n in (2, 4):
            w = V // n
            parts = [apply_penalties(row[r * w:(r + 1) * w], s, r * w) for r in range(n)]
            assert np.array_equal(torch.cat(parts).numpy(), want)
        # a shard that holds none of the biased ids is returned as it is (a copy)
        far = apply_penalties(row[:8], SeqSampler(bias={V + 5: 50.0}), 10_000)
        assert torch.equal(far, row[:8])
    assert torch.equal(row, before), "apply_penalties must not modify its input"
    # with penalties: on the biased logits
    prompt = [int(t) for t in rng.choice(V, 6)]
    output = [int(t) for t in rng.choice(list(bias), 4)] + [int(t) for t in rng.choice(V, 3)]
    kw = dict(repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.3)
    s = _sampler_after(prompt, output, bias=bias, **kw)
    x = want.copy()
    for t in set(prompt + output):
        x[t] = x[t] / 1.7 if x[t] > 0 else x[t] * 1.7
    for t in set(output):
        x[t] -= 0.6 + 0.3 * output.count(t)
    got = apply_penalties(row, s, 0)
    assert np.allclose(got.numpy(), x, rtol=0, atol=1e-12)
    w = V // 2
    parts = [apply_penalties(row[r * w:(r + 1) * w], s, r * w) for r in range(2)]
    assert torch.equal(torch.cat(parts), got)
    # a banned id stays banned whatever its bias
    t = next(iter(bias))
    s = SeqSampler(bias=bias, banned=(t,))
    got = apply_penalties(row, s, 0)
    assert got[t] == float("-inf") and np.array_equal(np.delete(got.numpy(), t), np.delete(want, t))


@pytest.mark.parametrize("tp", [1, 2])
def test_logit_bias_steers_greedy_and_sampled_tokens(tp, seed):
    """+100 on an id that is not the row's argmax makes greedy (temperature 0, and top_k 1) pick it, and
    sampled rows too (per-token and whole-distribution); -100 on the argmax makes greedy pick the
    second best; ids far from the row's scale change nothing else."""
    R = 10
    rng = np.random.default_rng(seed)
    rows = torch.from_numpy(rng.normal(0.0, 2.0, (R, V))).float()
    top2 = torch.topk(rows, 2, dim=-1).indices
    targets = [int(rng.choice([t for t in range(V) if t != int(top2[i, 0])])) for i in range(R)]
    kinds = [dict(temperature=0.0), dict(temperature=0.7, top_k=1), dict(temperature=0.9),
             dict(temperature=1.0, top_p=0.9), dict(temperature=0.0, repetition_penalty=1.3)]
    positions = [int(p) for p in rng.integers(0, 2**20, R)]

    def samplers(bias_of):
        out = []
        for i in range(R):
            smp = SeqSampler(seed=seed + i, bias=bias_of(i), **kinds[i % len(kinds)])
            smp.observe([3, 3, 50], 0)
            out.append(smp)
        return out

    got = sample_tp(rows, lambda: samplers(lambda i: {targets[i]: 100.0}), positions, tp)
    assert all(g == targets for g in got), (got, targets)
    greedy_rows = [i for i in range(R) if SeqSampler(**kinds[i % len(kinds)]).greedy]
    got = sample_tp(rows, lambda: samplers(lambda i: {int(top2[i, 0]): -100.0}), positions, tp)
    for i in greedy_rows:
        x = rows[i].double().numpy().copy()
        x[int(top2[i, 0])] -= 100.0
        if "repetition_penalty" in kinds[i % len(kinds)]:          # the penalty acts on the biased logits
            for t in (3, 50):
                x[t] = x[t] / 1.3 if x[t] > 0 else x[t] * 1.3
        else:
            assert int(np.argmax(x)) == int(top2[i, 1])
        for g in got:
            assert g[i] == int(np.argmax(x)) != int(top2[i, 0]), (i, g[i], top2[i])


@pytest.mark.parametrize("offset", [0, 4096])
def test_batched_candidates_honour_the_bias_as_the_row_loop_does(offset, seed):
    """The device path's batched local_candidates (device-fed steps) and the row-at-a-time loop give the
    same (score, index) bits with logit_bias on mixed rows (greedy, temperatures, penalties, a ban;
    bias ids inside and outside the shard); and the candidates equal those of unbiased samplers on
    logits biased by hand, so the bias is really applied."""
    from ranks.sampler import local_candidates
    n, R = 300, 12
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.normal(0.0, 2.0, (R, n))).float()
    temps = [0.0, 0.3, 0.7, 1.3, 2.5, 0.0]
    biases = []
    for i in range(R):
        inside = {offset + int(t): float(rng.uniform(-8, 8)) for t in rng.choice(n, 20, replace=False)}
        inside[offset + int(logits[i].argmax())] = -float(rng.uniform(1, 100))     # the unbiased best moves
        outside = {offset + n + int(t): 100.0 for t in rng.choice(50, 3, replace=False)}
        biases.append({**inside, **outside} if i % 5 != 4 else {})
    positions = [int(p) for p in rng.integers(0, 2**20, R)]

    def samplers(with_bias: bool):
        out = []
        for i in range(R):
            pen = dict(repetition_penalty=1.2, presence_penalty=0.4) if i % 4 == 1 else {}
            s = SeqSampler(temperature=temps[i % 6], seed=seed + i, bias=biases[i] if with_bias else (),
                           banned=(offset + 7,) if i % 3 == 2 else (), **pen)
            s.observe([offset + 3, offset + 3, offset + 250, 7], 0)
            out.append(s)
        return out

    by_hand = logits.double()
    for i, b in enumerate(biases):
        for t, v in b.items():
            if offset <= t < offset + n:
                by_hand[i, t - offset] += v
    for rows in (list(range(R)), [1, 2, 3, 4, 5, 7, 8, 9, 10, 11], [0, 5, 6]):
        sub = [samplers(True)[i] for i in rows]
        pos = [positions[i] for i in rows]
        a = local_candidates(logits.clone(), sub, pos, rows, offset, batched=True)
        b = local_candidates(logits.clone(), sub, pos, rows, offset, batched=False)
        assert torch.equal(a, b), (rows, a, b)
        plain = [samplers(False)[i] for i in rows]
        c = local_candidates(by_hand.clone(), plain, pos, rows, offset, batched=True)
        assert torch.equal(a, c), (rows, a, c)
    assert not torch.equal(local_candidates(logits, samplers(True), positions, list(range(R)), offset, batched=False),
                           local_candidates(logits, samplers(False), positions, list(range(R)), offset,
                                            batched=False)), "the bias changed nothing"


def test_with_tokens_carries_every_field_over():
    """with_tokens (speculation: the sampler after each draft) copies every SeqSampler field, whatever
    fields the class has, and gives the copy its own counts."""
    import dataclasses
    from ranks.sampler import with_tokens
    s = SeqSampler(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, presence_penalty=0.5, frequency_penalty=0.25,
                   repetition_penalty=1.1, seed=99, prompt_len=3, banned=(4,), bias={7: 2.5, 9: -1.0})
    s.observe([1, 2, 3, 7], 0)
    seen, output = dict(s.seen), dict(s.output)
    c = with_tokens(s, [8, 8], 4)
    for f in dataclasses.fields(SeqSampler):
        if f.name not in ("seen", "output"):
            assert getattr(c, f.name) == getattr(s, f.name), f.name
    assert c.seen == {**seen, 8: 2} and c.output == {**output, 8: 2}
    assert (s.seen, s.output) == (seen, output), "the original's counts changed"


def test_fallback_statistics_are_right():
    """The scipy-free formulas: textbook critical values, and scipy itself where it is installed."""
    for x, dof, p in [(3.841459, 1, 0.05), (6.634897, 1, 0.01), (18.307038, 10, 0.05), (10.827566, 1, 0.001),
                      (124.342113, 100, 0.05), (0.0, 3, 1.0)]:
        assert chi2_sf(x, dof) == pytest.approx(p, rel=1e-6, abs=1e-12), (x, dof)
    rng = np.random.default_rng(0)
    u = rng.random(5000)
    assert ks_pvalue(u, lambda x: x) > P_MIN and ks_pvalue(u ** 1.1, lambda x: x) < P_MIN
    if stats is not None:
        for dof in (1, 2, 7, 30, 63):
            for x in (0.1, 1.0, dof * 0.5, dof, dof + 3 * math.sqrt(2 * dof), 4.0 * dof + 20):
                assert chi2_sf(x, dof) == pytest.approx(stats.chi2.sf(x, dof), rel=1e-9, abs=1e-300)
        assert ks_pvalue(u, lambda x: x) == pytest.approx(stats.kstest(u, "uniform").pvalue, rel=0.05, abs=1e-3)


# --------------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_is_exact_argmax_with_ties_to_the_lower_id(tp, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(6, V, generator=gen)
    best = float(rows.max()) + 1.0
    rows[1, 40] = rows[1, 3] = best                 # tie across shards: 3 wins
    rows[2, 17] = rows[2, 9] = best                 # tie inside a shard: 9 wins
    rows[3, 63] = best                              # the last id
    rows[4, 0] = best                               # the first id
    rows[5, 33] = rows[5, 32] = rows[5, 63] = best  # three-way tie in the second half
    want = [int(np.argmax(rows[0].numpy())), 3, 9, 63, 0, 32]
    for greedy in (dict(temperature=0.0), dict(temperature=0.7, top_k=1)):
        got = sample_tp(rows, lambda: [SeqSampler(seed=seed + i, **greedy) for i in range(6)], list(range(6)), tp)
        assert all(g == want for g in got), f"{greedy}: {got} != {want}"


# --------------------------------------------------------------------------------------------------
# Filters


def _kept(logp: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logp)).flatten().tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3], dtype=torch.float64)      # sorted: 1 (.5), 3 (.3), 2 (.15), 0
    logits = probs.log()
    for p, want in [(0.3, {1}), (0.49, {1}), (0.51, {1, 3}), (0.79, {1, 3}), (0.81, {1, 2, 3}), (0.94, {1, 2, 3}),
                    (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})]:
        lp = filtered_log_probs(logits, SeqSampler(temperature=1.0, top_p=p))
        assert _kept(lp) == want, f"top_p={p}"
        # kept tokens keep their relative probabilities (the Gumbel argmax renormalises)
        kept = sorted(want)
        ratio = (lp[kept] - lp[kept].logsumexp(0)).exp()
        assert torch.allclose(ratio, probs[kept] / probs[kept].sum(), rtol=1e-12, atol=0)


def test_top_p_acts_after_temperature_and_top_k():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    for T, k, p in [(1.0, 0, 0.9), (0.5, 0, 0.9), (3.0, 0, 0.9), (1.0, 2, 0.5), (2.0, 3, 0.99), (0.3, 4, 0.999)]:
        want = {int(i) for i in np.flatnonzero(expected_probs(logits.numpy(), T, k, p))}
        assert _kept(filtered_log_probs(logits, SeqSampler(temperature=T, top_k=k, top_p=p))) == want, (T, k, p)


def test_min_p_keeps_tokens_within_a_factor_of_the_best():
    probs = torch.tensor([0.4, 0.2, 0.1, 0.04, 0.26], dtype=torch.float64)
    for m, want in [(0.09, {0, 1, 2, 3, 4}), (0.11, {0, 1, 2, 4}), (0.26, {0, 1, 4}), (0.51, {0, 4}),
                    (0.66, {0}), (1.0, {0})]:
        assert _kept(filtered_log_probs(probs.log(), SeqSampler(temperature=1.0, min_p=m))) == want, f"min_p={m}"
    # relative to the tempered distribution: T = 0.5 squares the ratios (0.2/0.4)^2 = 0.25
    assert _kept(filtered_log_probs(probs.log(), SeqSampler(temperature=0.5, min_p=0.24))) == {0, 1, 4}
    assert _kept(filtered_log_probs(probs.log(), SeqSampler(temperature=0.5, min_p=0.26))) == {0, 4}


def test_top_k_keeps_k_tokens():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 2.5, 0.0], dtype=torch.float64)
    for k, want in [(1, {1}), (2, {1, 4}), (3, {1, 3, 4}), (6, set(range(6))), (100, set(range(6)))]:
        assert _kept(filtered_log_probs(logits, SeqSampler(temperature=0.9, top_k=k))) == want


# --------------------------------------------------------------------------------------------------
# Penalties


def _sampler_after(prompt: list[int], output: list[int], **kw) -> SeqSampler:
    s = SeqSampler(prompt_len=len(prompt), **kw)
    seq = prompt + output
    at = 0
    for size in (3, 1, 4, 100):                      # observed in uneven steps, as the plans feed them
        s.observe(seq[at:at + size], at)
        at += size
    assert at >= len(seq)
    return s


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([2.0, -1.0, 0.5, -0.25, 3.0, 0.0, 1.0, -2.0], dtype=torch.float64)
    prompt, output = [0, 1, 1, 5], [2, 2, 2, 3, 0]
    s = _sampler_after(prompt, output, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    assert s.seen == {0: 2, 1: 2, 5: 1, 2: 3, 3: 1}
    assert s.output == {2: 3, 3: 1, 0: 1}
    want = torch.tensor([
        2.0 / 2 - 0.5 - 0.25 * 1,        # 0: prompt and output once: repetition, presence, frequency x1
        -1.0 * 2,                        # 1: prompt only, negative: repetition multiplies
        0.5 / 2 - 0.5 - 0.25 * 3,        # 2: output three times
        -0.25 * 2 - 0.5 - 0.25 * 1,      # 3: output once, negative
        3.0,                             # 4: never seen
        0.0 * 2,                         # 5: prompt, zero stays zero
        1.0, -2.0,                       # 6, 7: never seen
    ], dtype=torch.float64)
    got = apply_penalties(logits, s, 0)
    assert torch.allclose(got, want, rtol=0, atol=1e-12), f"{got.tolist()} != {want.tolist()}"
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, -0.25, 3.0, 0.0, 1.0, -2.0], dtype=torch.float64)), \
        "apply_penalties must not modify its input"
    # on shards: each shard's slice of the whole-row result
    for n in (2, 4):
        w = 8 // n
        parts = [apply_penalties(logits[r * w:(r + 1) * w], s, r * w) for r in range(n)]
        assert torch.allclose(torch.cat(parts), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("which", ["presence", "frequency", "repetition"])
def test_each_penalty_alone(which):
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    prompt, output = [1, 2], [0, 0, 2]
    kw = {"presence": dict(presence_penalty=-1.5), "frequency": dict(frequency_penalty=2.0),
          "repetition": dict(repetition_penalty=0.5)}[which]
    s = _sampler_after(prompt, output, **kw)
    want = {"presence": [1.0 + 1.5, 2.0, -1.0 + 1.5, 0.5],         # negative presence rewards output tokens
            "frequency": [1.0 - 2 * 2.0, 2.0, -1.0 - 2.0, 0.5],
            "repetition": [1.0 / 0.5, 2.0 / 0.5, -1.0 * 0.5, 0.5]}[which]
    assert apply_penalties(logits, s, 0).tolist() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_penalties_steer_greedy_and_sampled_tokens(tp, seed):
    """Greedy with a frequency penalty picks the hand-computed argmax; on two shards as well."""
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 50], logits[0, 20] = 5.0, 4.0, 3.9
    prompt, output = [1, 2, 3], [10, 10]                    # token 10 was generated twice
    s_kw = dict(temperature=0.0, frequency_penalty=0.6)      # 10: 5.0 - 1.2 = 3.8 < 3.9 < 4.0
    got = sample_tp(logits, lambda: [_sampler_after(prompt, output, **s_kw)], [5], tp)
    assert all(g == [50] for g in got)
    s_kw = dict(temperature=0.0, repetition_penalty=1.5)     # 10: 5 / 1.5 = 3.33; 50 wins
    got = sample_tp(logits, lambda: [_sampler_after(prompt, [10, 50], **s_kw)], [5], tp)
    assert all(g == [20] for g in got), "50 is in the output too: 4 / 1.5 = 2.67, so 20 (3.9) wins"
    # sampled, penalties applied before the temperature: the Gumbel draw equals the one on the penalised row
    s = _sampler_after(prompt, output, temperature=0.8, presence_penalty=1.0, seed=seed)
    manual = apply_penalties(logits[0].double(), s, 0) / 0.8 + gumbel_noise(seed, 5, V)
    got = sample_tp(logits, lambda: [_sampler_after(prompt, output, temperature=0.8, presence_penalty=1.0, seed=seed)],
                    [5], tp)
    assert all(g == [int(torch.argmax(manual.float()))] for g in got)


def test_observe_counts_output_by_position():
    """Tokens at positions >= prompt_len are output (whatever step carries them); none counted without penalties."""
    s = SeqSampler(prompt_len=5, presence_penalty=1.0)
    s.observe([7, 7, 7], 0)
    s.observe([7, 8, 9], 3)               # positions 3, 4 (prompt) and 5 (output)
    s.observe([9], 6)
    assert s.seen == {7: 4, 8: 1, 9: 2} and s.output == {9: 2}
    plain = SeqSampler(prompt_len=5)
    plain.observe([1, 2, 3, 4, 5, 6], 0)
    assert plain.seen == {} and plain.output == {}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny per-row ops: intra-op threads only add overhead (and the test threads share the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("sampler", [SeqSampler(temperature=0.0), SeqSampler(temperature=0.8, seed=3),
                                     SeqSampler(temperature=0.8, top_p=0.9, seed=3)], ids=["greedy", "sampled", "top_p"])
def test_nan_logits_raise_a_clear_error(sampler, seed):
    """A NaN in a row's logits (a broken checkpoint) is named, not a torch-internal reduction error or a
    silently chosen token; the other rows are not the problem."""
    from ranks.sampler import NonFiniteLogits
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 50, generator=g)
    logits[1, 7] = float("nan")
    with pytest.raises(NonFiniteLogits, match="batch row 1"):
        sample_rows(logits, [sampler] * 3, [5, 5, 5], rank=0, tp=1, gather=lambda t: t[None])
    ok = sample_rows(logits[[0, 2]], [sampler] * 2, [5, 5], rank=0, tp=1, gather=lambda t: t[None])
    assert all(0 <= t < 50 for t in ok)


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1e-9])
def test_sampling_params_refuse_a_temperature_that_is_not_finite_and_non_negative(temperature):
    """An infinite temperature divides a masked (-inf) logit into NaN (a grammar's mask, a ban): the
    request must be refused up front, not fail the ranks at their next step."""
    from runtime.sampling import SamplingParams
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature)
    SamplingParams(temperature=1e6)

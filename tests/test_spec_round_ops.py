"""The pieces of the GPU speculation round (ranks/spec_cuda.py) that need no GPU: the batched
acceptance rule against ranks.sampler.accept_greedy plus the worker's stop cut, the vocabulary-shard
argmax merge against the argmax of the whole row (ties to the lower id), and which rounds qualify."""

from __future__ import annotations

import pytest
import torch

from ranks.model import Batch
from ranks.sampler import accept_greedy
from ranks.spec_cuda import GpuRounds, accepted_lengths, draft_head_rows, merge_candidates, shard_candidates
from tests.util import page_table


@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_accepted_lengths_equal_accept_greedy_with_stops(K, seed):
    g = torch.Generator().manual_seed(seed)
    B, V, S = 64, 7, 3                       # a small vocabulary: matches and stops are frequent
    targets = torch.randint(0, V, (B, K + 1), generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    # make long accepted prefixes common: copy a random-length prefix of the targets
    for b in range(B):
        n = int(torch.randint(0, K + 1, (1,), generator=g))
        drafts[b, :n] = targets[b, :n]
    stops = torch.randint(-1, V, (B, S), generator=g)
    stops[: B // 4] = -1                     # some sequences without stops
    got = accepted_lengths(targets, drafts, stops)
    seen = set()
    for b in range(B):
        acc = accept_greedy(targets[b].tolist(), drafts[b].tolist())
        stop = {int(t) for t in stops[b] if t >= 0}
        cut = next((i for i, t in enumerate(acc) if t in stop), None)
        want = len(acc) - 1 if cut is None else cut
        assert int(got[b]) == want, (b, targets[b].tolist(), drafts[b].tolist(), stops[b].tolist())
        seen.add(want)
    assert seen == set(range(K + 1))         # every accepted length was exercised


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_shard_argmax_merge_equals_the_whole_row(tp, seed):
    g = torch.Generator().manual_seed(seed)
    R, n = 40, 11
    # bf16 logits with few distinct values: ties inside a shard and across shards
    full = (torch.randint(-4, 5, (R, n * tp), generator=g).float() / 4).to(torch.bfloat16)
    buf = sum(shard_candidates(full[:, r * n:(r + 1) * n], r, tp) for r in range(tp))
    got = merge_candidates(buf)
    want = torch.argmax(full.float(), dim=-1)                 # the first maximum: ties to the lower id
    assert torch.equal(got, want)
    maxima = (full.float() == full.float().max(-1, keepdim=True).values).sum(-1)
    assert (maxima > 1).any(), "the data should contain ties"


def test_eligibility():
    """Only greedy rounds where every sequence drafts K tokens and has pages for its last draft."""
    r = GpuRounds.__new__(GpuRounds)
    r.K = 3
    tables = page_table(2, 2)
    batch = Batch(torch.arange(8), [4, 4], [10, 60], [0, 1], tables)
    ok = dict(ndraft=[3, 3], sample=[True, True], greedy=[True, True], kv_tokens=[128, 128], stops=[[1], []])
    assert r.eligible(batch, **ok)
    assert r.pages(batch) == 2                                  # 60 + 6 needs two pages of 64
    assert not r.eligible(batch, **{**ok, "ndraft": [3, 2]})          # 4 columns but 2 drafts
    short = Batch(torch.arange(6), [4, 2], [10, 60], [0, 1], tables)   # fewer drafts: padded on the GPU
    assert r.eligible(short, **{**ok, "ndraft": [3, 1]})
    plain = Batch(torch.arange(2), [1, 1], [10, 60], [0, 1], tables)   # no drafts at all
    assert r.eligible(plain, **{**ok, "ndraft": [0, 0]})
    assert not r.eligible(Batch(torch.arange(5), [3, 2], [10, 60], [0, 1], tables), **{**ok, "ndraft": [3, 1]})
    assert not r.eligible(batch, **{**ok, "greedy": [True, False]})
    assert not r.eligible(batch, **{**ok, "sample": [True, False]})
    assert not r.eligible(batch, **{**ok, "kv_tokens": [128, 65]})        # position 65 has no page
    assert r.eligible(batch, **{**ok, "kv_tokens": [128, 66]})
    assert not r.eligible(batch, **{**ok, "stops": [list(range(65)), []]})
    assert not r.eligible(Batch(torch.arange(7), [4, 3], [10, 60], [0, 1], tables), **ok)


def test_draft_head_rows_per_rank():
    """The reduced proposal head: each rank keeps its shard's rows of ids below the bound."""
    assert draft_head_rows(0, 0, 100) is None and draft_head_rows(0, 1, 100) is None
    assert [draft_head_rows(150, r, 100) for r in range(3)] == [100, 50, 0]
    assert [draft_head_rows(30, r, 100) for r in range(2)] == [30, 0]
    assert [draft_head_rows(10 ** 6, r, 100) for r in range(2)] == [100, 100]
    with pytest.raises(ValueError):
        draft_head_rows(-1, 0, 100)


def test_offset_candidates_of_a_reduced_shard(seed):
    """A reduced head's candidates carry global ids through `offset`; a rank without rows offers
    -FLT_MAX, which the sum keeps and the merge never picks."""
    g = torch.Generator().manual_seed(seed)
    R, n = 6, 50
    full = torch.randn(R, 2 * n, generator=g).to(torch.bfloat16)
    rows = 20                                              # rank 0 keeps ids < 20, rank 1 none
    buf = shard_candidates(full[:, :rows], 0, 2, offset=0)
    other = torch.zeros(2, R, 2)
    other[1, :, 0] = -torch.finfo(torch.float32).max
    got = merge_candidates(buf + other)
    assert torch.equal(got, full[:, :rows].float().argmax(-1))
    buf1 = shard_candidates(full[:, n:n + rows], 1, 2, offset=n)     # rank 1's first rows: ids n..
    assert torch.equal(buf1[1, :, 1].long(), full[:, n:n + rows].float().argmax(-1) + n)

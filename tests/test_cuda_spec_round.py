"""A greedy speculation round as one GPU program (ranks/spec_cuda.py) against the same round done
step by step through the model's public calls (what Worker.spec_step does eagerly): the same target
argmax and accepted lengths, the same committed GDN state bit for bit, stops cutting the round, the
same drafts wherever the MTP head's top-2 margin is clear; and the captured graph's replays equal its
eager first run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ranks.model import Batch, commit_batched
from ranks.random_checkpoint import spec_for
from ranks.sampler import accept_greedy
from tests.util import page_table, random_weights, tiny_spec

pytestmark = pytest.mark.gpu

SPECS = {"tiny-dense": lambda: tiny_spec(False), "tiny-moe": lambda: tiny_spec(True),
         "small": lambda: spec_for("small")}


def _state_tensors(st) -> list[torch.Tensor]:
    out = []
    for v in vars(st).values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            out += v
    return out


def _at(st, t) -> int:
    return next(i for i, u in enumerate(_state_tensors(st)) if u is t)


@torch.inference_mode()
def _snapshot(st):
    return [t.clone() for t in _state_tensors(st)]


@torch.inference_mode()
def _restore(st, snap):
    for t, s in zip(_state_tensors(st), snap):
        t.copy_(s)


@torch.inference_mode()
def _eager_round(model, st, batch: Batch, P: int, K: int, stops, cap=None):
    """The round through public calls: verification (same page width as the GPU round), host argmax
    and acceptance, commit, MTP over the accepted columns, K-1 MTP steps. Returns targets [B, T],
    a [B], drafts [B, K] and the drafts' top-2 margins."""
    B, T = len(batch.columns), K + 1
    db = model.device_batch(batch, P)
    out = model.fast_forward(db, st, "all", keep_T=T)
    kept = dataclasses.replace(out.kept, seqs=list(range(B)), slots=list(batch.slots), columns=list(batch.columns))
    targets = out.logits.float().argmax(-1).view(B, T).cpu()
    ids = batch.token_ids.view(B, T)
    a = []
    for b in range(B):
        acc = accept_greedy(targets[b].tolist(), ids[b, 1:].tolist())
        cut = next((i for i, t in enumerate(acc) if t in stops[b]), None)
        a.append(len(acc) - 1 if cut is None else cut)
        if cap is not None:
            a[-1] = min(a[-1], cap[b])
    commit_batched(kept, st, a)
    drafts = torch.full((B, K), -1, dtype=torch.long)
    margins = torch.zeros(B, K)
    for b in range(B):
        n = a[b] + 1
        mids = torch.cat([ids[b, 1:n], targets[b, a[b]:a[b] + 1]])
        mb = Batch(mids, [n], [batch.starts[b]], [batch.slots[b]], batch.page_tables[b:b + 1])
        h = model.mtp_forward(mb, out.hidden[b * T:b * T + n], st, logits="none").hidden[-1:]
        for j in range(K):
            logits = model.head_logits(h).float()[0]
            top = logits.topk(2).values
            drafts[b, j], margins[b, j] = int(logits.argmax()), float(top[0] - top[1])
            if j == K - 1:
                break
            sb = Batch(drafts[b, j:j + 1], [1], [batch.starts[b] + a[b] + 1 + j], [batch.slots[b]],
                       batch.page_tables[b:b + 1])
            h = model.mtp_forward(sb, h, st, logits="none").hidden
    return targets, torch.tensor(a), drafts, margins


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("K", [1, 3])
def test_gpu_round_equals_the_eager_round(name, K, seed):
    from ranks.model_cuda import CudaHybridModel
    from ranks.spec_cuda import GpuRounds
    spec = SPECS[name]()
    w = {k: v.to(device="cuda", dtype=torch.bfloat16) for k, v in random_weights(spec, seed).items()}
    model = CudaHybridModel(spec, w, cuda_graphs=True)
    assert model.has_mtp
    model.reserve_verification(8 * (K + 1))
    rounds = GpuRounds(model, K, rank=0, tp=1)
    g = torch.Generator().manual_seed(seed)
    starts = [9, 70, 130]                            # across page (64) and GDN chunk boundaries
    B, T = len(starts), K + 1
    tables = page_table(B, 4)
    st = model.new_state(B, B * 4)
    for b, n in enumerate(starts):
        model.forward(Batch(torch.randint(0, spec.vocab_size, (n,), generator=g), [n], [0], [b], tables[b:b + 1]), st)
    x = torch.randint(0, spec.vocab_size, (B,), generator=g)
    # plain greedy continuations give drafts that are right (sequence 0), right once (1), wrong (2)
    snap = _snapshot(st)
    cont, cur = [], x.clone()
    for t in range(K):
        logits = model.forward(Batch(cur, [1] * B, [s + t for s in starts], list(range(B)), tables), st).logits
        cur = logits.float().argmax(-1).cpu()
        cont.append(cur)
    cont = torch.stack(cont, 1)                                           # [B, K]
    wrong = (cont + 1) % spec.vocab_size
    drafts_in = torch.stack([cont[0], torch.cat([cont[1, :1], wrong[1, 1:]]), wrong[2]])
    ids = torch.cat([x[:, None], drafts_in], 1).reshape(-1)
    batch = Batch(ids, [T] * B, starts, list(range(B)), tables)
    P = rounds.pages(batch)
    assert rounds.eligible(batch, [K] * B, [True] * B, [True] * B, [4 * 64] * B, [[]] * B)

    _restore(st, snap)
    stops = [set(), set(), set()]
    want_t, want_a, want_d, margins = _eager_round(model, st, batch, P, K, stops)
    want_state = _snapshot(st)
    print(f"{name} K={K}: accepted {want_a.tolist()}")
    assert want_a[0] > 0, "sequence 0's drafts are its greedy continuation"

    results = []
    for run in range(3):                                  # eager first run, capture, replay
        _restore(st, snap)
        res = rounds.run(batch, st, [[] for _ in range(B)])
        results.append(res)
        got_t, got_a, got_d = res[:, :T], res[:, T], res[:, T + 1:]
        assert np.array_equal(got_t, want_t.numpy()), f"run {run}: targets"
        assert np.array_equal(got_a, want_a.numpy()), f"run {run}: accepted"
        for j in range(len(spec.linear_attention_layers)):
            assert torch.equal(st.recurrent[j], want_state[_at(st, st.recurrent[j])]), \
                f"run {run}: recurrent state of GDN layer {j}"
            assert torch.equal(st.conv[j], want_state[_at(st, st.conv[j])]), \
                f"run {run}: conv window of GDN layer {j}"
        # drafts: equal while every earlier draft was equal and the eager margin is clear
        checked = 0
        for b in range(B):
            for j in range(K):
                if margins[b, j] < 0.05:
                    break
                assert got_d[b, j] == want_d[b, j], f"run {run}: draft {j} of sequence {b}"
                checked += 1
        assert checked > 0
    assert model.graphs.captures >= 1 and model.graphs.replays >= 1
    assert np.array_equal(results[1], results[0]) and np.array_equal(results[2], results[0])

    # fewer drafts (near a token budget, or none): the round pads to K + 1 columns and caps acceptance
    if K > 1:
        n = [K, 1, 0]
        short = Batch(torch.cat([ids.view(B, T)[b, :1 + n[b]] for b in range(B)]), [1 + v for v in n], starts,
                      list(range(B)), tables)
        assert rounds.eligible(short, n, [True] * B, [True] * B, [4 * 64] * B, [[]] * B)
        padded = torch.cat([torch.cat([ids.view(B, T)[b, :1 + n[b]], torch.zeros(K - n[b], dtype=ids.dtype)])
                            for b in range(B)])
        _restore(st, snap)
        want_t3, want_a3, want_d3, margins3 = _eager_round(model, st, Batch(padded, [T] * B, starts, list(range(B)),
                                                                            tables), P, K, [set()] * B, cap=n)
        want_state = _snapshot(st)
        _restore(st, snap)
        res = rounds.run(short, st, [[] for _ in range(B)], n)
        assert np.array_equal(res[:, T], want_a3.numpy()) and (res[:, T] <= np.array(n)).all()
        assert np.array_equal(res[:, :T], want_t3.numpy())
        for j in range(len(spec.linear_attention_layers)):
            assert torch.equal(st.recurrent[j], want_state[_at(st, st.recurrent[j])])
            assert torch.equal(st.conv[j], want_state[_at(st, st.conv[j])])

    # a stop token among the targets cuts the round there (accepted drafts before it stay)
    stops = [{int(want_t[0, 1])}, {int(want_t[1, 0])}, set()]
    _restore(st, snap)
    want_t2, want_a2, _, _ = _eager_round(model, st, batch, P, K, stops)
    assert want_a2[1] == 0 and want_a2[0] <= 1
    want_state = _snapshot(st)
    _restore(st, snap)
    res = rounds.run(batch, st, [sorted(s) for s in stops])
    assert np.array_equal(res[:, T], want_a2.numpy())
    for j in range(len(spec.linear_attention_layers)):
        assert torch.equal(st.recurrent[j], want_state[_at(st, st.recurrent[j])])


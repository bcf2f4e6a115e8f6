"""The layer program against itself: chunked prefill, T-column steps, batching and slots.

Whatever way the columns of a sequence are cut into steps, and whatever else shares the batch, the
logits and the state afterwards must be those of one full prefill. These structural tests run the
reference in float64 (every op then accumulates in float64), so any difference above rounding of
1e-10 is a bug in the program, not noise; float32 behaviour is covered by the HF parity tests.
"""

import pytest
import torch

from kernels import reference as ops
from ranks.model import Batch, HybridModel
from tests.util import page_table, rel, random_weights, tiny_spec

TOL = 1e-10


def _model(moe: bool, seed: int, **overrides) -> HybridModel:
    spec = tiny_spec(moe, **overrides)
    return HybridModel(spec, random_weights(spec, seed, dtype=torch.float64))


def _run_in_steps(model: HybridModel, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Feed `ids` as consecutive steps of the given sizes; return the logits of every column."""
    state = model.new_state(num_slots=1, num_pages=8)
    table = page_table(1, 8)
    outs, at = [], 0
    for size in cuts:
        chunk = ids[at:at + size]
        outs.append(model.forward(Batch(chunk, [len(chunk)], [at], [0], table), state, logits="all").logits)
        at += size
    assert at == len(ids), f"{cuts=} must cover {len(ids)} ids"
    return torch.cat(outs)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("cuts", [
    [130],                     # one prefill over three delta-rule chunks (64 + 64 + 2)
    [1] * 20 + [110],          # decode steps first, then a long chunk
    [64, 1, 65],               # chunk boundary, single column, chunk past a boundary
    [7, 50, 3, 1, 1, 68],      # odd sizes that do not align with 64-token pages
    [17] * 7 + [11],
], ids=lambda c: "+".join(map(str, c)) if len(c) < 8 else f"{len(c)}-steps")
def test_prefill_in_any_chunks_equals_one_prefill(moe, cuts, seed):
    model = _model(moe, seed)
    ids = torch.randint(0, model.spec.vocab_size, (130,), generator=torch.Generator().manual_seed(seed))
    full = _run_in_steps(model, ids, [130])
    stepped = _run_in_steps(model, ids, cuts)
    assert rel(stepped, full) < TOL


@pytest.mark.parametrize("T", [2, 4, 6])
def test_t_column_step_equals_t_single_steps(T, seed):
    """The verification shape of speculation: T columns after a prefill equal T decode steps."""
    model = _model(False, seed)
    ids = torch.randint(0, model.spec.vocab_size, (40 + T,), generator=torch.Generator().manual_seed(seed))
    singles = _run_in_steps(model, ids, [40] + [1] * T)[40:]
    block = _run_in_steps(model, ids, [40, T])[40:]
    assert rel(block, singles) < TOL
    assert torch.equal(ops.greedy(block), ops.greedy(singles))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_batched_sequences_equal_separate_runs(moe, seed):
    """Three sequences of different lengths and starts in one step give each its own result."""
    model = _model(moe, seed)
    gen = torch.Generator().manual_seed(seed)
    V = model.spec.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=gen) for n in (70, 5, 33)]
    extra = [torch.randint(0, V, (n,), generator=gen) for n in (1, 4, 66)]
    alone = [_run_in_steps(model, torch.cat([p, e]), [len(p), len(e)])[len(p):] for p, e in zip(prompts, extra)]

    state = model.new_state(num_slots=5, num_pages=12)
    tables = page_table(3, 4)
    slots = [4, 0, 2]                    # slots need not match batch order
    model.forward(Batch(torch.cat(prompts), [70, 5, 33], [0, 0, 0], slots, tables), state, logits="none")
    out = model.forward(Batch(torch.cat(extra), [1, 4, 66], [70, 5, 33], slots, tables), state, logits="all")
    at = 0
    for b, e in enumerate(extra):
        assert rel(out.logits[at:at + len(e)], alone[b]) < TOL, f"sequence {b}"
        at += len(e)
    last = model.forward(Batch(torch.cat(extra), [1, 4, 66], [71, 9, 99], slots, tables), state, logits="last")
    assert last.logits.shape == (3, V)


def test_fresh_sequence_ignores_stale_slot_state(seed):
    """starts == 0 resets the GDN state: a reused slot and page give the same result as new ones."""
    model = _model(False, seed)
    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(0, model.spec.vocab_size, (50,), generator=gen) for _ in range(2))
    state = model.new_state(num_slots=1, num_pages=2)
    table = page_table(1, 2)
    model.forward(Batch(a, [50], [0], [0], table), state, logits="none")
    reused = model.forward(Batch(b, [50], [0], [0], table), state, logits="all").logits
    fresh = _run_in_steps(model, b, [50])
    assert rel(reused, fresh) < TOL


@pytest.mark.parametrize("ratio", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 5, 64, 100])
def test_chunked_and_recurrent_delta_rules_agree(ratio, T, seed):
    gen = torch.Generator().manual_seed(seed)
    HK, DK, DV = 2, 16, 24
    HV = HK * ratio
    q = torch.randn(T, HK, DK, generator=gen)
    k = torch.randn(T, HK, DK, generator=gen)
    v = torch.randn(T, HV, DV, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * 2.0
    beta = torch.rand(T, HV, generator=gen)
    state = torch.randn(HV, DK, DV, generator=gen)
    q, k = ops.gdn_prepare_qk(q, k, ratio)
    o1, s1 = ops.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    o2, s2 = ops.gated_delta_rule_chunked(q, k, v, g, beta, state)
    assert rel(o2, o1) < 1e-5 and rel(s2, s1) < 1e-5               # float32: rounding only
    o1, s1 = ops.gated_delta_rule_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                            state.double())
    o2, s2 = ops.gated_delta_rule_chunked(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                          state.double())
    assert rel(o2, o1) < 1e-12 and rel(s2, s1) < 1e-12


@pytest.mark.parametrize("from_zero", [True, False], ids=["zero-state", "given-state"])
def test_delta_rule_matches_float64_formula(from_zero, seed):
    """Both rules against S_t = e^g (I - b k k^T) S_{t-1} + b k v^T, o_t = S_t^T q_t in float64."""
    gen = torch.Generator().manual_seed(seed)
    T, H, DK, DV = 9, 3, 8, 5
    q, k = ops.gdn_prepare_qk(torch.randn(T, H, DK, generator=gen), torch.randn(T, H, DK, generator=gen), 1)
    v, g, beta = torch.randn(T, H, DV, generator=gen), -torch.rand(T, H, generator=gen), torch.rand(T, H, generator=gen)
    S0 = None if from_zero else torch.randn(H, DK, DV, generator=gen)
    S = torch.zeros(H, DK, DV, dtype=torch.float64) if from_zero else S0.double()
    eye = torch.eye(DK, dtype=torch.float64)
    want = []
    for t in range(T):
        kt, b = k[t].double(), beta[t].double()[:, None, None]
        S = g[t].double().exp()[:, None, None] * (eye - b * kt[:, :, None] * kt[:, None, :]) @ S \
            + b * kt[:, :, None] * v[t].double()[:, None, :]
        want.append(torch.einsum("hkv,hk->hv", S, q[t].double()))
    for rule in (ops.gated_delta_rule_recurrent, ops.gated_delta_rule_chunked):
        o, S_end = rule(q, k, v, g, beta, S0)
        assert rel(o, torch.stack(want)) < 1e-5 and rel(S_end, S) < 1e-5, rule.__name__


def test_causal_conv_update_equals_sequence(seed):
    gen = torch.Generator().manual_seed(seed)
    C, K, T = 12, 4, 10
    x, w = torch.randn(T, C, generator=gen), torch.randn(C, K, generator=gen)
    y_seq, state_seq = ops.causal_conv1d(x, w, None)
    state = torch.zeros(C, K - 1)
    for t in range(T):
        y, state = ops.causal_conv1d_update(x[t], w, state)
        assert rel(y, y_seq[t]) < 1e-6
    assert torch.equal(state, state_seq)
    # the float64 formula: y_t = silu(sum_j w[:, j] x_{t-K+1+j})
    xp = torch.cat([torch.zeros(K - 1, C), x]).double()
    want = torch.stack([torch.nn.functional.silu((w.double() * xp[t:t + K].T).sum(-1)) for t in range(T)])
    assert rel(y_seq, want) < 1e-6

"""The CUDA Gated DeltaNet mixer (kernels/cuda_gdn.py) against the reference ops, on the GPU.

Real shapes (27B, 35B, their tp2 halves) and tiny odd ones (DK != DV, GVA ratio 3), batches of
sequences with mixed fresh / continuing states in shuffled slots, T = 1, 4 and 70 columns. Outputs
are poisoned with NaN first; slots outside the batch must come back bit for bit. The recurrence is
checked against a float64 run of the reference (gates, q/k preparation and the rule), with beta
rounded to bf16 as the model does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref

pytestmark = pytest.mark.gpu

# name: (HK, HV, DK, DV)
SHAPES = {
    "27b": (16, 48, 128, 128),
    "35b": (16, 32, 128, 128),
    "27b-tp2": (8, 24, 128, 128),
    "35b-tp2": (8, 16, 128, 128),
    "tiny16": (2, 4, 16, 16),
    "tiny32": (2, 4, 32, 32),
    "gva3": (2, 6, 16, 16),
    "dk32-dv16": (1, 3, 32, 16),
    "dk64-dv24": (2, 4, 64, 24),
}

# name: column counts of the batch's sequences
BATCHES = {
    "decode8": [1] * 8,
    "verify6": [4, 1, 4, 2, 4, 3],
    "long": [70, 1, 4],
    "single": [4],
}


def maxrel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 (NaN in a fails)."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def make_batch(lengths: list[int], gen: torch.Generator, spare: int = 3):
    """Shuffled distinct slots among len+spare, a mix of fresh and continuing sequences."""
    B = len(lengths)
    n_slots = B + spare
    slots = torch.randperm(n_slots, generator=gen)[:B].tolist()
    fresh = [int(v) for v in (torch.rand(B, generator=gen) < 0.5).tolist()]
    if B >= 2:
        fresh[0], fresh[1] = 1, 0                 # at least one of each
    else:
        fresh = [int(torch.randint(0, 2, (1,), generator=gen))]
    cu = [0]
    for T in lengths:
        cu.append(cu[-1] + T)
    dev = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")   # noqa: E731
    return n_slots, slots, fresh, cu, (dev(slots), dev(cu), dev(fresh))


# --------------------------------------------------------------------------------------------------
# conv1d


CONV_CASES = ([(s, 4) for s in ("27b", "35b", "27b-tp2", "tiny16", "gva3", "dk64-dv24")]
              + [("tiny16", 2), ("gva3", 3), ("gva3", 5), ("tiny16", 8)])    # every K is its own instantiation


@pytest.mark.parametrize("update_state", [True, False])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("shape,K", CONV_CASES)
def test_conv1d_matches_reference(shape, K, batch, update_state, seed):
    from kernels import cuda_gdn as cg
    HK, HV, DK, DV = SHAPES[shape]
    lengths, N, C, (slots, fresh, cu, (slots_d, cu_d, fresh_d)), x, w, conv0 = conv_inputs(
        2 * HK * DK + HV * DV, K, batch, seed)
    conv = conv0.clone()
    out = torch.full((N, C), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = cg.conv1d(x, w, conv, slots_d, cu_d, fresh_d, out=out, update_state=update_state)
    assert got.data_ptr() == out.data_ptr()
    check_conv(out, conv, x, w, conv0, lengths, slots, fresh, cu, update_state)


def conv_inputs(C, K, batch, seed, offset=False):
    """A conv launch's inputs: (lengths, N, C, (slots, fresh, cu, device metadata), x, w, windows);
    offset: x a view one element into its storage."""
    gen = torch.Generator().manual_seed(seed)
    lengths = BATCHES[batch]
    N = sum(lengths)
    n_slots, slots, fresh, cu, meta = make_batch(lengths, gen)
    x = torch.randn(N * C + offset, generator=gen).to(torch.bfloat16).cuda()[int(offset):].view(N, C)
    w = (0.3 * torch.randn(C, K, generator=gen)).to(torch.bfloat16).cuda()
    conv0 = torch.randn(n_slots, C, K - 1, generator=gen).to(torch.bfloat16).cuda()
    return lengths, N, C, (slots, fresh, cu, meta), x, w, conv0


def check_conv(out, conv, x, w, conv0, lengths, slots, fresh, cu, update_state=True):
    """A conv launch's outputs against the float32 reference per sequence, and its windows exactly."""
    expected_state = conv0.clone()
    for i, T in enumerate(lengths):
        lo, hi = cu[i], cu[i + 1]
        y, st = ref.causal_conv1d(x[lo:hi], w, None if fresh[i] else conv0[slots[i]])
        err = maxrel(out[lo:hi], y)
        assert err <= 1e-2, f"sequence {i} (T={T}, fresh={fresh[i]}): conv output error {err:.3g}"
        if update_state:
            expected_state[slots[i]] = st
    assert torch.equal(conv, expected_state), "conv windows differ (or a slot outside the batch changed)"


@pytest.mark.parametrize("case", ["27b-long", "35b-verify6", "gva3-K5-decode8", "odd-C", "offset-view"])
def test_conv1d_one_and_two_channels_per_thread_agree(case, seed, monkeypatch):
    """gdn_conv1d_bf16_x2 (C even, 4-byte aligned x / out: the default there) against the one-channel
    kernel (TANDEM_GDN_CONV_X2=0, and what an odd C or an offset view takes): the same outputs and
    windows bit for bit, both against the float32 reference."""
    from kernels import cuda_gdn as cg
    shape, K, batch = {"27b-long": ("27b", 4, "long"), "35b-verify6": ("35b", 4, "verify6"),
                       "gva3-K5-decode8": ("gva3", 5, "decode8"), "odd-C": (None, 4, "long"),
                       "offset-view": ("tiny16", 3, "verify6")}[case]
    if shape is None:
        C = 99
    else:
        HK, HV, DK, DV = SHAPES[shape]
        C = 2 * HK * DK + HV * DV
    # an offset view is 2-byte aligned: the one-channel kernel
    lengths, N, C, (slots, fresh, cu, (slots_d, cu_d, fresh_d)), x, w, conv0 = conv_inputs(
        C, K, batch, seed, offset=case == "offset-view")
    results = {}
    for x2 in ("1", "0"):
        monkeypatch.setenv(cg.CONV_X2_ENV, x2)
        conv = conv0.clone()
        out = torch.full((N, C), float("nan"), dtype=torch.bfloat16, device="cuda")
        cg.conv1d(x, w, conv, slots_d, cu_d, fresh_d, out=out)
        results[x2] = (out, conv)
    assert torch.equal(results["1"][0], results["0"][0]), "the two kernels' outputs differ"
    assert torch.equal(results["1"][1], results["0"][1]), "the two kernels' windows differ"
    check_conv(*results["1"], x, w, conv0, lengths, slots, fresh, cu)


# --------------------------------------------------------------------------------------------------
# gated delta rule


def rule_inputs(shape, lengths, gen, param_dtype=torch.float32):
    HK, HV, DK, DV = SHAPES[shape]
    C = 2 * HK * DK + HV * DV
    N = sum(lengths)
    n_slots, slots, fresh, cu, meta = make_batch(lengths, gen)
    y = F.silu(torch.randn(N, C, generator=gen)).to(torch.bfloat16).cuda()       # conv outputs
    a = torch.randn(N, HV, generator=gen).to(torch.bfloat16).cuda()
    b = torch.randn(N, HV, generator=gen).to(torch.bfloat16).cuda()
    A_log = torch.randn(HV, generator=gen).to(param_dtype).cuda()
    dt_bias = torch.randn(HV, generator=gen).to(param_dtype).cuda()
    state0 = (0.5 * torch.randn(n_slots, HV, DK, DV, generator=gen)).cuda()
    return dict(y=y, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state0=state0, slots=slots, fresh=fresh, cu=cu,
                meta=meta)


def reference_rule(inp, shape, keep: bool):
    """Per sequence: (o [T, HV, DV], final state or states [T, ...]) in float64."""
    HK, HV, DK, DV = SHAPES[shape]
    y, cu = inp["y"], inp["cu"]
    g, beta = ref.gdn_gates(inp["a"].double(), inp["b"], inp["A_log"].double(), inp["dt_bias"].double())
    beta = beta.double()                          # torch.sigmoid on bf16: rounded to bf16, as in the model
    results = []
    for i in range(len(cu) - 1):
        lo, hi = cu[i], cu[i + 1]
        T = hi - lo
        q, k, v = torch.split(y[lo:hi].double(), [HK * DK, HK * DK, HV * DV], dim=-1)
        q, k = ref.gdn_prepare_qk(q.reshape(T, HK, DK), k.reshape(T, HK, DK), HV // HK)
        s0 = None if inp["fresh"][i] else inp["state0"][inp["slots"][i]].double()
        fn = ref.gated_delta_rule_states if keep else ref.gated_delta_rule_recurrent
        results.append(fn(q, k, v.reshape(T, HV, DV), g[lo:hi], beta[lo:hi], s0))
    return results


def run_rule(cg, inp, shape, state, keep_states=None, out=None):
    HK, HV, DK, DV = SHAPES[shape]
    slots_d, cu_d, fresh_d = inp["meta"]
    return cg.gated_delta_rule(inp["y"], inp["a"], inp["b"], inp["A_log"], inp["dt_bias"], state, slots_d, cu_d,
                               fresh_d, HK, HV, DK, DV, out=out, keep_states=keep_states)


@pytest.mark.parametrize("keep", [False, True], ids=["in-place", "keep-states"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gated_delta_rule_matches_reference(shape, batch, keep, seed):
    from kernels import cuda_gdn as cg
    HK, HV, DK, DV = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    lengths = BATCHES[batch]
    N = sum(lengths)
    param_dtype = torch.bfloat16 if shape in ("27b", "35b-tp2", "gva3") else torch.float32
    inp = rule_inputs(shape, lengths, gen, param_dtype)
    state0 = inp["state0"]
    state = state0.clone()
    out = torch.full((N, HV, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    kept = torch.full((N, HV, DK, DV), float("nan"), device="cuda") if keep else None
    got = run_rule(cg, inp, shape, state, keep_states=kept, out=out)
    assert got.data_ptr() == out.data_ptr()
    expected_state = state0.clone()
    for i, (o_ref, s_ref) in enumerate(reference_rule(inp, shape, keep)):
        lo, hi = inp["cu"][i], inp["cu"][i + 1]
        T = hi - lo
        what = f"sequence {i} (T={T}, fresh={inp['fresh'][i]}, slot={inp['slots'][i]})"
        err = maxrel(out[lo:hi], o_ref)
        assert err <= 1e-2, f"{what}: output error {err:.3g}"
        bound = 1e-4 if T <= 16 else 1e-3
        if keep:
            for t in range(T):
                err = maxrel(kept[lo + t], s_ref[t])
                assert err <= bound, f"{what}: kept state after column {t} error {err:.3g}"
        else:
            err = maxrel(state[inp["slots"][i]], s_ref)
            assert err <= bound, f"{what}: final state error {err:.3g}"
            expected_state[inp["slots"][i]] = state[inp["slots"][i]]
    # in place: every slot outside the batch unchanged; keep_states: the live state untouched
    assert torch.equal(state, expected_state)


@pytest.mark.parametrize("shape", ["27b-tp2", "tiny16", "gva3", "dk64-dv24"])
def test_verification_states_equal_decoding_bit_for_bit(shape, seed):
    """keep_states[lo + t] and the verification outputs equal decoding the columns one at a time."""
    from kernels import cuda_gdn as cg
    HK, HV, DK, DV = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    lengths = [4, 3, 4]
    N = sum(lengths)
    inp = rule_inputs(shape, lengths, gen)
    state0, cu, slots, fresh = inp["state0"], inp["cu"], inp["slots"], inp["fresh"]
    live = state0.clone()
    kept = torch.empty(N, HV, DK, DV, device="cuda")
    out_v = run_rule(cg, inp, shape, live, keep_states=kept)
    assert torch.equal(live, state0), "verification changed the live state"

    dec = state0.clone()
    for t in range(max(lengths)):
        active = [i for i, T in enumerate(lengths) if t < T]
        cols = [cu[i] + t for i in active]
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")   # noqa: E731
        o = cg.gated_delta_rule(inp["y"][cols].contiguous(), inp["a"][cols].contiguous(),
                                inp["b"][cols].contiguous(), inp["A_log"], inp["dt_bias"], dec,
                                i32([slots[i] for i in active]), i32(list(range(len(active) + 1))),
                                i32([fresh[i] if t == 0 else 0 for i in active]), HK, HV, DK, DV)
        for j, i in enumerate(active):
            assert torch.equal(dec[slots[i]], kept[cu[i] + t]), f"sequence {i} column {t}: state differs"
            assert torch.equal(o[j], out_v[cu[i] + t]), f"sequence {i} column {t}: output differs"


def test_negative_slot_runs_from_zeros_and_writes_nothing(seed):
    from kernels import cuda_gdn as cg
    shape = "tiny32"
    HK, HV, DK, DV = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    inp = rule_inputs(shape, [3, 2], gen)
    # sequence 0: no slot (-1), not fresh: it must still start from zeros; sequence 1: fresh
    slots_d, cu_d, fresh_d = inp["meta"]
    slots_d[0] = -1
    fresh_d.copy_(torch.tensor([0, 1], dtype=torch.int32))
    inp["fresh"] = [1, 1]                         # what the reference sees: both start from zeros
    state = inp["state0"].clone()
    out = run_rule(cg, inp, shape, state)
    (o0, _), (o1, s1) = reference_rule(inp, shape, keep=False)
    assert maxrel(out[0:3], o0) <= 1e-2 and maxrel(out[3:5], o1) <= 1e-2
    expected = inp["state0"].clone()
    expected[inp["slots"][1]] = state[inp["slots"][1]]
    assert maxrel(state[inp["slots"][1]], s1) <= 1e-4
    assert torch.equal(state, expected)

    # conv: same rule
    C = 2 * HK * DK + HV * DV
    x = torch.randn(5, C, generator=gen).to(torch.bfloat16).cuda()
    w = (0.3 * torch.randn(C, 4, generator=gen)).to(torch.bfloat16).cuda()
    conv0 = torch.randn(state.shape[0], C, 3, generator=gen).to(torch.bfloat16).cuda()
    conv = conv0.clone()
    y = cg.conv1d(x, w, conv, slots_d, cu_d, fresh_d)
    y0, _ = ref.causal_conv1d(x[0:3], w, None)
    y1, st1 = ref.causal_conv1d(x[3:5], w, None)
    assert maxrel(y[0:3], y0) <= 1e-2 and maxrel(y[3:5], y1) <= 1e-2
    expected = conv0.clone()
    expected[inp["slots"][1]] = st1
    assert torch.equal(conv, expected)


# --------------------------------------------------------------------------------------------------
# gated RMSNorm


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["27b", "35b-tp2", "tiny16", "dk64-dv24"])
def test_gated_rms_norm_matches_reference(shape, weight_dtype, seed):
    from kernels import cuda_gdn as cg
    HK, HV, DK, DV = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    N = 7
    x = (0.2 * torch.randn(N, HV, DV, generator=gen)).to(torch.bfloat16).cuda()
    z = (2.0 * torch.randn(N, HV * DV, generator=gen)).to(torch.bfloat16).cuda()
    w = (1.0 + 0.3 * torch.randn(DV, generator=gen)).to(weight_dtype).cuda()
    eps = 1e-6
    out = torch.full((N, HV * DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = cg.gated_rms_norm(x, z, w, eps, out=out)
    assert got.data_ptr() == out.data_ptr()
    expected = ref.gated_rms_norm(x, z.view(N, HV, DV), w, eps).reshape(N, HV * DV)
    assert maxrel(out, expected) <= 1e-2


# --------------------------------------------------------------------------------------------------
# CUDA graphs and argument checks


def test_mixer_replays_in_a_cuda_graph_bit_for_bit(seed):
    from kernels import cuda_gdn as cg
    shape = "gva3"
    HK, HV, DK, DV = SHAPES[shape]
    C = 2 * HK * DK + HV * DV
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 1, 1, 1]
    inp = rule_inputs(shape, lengths, gen)
    slots_d, cu_d, fresh_d = inp["meta"]
    N = sum(lengths)
    x = torch.randn(N, C, generator=gen).to(torch.bfloat16).cuda()
    z = torch.randn(N, HV * DV, generator=gen).to(torch.bfloat16).cuda()
    w = (0.3 * torch.randn(C, 4, generator=gen)).to(torch.bfloat16).cuda()
    nw = (1.0 + 0.3 * torch.randn(DV, generator=gen)).to(torch.bfloat16).cuda()
    conv0 = torch.randn(inp["state0"].shape[0], C, 3, generator=gen).to(torch.bfloat16).cuda()
    y, o, n = (torch.empty(N, C, dtype=torch.bfloat16, device="cuda"),
               torch.empty(N, HV, DV, dtype=torch.bfloat16, device="cuda"),
               torch.empty(N, HV * DV, dtype=torch.bfloat16, device="cuda"))
    conv, rec = conv0.clone(), inp["state0"].clone()

    def step():
        cg.conv1d(x, w, conv, slots_d, cu_d, fresh_d, out=y)
        cg.gated_delta_rule(y, inp["a"], inp["b"], inp["A_log"], inp["dt_bias"], rec, slots_d, cu_d, fresh_d,
                            HK, HV, DK, DV, out=o)
        cg.gated_rms_norm(o, z, nw, 1e-6, out=n)

    step()                                            # eager (also compiles)
    eager = (n.clone(), conv.clone(), rec.clone())
    conv.copy_(conv0)
    rec.copy_(inp["state0"])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    conv.copy_(conv0)
    rec.copy_(inp["state0"])
    n.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(n, eager[0]) and torch.equal(conv, eager[1]) and torch.equal(rec, eager[2])


def test_argument_errors_name_the_argument():
    from kernels import cuda_gdn as cg
    from kernels.launch import KernelError
    HK, HV, DK, DV = SHAPES["tiny16"]
    C = 2 * HK * DK + HV * DV
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")   # noqa: E731
    slots, cu, fresh = i32([0]), i32([0, 1]), i32([1])
    y = torch.zeros(1, C, dtype=torch.bfloat16, device="cuda")
    ab = torch.zeros(1, HV, dtype=torch.bfloat16, device="cuda")
    p = torch.zeros(HV, device="cuda")
    state = torch.zeros(2, HV, DK, DV, device="cuda")
    with pytest.raises(KernelError, match="state"):
        cg.gated_delta_rule(y, ab, ab, p, p, state.to(torch.bfloat16), slots, cu, fresh, HK, HV, DK, DV)
    with pytest.raises(KernelError, match="slots"):
        cg.gated_delta_rule(y, ab, ab, p, p, state, slots.long(), cu, fresh, HK, HV, DK, DV)
    with pytest.raises(KernelError, match="keep_states"):
        cg.gated_delta_rule(y, ab, ab, p, p, state, slots, cu, fresh, HK, HV, DK, DV,
                            keep_states=torch.zeros(2, HV, DK, DV, device="cuda"))
    with pytest.raises(KernelError, match="conv_state"):
        cg.conv1d(y, torch.zeros(C, 4, dtype=torch.bfloat16, device="cuda"),
                  torch.zeros(2, C, 4, dtype=torch.bfloat16, device="cuda"), slots, cu, fresh)

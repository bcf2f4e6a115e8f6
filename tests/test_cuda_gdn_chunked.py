"""The chunked gated delta rule (kernels/cuda_gdn.py with max_columns: gdn_chunk_prep / gdn_chunk_scan)
against the reference ops and against the recurrent kernel, on the GPU.

Real shapes (27B, 35B, their tp2 halves) and tiny odd ones (DK != DV, GVA ratio 3, DK 256, a value
slice of 8 columns), batches that mix long and short sequences: full and partial chunks of 64, one
column, 8192 columns, continuing (non-fresh) states, a sequence without a slot, an empty sequence.
Outputs are poisoned with NaN first; slots outside the batch must come back bit for bit.

Bounds: the outputs are bf16, whose rounding alone is up to 2^-8 relative, so 1e-2 of the largest
output as in tests/test_cuda_gdn.py. The state is fp32 throughout: the chunked algorithm in fp32 stays
within ~2e-6 of float64 at 8192 columns (random data, the model's shapes), the recurrent one ~2e-7,
so 1e-4 of the largest state entry is a wide margin that still catches any indexing or masking slip
(those move entries by O(1)).
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
    "gva3": (2, 6, 16, 16),
    "dk32-dv16": (1, 3, 32, 16),
    "dk64-dv24": (2, 4, 64, 24),
    "dk256-dv32": (1, 2, 256, 32),
}

# (shape, column counts of the batch's sequences); a lone sequence continues from its slot's state
CASES = [
    ("27b", [8192]),
    ("27b", [200, 1, 65]),
    ("35b", [64, 64, 3]),
    ("35b", [130]),
    ("27b-tp2", [1000, 63, 5]),
    ("35b-tp2", [2048, 1]),
    ("gva3", [200, 1, 65]),
    ("gva3", [64, 64, 3]),
    ("dk32-dv16", [130]),
    ("dk32-dv16", [65, 2, 64, 63]),
    ("dk64-dv24", [200, 1, 65]),
    ("dk256-dv32", [130, 64]),
]

STATE_BOUND = 1e-4
OUT_BOUND = 1e-2


def maxrel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 (NaN in a fails)."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def make_inputs(shape: str, lengths: list[int], gen: torch.Generator, slots: list[int] | None = None,
                fresh: list[int] | None = None, spare: int = 3):
    """Random conv outputs, gates and states; shuffled distinct slots among len + spare; a mix of fresh
    and continuing sequences (a lone sequence continues)."""
    HK, HV, DK, DV = SHAPES[shape]
    C = 2 * HK * DK + HV * DV
    B = len(lengths)
    N = sum(lengths)
    n_slots = B + spare
    if slots is None:
        slots = torch.randperm(n_slots, generator=gen)[:B].tolist()
    if fresh is None:
        fresh = [int(v) for v in (torch.rand(B, generator=gen) < 0.5).tolist()]
        if B >= 2:
            fresh[0], fresh[1] = 1, 0
        else:
            fresh = [0]
    cu = [0]
    for T in lengths:
        cu.append(cu[-1] + T)
    param_dtype = torch.bfloat16 if shape in ("27b", "35b-tp2", "gva3", "dk256-dv32") else torch.float32
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")   # noqa: E731
    return dict(
        y=F.silu(torch.randn(N, C, generator=gen)).to(torch.bfloat16).cuda(),
        a=torch.randn(N, HV, generator=gen).to(torch.bfloat16).cuda(),
        b=torch.randn(N, HV, generator=gen).to(torch.bfloat16).cuda(),
        A_log=torch.randn(HV, generator=gen).to(param_dtype).cuda(),
        dt_bias=torch.randn(HV, generator=gen).to(param_dtype).cuda(),
        state0=(0.5 * torch.randn(n_slots, HV, DK, DV, generator=gen)).cuda(),
        slots=slots, fresh=fresh, cu=cu, meta=(i32(slots), i32(cu), i32(fresh)))


def reference_rule(inp, shape):
    """Per sequence: (o [T, HV, DV], final state) in float64, or None for an empty sequence. A sequence
    starts from zeros when fresh or without a slot."""
    HK, HV, DK, DV = SHAPES[shape]
    y, cu = inp["y"], inp["cu"]
    g, beta = ref.gdn_gates(inp["a"].double(), inp["b"], inp["A_log"].double(), inp["dt_bias"].double())
    beta = beta.double()                          # torch.sigmoid on bf16: rounded to bf16, as in the model
    results = []
    for i in range(len(cu) - 1):
        lo, hi = cu[i], cu[i + 1]
        T = hi - lo
        if T <= 0:
            results.append(None)
            continue
        q, k, v = torch.split(y[lo:hi].double(), [HK * DK, HK * DK, HV * DV], dim=-1)
        q, k = ref.gdn_prepare_qk(q.reshape(T, HK, DK), k.reshape(T, HK, DK), HV // HK)
        slot = inp["slots"][i]
        s0 = None if inp["fresh"][i] or slot < 0 else inp["state0"][slot].double()
        results.append(ref.gated_delta_rule_recurrent(q, k, v.reshape(T, HV, DV), g[lo:hi], beta[lo:hi], s0))
    return results


def run_rule(cg, inp, shape, state, out=None, max_columns=None, keep_states=None):
    HK, HV, DK, DV = SHAPES[shape]
    slots_d, cu_d, fresh_d = inp["meta"]
    return cg.gated_delta_rule(inp["y"], inp["a"], inp["b"], inp["A_log"], inp["dt_bias"], state, slots_d, cu_d,
                               fresh_d, HK, HV, DK, DV, out=out, keep_states=keep_states, max_columns=max_columns)


def check_against_reference_and_recurrent(cg, inp, shape, lengths, max_columns):
    HK, HV, DK, DV = SHAPES[shape]
    N = sum(lengths)
    state0 = inp["state0"]
    state = state0.clone()
    out = torch.full((N, HV, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    # max_columns is an upper bound: raised to the threshold, short batches take the chunked path too
    got = run_rule(cg, inp, shape, state, out=out, max_columns=max(max_columns, cg.CHUNKED_MIN_COLUMNS))
    assert got.data_ptr() == out.data_ptr()
    rec_state = state0.clone()
    rec_out = run_rule(cg, inp, shape, rec_state)             # the recurrent kernel on the same inputs
    expected_state = state0.clone()
    for i, res in enumerate(reference_rule(inp, shape)):
        lo, hi = inp["cu"][i], inp["cu"][i + 1]
        slot = inp["slots"][i]
        what = f"sequence {i} (T={hi - lo}, fresh={inp['fresh'][i]}, slot={slot})"
        if res is None:
            continue
        o_ref, s_ref = res
        err = maxrel(out[lo:hi], o_ref)
        assert err <= OUT_BOUND, f"{what}: output error {err:.3g} against float64"
        err = maxrel(out[lo:hi], rec_out[lo:hi])
        assert err <= OUT_BOUND, f"{what}: output differs from the recurrent kernel by {err:.3g}"
        if slot >= 0:
            err = maxrel(state[slot], s_ref)
            assert err <= STATE_BOUND, f"{what}: final state error {err:.3g} against float64"
            err = maxrel(state[slot], rec_state[slot])
            assert err <= STATE_BOUND, f"{what}: final state differs from the recurrent kernel by {err:.3g}"
            expected_state[slot] = state[slot]
    # every slot outside the batch (and those of skipped sequences) unchanged, bit for bit
    assert torch.equal(state, expected_state)
    return out


@pytest.mark.parametrize("shape,lengths", CASES, ids=[f"{s}-{'+'.join(map(str, ls))}" for s, ls in CASES])
def test_chunked_rule_matches_reference_and_recurrent(shape, lengths, seed):
    from kernels import cuda_gdn as cg
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(shape, lengths, gen)
    check_against_reference_and_recurrent(cg, inp, shape, lengths, max(lengths))


LEFT_LOOKING_CASES = [("27b", [200, 1, 65]), ("gva3", [64, 64, 3]), ("dk64-dv24", [200, 1, 65]),
                      ("dk256-dv32", [130, 64])]


@pytest.mark.parametrize("shape,lengths", LEFT_LOOKING_CASES,
                         ids=[f"{s}-{'+'.join(map(str, ls))}" for s, ls in LEFT_LOOKING_CASES])
def test_the_left_looking_prep_that_sm_120_builds(shape, lengths, seed, tmp_path, monkeypatch):
    """gdn.cu picks the prep's triangular solve by architecture (GDN_PREP_RIGHT_LOOKING: right-looking,
    but left-looking for sm_120, whose ptxas spills the other form). Both forms run here: the source
    built with the left-looking one forced meets the same bounds."""
    from kernels import cuda_gdn as cg
    src = tmp_path / "gdn_left_looking.cu"
    src.write_text('#define GDN_PREP_RIGHT_LOOKING 0\n#include "gdn.cu"\n')
    monkeypatch.setattr(cg, "_SOURCE", str(src.with_suffix("")))      # kernels.launch reads <name>.cu
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(shape, lengths, gen)
    check_against_reference_and_recurrent(cg, inp, shape, lengths, max(lengths))


def test_no_slot_empty_sequence_and_generous_max_columns(seed):
    """Sequence 0 has no slot (-1) and is not marked fresh: it starts from zeros and writes nothing;
    sequence 1 is empty (skipped: its slot keeps its state, no column is its own); max_columns above
    the longest sequence only adds blocks that exit."""
    from kernels import cuda_gdn as cg
    shape = "dk64-dv24"
    gen = torch.Generator().manual_seed(seed)
    lengths = [130, 0, 70]
    inp = make_inputs(shape, lengths, gen, slots=[-1, 0, 2], fresh=[0, 0, 0])
    check_against_reference_and_recurrent(cg, inp, shape, lengths, sum(lengths) + 64)


def test_short_batches_and_kept_states_stay_on_the_recurrent_kernel(seed):
    """Below CHUNKED_MIN_COLUMNS, and whenever keep_states is given, max_columns changes nothing: the
    recurrent kernel runs, bit for bit."""
    from kernels import cuda_gdn as cg
    shape = "gva3"
    HK, HV, DK, DV = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    lengths = [cg.CHUNKED_MIN_COLUMNS - 1, 4, 1]
    inp = make_inputs(shape, lengths, gen)
    N = sum(lengths)
    s_plain, s_hint = inp["state0"].clone(), inp["state0"].clone()
    o_plain = run_rule(cg, inp, shape, s_plain)
    o_hint = run_rule(cg, inp, shape, s_hint, max_columns=max(lengths))
    assert torch.equal(o_plain, o_hint) and torch.equal(s_plain, s_hint)

    kept_plain = torch.empty(N, HV, DK, DV, device="cuda")
    kept_hint = torch.empty(N, HV, DK, DV, device="cuda")
    live = inp["state0"].clone()
    o_plain = run_rule(cg, inp, shape, live, keep_states=kept_plain)
    o_hint = run_rule(cg, inp, shape, live, keep_states=kept_hint, max_columns=10 * cg.CHUNKED_MIN_COLUMNS)
    assert torch.equal(o_plain, o_hint) and torch.equal(kept_plain, kept_hint)
    assert torch.equal(live, inp["state0"])


def test_max_columns_must_be_a_non_negative_int():
    from kernels import cuda_gdn as cg
    from kernels.launch import KernelError
    HK, HV, DK, DV = SHAPES["gva3"]
    C = 2 * HK * DK + HV * DV
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")   # noqa: E731
    y = torch.zeros(1, C, dtype=torch.bfloat16, device="cuda")
    ab = torch.zeros(1, HV, dtype=torch.bfloat16, device="cuda")
    p = torch.zeros(HV, device="cuda")
    state = torch.zeros(2, HV, DK, DV, device="cuda")
    for bad in (-1, 64.5, "64"):
        with pytest.raises(KernelError, match="max_columns"):
            cg.gated_delta_rule(y, ab, ab, p, p, state, i32([0]), i32([0, 1]), i32([1]), HK, HV, DK, DV,
                                max_columns=bad)

"""kernels/cuda_misc.py (norm.cu, moe.cu, sample.cu) against kernels/reference.py on the GPU.

Fresh random inputs every run (the `seed` fixture), outputs poisoned with NaN first (passed as out=),
at the 27B shapes (E=5120, V=248320), the 35B-A3B shapes (E=2048, X=256, A=8, I=512; tp2 I=256)
and odd small ones (E=24, 40; X=8, A=2, I=32).

Bounds:
* embedding: exact (out-of-range ids read the clamped row).
* swiglu: exact against torch's bf16 F.silu(gate) * up.
* rms_norm / add_rms_norm: the residual add is bit-exact; the norm is within 1 bf16 ulp of the
  reference (the fp32 sum of squares is summed in a different order than torch's reduction; the
  maths after it is the reference's, operation for operation). The share of elements that are not
  bit-exact is printed (pytest -s) and must stay small.
* moe_route: ids equal to the rule "descending probability, ties to the lower expert id" applied to
  the reference's fp32 probabilities, except in rows where two distinct logits give probabilities
  within 1e-6 (there only the selected probabilities are checked); weights within 1 bf16 ulp;
  constructed ties check that the lower id wins.
* experts (decode kernels and the prefill path): relative error (Frobenius) <= 1e-2.
* argmax_rows: exact (values and ids) against torch.argmax (first maximum), with constructed ties
  across CTA chunk boundaries and inside one vector, and NaN elements that never win.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref
from tests.util import rel

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
EPS = 1e-6


def _cm():
    from kernels import cuda_misc
    return cuda_misc


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(shape, g, dtype=BF16, scale=1.0):
    t = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
    return t.mul_(scale) if scale != 1.0 else t


def _poison(shape, dtype):
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    return torch.full(shape, -7, dtype=dtype, device="cuda")


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """bf16 bits as integers that are monotonic in the value (ulp distance = difference)."""
    b = t.contiguous().view(torch.int16).to(torch.int32)
    mag = b & 0x7FFF
    return torch.where(b < 0, -mag, mag)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    assert a.dtype == b.dtype == BF16
    return (_ordered(a) - _ordered(b)).abs()


# --------------------------------------------------------------------------------------------------
# Embedding


@pytest.mark.parametrize("V,E", [(248320, 5120), (1000, 2048), (50, 24), (50, 40), (33, 13)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_embedding(V, E, id_dtype, seed):
    cm = _cm()
    g = _gen(seed)
    table = _randn((V, E), g)
    N = 37
    ids = torch.randint(0, V, (N,), generator=g, device="cuda").to(id_dtype)
    ids[0], ids[1], ids[2] = -5, V + 3, V - 1                  # out of range: clamped, never read outside
    out = cm.embedding(ids, table, out=_poison((N, E), BF16))
    want = F.embedding(ids.long().clamp(0, V - 1), table)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    twod = cm.embedding(ids[:36].reshape(6, 6), table)          # any id shape
    assert torch.equal(twod.view(torch.int16), want[:36].reshape(6, 6, E).view(torch.int16))


# --------------------------------------------------------------------------------------------------
# RMSNorm


def _misaligned(shape, g):
    """A contiguous bf16 tensor whose data pointer is 2 bytes past 16-byte alignment (generic path)."""
    n = 1
    for s in shape:
        n *= s
    buf = _randn((n + 1,), g)
    return buf[1:].view(*shape)


NORM_SHAPES = [(7, 5120), (64, 5120), (3, 2048), (5, 24), (2, 40), (3, 4, 256), (4, 13), (2, 16384), (1, 6000)]


def _check_norm(got, want, what):
    d = _ulps(got, want)
    assert not torch.isnan(got).any(), f"{what}: NaN left in the output"
    worst = int(d.max())
    share = float((d > 0).float().mean())
    print(f"{what}: max {worst} bf16 ulp, {share:.2e} of elements not bit-exact")
    assert worst <= 1, f"{what}: {worst} ulps"
    assert share < 0.02, f"{what}: {share:.3f} of elements differ"


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_rms_norm(shape, aligned, seed):
    cm = _cm()
    g = _gen(seed)
    x = _randn(shape, g, scale=3.0) if aligned else _misaligned(shape, g)
    w = _randn((shape[-1],), g, scale=0.1)
    want = ref.rms_norm(x, w, EPS)
    got = cm.rms_norm(x, w, EPS, out=_poison(shape, BF16))
    _check_norm(got, want, f"rms_norm {shape} {'aligned' if aligned else 'misaligned'}")
    inplace = x.clone()                                        # a fresh (aligned) buffer
    cm.rms_norm(inplace, w, EPS, out=inplace)
    if aligned:                                                # same path: same bits
        assert torch.equal(inplace.view(torch.int16), got.view(torch.int16))
    else:                                                      # the vector path may sum in another order
        _check_norm(inplace, want, f"rms_norm {shape} in place")


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_add_rms_norm(shape, aligned, seed):
    cm = _cm()
    g = _gen(seed)
    if aligned:
        x, y = _randn(shape, g, scale=3.0), _randn(shape, g)
    else:
        x, y = _misaligned(shape, g), _misaligned(shape, g)
    w = _randn((shape[-1],), g, scale=0.1)
    x_new = x + y                                              # torch's bf16 add
    want = ref.rms_norm(x_new, w, EPS)
    x_out, out = cm.add_rms_norm(x, y, w, EPS, x_out=_poison(shape, BF16), out=_poison(shape, BF16))
    assert torch.equal(x_out.view(torch.int16), x_new.view(torch.int16))
    _check_norm(out, want, f"add_rms_norm {shape} {'aligned' if aligned else 'misaligned'}")
    xi = x.clone()                                             # in place on the residual
    r_x, r_out = cm.add_rms_norm(xi, y, w, EPS, x_out=xi)
    assert r_x.data_ptr() == xi.data_ptr()
    assert torch.equal(xi.view(torch.int16), x_new.view(torch.int16))
    assert torch.equal(r_out.view(torch.int16), out.view(torch.int16))


@pytest.mark.parametrize("T,F2", [(300, 2 * 17408), (33, 2 * 8704), (5, 2 * 13), (2, 2 * 24)])
def test_swiglu(T, F2, seed):
    """Bit for bit torch's bf16 F.silu(gate) * up (the reference's roundings), fast and generic paths."""
    cm = _cm()
    y = _randn((T, F2), _gen(seed), scale=4.0)
    gate, up = y[:, :F2 // 2], y[:, F2 // 2:]
    want = F.silu(gate) * up
    got = cm.swiglu(y, out=_poison((T, F2 // 2), BF16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
        f"{(got.float() != want.float()).sum().item()} of {want.numel()} elements differ"
    # the reference formula in float32 agrees to bf16 rounding
    r = (F.silu(gate.float()).bfloat16().float() * up.float())
    assert rel(got.float(), r) < 1e-2


# --------------------------------------------------------------------------------------------------
# MoE router


def _rule_topk(logits: torch.Tensor, k: int):
    """The reference's fp32 probabilities and the rule's ids (descending, ties to the lower id)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    order = torch.sort(probs.cpu(), dim=-1, descending=True, stable=True).indices[:, :k]
    return probs.cpu(), order


@pytest.mark.parametrize("N,E,X,A", [(1, 2048, 256, 8), (64, 2048, 256, 8), (7, 24, 8, 2), (5, 40, 40, 3),
                                     (9, 64, 512, 8), (3, 64, 32, 32), (2, 64, 512, 32), (4, 64, 300, 20)])
@pytest.mark.parametrize("logit_dtype", [BF16, torch.float32])
def test_moe_route(N, E, X, A, logit_dtype, seed):
    cm = _cm()
    g = _gen(seed)
    x = _randn((N, E), g)
    w_router = _randn((X, E), g, scale=2.0 / E ** 0.5)
    logits = F.linear(x, w_router)                             # exactly what reference.moe_route computes
    weights, ids = cm.moe_route(logits.to(logit_dtype), A, weights_out=_poison((N, A), BF16),
                                ids_out=_poison((N, A), torch.int32))
    lf = logits.to(logit_dtype).float().cpu()
    probs, rule = _rule_topk(logits.to(logit_dtype), A)
    ids_c, w_c = ids.long().cpu(), weights.cpu()
    assert ((ids_c >= 0) & (ids_c < X)).all()
    assert all(len(set(r.tolist())) == A for r in ids_c), "an expert selected twice"
    ref_w, ref_ids = ref.moe_route(x, w_router, A) if logit_dtype == BF16 else (None, None)
    near = 0
    for n in range(N):
        srt = torch.sort(probs[n], descending=True, stable=True)
        top_v, top_i = srt.values[:A + 1], srt.indices[:A + 1]
        gaps = (top_v[:-1] - top_v[1:]).abs()
        same_logit = lf[n, top_i[:-1]] == lf[n, top_i[1:]]
        is_near = bool(((gaps < 1e-6) & ~same_logit).any())
        got_p = probs[n, ids_c[n]]
        assert torch.allclose(got_p, srt.values[:A], rtol=0, atol=1e-6), f"row {n}: not the top {A}"
        if is_near:
            near += 1
            continue
        assert torch.equal(ids_c[n], rule[n]), f"row {n}: ids {ids_c[n].tolist()} != {rule[n].tolist()}"
        top = probs[n, rule[n]]
        want_w = (top / top.sum()).to(BF16)
        assert int(_ulps(w_c[n], want_w).max()) <= 1, f"row {n}: weights {w_c[n]} vs {want_w}"
        if ref_ids is not None and not bool((gaps[:A] == 0).any()):   # no exact ties: torch.topk's order is the rule's
            assert torch.equal(ids_c[n], ref_ids[n].cpu()), f"row {n}: differs from reference.moe_route"
            assert int(_ulps(w_c[n], ref_w[n].cpu()).max()) <= 1
    print(f"moe_route N={N} X={X} A={A}: {near} row(s) with near-ties (< 1e-6) skipped")
    assert near <= max(1, N // 4)


@pytest.mark.parametrize("N,X,A", [(1, 256, 8), (64, 256, 8), (5, 8, 2), (3, 32, 31), (9, 511, 8)])
@pytest.mark.parametrize("logit_dtype", [BF16, torch.float32])
def test_moe_route_with_the_shared_expert(N, X, A, logit_dtype, seed):
    """shared=True: logits [N, X + 1], the last column the shared expert's gate. The first A slots are
    moe_route of the X router columns alone (the same ids and weights, bit for bit), slot A is expert X
    with torch's bf16 sigmoid of the gate logit."""
    cm = _cm()
    g = _gen(seed)
    E = 64
    x = _randn((N, E), g)
    w = _randn((X + 1, E), g, scale=2.0 / E ** 0.5)
    logits = F.linear(x, w).to(logit_dtype)
    weights, ids = cm.moe_route(logits, A, weights_out=_poison((N, A + 1), BF16),
                                ids_out=_poison((N, A + 1), torch.int32), shared=True)
    plain_w, plain_ids = cm.moe_route(logits[:, :X].contiguous(), A)
    assert torch.equal(ids[:, :A], plain_ids) and torch.equal(weights[:, :A], plain_w)
    assert (ids[:, A] == X).all()
    want = torch.sigmoid(logits[:, X].float().cpu()).to(BF16)
    assert int(_ulps(weights[:, A].cpu(), want).max()) <= 1
    with pytest.raises(cm.KernelError, match="top_k"):
        cm.moe_route(logits, X + 1, shared=True)              # X routed experts only


def test_keyed_noise_is_the_same_on_the_gpu(seed):
    """The sampler's keyed uniforms are integer hashes: the same bits on the GPU as on the CPU (the
    noise a GPU rank adds equals the reference backend's up to the last ulp of log)."""
    from ranks.sampler import gumbel_noise, keyed_uniforms
    V = 248_320
    assert torch.equal(keyed_uniforms(seed, 9, 0, 0, V, "cuda").cpu(), keyed_uniforms(seed, 9, 0, 0, V))
    torch.testing.assert_close(gumbel_noise(seed, 9, V, "cuda").cpu(), gumbel_noise(seed, 9, V), rtol=1e-14,
                               atol=1e-14)


def test_batched_sampling_candidates_equal_the_row_loop_on_the_gpu(seed):
    """ranks.sampler.local_candidates on a GPU: the batched form (the default there: one batch of device
    operations for all rows) gives the row loop's (score, index) bits on the same device, for mixed
    greedy / tempered / penalised / biased rows of a 248k vocabulary shard at an offset."""
    from ranks.sampler import SeqSampler, local_candidates
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(9, 124_160, generator=gen) * 3.0).to(BF16).to("cuda")
    temps = [0.0, 0.6, 1.0, 1.7]
    samplers = []
    for i in range(9):
        s = SeqSampler(temperature=temps[i % 4], seed=seed + i, repetition_penalty=1.3 if i % 3 == 0 else 1.0,
                       frequency_penalty=0.3 if i % 3 == 0 else 0.0,
                       bias={124_160 + 7 * i: 5.0, 124_160 + 100_000: -2.5, 3: 100.0} if i % 2 else {})
        s.observe([124_160 + 5, 124_160 + 5, 124_160 + 90_000, 3], 0)
        samplers.append(s)
    positions = [1_000 + 17 * i for i in range(9)]
    for rows in (list(range(9)), [1, 2, 3, 5, 6, 7]):
        sub, pos = [samplers[i] for i in rows], [positions[i] for i in rows]
        a = local_candidates(logits, sub, pos, rows, 124_160)
        b = local_candidates(logits, sub, pos, rows, 124_160, batched=False)
        assert torch.equal(a, b), (rows, a, b)


def test_moe_route_ties_go_to_lower_id():
    cm = _cm()
    X = 256
    logits = torch.full((4, X), -1.0, dtype=torch.float32, device="cuda")
    logits[0, [200, 37, 5, 64]] = 2.0               # 5 and 37: one lane, two slots; 64: lane 0
    logits[1, [255, 254]] = 3.0                     # the tie after a clear winner
    logits[1, 100] = 4.0
    logits[2] = 0.5                                 # all equal: 0..7, weights 1/8
    logits[3, [31, 32, 33]] = 1.0                   # lane boundary
    w, ids = cm.moe_route(logits.to(BF16), 8)
    ids = ids.cpu().tolist()
    assert ids[0][:4] == [5, 37, 64, 200] and ids[0][4:] == [0, 1, 2, 3]
    assert ids[1][:3] == [100, 254, 255] and ids[1][3:] == [0, 1, 2, 3, 4]
    assert ids[2] == list(range(8))
    assert ids[3][:3] == [31, 32, 33]
    assert torch.equal(w[2].float().cpu(), torch.full((8,), 0.125))
    nan = torch.full((1, X), -1.0, dtype=torch.float32, device="cuda")
    nan[0, [3, 100]] = float("nan")                 # a NaN logit makes the softmax NaN: ids stay valid, distinct
    _, ids_n = cm.moe_route(nan, 8)
    assert sorted(set(ids_n.cpu().tolist()[0])) == sorted(ids_n.cpu().tolist()[0]) and int(ids_n.max()) < X
    w2, ids2 = cm.moe_route(logits[:1, :], 3)       # fp32 logits, k = 3
    assert ids2.cpu().tolist() == [[5, 37, 64]]
    assert torch.allclose(w2.float().cpu(), torch.full((1, 3), 1 / 3), atol=2e-3)


# --------------------------------------------------------------------------------------------------
# Routed experts


def _experts_inputs(N, E, X, A, I, g, ids_dtype=torch.int32, w_dtype=BF16):
    x = _randn((N, E), g)
    gate_up = _randn((X, 2 * I, E), g, scale=1.0 / E ** 0.5)
    down = _randn((X, E, I), g, scale=1.0 / I ** 0.5)
    ids = torch.rand((N, X), generator=g, device="cuda").argsort(dim=-1)[:, :A].to(ids_dtype).contiguous()
    weights = torch.softmax(torch.randn((N, A), generator=g, device="cuda"), dim=-1).to(w_dtype)
    return x, ids, weights, gate_up, down


EXPERT_SHAPES = [(1, 2048, 256, 8, 512), (8, 2048, 256, 8, 512), (64, 2048, 256, 8, 512),
                 (4, 2048, 256, 8, 256), (3, 24, 8, 2, 32), (5, 40, 8, 2, 32)]


@pytest.mark.parametrize("N,E,X,A,I", EXPERT_SHAPES, ids=lambda v: str(v))
def test_moe_experts_decode(N, E, X, A, I, seed):
    cm = _cm()
    g = _gen(seed)
    x, ids, weights, gate_up, down = _experts_inputs(N, E, X, A, I, g)
    want = ref.moe_experts(x, ids.long(), weights, gate_up, down)
    got = cm.moe_experts_decode(x, ids, weights, gate_up, down, out=_poison((N, E), BF16),
                                h=_poison((N, A, I), BF16))
    assert not torch.isnan(got).any()
    err = rel(got, want)
    print(f"moe_experts_decode N={N} E={E} X={X} A={A} I={I}: rel err {err:.2e}")
    assert err <= 1e-2
    # int64 ids and fp32 weights take the same path
    got64 = cm.moe_experts_decode(x, ids.long(), weights.float(), gate_up, down)
    assert rel(got64, want) <= 1e-2


@pytest.mark.parametrize("N,E,X,A,I", [(100, 2048, 256, 8, 512), (2048, 2048, 256, 8, 256), (33, 40, 8, 2, 32)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_moe_experts_prefill(N, E, X, A, I, grouped, seed, monkeypatch):
    """Both routes (the grouped matmul where this GPU supports it, and the per-expert loop)."""
    cm = _cm()
    if grouped and not cm._grouped_mm_works(torch.device("cuda")):
        pytest.skip("torch._grouped_mm does not run bf16 on this GPU")
    monkeypatch.setitem(cm._GROUPED_MM, "cuda", grouped)
    monkeypatch.setitem(cm._GROUPED_MM, str(torch.device("cuda", torch.cuda.current_device())), grouped)
    g = _gen(seed)
    x, ids, weights, gate_up, down = _experts_inputs(N, E, X, A, I, g, ids_dtype=torch.int64)
    want = ref.moe_experts(x, ids, weights, gate_up, down)
    got = cm.moe_experts_prefill(x, ids, weights, gate_up, down, out=_poison((N, E), BF16))
    assert rel(got, want) <= 1e-2
    dec = cm.moe_experts_decode(x, ids, weights, gate_up, down)
    assert rel(dec, want) <= 1e-2


def test_moe_block_with_route(seed):
    """Router + experts kernels composed like reference.moe_block (no shared expert)."""
    cm = _cm()
    g = _gen(seed)
    N, E, X, A, I = 4, 2048, 256, 8, 512
    x, _, _, gate_up, down = _experts_inputs(N, E, X, A, I, g)
    w_router = _randn((X, E), g, scale=2.0 / E ** 0.5)
    want = ref.moe_block(x, w_router, A, gate_up, down, None, None)
    w, ids = cm.moe_route(F.linear(x, w_router), A)
    got = cm.moe_experts_decode(x, ids, w, gate_up, down)
    assert rel(got, want) <= 1e-2


@pytest.mark.parametrize("N,E,X,A,I", EXPERT_SHAPES + [(1, 2048, 257, 9, 512), (8, 2048, 257, 9, 512),
                                                   (2, 64, 40, 31, 16), (2, 64, 16, 16, 512)], ids=lambda v: str(v))
def test_moe_expert_kernels_agree(N, E, X, A, I, seed, monkeypatch):
    """The expert kernels (TANDEM_MOE_KERNELS=early: the first weight loads issued before x / h are
    staged; the down kernel's 24 per lane, more than one batch where A * I / 8 > 768), the earlier ones
    (old) and the default's choice between them sum in the same order: the same bits; all within the
    bf16 bound of reference.moe_experts. Shapes include the 35B-A3B's with the
    shared expert folded (A = 9) and rows of two batches (A * I = 8192: 1024 chunks of 16 bytes)."""
    cm = _cm()
    g = _gen(seed)
    x, ids, weights, gate_up, down = _experts_inputs(N, E, X, A, I, g)
    want = ref.moe_experts(x, ids.long(), weights, gate_up, down)
    outs = []
    for variant in ("early", "old", ""):
        monkeypatch.setenv(cm.MOE_KERNELS_ENV, variant)
        outs.append(cm.moe_experts_decode(x, ids, weights, gate_up, down, out=_poison((N, E), BF16),
                                          h=_poison((N, A, I), BF16)))
    for o in outs[1:]:
        assert torch.equal(outs[0].view(torch.int16), o.view(torch.int16))
    assert rel(outs[0], want) <= 1e-2


# --------------------------------------------------------------------------------------------------
# Argmax


@pytest.mark.parametrize("R,V", [(1, 248320), (8, 124160), (64, 248320), (3, 1000), (5, 4099), (2, 20001)])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_argmax_rows(R, V, dtype, seed):
    cm = _cm()
    g = _gen(seed)
    logits = _randn((R, V), g, dtype=dtype, scale=4.0)
    chunk = cm._argmax_chunk(R, V)
    big = 100.0
    if V > chunk + 1:                                           # tie across the first CTA boundary
        logits[0, chunk - 1] = big
        logits[0, chunk] = big
    if R > 1 and V > 2 * chunk + 10:                            # tie across two CTAs, later one first in memory
        logits[1, 2 * chunk + 5] = big
        logits[1, chunk] = big
    if R > 2:                                                   # NaN before and after the maximum
        logits[2, 3] = float("nan")
        logits[2, V - 1] = float("nan")
        logits[2, V // 2] = big
    if R > 3:                                                   # tie inside one 16-byte vector
        logits[3, 9] = big
        logits[3, 13] = big
    vals, ids = cm.argmax_rows(logits, values_out=_poison((R,), torch.float32),
                               ids_out=_poison((R,), torch.int64))
    clean = torch.nan_to_num(logits.float(), nan=float("-inf"))
    want_ids = torch.argmax(clean, dim=-1)                      # first maximum
    want_vals = clean.max(dim=-1).values
    assert torch.equal(ids.cpu(), want_ids.cpu()), (ids.cpu(), want_ids.cpu())
    assert torch.equal(vals.cpu(), want_vals.cpu())
    if V > chunk + 1:
        assert int(ids[0]) == chunk - 1
    if R > 1 and V > 2 * chunk + 10:
        assert int(ids[1]) == chunk
    if R > 2:
        assert int(ids[2]) == V // 2
    if R > 3:
        assert int(ids[3]) == 9


def test_argmax_rows_special_rows():
    cm = _cm()
    V = 248320
    x = torch.zeros((4, V), dtype=BF16, device="cuda")
    x[0] = float("nan")                                         # nothing but NaN: (-inf, 0)
    x[1] = float("-inf")                                        # all -inf: the first one
    x[2] = float("nan")
    x[2, V - 1] = -3.0                                          # the only number, at the very end
    x[3] = 1.0                                                  # all equal: index 0
    vals, ids = cm.argmax_rows(x)
    assert ids.cpu().tolist() == [0, 0, V - 1, 0]
    assert vals.cpu().tolist() == [float("-inf"), float("-inf"), -3.0, 1.0]


# --------------------------------------------------------------------------------------------------
# CUDA graphs


def test_capturable_in_cuda_graph(seed):
    """Embedding, route, experts, add_rms_norm and argmax captured once and replayed on new inputs;
    every captured output equals the eager kernel on the captured inputs (all kernels are deterministic)."""
    cm = _cm()
    g = _gen(seed)
    N, E, X, A, I, V = 4, 2048, 64, 8, 256, 12288
    x, _, _, gate_up, down = _experts_inputs(N, E, X, A, I, g)
    w_router = _randn((X, E), g, scale=2.0 / E ** 0.5)
    w_norm = _randn((E,), g, scale=0.1)
    head = _randn((V, E), g, scale=1.0 / E ** 0.5)
    ids_in = torch.randint(0, V, (N,), generator=g, device="cuda", dtype=torch.int32)
    static_x = x.clone()

    def step():
        emb = cm.embedding(ids_in, head)
        router = F.linear(static_x, w_router)
        w, ids = cm.moe_route(router, A)
        y = cm.moe_experts_decode(static_x, ids, w, gate_up, down)
        resid, h = cm.add_rms_norm(emb, y, w_norm, EPS)
        logits = F.linear(h, head)
        vals, best = cm.argmax_rows(logits)
        return emb, router, w, ids, y, resid, h, logits, vals, best

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                                  # compile and warm up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        emb, router, w, ids, y, resid, h, logits, vals, best = step()
    same = lambda a, b: torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.dtype == BF16 else torch.equal(a, b)
    for _ in range(2):
        static_x.copy_(_randn((N, E), g))
        ids_in.copy_(torch.randint(0, V, (N,), generator=g, device="cuda", dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert same(emb, F.embedding(ids_in.long(), head))
        w_e, ids_e = cm.moe_route(router, A)
        assert same(w, w_e) and same(ids, ids_e)
        assert same(y, cm.moe_experts_decode(static_x, ids, w, gate_up, down))
        r_e, h_e = cm.add_rms_norm(emb, y, w_norm, EPS)
        assert same(resid, r_e) and same(h, h_e)
        v_e, b_e = cm.argmax_rows(logits)
        assert same(vals, v_e) and same(best, b_e)
        assert torch.equal(best, torch.argmax(logits.float(), dim=-1))

"""CUDA gated attention (kernels/cuda_attention.py) against the reference ops.

Pools are filled with large garbage first and every page table entry past a sequence's pages points
at a garbage page, so a read past a length shows; pages are shuffled; outputs are poisoned with NaN
(passed as out=); the columns of the batch are shuffled so nothing relies on column order.
"""

import math

import pytest
import torch

from kernels import reference as ops
from tests.util import rel

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF = torch.bfloat16
GARBAGE = 3.0e4
EPS = 1e-6
THETA = 1e7
TOL = 1e-2

SHAPES = {              # H, KV, D, rotary dim
    "27b": (24, 4, 256, 64),
    "35b": (16, 2, 256, 64),
    "27b-tp2": (12, 2, 256, 64),
    "35b-tp2": (8, 1, 256, 64),
    "demo": (6, 2, 64, 16),
    "h4kv2d32": (4, 2, 32, 8),
    "h6kv1d64": (6, 1, 64, 16),
    "h12kv1d128": (12, 1, 128, 32),        # 12 heads per kv head: two CTAs of 6 heads
}


def _ca():
    from kernels import cuda_attention
    return cuda_attention


class Case:
    """B sequences with `lengths` keys after this step; the last min(T, L) positions are the columns."""

    def __init__(self, shape: str, lengths: list[int], T: int, seed: int, spare_pages: int = 2):
        self.H, self.KV, self.D, self.R = SHAPES[shape]
        KV, D = self.KV, self.D
        g = torch.Generator().manual_seed(seed)
        self.gen = g
        self.lengths = lengths
        need = [math.ceil(n / 64) for n in lengths]
        max_pages = max(need) + 1
        P = sum(need) + spare_pages
        perm = torch.randperm(P, generator=g)
        garbage_page = int(perm[-1])                                   # never assigned
        table = torch.full((len(lengths), max_pages), garbage_page, dtype=torch.int32)
        at = 0
        for b, n in enumerate(need):
            table[b, :n] = perm[at:at + n].to(torch.int32)
            at += n
        self.tables = table.to(DEV)
        pos, seq, self.bounds = [], [], []
        for b, n in enumerate(lengths):
            t = min(T, n)
            self.bounds.append((len(pos), len(pos) + t))
            pos += list(range(n - t, n))
            seq += [b] * t
        self.N = len(pos)
        self.positions = torch.tensor(pos, dtype=torch.int32, device=DEV)
        self.seq_of_col = torch.tensor(seq, dtype=torch.int32, device=DEV)
        sign = torch.where(torch.rand(P, 64, KV, D, generator=g) < 0.5, -1.0, 1.0)
        self.k_pool = (sign * GARBAGE).to(BF).to(DEV)
        self.v_pool = (-sign * GARBAGE).to(BF).to(DEV)
        self.order = torch.randperm(self.N, generator=g).to(DEV)      # kernel sees shuffled columns

    def randn(self, *shape, scale=1.0):
        return (torch.randn(*shape, generator=self.gen) * scale).to(BF).to(DEV)

    def fill_history(self, upto_columns: bool) -> None:
        """Random k/v at positions [0, L - T) (or [0, L) with upto_columns) of every sequence."""
        for b, n in enumerate(self.lengths):
            lo, hi = self.bounds[b]
            end = n if upto_columns else n - (hi - lo)
            if end == 0:
                continue
            p = torch.arange(end, device=DEV, dtype=torch.int32)
            k = self.randn(end, self.KV, self.D)
            v = self.randn(end, self.KV, self.D)
            ops.paged_kv_write(self.k_pool, self.v_pool, self.tables[b], p, k, v)

    def shuffled(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.order].contiguous()


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a != b).float().mean())


# --------------------------------------------------------------------------------------------------
# q/k norm + rope + KV write


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_qk_norm_rope_kv_write(shape, T, seed):
    ca = _ca()
    c = Case(shape, [1, 63, 64, 65, 1000, 5000] if T == 1 else [4, 63, 64, 65, 130, 5000], T, seed)
    H, KV, D, R, N = c.H, c.KV, c.D, c.R, c.N
    c.fill_history(upto_columns=False)
    qg = c.randn(N, H * 2 * D, scale=2.0)
    k, v = c.randn(N, KV * D, scale=2.0), c.randn(N, KV * D)
    qw, kw = c.randn(D, scale=0.2), c.randn(D, scale=0.2)

    # reference: bf16 (the model's path, bit-level target) and fp32 (accuracy)
    k_exp, v_exp = c.k_pool.clone(), c.v_pool.clone()
    q = ops.split_q_gate(qg, H, D)[0]
    cos, sin = ops.rope_cos_sin(c.positions, R, THETA, BF)
    q_ref = ops.apply_partial_rope(ops.rms_norm(q, qw, EPS), cos, sin)
    k_ref = ops.apply_partial_rope(ops.rms_norm(k.view(N, KV, D), kw, EPS), cos, sin)
    cos32, sin32 = ops.rope_cos_sin(c.positions, R, THETA, torch.float32)
    q_ref32 = ops.apply_partial_rope(ops.rms_norm(q.float(), qw, EPS), cos32, sin32)
    k_ref32 = ops.apply_partial_rope(ops.rms_norm(k.view(N, KV, D).float(), kw, EPS), cos32, sin32)
    for b, (lo, hi) in enumerate(c.bounds):
        ops.paged_kv_write(k_exp, v_exp, c.tables[b], c.positions[lo:hi], k_ref[lo:hi], v.view(N, KV, D)[lo:hi])
    written = torch.zeros(c.k_pool.shape[:2], dtype=torch.bool, device=DEV)
    for b, (lo, hi) in enumerate(c.bounds):
        p = c.positions[lo:hi].long()
        written[c.tables[b].long()[p // 64], p % 64] = True

    q_out = torch.full((N, H, D), float("nan"), dtype=BF, device=DEV)
    o = c.order
    res = ca.qk_norm_rope_kv_write(qg[o].contiguous(), k[o].contiguous(), v[o].contiguous(), qw, kw, EPS,
                                   c.shuffled(c.positions), c.shuffled(c.seq_of_col), c.tables, c.k_pool,
                                   c.v_pool, R, THETA, q_out=q_out)
    torch.cuda.synchronize()
    assert res is q_out
    assert rel(q_out, q_ref32[o]) <= TOL
    assert _mismatch(q_out, q_ref[o]) <= 0.01, "q rounding differs from the bf16 reference"
    assert torch.equal(c.k_pool[~written], k_exp[~written]), "k pool entries outside the columns changed"
    assert torch.equal(c.v_pool[~written], v_exp[~written]), "v pool entries outside the columns changed"
    assert torch.equal(c.v_pool[written], v_exp[written])
    for b, (lo, hi) in enumerate(c.bounds):
        p = c.positions[lo:hi].long()
        got = c.k_pool[c.tables[b].long()[p // 64], p % 64]
        assert rel(got, k_ref32[lo:hi]) <= TOL
    assert _mismatch(c.k_pool[written], k_exp[written]) <= 0.01, "k rounding differs from the bf16 reference"


def test_qk_norm_rope_strided_inputs(seed):
    """qg/k/v as column slices of one fused projection output (strided rows)."""
    ca = _ca()
    c = Case("demo", [5, 70], 3, seed)
    H, KV, D, R, N = c.H, c.KV, c.D, c.R, c.N
    fused = c.randn(N, H * 2 * D + 2 * KV * D + 8)
    qg, k, v = fused[:, :H * 2 * D], fused[:, H * 2 * D:H * 2 * D + KV * D], fused[:, H * 2 * D + KV * D:-8]
    qw, kw = c.randn(D, scale=0.2), c.randn(D, scale=0.2)
    q_out = ca.qk_norm_rope_kv_write(qg, k, v, qw, kw, EPS, c.positions, c.seq_of_col, c.tables, c.k_pool,
                                     c.v_pool, R, THETA)
    cos, sin = ops.rope_cos_sin(c.positions, R, THETA, torch.float32)
    q_ref = ops.apply_partial_rope(ops.rms_norm(ops.split_q_gate(qg, H, D)[0].float(), qw, EPS), cos, sin)
    k_ref = ops.apply_partial_rope(ops.rms_norm(k.reshape(N, KV, D).float(), kw, EPS), cos, sin)
    assert rel(q_out, q_ref) <= TOL
    for b, (lo, hi) in enumerate(c.bounds):
        p = c.positions[lo:hi].long()
        assert rel(c.k_pool[c.tables[b].long()[p // 64], p % 64], k_ref[lo:hi]) <= TOL
        assert torch.equal(c.v_pool[c.tables[b].long()[p // 64], p % 64], v[lo:hi].reshape(-1, KV, D))


# --------------------------------------------------------------------------------------------------
# Decode / verification attention


def _reference_decode(c: Case, q: torch.Tensor, gate: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 reference of the gated output [N, H*D] in batch (unshuffled) order."""
    outs = []
    for b, (lo, hi) in enumerate(c.bounds):
        outs.append(ops.paged_attention(q[lo:hi].float(), c.k_pool, c.v_pool, c.tables[b], c.positions[lo:hi], scale))
    o = torch.cat(outs).reshape(c.N, c.H * c.D)
    return o * torch.sigmoid(gate.float())


def _run_decode(c: Case, hint, strided_gate: bool = True, check_ref: bool = True):
    ca = _ca()
    H, D, N = c.H, c.D, c.N
    qg = c.randn(N, H * 2 * D)
    q = ops.split_q_gate(qg, H, D)[0].contiguous()
    scale = D ** -0.5
    ref = _reference_decode(c, q, ops.split_q_gate(qg, H, D)[1], scale)
    o = c.order
    qg_s = qg[o].contiguous()
    gate = qg_s.view(N, H, 2 * D)[..., D:] if strided_gate else qg_s.view(N, H, 2 * D)[..., D:].reshape(N, H * D)
    out = torch.full((N, H * D), float("nan"), dtype=BF, device=DEV)
    res = ca.decode_attention(q[o].contiguous(), c.k_pool, c.v_pool, c.tables, c.shuffled(c.positions),
                              c.shuffled(c.seq_of_col), scale, gate, out=out, max_len_hint=hint)
    torch.cuda.synchronize()
    assert res is out
    assert not out.isnan().any()
    err = rel(out, ref[o])
    assert err <= TOL, f"relative error {err:.3g}"


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_attention(shape, T, seed):
    lengths = [1, 63, 64, 65, 1000, 5000] if T == 1 else [4, 63, 64, 65, 1000, 5000]
    c = Case(shape, lengths, T, seed)
    c.fill_history(upto_columns=True)
    _run_decode(c, hint=None)


@pytest.mark.parametrize("hint", ["exact", "small", "one-split"])
def test_decode_attention_hints(hint, seed):
    """A bound equal to the longest context, one far too small (the last split runs to the true
    length), and one that gives a single split (gated output written by the split kernel)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3000, (8,), generator=g).tolist()
    c = Case("27b", lengths, 4, seed)
    c.fill_history(upto_columns=True)
    _run_decode(c, hint={"exact": max(lengths), "small": 300, "one-split": 1}[hint], strided_gate=False)


def test_decode_attention_32k(seed):
    c = Case("35b", [32768 - 3], 4, seed)
    c.fill_history(upto_columns=True)
    _run_decode(c, hint=32768)


@pytest.mark.parametrize("path", ["split", "tc"])
def test_decode_attention_more_splits_than_the_combine_stages(path, seed, monkeypatch):
    """gqa_decode_combine stages up to COMB_S = 256 splits' (max, sum) pairs in shared memory and reads
    more in place: with the SM count faked to 4096, one 20 000-key column of a single kv head gets 313
    splits on either path (checked), and the result still matches the reference."""
    ca = _ca()
    monkeypatch.setattr(ca.L, "sm_count", lambda *a, **k: 4096)
    c = Case("35b-tp2", [20000], 1, seed)
    c.fill_history(upto_columns=True)
    if path == "split":
        S, _ = ca.choose_splits(1, c.KV, c.H // c.KV, 20000, 4096, ca._ATT_MAXG, c.D)
        assert S > 256
        _run_decode(c, hint=20000)
    else:
        S, _ = ca.choose_tc_splits(c.KV, 20000, 4096, c.H * (c.D + 2) * 4)
        assert S > 256
        _run_decode_tc(c, hint=20000)


def test_decode_attention_graph_capture(seed):
    """Captured once, replayed with different positions written in place: the lengths are read on
    the device, so the replay follows them."""
    ca = _ca()
    c = Case("27b-tp2", [700, 900], 2, seed)
    c.fill_history(upto_columns=True)
    H, D, N = c.H, c.D, c.N
    q = c.randn(N, H, D)
    gate = c.randn(N, H * D)
    scale = D ** -0.5
    pos = c.positions.clone()
    out = torch.full((N, H * D), float("nan"), dtype=BF, device=DEV)
    ca.decode_attention(q, c.k_pool, c.v_pool, c.tables, pos, c.seq_of_col, scale, gate, out=out, max_len_hint=1024)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ca.decode_attention(q, c.k_pool, c.v_pool, c.tables, pos, c.seq_of_col, scale, gate, out=out,
                            max_len_hint=1024)
    base = c.positions.clone()
    for shift in (0, -300, -650):
        c.positions = base + shift
        pos.copy_(c.positions)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, _reference_decode(c, q, gate, scale)) <= TOL


# --------------------------------------------------------------------------------------------------
# Prefill


@pytest.mark.parametrize("shape", ["27b", "h6kv1d64"])
def test_prefill_attention(shape, seed):
    """One sequence: a 100-token prefix already cached, then 300 columns."""
    ca = _ca()
    c = Case(shape, [400], 300, seed)
    c.fill_history(upto_columns=True)
    H, D, N = c.H, c.D, c.N
    q = c.randn(N, H, D)
    gate = c.randn(N, H * D)
    scale = D ** -0.5
    ref = ops.paged_attention(q.float(), c.k_pool, c.v_pool, c.tables[0], c.positions, scale)
    got = ca.prefill_attention(q, c.k_pool, c.v_pool, c.tables[0], c.positions, scale)
    assert rel(got, ref) <= TOL
    gated = ca.prefill_attention(q, c.k_pool, c.v_pool, c.tables[0], c.positions, scale, gate=gate, length=400)
    assert rel(gated, ref.reshape(N, H * D) * torch.sigmoid(gate.float())) <= TOL


# --------------------------------------------------------------------------------------------------
# int8 KV (codes int8 [P, 64, KV, D] + fp32 scales [P, 64, KV, D/64]; kernels/reference.quantize_kv_int8)

I8_SHAPES = [s for s in SHAPES if SHAPES[s][2] % 64 == 0]


def _int8_pools(c: Case):
    """Garbage int8 pools and scale pools (read past a length shows as large values)."""
    P, KV, D = c.k_pool.shape[0], c.KV, c.D
    codes = lambda: torch.randint(-127, 128, (P, 64, KV, D), generator=c.gen, dtype=torch.int8).to(DEV)  # noqa: E731
    scales = lambda: torch.full((P, 64, KV, D // 64), 1.0e3, dtype=torch.float32).to(DEV)               # noqa: E731
    c.kq, c.vq, c.ks, c.vs = codes(), codes(), scales(), scales()


def _fill_history_int8(c: Case, upto_columns: bool) -> None:
    for b, n in enumerate(c.lengths):
        lo, hi = c.bounds[b]
        end = n if upto_columns else n - (hi - lo)
        if end == 0:
            continue
        p = torch.arange(end, device=DEV, dtype=torch.int32)
        ops.paged_kv_write(c.kq, c.vq, c.tables[b], p, c.randn(end, c.KV, c.D), c.randn(end, c.KV, c.D), c.ks, c.vs)


def _ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max()) if a.numel() else 0


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", I8_SHAPES)
def test_qk_norm_rope_kv_write_int8(shape, T, seed):
    """The int8 kernel stores quantize_kv_int8 of exactly what the bf16 kernel stores (k after norm
    and rope, raw v): codes equal, scales within 1 ulp (expected equal: same fp32 IEEE division);
    q_out equal to the bf16 kernel's; nothing outside the columns changes."""
    ca = _ca()
    c = Case(shape, [1, 63, 64, 65, 1000, 5000] if T == 1 else [4, 63, 64, 65, 130, 5000], T, seed)
    H, KV, D, R, N = c.H, c.KV, c.D, c.R, c.N
    _int8_pools(c)
    _fill_history_int8(c, upto_columns=False)
    qg = c.randn(N, H * 2 * D, scale=2.0)
    k, v = c.randn(N, KV * D, scale=2.0), c.randn(N, KV * D)
    k[0, :64] = 0                                     # a zero group (scale 0, codes 0)
    qw, kw = c.randn(D, scale=0.2), c.randn(D, scale=0.2)
    o = c.order
    args = (qg[o].contiguous(), k[o].contiguous(), v[o].contiguous(), qw, kw, EPS, c.shuffled(c.positions),
            c.shuffled(c.seq_of_col), c.tables)
    q_bf = ca.qk_norm_rope_kv_write(*args, c.k_pool, c.v_pool, R, THETA)
    kq0, vq0, ks0, vs0 = c.kq.clone(), c.vq.clone(), c.ks.clone(), c.vs.clone()
    q_out = torch.full((N, H, D), float("nan"), dtype=BF, device=DEV)
    res = ca.qk_norm_rope_kv_write(*args, c.kq, c.vq, R, THETA, q_out=q_out, k_scale=c.ks, v_scale=c.vs)
    torch.cuda.synchronize()
    assert res is q_out
    assert torch.equal(q_out, q_bf)
    written = torch.zeros(c.k_pool.shape[:2], dtype=torch.bool, device=DEV)
    for b, (lo, hi) in enumerate(c.bounds):
        p = c.positions[lo:hi].long()
        pages, offs = c.tables[b].long()[p // 64], p % 64
        written[pages, offs] = True
        for pool, codes, scales in ((c.k_pool, c.kq, c.ks), (c.v_pool, c.vq, c.vs)):
            want_q, want_s = ops.quantize_kv_int8(pool[pages, offs])
            assert torch.equal(codes[pages, offs], want_q)
            assert _ulp_diff(scales[pages, offs], want_s) <= 1
    for now, before in ((c.kq, kq0), (c.vq, vq0), (c.ks, ks0), (c.vs, vs0)):
        assert torch.equal(now[~written], before[~written]), "pool entries outside the columns changed"
    assert not c.ks.isnan().any() and not c.vs.isnan().any()


def _run_decode_int8(c: Case, hint, strided_gate: bool = True):
    ca = _ca()
    H, D, N = c.H, c.D, c.N
    qg = c.randn(N, H * 2 * D)
    q, gate = ops.split_q_gate(qg, H, D)
    q = q.contiguous()
    scale = D ** -0.5
    outs = []
    for b, (lo, hi) in enumerate(c.bounds):                     # fp32 on the dequantised pools
        outs.append(ops.paged_attention(q[lo:hi].float(), c.kq, c.vq, c.tables[b], c.positions[lo:hi], scale,
                                        k_scale=c.ks, v_scale=c.vs))
    ref = torch.cat(outs).reshape(N, H * D) * torch.sigmoid(gate.float())
    o = c.order
    qg_s = qg[o].contiguous()
    g = qg_s.view(N, H, 2 * D)[..., D:] if strided_gate else qg_s.view(N, H, 2 * D)[..., D:].reshape(N, H * D)
    out = torch.full((N, H * D), float("nan"), dtype=BF, device=DEV)
    res = ca.decode_attention(q[o].contiguous(), c.kq, c.vq, c.tables, c.shuffled(c.positions),
                              c.shuffled(c.seq_of_col), scale, g, out=out, max_len_hint=hint, k_scale=c.ks,
                              v_scale=c.vs)
    torch.cuda.synchronize()
    assert res is out
    assert not out.isnan().any()
    err = rel(out, ref[o])
    assert err <= TOL, f"relative error {err:.3g}"


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", I8_SHAPES)
def test_decode_attention_int8(shape, T, seed):
    lengths = [1, 63, 64, 65, 1000, 5000] if T == 1 else [4, 63, 64, 65, 1000, 5000]
    c = Case(shape, lengths, T, seed)
    _int8_pools(c)
    _fill_history_int8(c, upto_columns=True)
    _run_decode_int8(c, hint=None)


@pytest.mark.parametrize("hint", ["exact", "small", "one-split"])
def test_decode_attention_int8_hints(hint, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3000, (8,), generator=g).tolist()
    c = Case("27b", lengths, 4, seed)
    _int8_pools(c)
    _fill_history_int8(c, upto_columns=True)
    _run_decode_int8(c, hint={"exact": max(lengths), "small": 300, "one-split": 1}[hint], strided_gate=False)


def test_decode_attention_int8_rejects_mixed_pools(seed):
    ca = _ca()
    from kernels.launch import KernelError
    c = Case("demo", [10], 1, seed)
    _int8_pools(c)
    q, gate = c.randn(1, c.H, c.D), c.randn(1, c.H * c.D)
    with pytest.raises(KernelError):
        ca.decode_attention(q, c.kq, c.vq, c.tables, c.positions, c.seq_of_col, 1.0, gate)     # no scales
    with pytest.raises(KernelError):
        ca.decode_attention(q, c.k_pool, c.v_pool, c.tables, c.positions, c.seq_of_col, 1.0, gate,
                            k_scale=c.ks, v_scale=c.vs)


@pytest.mark.parametrize("shape", ["27b", "h6kv1d64"])
def test_prefill_attention_int8(shape, seed):
    ca = _ca()
    c = Case(shape, [400], 300, seed)
    _int8_pools(c)
    _fill_history_int8(c, upto_columns=True)
    H, D, N = c.H, c.D, c.N
    q, gate = c.randn(N, H, D), c.randn(N, H * D)
    scale = D ** -0.5
    ref = ops.paged_attention(q.float(), c.kq, c.vq, c.tables[0], c.positions, scale, k_scale=c.ks, v_scale=c.vs)
    got = ca.prefill_attention(q, c.kq, c.vq, c.tables[0], c.positions, scale, k_scale=c.ks, v_scale=c.vs)
    assert rel(got, ref) <= TOL
    gated = ca.prefill_attention(q, c.kq, c.vq, c.tables[0], c.positions, scale, gate=gate, length=400,
                                 k_scale=c.ks, v_scale=c.vs)
    assert rel(gated, ref.reshape(N, H * D) * torch.sigmoid(gate.float())) <= TOL


# --------------------------------------------------------------------------------------------------
# Decode on tensor cores (decode_attention_tc: the prefill kernel's key-split form + the combine)

TC_SHAPES = [s for s, v in SHAPES.items() if v[2] in (64, 128, 256)]


def _run_decode_tc(c: Case, hint, int8: bool = False):
    """decode_attention_tc on the case's columns (grouped by sequence, as cu_seqlens needs) against
    the fp32 reference, output poisoned with NaN."""
    ca = _ca()
    H, D, N = c.H, c.D, c.N
    qg = c.randn(N, H * 2 * D)
    q, gate = ops.split_q_gate(qg, H, D)
    q = q.contiguous()
    scale = D ** -0.5
    pools = (c.kq, c.vq) if int8 else (c.k_pool, c.v_pool)
    scales = dict(k_scale=c.ks, v_scale=c.vs) if int8 else {}
    outs = []
    for b, (lo, hi) in enumerate(c.bounds):
        outs.append(ops.paged_attention(q[lo:hi].float(), *pools, c.tables[b], c.positions[lo:hi], scale, **scales))
    ref = torch.cat(outs).reshape(N, H * D) * torch.sigmoid(gate.float())
    cu = torch.tensor([0] + [hi for _, hi in c.bounds], dtype=torch.int32, device=DEV)
    max_columns = max(hi - lo for lo, hi in c.bounds)
    out = torch.full((N, H * D), float("nan"), dtype=BF, device=DEV)
    res = ca.decode_attention_tc(q, *pools, c.tables, c.positions, cu, scale, qg.view(N, H, 2 * D)[..., D:],
                                 max_columns, max_len_hint=hint, out=out, **scales)
    torch.cuda.synchronize()
    assert res is out
    assert not out.isnan().any()
    err = rel(out, ref)
    assert err <= TOL, f"relative error {err:.3g}"


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", TC_SHAPES)
def test_decode_attention_tc(shape, T, seed):
    lengths = [1, 63, 64, 65, 1000, 5000] if T == 1 else [4, 63, 64, 65, 1000, 5000]
    c = Case(shape, lengths, T, seed)
    c.fill_history(upto_columns=True)
    _run_decode_tc(c, hint=None)


@pytest.mark.parametrize("hint", ["exact", "small", "one-split"])
def test_decode_attention_tc_hints(hint, seed):
    """A bound equal to the longest context, one far too small (the last split runs to the end), and
    one page (a single split: its partials still go through the combine)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3000, (8,), generator=g).tolist()
    c = Case("27b", lengths, 4, seed)
    c.fill_history(upto_columns=True)
    _run_decode_tc(c, hint={"exact": max(lengths), "small": 300, "one-split": 1}[hint])


@pytest.mark.parametrize("T", [1, 4])
def test_decode_attention_tc_int8(T, seed):
    lengths = [1, 63, 64, 65, 1000, 5000] if T == 1 else [4, 63, 64, 65, 1000, 5000]
    c = Case("27b", lengths, T, seed)
    _int8_pools(c)
    _fill_history_int8(c, upto_columns=True)
    _run_decode_tc(c, hint=None, int8=True)


def test_decode_attention_tc_32k(seed):
    c = Case("35b", [32768 - 3, 20000], 4, seed)
    c.fill_history(upto_columns=True)
    _run_decode_tc(c, hint=65536 // 2)


def test_decode_attention_tc_graph_capture(seed):
    """Captured once, replayed after the KV and q change in place: device reads only."""
    ca = _ca()
    c = Case("27b", [3000, 700], 1, seed)
    c.fill_history(upto_columns=True)
    H, D, N = c.H, c.D, c.N
    qg = c.randn(N, H * 2 * D)
    q = ops.split_q_gate(qg, H, D)[0].contiguous()
    gate = qg.view(N, H, 2 * D)[..., D:]
    cu = torch.tensor([0] + [hi for _, hi in c.bounds], dtype=torch.int32, device=DEV)
    out = torch.empty(N, H * D, dtype=BF, device=DEV)
    args = (q, c.k_pool, c.v_pool, c.tables, c.positions, cu, D ** -0.5, gate, 1)
    ca.decode_attention_tc(*args, max_len_hint=4096, out=out)      # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        ca.decode_attention_tc(*args, max_len_hint=4096, out=out)
    torch.cuda.current_stream().wait_stream(s)
    c.fill_history(upto_columns=True)                                # new keys and values in place
    q.copy_(c.randn(N, H, D))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    outs = [ops.paged_attention(q[lo:hi].float(), c.k_pool, c.v_pool, c.tables[b], c.positions[lo:hi], D ** -0.5)
            for b, (lo, hi) in enumerate(c.bounds)]
    ref = torch.cat(outs).reshape(N, H * D) * torch.sigmoid(gate.float().reshape(N, H * D))   # gate: the [N, H, D] view
    assert rel(out, ref) <= TOL

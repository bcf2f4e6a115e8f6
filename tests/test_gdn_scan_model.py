"""A CPU model of the tensor-core chunked GDN scan (gdn.cu: gdn_chunk_scan_tc_dkXX), lane by lane.

No GPU: numpy stands in for one thread block at a time, all its warps and lanes at once. The model
transcribes the kernel's index formulas (cp.async destinations with the XOR swizzle, the ldmatrix lane
addresses, the C-fragment positions of S^T, V'^T and O^T), and emulates what the hardware does with
them: ldmatrix x4 (plain and .trans) hands each lane the 16-bit pairs of the PTX fragment layout, and
mma.m16n8k16 (row.col, bf16 in, fp32 accumulate) multiplies the matrices those fragments make up.
The bf16 hi/lo split (cvt.rn.bf16x2) and the per-row fp32 factors are done in fp32 as the kernel does.

Not modelled: the prep kernel's own fp32 arithmetic (its outputs are computed here in float64 and
rounded to fp32, then packed in the tensor-core layout exactly as gdn_chunk_prep writes it), and the
tensor core's internal accumulation order (each mma sums its 16 exact products in float64 and rounds
once to fp32). The ordering of cp.async groups and barriers is not checked either; every chunk's tiles
are staged before its products, as the waits guarantee.

The result is compared with kernels/reference.gated_delta_rule_recurrent in float64 with the bounds of
tests/test_cuda_gdn_chunked.py (state 1e-4, outputs 1e-2 of the largest entry).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import reference as ref

CHUNK = 64


# ---- bf16 and fragments ----------------------------------------------------------------------------

def bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, round to nearest even (no NaN in these data)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_val(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def split(x0: np.ndarray, x1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gdn_split: (x0, x1) fp32 -> (hi, lo) bf16x2 words, low half = x0."""
    x0, x1 = np.float32(x0), np.float32(x1)
    h0, h1 = bf16_bits(x0), bf16_bits(x1)
    r0 = (x0 - bf16_val(h0)).astype(np.float32)
    r1 = (x1 - bf16_val(h1)).astype(np.float32)
    l0, l1 = bf16_bits(r0), bf16_bits(r1)
    pack = lambda lo, hi: lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)   # noqa: E731
    return pack(h0, h1), pack(l0, l1)


def halves(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16x2 word -> (low value, high value) as float64."""
    return (bf16_val((w & 0xFFFF).astype(np.uint16)).astype(np.float64),
            bf16_val((w >> 16).astype(np.uint16)).astype(np.float64))


def ldmatrix(smem16: np.ndarray, addr: np.ndarray, trans: bool) -> np.ndarray:
    """ldmatrix.sync.aligned.m8n8.x4[.trans].b16: addr [..., 32] byte addresses (lane l: row l & 7 of
    matrix l >> 3, 8 bf16 each) -> [..., 32, 4] words; lane l = 4 g + t gets in word j, from matrix j,
    (row g, cols 2t, 2t+1) or, transposed, (rows 2t, 2t+1, col g); low half = the first."""
    assert np.all(addr % 16 == 0)
    rows = smem16[(addr // 2)[..., None] + np.arange(8)]          # [..., 32 lanes, 8]
    mats = rows.reshape(*rows.shape[:-2], 4, 8, 8)                 # [..., matrix, row, col]
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    if trans:
        lo, hi = mats[..., :, 2 * t, g], mats[..., :, 2 * t + 1, g]   # [..., 4, 32]
    else:
        lo, hi = mats[..., :, g, 2 * t], mats[..., :, g, 2 * t + 1]
    w = lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)
    return np.swapaxes(w, -1, -2)                                  # [..., 32, 4]


def mma(c: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 on fragments [..., 32, *]: returns the new
    C fragment [..., 32, 4] (fp32). Fragments (lane = 4 g + t):
      A a0 = (row g, k 2t, 2t+1)  a1 = (row g+8, k 2t..)  a2 = (row g, k 2t+8..)  a3 = (row g+8, k 2t+8..)
      B b0 = (k 2t, 2t+1; col g)  b1 = (k 2t+8, 2t+9; col g)
      C c0, c1 = (row g, cols 2t, 2t+1)  c2, c3 = (row g+8, cols 2t, 2t+1)"""
    lead = c.shape[:-2]
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    A = np.zeros(lead + (16, 16))
    B = np.zeros(lead + (16, 8))
    C = np.zeros(lead + (16, 8))
    for j, (r, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
        lo, hi = halves(a[..., j])
        A[..., r, k], A[..., r, k + 1] = lo, hi
    for j, k in enumerate((2 * t, 2 * t + 8)):
        lo, hi = halves((b0, b1)[j])
        B[..., k, g], B[..., k + 1, g] = lo, hi
    C[..., g, 2 * t], C[..., g, 2 * t + 1] = c[..., 0], c[..., 1]
    C[..., g + 8, 2 * t], C[..., g + 8, 2 * t + 1] = c[..., 2], c[..., 3]
    D = (A @ B + C).astype(np.float32)
    return np.stack([D[..., g, 2 * t], D[..., g, 2 * t + 1], D[..., g + 8, 2 * t], D[..., g + 8, 2 * t + 1]], -1)


def swz(D: int, r, c):
    """gdn_swz<D>: byte offset of 16-byte chunk c of row r in a [.][D] bf16 tile."""
    M = min(D // 8, 8) - 1
    return (r * D + ((c ^ (r & M)) << 3)) * 2


def lane_offs(D: int, trans: bool) -> list[np.ndarray]:
    """gdn_lane_offs<D>: per lane [32], the byte offsets o[e], e = 0..3."""
    lane = np.arange(32)
    m = lane >> 3
    r = (8 * (m & 1) if trans else 8 * (m >> 1)) + (lane & 7)
    cb = (m >> 1) if trans else (m & 1)
    return [swz(D, r, 2 * e + cb) for e in range(4)]


# ---- the prep's outputs (float64 maths, fp32 / bf16 storage in the tensor-core layout) ------------

def prep(y, a, b, A_log, dt_bias, cu, HK, HV, DK, DV):
    """U [N, HV, DV] fp32; W [N, HV, 2, DK] and QKD [N, HV, 2, 64] bf16 bits (hi, lo); info [N, HV, 4]
    fp32 {iq scale e^G, ik e^(G_last - G), e^G_last, 0}, as gdn_chunk_prep_dkXX writes them."""
    N = y.shape[0]
    scale = np.float32(DK ** -0.5)
    yd = y.astype(np.float64)
    q = yd[:, :HK * DK].reshape(N, HK, DK)
    k = yd[:, HK * DK:2 * HK * DK].reshape(N, HK, DK)
    v = yd[:, 2 * HK * DK:].reshape(N, HV, DV)
    g = -np.exp(A_log)[None] * np.logaddexp(0.0, a + dt_bias[None])          # softplus
    beta = bf16_val(bf16_bits((1.0 / (1.0 + np.exp(-b))).astype(np.float32))).astype(np.float64)
    iq = 1.0 / np.sqrt((q * q).sum(-1) + 1e-6)
    ik = 1.0 / np.sqrt((k * k).sum(-1) + 1e-6)
    U = np.zeros((N, HV, DV), np.float32)
    W = np.zeros((N, HV, 2, DK), np.uint16)
    QKD = np.zeros((N, HV, 2, CHUNK), np.uint16)
    info = np.zeros((N, HV, 4), np.float32)
    ratio = HV // HK
    for s in range(len(cu) - 1):
        for t0 in range(cu[s], cu[s + 1], CHUNK):
            L = min(CHUNK, cu[s + 1] - t0)
            rows = slice(t0, t0 + L)
            for h in range(HV):
                hk = h // ratio
                qn = np.zeros((CHUNK, DK))
                kn = np.zeros((CHUNK, DK))
                qn[:L] = q[rows, hk] * iq[rows, hk, None] * float(scale)
                kn[:L] = k[rows, hk] * ik[rows, hk, None]
                gg = np.zeros(CHUNK)
                bb = np.zeros(CHUNK)
                gg[:L], bb[:L] = g[rows, h], beta[rows, h]
                G = np.cumsum(gg)
                D = np.tril(np.exp(np.minimum(G[:, None] - G[None, :], 0.0)))
                A = np.tril(bb[:, None] * (kn @ kn.T) * D, -1)
                X = np.linalg.solve(np.eye(CHUNK) + A, np.concatenate(
                    [np.pad(bb[:L, None] * v[rows, h], ((0, CHUNK - L), (0, 0))),
                     kn * (bb * np.exp(G))[:, None]], 1))
                U[rows, h] = X[:L, :DV]
                Wf = X[:L, DV:].astype(np.float32)
                Qf = ((qn @ kn.T) * D)[:L].astype(np.float32)
                for dst, f in ((W, Wf), (QKD, Qf)):
                    hi = bf16_bits(f)
                    dst[rows, h, 0] = hi
                    dst[rows, h, 1] = bf16_bits((f - bf16_val(hi)).astype(np.float32))
                Gf = G.astype(np.float32)
                eG = np.exp(Gf.astype(np.float64)).astype(np.float32)
                Gl = Gf[CHUNK - 1]
                info[rows, h, 0] = (iq[rows, hk].astype(np.float32) * scale).astype(np.float32) * eG[:L]
                info[rows, h, 1] = ik[rows, hk].astype(np.float32) * np.exp(
                    (Gl - Gf[:L]).astype(np.float64)).astype(np.float32)
                info[rows, h, 2] = np.float32(np.exp(np.float64(Gl)))
    return U, W, QKD, info


# ---- the scan kernel, one block at a time -----------------------------------------------------------

def scan_tc(out, state, U, W, QKD, info, ybits, slots, cu, fresh, HK, HV, DK, DV, warps):
    """gdn_chunk_scan_tc_dkDK over grid (ceil(DV / (16 warps)), HV, B), block 32 warps. out: [N, HV, DV]
    float32 (the kernel writes bf16; rounded here at the store); state [S, HV, DK, DV] fp32, in place."""
    N = ybits.shape[0]
    C = 2 * HK * DK + HV * DV
    NT, KS = DK // 8, DK // 16
    NQ = 4 if DK >= 128 else 2
    TB, DB = CHUNK * DK * 2, CHUNK * CHUNK * 2
    sWh, sWl, sQ, sK = 0, TB, 2 * TB, 3 * TB
    sDh, sDl, sInf = 4 * TB, 4 * TB + DB, 4 * TB + 2 * DB
    smem_bytes = 4 * TB + 2 * DB + CHUNK * 16
    yflat = ybits.reshape(-1)
    Wf, Qf = W.reshape(-1), QKD.reshape(-1)
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    warp = np.arange(warps)[:, None]
    ow, od, okk = lane_offs(DK, False), lane_offs(CHUNK, False), lane_offs(DK, True)

    def ld(smem16, base, off):                 # one ldmatrix per warp: [warps, 32, 4]
        return ldmatrix(smem16, np.broadcast_to(base + off, (warps, 32)), False)

    def ldt(smem16, base, off):
        return ldmatrix(smem16, np.broadcast_to(base + off, (warps, 32)), True)

    for bseq in range(len(cu) - 1):
        lo, hi = cu[bseq], cu[bseq + 1]
        if lo < 0 or hi > N or hi <= lo:
            continue
        slot = slots[bseq]
        zero = fresh[bseq] != 0 or slot < 0
        for h in range(HV):
            hk = h // (HV // HK)
            for bx in range(-(-DV // (16 * warps))):
                smem = np.zeros(smem_bytes, np.uint8)
                s16, s32 = smem.view(np.uint16), smem.view(np.float32)
                vb = (bx * warps + warp) * 16                      # [warps, 1]
                v0, v1 = vb + g, vb + g + 8                        # [warps, 32]
                ok0, ok1 = v0 < DV, v1 < DV
                sp = state[max(slot, 0), h]                        # [DK, DV]
                st = np.zeros((NT, warps, 32, 4), np.float32)
                if not zero:
                    for n in range(NT):
                        d = 8 * n + 2 * t
                        st[n, ..., 0] = np.where(ok0, sp[d, np.minimum(v0, DV - 1)], 0)
                        st[n, ..., 1] = np.where(ok0, sp[d + 1, np.minimum(v0, DV - 1)], 0)
                        st[n, ..., 2] = np.where(ok1, sp[d, np.minimum(v1, DV - 1)], 0)
                        st[n, ..., 3] = np.where(ok1, sp[d + 1, np.minimum(v1, DV - 1)], 0)

                def cp16(dst, src_flat, src_elem, v):    # 16 bytes global -> shared, zero-filled when not v
                    smem[dst:dst + 16] = src_flat[src_elem:src_elem + 8].view(np.uint8) if v else 0

                def issue_wq(t0, L):
                    for i in range(CHUNK):
                        for c in range(DK // 4):
                            part, cc = divmod(c, DK // 8)
                            cp16((sWl if part else sWh) + swz(DK, i, cc), Wf,
                                 ((t0 + i) * HV + h) * 2 * DK + 8 * c, i < L)
                        for c in range(DK // 8):
                            cp16(sQ + swz(DK, i, c), yflat, (t0 + i) * C + hk * DK + 8 * c, i < L)

                def issue_kd(t0, L):
                    for i in range(CHUNK):
                        for c in range(DK // 8):
                            cp16(sK + swz(DK, i, c), yflat, (t0 + i) * C + (HK + hk) * DK + 8 * c, i < L)
                        for c in range(16):
                            cp16((sDl if c >> 3 else sDh) + swz(CHUNK, i, c & 7), Qf,
                                 ((t0 + i) * HV + h) * 128 + 8 * c, i < L)
                        smem[sInf + 16 * i:sInf + 16 * i + 16] = (
                            info[t0 + i, h].view(np.uint8) if i < L else 0)

                nch = (hi - lo + CHUNK - 1) // CHUNK
                for c in range(nch):
                    t0 = lo + c * CHUNK
                    L = min(CHUNK, hi - t0)
                    issue_wq(t0, L)
                    issue_kd(t0, L)
                    s_info = s32[sInf // 4:sInf // 4 + 4 * CHUNK].reshape(CHUNK, 4)
                    Lt = L - 2 * t
                    vt = np.zeros((8, warps, 32, 4), np.float32)

                    def urow(n, dr, v, ok):
                        r = t0 + 2 * t + 8 * n + dr
                        valid = (8 * n + dr < Lt) & ok
                        return np.where(valid, U[np.minimum(r, N - 1)[None, :], h, np.minimum(v, DV - 1)], 0)

                    for hq in range(NQ):
                        ng = 8 // NQ
                        ot = np.zeros((ng, warps, 32, 4), np.float32)
                        for n in range(ng * hq, ng * (hq + 1)):
                            vt[n, ..., 0] = urow(n, 0, v0, ok0)
                            vt[n, ..., 1] = urow(n, 1, v0, ok0)
                            vt[n, ..., 2] = urow(n, 0, v1, ok1)
                            vt[n, ..., 3] = urow(n, 1, v1, ok1)
                        for kk in range(KS):
                            ah, al = np.zeros((warps, 32, 4), np.uint32), np.zeros((warps, 32, 4), np.uint32)
                            for j, (n, e) in enumerate(((2 * kk, 0), (2 * kk, 2), (2 * kk + 1, 0), (2 * kk + 1, 2))):
                                ah[..., j], al[..., j] = split(-st[n, ..., e], -st[n, ..., e + 1])
                            for pp in range(4 // NQ):
                                p = 4 // NQ * hq + pp
                                off = ow[kk & 3] + 32 * DK * p + 128 * (kk >> 2)
                                bw = ld(s16, sWh, off)
                                vt[2 * p] = mma(vt[2 * p], ah, bw[..., 0], bw[..., 1])
                                vt[2 * p + 1] = mma(vt[2 * p + 1], ah, bw[..., 2], bw[..., 3])
                                vt[2 * p] = mma(vt[2 * p], al, bw[..., 0], bw[..., 1])
                                vt[2 * p + 1] = mma(vt[2 * p + 1], al, bw[..., 2], bw[..., 3])
                                bw = ld(s16, sWl, off)
                                vt[2 * p] = mma(vt[2 * p], ah, bw[..., 0], bw[..., 1])
                                vt[2 * p + 1] = mma(vt[2 * p + 1], ah, bw[..., 2], bw[..., 3])
                                bq = ld(s16, sQ, off)
                                ot[2 * pp] = mma(ot[2 * pp], ah, bq[..., 0], bq[..., 1])
                                ot[2 * pp + 1] = mma(ot[2 * pp + 1], ah, bq[..., 2], bq[..., 3])
                                ot[2 * pp] = mma(ot[2 * pp], al, bq[..., 0], bq[..., 1])
                                ot[2 * pp + 1] = mma(ot[2 * pp + 1], al, bq[..., 2], bq[..., 3])
                        for n in range(ng):
                            i = 64 // NQ * hq + 8 * n + 2 * t
                            f0, f1 = -s_info[i, 0], -s_info[i + 1, 0]
                            ot[n, ..., 0] *= f0
                            ot[n, ..., 1] *= f1
                            ot[n, ..., 2] *= f0
                            ot[n, ..., 3] *= f1
                        for kj in range(4 // NQ * (hq + 1)):
                            ah, al = np.zeros((warps, 32, 4), np.uint32), np.zeros((warps, 32, 4), np.uint32)
                            for j, (n, e) in enumerate(((2 * kj, 0), (2 * kj, 2), (2 * kj + 1, 0), (2 * kj + 1, 2))):
                                ah[..., j], al[..., j] = split(vt[n, ..., e], vt[n, ..., e + 1])
                            for pp in range(4 // NQ):
                                p = 4 // NQ * hq + pp
                                if p < kj:
                                    continue
                                off = od[kj] + 32 * CHUNK * p
                                bd = ld(s16, sDh, off)
                                ot[2 * pp] = mma(ot[2 * pp], ah, bd[..., 0], bd[..., 1])
                                ot[2 * pp + 1] = mma(ot[2 * pp + 1], ah, bd[..., 2], bd[..., 3])
                                ot[2 * pp] = mma(ot[2 * pp], al, bd[..., 0], bd[..., 1])
                                ot[2 * pp + 1] = mma(ot[2 * pp + 1], al, bd[..., 2], bd[..., 3])
                                bd = ld(s16, sDl, off)
                                ot[2 * pp] = mma(ot[2 * pp], ah, bd[..., 0], bd[..., 1])
                                ot[2 * pp + 1] = mma(ot[2 * pp + 1], ah, bd[..., 2], bd[..., 3])
                        for n in range(ng * hq, ng * (hq + 1)):
                            for dr, (e0, e1) in ((0, (0, 2)), (1, (1, 3))):
                                r = t0 + 2 * t + 8 * n + dr
                                valid = 8 * n + dr < Lt
                                for v, ok, e in ((v0, ok0, e0), (v1, ok1, e1)):
                                    m = valid & ok
                                    wi, li = np.nonzero(m)
                                    out[r[li], h, v[wi, li]] = bf16_val(bf16_bits(ot[n - ng * hq][wi, li, e]))

                    # update: S^T <- e^G_last S^T + (V'^T diag(ik e^(G_last - G))) k
                    eL = s_info[0, 2]
                    st *= eL
                    for ki in range(4):
                        fa, fb = s_info[16 * ki + 2 * t, 1], s_info[16 * ki + 2 * t + 1, 1]
                        fc, fd = s_info[16 * ki + 8 + 2 * t, 1], s_info[16 * ki + 9 + 2 * t, 1]
                        ah, al = np.zeros((warps, 32, 4), np.uint32), np.zeros((warps, 32, 4), np.uint32)
                        ah[..., 0], al[..., 0] = split(vt[2 * ki, ..., 0] * fa, vt[2 * ki, ..., 1] * fb)
                        ah[..., 1], al[..., 1] = split(vt[2 * ki, ..., 2] * fa, vt[2 * ki, ..., 3] * fb)
                        ah[..., 2], al[..., 2] = split(vt[2 * ki + 1, ..., 0] * fc, vt[2 * ki + 1, ..., 1] * fd)
                        ah[..., 3], al[..., 3] = split(vt[2 * ki + 1, ..., 2] * fc, vt[2 * ki + 1, ..., 3] * fd)
                        for p in range(KS):
                            bk = ldt(s16, sK, okk[p & 3] + 32 * DK * ki + 128 * (p >> 2))
                            st[2 * p] = mma(st[2 * p], ah, bk[..., 0], bk[..., 1])
                            st[2 * p + 1] = mma(st[2 * p + 1], ah, bk[..., 2], bk[..., 3])
                            st[2 * p] = mma(st[2 * p], al, bk[..., 0], bk[..., 1])
                            st[2 * p + 1] = mma(st[2 * p + 1], al, bk[..., 2], bk[..., 3])

                if slot >= 0:
                    so = state[slot, h]
                    for n in range(NT):
                        d = 8 * n + 2 * t
                        for v, ok, (e0, e1) in ((v0, ok0, (0, 1)), (v1, ok1, (2, 3))):
                            wi, li = np.nonzero(ok)
                            so[d[li], v[wi, li]] = st[n][wi, li, e0]
                            so[d[li] + 1, v[wi, li]] = st[n][wi, li, e1]


# ---- the comparison -------------------------------------------------------------------------------

def run_case(HK, HV, DK, DV, lengths, warps, seed=0, fresh=None):
    rng = np.random.default_rng(seed)
    B = len(lengths)
    cu = [0]
    for T in lengths:
        cu.append(cu[-1] + T)
    N = cu[-1]
    C = 2 * HK * DK + HV * DV
    yf = rng.standard_normal((N, C)).astype(np.float32)
    yf = yf / (1 + np.exp(-yf))                                           # silu-like conv outputs
    ybits = bf16_bits(yf)
    a = bf16_val(bf16_bits(rng.standard_normal((N, HV)).astype(np.float32))).astype(np.float64)
    b = bf16_val(bf16_bits(rng.standard_normal((N, HV)).astype(np.float32))).astype(np.float64)
    A_log = rng.standard_normal(HV)
    dt_bias = rng.standard_normal(HV)
    n_slots = B + 2
    slots = list(rng.permutation(n_slots)[:B])
    if fresh is None:
        fresh = [1] + [0] * (B - 1)
    state0 = (0.5 * rng.standard_normal((n_slots, HV, DK, DV))).astype(np.float32)

    U, W, QKD, info = prep(bf16_val(ybits), a, b, A_log, dt_bias, cu, HK, HV, DK, DV)
    out = np.full((N, HV, DV), np.nan, np.float32)
    state = state0.copy()
    scan_tc(out, state, U, W, QKD, info, ybits, slots, cu, fresh, HK, HV, DK, DV, warps)

    y64 = torch.from_numpy(bf16_val(ybits).astype(np.float64))
    g, beta = ref.gdn_gates(torch.from_numpy(a), torch.from_numpy(b).to(torch.bfloat16),
                            torch.from_numpy(A_log), torch.from_numpy(dt_bias))
    beta = beta.double()
    err_o = err_s = 0.0
    for s in range(B):
        lo, hi = cu[s], cu[s + 1]
        T = hi - lo
        q, k, v = torch.split(y64[lo:hi], [HK * DK, HK * DK, HV * DV], dim=-1)
        q, k = ref.gdn_prepare_qk(q.reshape(T, HK, DK), k.reshape(T, HK, DK), HV // HK)
        s0 = None if fresh[s] else torch.from_numpy(state0[slots[s]].astype(np.float64))
        o_ref, s_ref = ref.gated_delta_rule_recurrent(q, k, v.reshape(T, HV, DV), g[lo:hi], beta[lo:hi], s0)
        o_ref, s_ref = o_ref.numpy(), s_ref.numpy()
        err_o = max(err_o, float(np.abs(out[lo:hi] - o_ref).max() / np.abs(o_ref).max()))
        err_s = max(err_s, float(np.abs(state[slots[s]] - s_ref).max() / np.abs(s_ref).max()))
    untouched = [i for i in range(n_slots) if i not in slots]
    assert np.array_equal(state[untouched], state0[untouched])
    return err_o, err_s


# (HK, HV, DK, DV), lengths, warps per block
CASES = [
    ((2, 6, 16, 16), [200, 1, 65], 1),
    ((1, 3, 32, 16), [65, 2, 64, 63], 1),
    ((2, 4, 64, 24), [200, 1, 65], 2),
    ((1, 2, 128, 128), [130, 3], 4),
    ((1, 2, 128, 32), [70], 2),
]


@pytest.mark.parametrize("shape,lengths,warps", CASES, ids=lambda x: str(x))
def test_scan_model_matches_reference(shape, lengths, warps):
    err_o, err_s = run_case(*shape, lengths, warps)
    assert err_o < 1e-2, err_o
    assert err_s < 1e-4, err_s


def test_fragment_helpers():
    """ldmatrix + mma on random bf16 tiles equal the plain matrix product (a check of the model's own
    fragment decoding, independent of the kernel)."""
    rng = np.random.default_rng(1)
    A = bf16_val(bf16_bits(rng.standard_normal((16, 16)).astype(np.float32)))
    Bm = bf16_val(bf16_bits(rng.standard_normal((16, 8)).astype(np.float32)))
    smem = np.zeros(4096, np.uint16)
    smem[:256] = bf16_bits(A).reshape(-1)                 # A row-major [16][16]
    smem[512:640] = bf16_bits(Bm.T).reshape(-1)           # B^T [8][16]: column n, k contiguous
    smem[1024:1152] = bf16_bits(Bm).reshape(-1)           # B row-major [16][8]
    lane = np.arange(32)
    m = lane >> 3
    a = ldmatrix(smem, 2 * (16 * (8 * (m & 1) + (lane & 7)) + 8 * (m >> 1)), False)
    b = ldmatrix(smem, 2 * (512 + 16 * (lane & 7) + 8 * (m & 1)), False)           # x4: matrices 2, 3 repeat 0, 1
    bt = ldmatrix(smem, 2 * (1024 + 8 * (8 * (m & 1) + (lane & 7))), True)
    ref_c = (A.astype(np.float64) @ Bm).astype(np.float32)
    g, t = lane >> 2, lane & 3
    want = np.stack([ref_c[g, 2 * t], ref_c[g, 2 * t + 1], ref_c[g + 8, 2 * t], ref_c[g + 8, 2 * t + 1]], -1)
    z = np.zeros((32, 4), np.float32)
    assert np.array_equal(mma(z, a, b[:, 0], b[:, 1]), want)
    assert np.array_equal(mma(z, a, bt[:, 0], bt[:, 1]), want)

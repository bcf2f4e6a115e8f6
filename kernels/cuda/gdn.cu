// Gated DeltaNet mixer for decode and speculative verification, batched over sequences.
//
// Batch metadata lives on the device: cu_seqlens [B+1] (each sequence's column range lo..hi of the
// flattened N columns), slots [B] (its state slot; < 0: no slot, the state starts from zeros and is
// never written), fresh [B] (1: the sequence starts at position 0, so its conv window and recurrent
// state start from zeros whatever the slot holds). A sequence whose range is empty or outside
// [0, N) is skipped (nothing read, nothing written). The slots of one batch must be distinct.
//
// gdn_conv1d_bf16       depthwise causal conv + SiLU over each sequence's columns, continuing from the
//                       slot's window [S, C, K-1]; y = bf16(silu(bf16(sum_j w_j x_{t-K+1+j}))), the sum
//                       in fp32 (kernels/reference.causal_conv1d). One thread per (channel, sequence,
//                       chunk of 16 columns): the conv has no recurrence, so chunks run in parallel;
//                       chunk 0 alone reads the old window and writes the new one (the last K-1
//                       inputs, read back from x), so no other thread touches the slot's window.
// gdn_recurrent_dkXX    gates, q/k l2norm and the gated delta rule, fp32 state in registers across the
//                       sequence's columns. See the layout note above gdn_recurrent_body.
// gdn_gated_rms_norm_bf16  the GDN output norm (kernels/reference.gated_rms_norm), one warp per head row.
#include "common.cuh"

#define GDN_CONV_MAX_K 8        // conv kernel width supported: 2..8
#define GDN_CONV_COLS 16        // columns per conv thread (>= GDN_CONV_MAX_K - 1)

__device__ __forceinline__ float gdn_round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// torch's formulas (opmath fp32, precise expf / log1pf, IEEE division).
__device__ __forceinline__ float gdn_silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float gdn_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gdn_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// --------------------------------------------------------------------------------------------------
// Causal conv1d

extern "C" __global__ void __launch_bounds__(128)
gdn_conv1d_bf16(bf16_t* __restrict__ out,                // [N, C]
                const bf16_t* __restrict__ x,            // [N, C] pre-conv inputs
                const bf16_t* __restrict__ weight,       // [C, K]
                bf16_t* __restrict__ conv_state,         // [S, C, K-1]
                const int* __restrict__ slots, const int* __restrict__ cu_seqlens,
                const int* __restrict__ fresh, int N, int C, int K, int update_state)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int bseq = blockIdx.y;
    const int lo = cu_seqlens[bseq], hi = cu_seqlens[bseq + 1];
    if (lo < 0 || hi > N || hi <= lo) return;
    const int T = hi - lo;
    const int t0 = blockIdx.z * GDN_CONV_COLS;           // this thread's columns t0..t1-1 (relative to lo)
    if (t0 >= T) return;
    const int t1 = min(T, t0 + GDN_CONV_COLS);
    const int W = K - 1;
    const int slot = slots[bseq];
    const bool zero = fresh[bseq] != 0 || slot < 0;
    bf16_t* st = conv_state + ((i64_t)(slot < 0 ? 0 : slot) * C + c) * W;   // the slot's window, oldest first

    float w[GDN_CONV_MAX_K];
#pragma unroll
    for (int j = 0; j < GDN_CONV_MAX_K; ++j) w[j] = j < K ? bf16_to_f32(weight[(i64_t)c * K + j]) : 0.f;

    // win[j] = the input at column t0 - W + j (j < W): from x, or from the old window before lo.
    // Only chunk 0 (t0 = 0) reaches before lo, since t0 >= GDN_CONV_COLS >= W otherwise.
    float win[GDN_CONV_MAX_K - 1];
#pragma unroll
    for (int j = 0; j < GDN_CONV_MAX_K - 1; ++j) {
        float v = 0.f;
        if (j < W) {
            const int m = t0 - W + j;
            if (m >= 0) v = bf16_to_f32(x[(i64_t)(lo + m) * C + c]);
            else if (!zero) v = bf16_to_f32(st[m + W]);
        }
        win[j] = v;
    }
    float old[GDN_CONV_MAX_K - 1];                       // chunk 0: the old window (zeros when fresh)
#pragma unroll
    for (int j = 0; j < GDN_CONV_MAX_K - 1; ++j) old[j] = win[j];

    for (int t = t0; t < t1; ++t) {
        const float xt = bf16_to_f32(x[(i64_t)(lo + t) * C + c]);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < GDN_CONV_MAX_K; ++j) {
            if (j < K) {
                const float xv = j < W ? win[min(j, GDN_CONV_MAX_K - 2)] : xt;     // j == W: the new input
                acc = __fadd_rn(acc, __fmul_rn(w[j], xv));
            }
        }
#pragma unroll
        for (int j = 0; j < GDN_CONV_MAX_K - 1; ++j) {   // shift the window by one column
            if (j < W - 1) win[j] = win[min(j + 1, GDN_CONV_MAX_K - 2)];
            else if (j == W - 1) win[j] = xt;
        }
        out[(i64_t)(lo + t) * C + c] = f32_to_bf16(gdn_silu(gdn_round_bf16(acc)));
    }

    // New window = the last W entries of [old window, x_lo .. x_{hi-1}]: entry j is column T - W + j.
    if (update_state && slot >= 0 && blockIdx.z == 0) {
#pragma unroll
        for (int j = 0; j < GDN_CONV_MAX_K - 1; ++j) {
            if (j < W) {
                const int m = T - W + j;
                bf16_t v;
                if (m >= 0) {
                    v = x[(i64_t)(lo + m) * C + c];
                } else {                                  // old[m + W], m + W in 0..W-1
                    float o = 0.f;
#pragma unroll
                    for (int i = 0; i < GDN_CONV_MAX_K - 1; ++i) if (i == m + W) o = old[i];
                    v = f32_to_bf16(o);                   // exact: o is a bf16 value
                }
                st[j] = v;
            }
        }
    }
}

// --------------------------------------------------------------------------------------------------
// Gated delta rule (recurrent form), gates and q/k l2norm fused.
//
// Grid (ceil(DV/8 / warps_per_block), HV, B). A warp owns an 8-column slice [vw, vw+8) of one value
// head's DK x DV state: lane L holds rows r0 = (L>>1)*RPT .. r0+RPT-1 (RPT = DK/16) and columns
// v0 = vw + (L&1)*4 .. v0+3, as RPT float4 (16-byte loads; each row's 32-byte piece is one full sector).
// Reductions over DK (u = k^T S, o = q^T S, |q|^2, |k|^2) = in-thread over RPT rows, then a butterfly
// over the 16 lanes of equal parity (xor 2, 4, 8, 16): every lane ends with the same bits. Warps are
// independent (no shared memory, no __syncthreads); each recomputes its key head's q/k norms from the
// conv output (DK values: one 16-byte load of q and one of k per lane when RPT = 8). The next column's
// raw inputs are loaded while the current one is computed.
//
// Per column (reference.gated_delta_rule_recurrent), with explicit roundings so that every column
// runs the same instructions whether it is a decode step or a verification column (committing
// keep_states[a] equals decoding a+1 columns one at a time, bit for bit):
//   g = -exp(A_log) * softplus(a + dt_bias); beta = bf16(sigmoid(b));
//   q = (q * rsqrt(|q|^2 + 1e-6)) * DK^-0.5; k = k * rsqrt(|k|^2 + 1e-6)
//   S = exp(g) S; u = k^T S; d = beta (v - u); S = S + k d^T; o = q^T S

template <int RPT>
struct GdnRaw {                        // one column's raw bf16 inputs for one lane
    unsigned q[(RPT + 1) / 2], k[(RPT + 1) / 2];
    uint2 v;
    bf16_t a, b;
};

template <int RPT>
__device__ __forceinline__ void gdn_load_words(unsigned* w, const bf16_t* p) {
    if constexpr (RPT % 8 == 0) {
#pragma unroll
        for (int i = 0; i < RPT / 8; ++i) {
            const uint4 u = reinterpret_cast<const uint4*>(p)[i];
            w[4 * i] = u.x; w[4 * i + 1] = u.y; w[4 * i + 2] = u.z; w[4 * i + 3] = u.w;
        }
    } else if constexpr (RPT == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        w[0] = u.x; w[1] = u.y;
    } else if constexpr (RPT == 2) {
        w[0] = *reinterpret_cast<const unsigned*>(p);
    } else {
        w[0] = p[0];
    }
}

template <int RPT>
__device__ __forceinline__ void gdn_unpack(float* f, const unsigned* w) {
    if constexpr (RPT == 1) {
        f[0] = bf16_to_f32((bf16_t)w[0]);
    } else {
#pragma unroll
        for (int i = 0; i < RPT / 2; ++i) {
            const float2 p = bf16x2_to_f32x2(w[i]);
            f[2 * i] = p.x; f[2 * i + 1] = p.y;
        }
    }
}

template <int RPT>
__device__ __forceinline__ void gdn_load_raw(GdnRaw<RPT>& r, const bf16_t* __restrict__ yrow,
                                             const bf16_t* __restrict__ arow, const bf16_t* __restrict__ brow,
                                             i64_t qoff, i64_t koff, i64_t voff) {
    gdn_load_words<RPT>(r.q, yrow + qoff);
    gdn_load_words<RPT>(r.k, yrow + koff);
    r.v = *reinterpret_cast<const uint2*>(yrow + voff);
    r.a = *arow;
    r.b = *brow;
}

// Sum over the 16 lanes of the caller's parity; identical bits in all of them.
__device__ __forceinline__ float gdn_sum16(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    return v;
}

__device__ __forceinline__ float gdn_param(const void* p, int is_bf16, int i) {
    return is_bf16 ? bf16_to_f32(reinterpret_cast<const bf16_t*>(p)[i]) : reinterpret_cast<const float*>(p)[i];
}

template <int RPT>
__device__ __forceinline__ void gdn_recurrent_body(
    bf16_t* __restrict__ out,          // [N, HV, DV]
    float* __restrict__ keep,          // [N, HV, DK, DV] or null
    float* __restrict__ state,         // [S, HV, DK, DV]
    const bf16_t* __restrict__ y,      // [N, C] = [q (HK*DK) | k (HK*DK) | v (HV*DV)]
    const bf16_t* __restrict__ a, const bf16_t* __restrict__ b,        // [N, HV]
    const void* __restrict__ A_log, const void* __restrict__ dt_bias,  // [HV] fp32 or bf16 (flags bit 0 / 1)
    int flags, const int* __restrict__ slots, const int* __restrict__ cu_seqlens,
    const int* __restrict__ fresh, int N, int HK, int HV, int DV, float scale)
{
    constexpr int DK = 16 * RPT;
    const int lane = threadIdx.x & 31;
    const int vw = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 8;   // warp-uniform
    if (vw >= DV) return;
    const int h = blockIdx.y, bseq = blockIdx.z;
    const int lo = cu_seqlens[bseq], hi = cu_seqlens[bseq + 1];
    if (lo < 0 || hi > N || hi <= lo) return;                                  // warp-uniform
    const int v0 = vw + (lane & 1) * 4;
    const int r0 = (lane >> 1) * RPT;
    const int hk = h / (HV / HK);
    const i64_t C = (i64_t)2 * HK * DK + (i64_t)HV * DV;
    const int slot = slots[bseq];
    const bool zero = fresh[bseq] != 0 || slot < 0;
    float* sp = state + (((i64_t)(slot < 0 ? 0 : slot) * HV + h) * DK + r0) * DV + v0;

    float S[RPT][4];
    if (zero) {
#pragma unroll
        for (int i = 0; i < RPT; ++i) S[i][0] = S[i][1] = S[i][2] = S[i][3] = 0.f;
    } else {
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const float4 f = *reinterpret_cast<const float4*>(sp + (i64_t)i * DV);
            S[i][0] = f.x; S[i][1] = f.y; S[i][2] = f.z; S[i][3] = f.w;
        }
    }

    const float negA = -expf(gdn_param(A_log, flags & 1, h));
    const float dtb = gdn_param(dt_bias, flags & 2, h);
    const i64_t qoff = (i64_t)hk * DK + r0;
    const i64_t koff = (i64_t)HK * DK + (i64_t)hk * DK + r0;
    const i64_t voff = (i64_t)2 * HK * DK + (i64_t)h * DV + v0;

    GdnRaw<RPT> cur;
    gdn_load_raw<RPT>(cur, y + (i64_t)lo * C, a + (i64_t)lo * HV + h, b + (i64_t)lo * HV + h, qoff, koff, voff);

    for (int n = lo; n < hi; ++n) {
        GdnRaw<RPT> nxt = cur;
        if (n + 1 < hi)
            gdn_load_raw<RPT>(nxt, y + (i64_t)(n + 1) * C, a + (i64_t)(n + 1) * HV + h,
                              b + (i64_t)(n + 1) * HV + h, qoff, koff, voff);

        float q[RPT], k[RPT], v[4];
        gdn_unpack<RPT>(q, cur.q);
        gdn_unpack<RPT>(k, cur.k);
        const float2 v01 = bf16x2_to_f32x2(cur.v.x), v23 = bf16x2_to_f32x2(cur.v.y);
        v[0] = v01.x; v[1] = v01.y; v[2] = v23.x; v[3] = v23.y;

        // gates
        const float g = __fmul_rn(negA, gdn_softplus(__fadd_rn(bf16_to_f32(cur.a), dtb)));
        const float beta = gdn_round_bf16(gdn_sigmoid(bf16_to_f32(cur.b)));
        const float decay = expf(g);

        // l2norm of q and k over DK (eps on the sum of squares), q scaled by DK^-0.5
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int i = 0; i < RPT; ++i) { sq = fmaf(q[i], q[i], sq); sk = fmaf(k[i], k[i], sk); }
        sq = gdn_sum16(sq);
        sk = gdn_sum16(sk);
        const float iq = rsqrtf(__fadd_rn(sq, 1e-6f)), ik = rsqrtf(__fadd_rn(sk, 1e-6f));
#pragma unroll
        for (int i = 0; i < RPT; ++i) { q[i] = __fmul_rn(__fmul_rn(q[i], iq), scale); k[i] = __fmul_rn(k[i], ik); }

        // S = exp(g) S; u = k^T S
        float u[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) u[c] = 0.f;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                S[i][c] = __fmul_rn(S[i][c], decay);
                u[c] = fmaf(k[i], S[i][c], u[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) u[c] = gdn_sum16(u[c]);

        // d = beta (v - u); S = S + k d^T; o = q^T S
        float d[4], o[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) { d[c] = __fmul_rn(beta, __fsub_rn(v[c], u[c])); o[c] = 0.f; }
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                S[i][c] = fmaf(k[i], d[c], S[i][c]);
                o[c] = fmaf(q[i], S[i][c], o[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) o[c] = gdn_sum16(o[c]);

        if (lane < 2) {                                   // row group 0 holds the warp's 8 outputs
            uint2 pk;
            pk.x = (unsigned)f32_to_bf16(o[0]) | ((unsigned)f32_to_bf16(o[1]) << 16);
            pk.y = (unsigned)f32_to_bf16(o[2]) | ((unsigned)f32_to_bf16(o[3]) << 16);
            *reinterpret_cast<uint2*>(out + ((i64_t)n * HV + h) * DV + v0) = pk;
        }
        if (keep != nullptr) {                            // the state after this column
            float* kp = keep + (((i64_t)n * HV + h) * DK + r0) * DV + v0;
#pragma unroll
            for (int i = 0; i < RPT; ++i)
                *reinterpret_cast<float4*>(kp + (i64_t)i * DV) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
        }
        cur = nxt;
    }

    if (keep == nullptr && slot >= 0) {
#pragma unroll
        for (int i = 0; i < RPT; ++i)
            *reinterpret_cast<float4*>(sp + (i64_t)i * DV) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
    }
}

#define GDN_RECURRENT(NAME, RPT)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                             \
        bf16_t* __restrict__ out, float* __restrict__ keep, float* __restrict__ state,                  \
        const bf16_t* __restrict__ y, const bf16_t* __restrict__ a, const bf16_t* __restrict__ b,       \
        const void* __restrict__ A_log, const void* __restrict__ dt_bias, int flags,                    \
        const int* __restrict__ slots, const int* __restrict__ cu_seqlens, const int* __restrict__ fresh, \
        int N, int HK, int HV, int DV, float scale) {                                                   \
        gdn_recurrent_body<RPT>(out, keep, state, y, a, b, A_log, dt_bias, flags, slots, cu_seqlens,     \
                                fresh, N, HK, HV, DV, scale);                                           \
    }

GDN_RECURRENT(gdn_recurrent_dk16, 1)
GDN_RECURRENT(gdn_recurrent_dk32, 2)
GDN_RECURRENT(gdn_recurrent_dk64, 4)
GDN_RECURRENT(gdn_recurrent_dk128, 8)
GDN_RECURRENT(gdn_recurrent_dk256, 16)

// --------------------------------------------------------------------------------------------------
// Gated RMSNorm (GDN output norm): per head row x [DV] with gate z [DV] and weight [DV]:
//   n = bf16(x * rsqrt(sum(x^2) * (1/DV) + eps)); n = w * n (bf16 when w is bf16, fp32 when w is fp32);
//   out = bf16(n * silu(z)) with silu in fp32.
// One warp per row; lane holds elements lane*4 + 128*i (8-byte loads; DV % 4 == 0). Rows = N * HV.

extern "C" __global__ void __launch_bounds__(256)
gdn_gated_rms_norm_bf16(bf16_t* __restrict__ out, const bf16_t* __restrict__ x, const bf16_t* __restrict__ z,
                        const void* __restrict__ weight, int w_bf16, int rows, int DV, float eps)
{
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;                              // warp-uniform
    const bf16_t* xr = x + (i64_t)row * DV;
    const bf16_t* zr = z + (i64_t)row * DV;
    bf16_t* orow = out + (i64_t)row * DV;

    float ss = 0.f;
    for (int e = lane * 4; e < DV; e += 128) {
        const uint2 w = *reinterpret_cast<const uint2*>(xr + e);
        const float2 p = bf16x2_to_f32x2(w.x), q = bf16x2_to_f32x2(w.y);
        ss = fmaf(p.x, p.x, ss); ss = fmaf(p.y, p.y, ss); ss = fmaf(q.x, q.x, ss); ss = fmaf(q.y, q.y, ss);
    }
    ss = warp_sum(ss);
    const float r = rsqrtf(__fadd_rn(__fmul_rn(ss, 1.f / (float)DV), eps));   // torch's mean: sum * (1/DV)

    for (int e = lane * 4; e < DV; e += 128) {
        const uint2 xw = *reinterpret_cast<const uint2*>(xr + e);
        const uint2 zw = *reinterpret_cast<const uint2*>(zr + e);
        const float2 x01 = bf16x2_to_f32x2(xw.x), x23 = bf16x2_to_f32x2(xw.y);
        const float2 z01 = bf16x2_to_f32x2(zw.x), z23 = bf16x2_to_f32x2(zw.y);
        const float xv[4] = {x01.x, x01.y, x23.x, x23.y};
        const float zv[4] = {z01.x, z01.y, z23.x, z23.y};
        bf16_t o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float n = gdn_round_bf16(__fmul_rn(xv[i], r));
            const float wn = w_bf16 ? gdn_round_bf16(__fmul_rn(bf16_to_f32(reinterpret_cast<const bf16_t*>(weight)[e + i]), n))
                                    : __fmul_rn(reinterpret_cast<const float*>(weight)[e + i], n);
            o[i] = f32_to_bf16(__fmul_rn(wn, gdn_silu(zv[i])));
        }
        uint2 pk;
        pk.x = (unsigned)o[0] | ((unsigned)o[1] << 16);
        pk.y = (unsigned)o[2] | ((unsigned)o[3] << 16);
        *reinterpret_cast<uint2*>(orow + e) = pk;
    }
}

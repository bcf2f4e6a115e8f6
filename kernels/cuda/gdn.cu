// Gated DeltaNet mixer for decode, speculative verification and prefill, batched over sequences.
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
//                       chunk of 16 columns, all loaded before the first is computed): the conv has no
//                       recurrence, so chunks run in parallel;
//                       chunk 0 alone reads the old window and writes the new one (the last K-1
//                       inputs, read back from x), so no other thread touches the slot's window.
// gdn_conv1d_bf16_x2    the same with two channels per thread (C even, x / out 4-byte aligned).
// gdn_recurrent_dkXX    gates, q/k l2norm and the gated delta rule, fp32 state in registers across the
//                       sequence's columns. See the layout note above gdn_recurrent_body.
// gdn_chunk_prep_dkXX, gdn_chunk_scan_dkXX   the same rule in chunks of 64 columns for prefill (one
//                       sequential step per chunk); see the note above gdn_chunk_prep_body.
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

// K a compile-time constant, so the window and the chunk's inputs stay in registers through the
// unrolled column loop (with K at run time ptxas put them on the stack). P channels per thread (1, or
// 2 when C is even and x / out are 4-byte aligned: one 32-bit load or store moves both channels'
// values, half the memory instructions of P = 1); each channel's arithmetic is the same in either.
template <int P>
__device__ __forceinline__ void conv_load(float (&v)[P], const bf16_t* p) {
    if (P == 2) {
        const float2 f = bf16x2_to_f32x2(*reinterpret_cast<const unsigned*>(p));
        v[0] = f.x; v[P - 1] = f.y;
    } else {
        v[0] = bf16_to_f32(*p);
    }
}

template <int K, int P>
__device__ __forceinline__ void gdn_conv1d_body(bf16_t* __restrict__ out, const bf16_t* __restrict__ x,
                                                const bf16_t* __restrict__ weight, bf16_t* __restrict__ conv_state,
                                                const int* __restrict__ slots, const int* __restrict__ cu_seqlens,
                                                const int* __restrict__ fresh, int N, int C, int update_state)
{
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * P;    // this thread's channels c..c+P-1
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
    bf16_t* st = conv_state + ((i64_t)(slot < 0 ? 0 : slot) * C + c) * W;   // channel c's window, oldest
                                                                             // first; c + 1's follows it
    float w[P][GDN_CONV_MAX_K];
#pragma unroll
    for (int q = 0; q < P; ++q)
#pragma unroll
        for (int j = 0; j < GDN_CONV_MAX_K; ++j) w[q][j] = j < K ? bf16_to_f32(weight[(i64_t)(c + q) * K + j]) : 0.f;

    // win[j] = the input at column t0 - W + j (j < W): from x, or from the old window before lo.
    // Only chunk 0 (t0 = 0) reaches before lo, since t0 >= GDN_CONV_COLS >= W otherwise.
    float win[P][GDN_CONV_MAX_K - 1];
#pragma unroll
    for (int j = 0; j < GDN_CONV_MAX_K - 1; ++j) {
        float v[P];
#pragma unroll
        for (int q = 0; q < P; ++q) v[q] = 0.f;
        if (j < W) {
            const int m = t0 - W + j;
            if (m >= 0) {
                conv_load<P>(v, x + (i64_t)(lo + m) * C + c);
            } else if (!zero) {
#pragma unroll
                for (int q = 0; q < P; ++q) v[q] = bf16_to_f32(st[q * W + m + W]);
            }
        }
#pragma unroll
        for (int q = 0; q < P; ++q) win[q][j] = v[q];
    }
    // The chunk's inputs loaded up front: sixteen loads in flight per thread (one at a time, a prefill
    // chunk's conv ran at an eighth of the memory bandwidth).
    float xs[GDN_CONV_COLS][P];
#pragma unroll
    for (int i = 0; i < GDN_CONV_COLS; ++i) {
        if (t0 + i < t1) {
            conv_load<P>(xs[i], x + (i64_t)(lo + t0 + i) * C + c);
        } else {
#pragma unroll
            for (int q = 0; q < P; ++q) xs[i][q] = 0.f;
        }
    }

#pragma unroll
    for (int i = 0; i < GDN_CONV_COLS; ++i) {
        const int t = t0 + i;
        if (t < t1) {
            bf16_t o[P];
#pragma unroll
            for (int q = 0; q < P; ++q) {
                const float xt = xs[i][q];
                float acc = 0.f;
#pragma unroll
                for (int j = 0; j < GDN_CONV_MAX_K; ++j) {
                    if (j < K) {
                        const float xv = j < W ? win[q][min(j, GDN_CONV_MAX_K - 2)] : xt;   // j == W: the new input
                        acc = __fadd_rn(acc, __fmul_rn(w[q][j], xv));
                    }
                }
#pragma unroll
                for (int j = 0; j < GDN_CONV_MAX_K - 1; ++j) {   // shift the window by one column
                    if (j < W - 1) win[q][j] = win[q][min(j + 1, GDN_CONV_MAX_K - 2)];
                    else if (j == W - 1) win[q][j] = xt;
                }
                o[q] = f32_to_bf16(gdn_silu(gdn_round_bf16(acc)));
            }
            bf16_t* dst = out + (i64_t)(lo + t) * C + c;
            if (P == 2) *reinterpret_cast<unsigned*>(dst) = (unsigned)o[0] | ((unsigned)o[P - 1] << 16);
            else *dst = o[0];
        }
    }

    // New window = the last W entries of [old window, x_lo .. x_{hi-1}]: entry j is column T - W + j.
    if (update_state && slot >= 0 && blockIdx.z == 0) {
#pragma unroll
        for (int q = 0; q < P; ++q) {
#pragma unroll
            for (int j = 0; j < GDN_CONV_MAX_K - 1; ++j) {
                if (j < W) {
                    const int m = T - W + j;
                    bf16_t v;
                    if (m >= 0) v = x[(i64_t)(lo + m) * C + c + q];
                    else v = zero ? (bf16_t)0 : st[q * W + m + W];   // the old window's entry m + W > j:
                    st[q * W + j] = v;                                // read before this loop writes it
                }
            }
        }
    }
}

#define GDN_CONV_CASES(P) \
    switch (K) {                                         /* 2..GDN_CONV_MAX_K (the wrapper checks) */ \
    case 2: gdn_conv1d_body<2, P>(out, x, weight, conv_state, slots, cu_seqlens, fresh, N, C, update_state); break; \
    case 3: gdn_conv1d_body<3, P>(out, x, weight, conv_state, slots, cu_seqlens, fresh, N, C, update_state); break; \
    case 4: gdn_conv1d_body<4, P>(out, x, weight, conv_state, slots, cu_seqlens, fresh, N, C, update_state); break; \
    case 5: gdn_conv1d_body<5, P>(out, x, weight, conv_state, slots, cu_seqlens, fresh, N, C, update_state); break; \
    case 6: gdn_conv1d_body<6, P>(out, x, weight, conv_state, slots, cu_seqlens, fresh, N, C, update_state); break; \
    case 7: gdn_conv1d_body<7, P>(out, x, weight, conv_state, slots, cu_seqlens, fresh, N, C, update_state); break; \
    case 8: gdn_conv1d_body<8, P>(out, x, weight, conv_state, slots, cu_seqlens, fresh, N, C, update_state); break; \
    }

#define GDN_CONV_KERNEL(name, P) \
    extern "C" __global__ void __launch_bounds__(128) \
    name(bf16_t* __restrict__ out,                       /* [N, C] */ \
         const bf16_t* __restrict__ x,                   /* [N, C] pre-conv inputs */ \
         const bf16_t* __restrict__ weight,              /* [C, K] */ \
         bf16_t* __restrict__ conv_state,                /* [S, C, K-1] */ \
         const int* __restrict__ slots, const int* __restrict__ cu_seqlens, \
         const int* __restrict__ fresh, int N, int C, int K, int update_state) \
    { \
        pdl_enter(); \
        GDN_CONV_CASES(P) \
    }

GDN_CONV_KERNEL(gdn_conv1d_bf16, 1)
GDN_CONV_KERNEL(gdn_conv1d_bf16_x2, 2)             // C even, x and out 4-byte aligned

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
        pdl_enter();                                                                                    \
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
    pdl_enter();
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

// --------------------------------------------------------------------------------------------------
// Gated delta rule, chunked form (prefill: sequences of many columns). Same batch metadata contract
// as the recurrent kernel (fresh / negative slots start from zeros, a negative slot is never
// written, empty or out-of-range sequences are skipped), same gate and q/k l2norm formulas; the
// rule is reorganised as kernels/reference.gated_delta_rule_chunked so that the sequential part is
// one step per chunk of 64 columns instead of one per column. Chunk c of a sequence covers its
// columns lo + 64c .. min(lo + 64c + 64, hi) - 1; a last partial chunk of L < 64 columns behaves as
// if padded with columns of beta = 0, g = 0 (rows >= L of every chunk matrix are zero), so
// sequences of any length share one layout with no padding in memory. The prep runs on CUDA cores in
// fp32; the scan (DK <= 128) on tensor cores in split precision (see "Tensor-core scan" below).
//
// Two kernels, through scratch indexed by column n (absolute, 0..N-1) and value head h:
//   U [N, HV, DV], W [N, HV, DK], QKD [N, HV, 64], info [N, HV] float4 {G, iq, ik, 0}.
//
// gdn_chunk_prep_dkXX   grid (chunks of the longest sequence, HK, B), 256 threads. One block per
//   (chunk, key head, sequence): the q/k norms (iq, ik = rsqrt(|x|^2 + 1e-6), as the recurrent
//   kernel) and the Gram products k k^T and q k^T (q = (q iq) DK^-0.5, k = k ik; 64 x 64, DK
//   staged through shared tiles of 32, each thread a 4 x 4 block of rows ti + 16r, columns
//   tj + 16s) are per key head, so the block computes them once and then loops over the HV/HK value
//   heads that read this key head. Per value head: gates g, beta (the recurrent kernel's formulas),
//   G = in-chunk cumulative sum of g (sequential, as torch.cumsum), D_ij = exp(G_i - G_j) (j <= i:
//   the exponent is <= 0, so nothing overflows however strong the decay),
//     A = strict_lower(beta_i (k_i . k_j) D_ij)  -> shared [64][64]
//     QKD = lower((q_i . k_j) D_ij)             -> scratch, zeros above the diagonal
//   and (I + A) X = [beta v | (k beta) e^G] by forward substitution: one thread per column of X
//   (DV + DK columns), its 64 rows in registers, right-looking (x_j, once final, is taken off every
//   later row, so the dependency chain is one FMA per row); A is stored transposed and A_ij is the
//   same shared word for every thread (broadcast), so no barrier is needed inside the solve.
//   U = X[:, :DV], W = X[:, DV:].
//   k k^T waits in shared memory (thread-major, conflict-free) and q k^T in registers while the value
//   heads are solved (two blocks per SM: <= 128 registers, ~34 KiB shared). The 64 x 64 reads of A
//   are the same for every column a thread solves; an opaque zero in their address keeps the compiler
//   from hoisting them out of the column loop (it would spill them all).
//
// gdn_chunk_scan_dkXX   grid (ceil(DV/16), HV, B), 128 threads. A block owns a 16-column slice of one
//   value head's state [DK x 16] (fp32, in shared memory for the products that read all of it, and
//   in the registers of the thread that updates it). Per chunk, in order:
//     V' = U - W S;  O = (q e^G) S + QKD V';  S <- e^{G_last} S + (k e^{G_last - G})^T V'
//   Rows (V', O): thread = (row ri = tid/2, 8 columns); the DK-long products stream the W row and the
//   bf16 q row from global memory (the slices of a value head share W rows, the value heads of a key
//   head share q rows: mostly L1/L2 hits) against broadcast reads of S. Update: thread = (state row
//   cd + 64m, 8 columns), k read from the conv output (a warp reads 32 consecutive bf16 of a row).
//   The per-row factors {e^G, e^(G_last - G), iq, ik} are staged per chunk in a double buffer, so a
//   chunk takes two barriers: before the rows (S, V' and factors ready) and between the rows' V' and
//   O/update. O is written as bf16; the final S to the slot. 16 columns per block: at the 27B shape
//   one sequence makes 384 blocks (~3 per SM), and a narrower slice would re-read W and q more often.
//   Launch bounds (128, 4): without a block count ptxas aimed at ~80 registers and spilled.

//
// Tensor-core scan (gdn_chunk_scan_tc_dkXX, DK <= 128; DK 256 keeps the CUDA-core scan above, whose
// state slice would not fit in registers). A warp owns 16 value columns of one value head and keeps
// S^T [16 x DK] in registers as mma.m16n8k16 C fragments across chunks (the C fragments of n-tiles
// 2k, 2k+1 are the A fragment of k-step k, so S^T feeds the next products without a trip through
// shared memory). Per chunk, transposed so that the value columns are the mma rows:
//   V'^T = U^T - S^T W^T;  O^T = (S^T q^T) diag(iq scale e^G) + V'^T QKD^T;
//   S^T <- e^G_last S^T + (V'^T diag(ik e^(G_last - G))) k
// W, q, k, QKD, the per-row factors and the block's U rows are staged per chunk in shared memory with
// cp.async (rows >= L zero-filled), in two groups that land while the other phase computes, and read
// as B fragments with ldmatrix (k transposed; U as plain loads). The prep writes W and QKD as
// bf16 hi/lo pairs and the factors {iq scale e^G, ik e^(G_last - G), e^G_last} for this kernel.
// Split precision: an fp32 operand x is split into hi = bf16(x), lo = bf16(x - hi); |x - hi - lo|
// <= 2^-18 |x|. fp32 x fp32 products (S W, V' QKD) take three mmas, hi hi + hi lo + lo hi (the dropped
// lo lo term is <= 2^-18 |a b|), so each term carries at most ~3 * 2^-18 = 1.1e-5 relative error, in
// random directions (fp32 accumulation adds ~2^-24 per step). q and k are bf16 conv outputs, exact:
// their norms and gates are applied as fp32 row factors outside the mma, so S q and V' k take two
// mmas (hi, lo of the fp32 side) and lose only the 2^-18 split residue. The state feels the S W and
// V' k errors, ~1e-5 of a term at worst, mostly cancelling over the DK- and 64-long sums, and the
// rule is contractive (decay <= 1, (I - beta k k^T)), so errors do not compound over chunks.
// The products use mma.sync m16n8k16 (sm_80+), about 4x fewer issue slots than the fp32 FMAs per term
// even with three passes.

#define GDN_CHUNK 64            // columns per chunk
#define GDN_PREP_THREADS 256
#define GDN_SCAN_THREADS 128
#define GDN_SCAN_COLS 16        // value columns of one scan block (two groups of 8)
#define GDN_SCAN_TC(DK) ((DK) <= 128)   // DK with the tensor-core scan (gdn_chunk_scan_tc_dkXX)

// The chunk prep's triangular solve: right-looking (one FMA of dependency per row; the left-looking
// form's chains were the prep's bound: 309 -> 179 us per 27B layer and 2 048 columns on an H200), but
// for sm_120, whose ptxas (nvcc 13.0) spills 392 bytes of the right-looking form's registers; there the
// left-looking form of before stays (no spill). Defined before including this file to force one form.
#ifndef GDN_PREP_RIGHT_LOOKING
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define GDN_PREP_RIGHT_LOOKING 0
#else
#define GDN_PREP_RIGHT_LOOKING 1
#endif
#endif

// x -> hi = bf16(x), lo = bf16(x - hi), both rounded to nearest even by the conversion instruction
// (f32_to_bf16's result for every finite x, without its NaN branch).
__device__ __forceinline__ void gdn_hi_lo(float x, bf16_t& hi, bf16_t& lo) {
    unsigned short h, l;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    const float r = __fsub_rn(x, __uint_as_float((unsigned)h << 16));
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(l) : "f"(r));
    hi = (bf16_t)h;
    lo = (bf16_t)l;
}

template <int DK>
__device__ __forceinline__ void gdn_chunk_prep_body(
    float* __restrict__ U,             // [N, HV, DV]
    float* __restrict__ W,             // [N, HV, DK]
    float* __restrict__ QKD,           // [N, HV, 64]
    float4* __restrict__ info,         // [N, HV] {G, iq, ik, 0}
    const bf16_t* __restrict__ y,      // [N, C] = [q (HK*DK) | k (HK*DK) | v (HV*DV)]
    const bf16_t* __restrict__ a, const bf16_t* __restrict__ b,        // [N, HV]
    const void* __restrict__ A_log, const void* __restrict__ dt_bias,  // [HV] fp32 or bf16 (flags bit 0 / 1)
    int flags, const int* __restrict__ cu_seqlens, int N, int HK, int HV, int DV, float scale)
{
    constexpr int TK = DK < 32 ? DK : 32;              // DK tile of the Gram products
    constexpr int TS = TK + 1;                         // odd row pitch: the 16 column reads hit 16 banks
    // A [64][AP], transposed for the right-looking solve (column j of A at [j * AP]: a column per step
    // as float4 broadcasts; the pitch of 68, a multiple of 4, makes the writes below 2-way conflicts)
    constexpr int AP = GDN_CHUNK + 4;
    constexpr int MAT = 2 * GDN_CHUNK * TS > GDN_CHUNK * AP ? 2 * GDN_CHUNK * TS : GDN_CHUNK * AP;
    __shared__ float s_kk[16 * GDN_PREP_THREADS];      // k k^T: this thread's element e at [e * 256 + tid]
    __shared__ __align__(16) float s_mat[MAT];         // q/k tiles [2][64][TS], then A^T [64][AP]
    __shared__ float s_iq[GDN_CHUNK], s_ik[GDN_CHUNK], s_beta[GDN_CHUNK], s_G[GDN_CHUNK], s_eG[GDN_CHUNK];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hk = blockIdx.y, bseq = blockIdx.z;
    const int lo = cu_seqlens[bseq], hi = cu_seqlens[bseq + 1];
    if (lo < 0 || hi > N || hi <= lo) return;                                  // block-uniform
    if (blockIdx.x >= (unsigned)((hi - lo + GDN_CHUNK - 1) / GDN_CHUNK)) return;
    const int t0 = lo + blockIdx.x * GDN_CHUNK;
    const int L = min(GDN_CHUNK, hi - t0);                                     // 1..64 valid rows
    const int ratio = HV / HK;
    const i64_t C = (i64_t)2 * HK * DK + (i64_t)HV * DV;
    const bf16_t* yq = y + (i64_t)t0 * C + (i64_t)hk * DK;                    // row i: + i * C
    const bf16_t* yk = yq + (i64_t)HK * DK;

    // q/k norms: 128 rows (column i, q or k), a warp per row; rows >= L get 0 (zero q, k).
    for (int r = warp; r < 2 * GDN_CHUNK; r += GDN_PREP_THREADS / 32) {
        const int i = r >> 1;
        float ss = 0.f;
        if (i < L) {                                                           // warp-uniform
            const unsigned* p = reinterpret_cast<const unsigned*>(((r & 1) ? yk : yq) + (i64_t)i * C);
            for (int w = lane; w < DK / 2; w += 32) {
                const float2 f = bf16x2_to_f32x2(p[w]);
                ss = fmaf(f.x, f.x, ss);
                ss = fmaf(f.y, f.y, ss);
            }
        }
        ss = warp_sum(ss);
        if (lane == 0) ((r & 1) ? s_ik : s_iq)[i] = i < L ? rsqrtf(__fadd_rn(ss, 1e-6f)) : 0.f;
    }

    // Gram products over DK tiles: kk = k k^T, qk = q k^T for rows ti + 16r, columns tj + 16s.
    const int ti = tid >> 4, tj = tid & 15;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int s = 0; s < 4; ++s) kk[r][s] = qk[r][s] = 0.f;
    float* tq = s_mat;
    float* tk = s_mat + GDN_CHUNK * TS;
    for (int d0 = 0; d0 < DK; d0 += TK) {
        __syncthreads();                               // norms written / the previous tile consumed
        for (int idx = tid; idx < 2 * GDN_CHUNK * (TK / 2); idx += GDN_PREP_THREADS) {
            const int which = idx / (GDN_CHUNK * (TK / 2));                    // 0: q, 1: k
            const int rem = idx - which * (GDN_CHUNK * (TK / 2));
            const int i = rem / (TK / 2), w = rem - i * (TK / 2);
            float2 f = make_float2(0.f, 0.f);
            if (i < L) {
                f = bf16x2_to_f32x2(reinterpret_cast<const unsigned*>((which ? yk : yq) + (i64_t)i * C + d0)[w]);
                if (which) {
                    const float r = s_ik[i];
                    f.x = __fmul_rn(f.x, r);
                    f.y = __fmul_rn(f.y, r);
                } else {
                    const float r = s_iq[i];
                    f.x = __fmul_rn(__fmul_rn(f.x, r), scale);
                    f.y = __fmul_rn(__fmul_rn(f.y, r), scale);
                }
            }
            float* dst = (which ? tk : tq) + i * TS + 2 * w;
            dst[0] = f.x;
            dst[1] = f.y;
        }
        __syncthreads();
#pragma unroll 8
        for (int dd = 0; dd < TK; ++dd) {
            float kr[4], qr[4], kc[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                kr[r] = tk[(ti + 16 * r) * TS + dd];
                qr[r] = tq[(ti + 16 * r) * TS + dd];
                kc[r] = tk[(tj + 16 * r) * TS + dd];
            }
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    kk[r][s] = fmaf(kr[r], kc[s], kk[r][s]);
                    qk[r][s] = fmaf(qr[r], kc[s], qk[r][s]);
                }
        }
    }
#pragma unroll
    for (int e = 0; e < 16; ++e) s_kk[e * GDN_PREP_THREADS + tid] = kk[e >> 2][e & 3];

    const bf16_t* yv0 = y + (i64_t)t0 * C + (i64_t)2 * HK * DK;
    for (int jh = 0; jh < ratio; ++jh) {
        const int h = hk * ratio + jh;
        __syncthreads();                               // tiles / the previous head's A and gates consumed

        // gates of this value head; G = sequential in-chunk cumulative sum (rows >= L: g = 0, beta = 0)
        if (warp == 0) {
            const float negA = -expf(gdn_param(A_log, flags & 1, h));
            const float dtb = gdn_param(dt_bias, flags & 2, h);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = lane + 32 * e;
                float g = 0.f, beta = 0.f;
                if (i < L) {
                    const i64_t n = (i64_t)(t0 + i) * HV + h;
                    g = __fmul_rn(negA, gdn_softplus(__fadd_rn(bf16_to_f32(a[n]), dtb)));
                    beta = gdn_round_bf16(gdn_sigmoid(bf16_to_f32(b[n])));
                }
                s_G[i] = g;
                s_beta[i] = beta;
            }
            __syncwarp();
            if (lane == 0) {
                float acc = 0.f;
#pragma unroll 8
                for (int i = 0; i < GDN_CHUNK; ++i) {
                    acc = __fadd_rn(acc, s_G[i]);
                    s_G[i] = acc;
                }
            }
            __syncwarp();
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = lane + 32 * e;
                const float G = s_G[i];
                s_eG[i] = expf(G);
                if (i < L) {
                    if constexpr (GDN_SCAN_TC(DK)) {                // rows >= L have g = 0: G_63 = G_last
                        const float Gl = s_G[GDN_CHUNK - 1];
                        info[(i64_t)(t0 + i) * HV + h] =
                            make_float4(__fmul_rn(__fmul_rn(s_iq[i], scale), s_eG[i]),
                                        __fmul_rn(s_ik[i], expf(__fsub_rn(Gl, G))), expf(Gl), 0.f);
                    } else {
                        info[(i64_t)(t0 + i) * HV + h] = make_float4(G, s_iq[i], s_ik[i], 0.f);
                    }
                }
            }
        }
        __syncthreads();

        // A (shared) and QKD (scratch) from this thread's 4 x 4 block
        {
            float* sA = s_mat;
            float* qkd = QKD + ((i64_t)t0 * HV + h) * GDN_CHUNK;               // row i: + i * HV * 64
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int ri = ti + 16 * r;
                const float Gi = s_G[ri], bi = s_beta[ri];
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const int cj = tj + 16 * s;
                    const float D = cj <= ri ? expf(__fsub_rn(Gi, s_G[cj])) : 0.f;
                    sA[GDN_PREP_RIGHT_LOOKING ? cj * AP + ri : ri * AP + cj] =
                        cj < ri ? __fmul_rn(__fmul_rn(bi, s_kk[(4 * r + s) * GDN_PREP_THREADS + tid]), D) : 0.f;
                    if (ri < L) {
                        const float x = cj <= ri ? __fmul_rn(qk[r][s], D) : 0.f;
                        if constexpr (GDN_SCAN_TC(DK)) {            // [n][h][2][64] bf16 hi, lo
                            bf16_t* qb = reinterpret_cast<bf16_t*>(QKD) + ((i64_t)(t0 + ri) * HV + h) * 128 + cj;
                            gdn_hi_lo(x, qb[0], qb[GDN_CHUNK]);
                        } else {
                            qkd[(i64_t)ri * HV * GDN_CHUNK + cj] = x;
                        }
                    }
                }
            }
        }
        __syncthreads();

        // (I + A) X = [beta v | (k beta) e^G], one thread per column of X.
        // Right-looking (GDN_PREP_RIGHT_LOOKING): once x_j is final it is taken off every later row
        // (column j of A is one row of the transposed tile), so a row's value is final one FMA after the
        // row before it, and the FMAs of a column step are independent. Rows >= L have zero right-hand
        // sides and zero rows of A (beta = 0, k = 0), so they stay zero: only their loads (clamped to a
        // valid row) and stores need a test. Otherwise left-looking, rows in order, each row's dot
        // product in two chains.
        const int CI = (int)C;                          // offsets inside a chunk fit an int
        for (int col = tid; col < DV + DK; col += GDN_PREP_THREADS) {
            // An opaque zero offset: A is the same for every column, and without it the compiler
            // hoists all 64 x 64 shared reads out of this loop into (spilled) registers.
            unsigned zero_off;
            asm volatile("mov.u32 %0, 0;" : "=r"(zero_off));
            const float4* sA4 = reinterpret_cast<const float4*>(s_mat) + zero_off;
            const bool isv = col < DV;
            const bf16_t* src = isv ? yv0 + (i64_t)h * DV + col : yk + (col - DV);
            float x[GDN_CHUNK];
            if constexpr (GDN_PREP_RIGHT_LOOKING) {
#pragma unroll
                for (int i = 0; i < GDN_CHUNK; ++i) {
                    const float raw = bf16_to_f32(src[min(i, L - 1) * CI]);
                    x[i] = isv ? __fmul_rn(s_beta[i], raw)
                               : __fmul_rn(__fmul_rn(__fmul_rn(raw, s_ik[i]), s_beta[i]), s_eG[i]);
                }
#pragma unroll
                for (int j = 0; j < GDN_CHUNK - 1; ++j) {
                    // block-uniform; x_j of a row >= L only reaches rows >= L. The branch also bounds how
                    // far ptxas hoists the next steps' shared loads (which would spill x otherwise)
                    if (j < L - 1) {
                        const float xj = x[j];
#pragma unroll
                        for (int i4 = (j + 1) & ~3; i4 < GDN_CHUNK; i4 += 4) {
                            const float4 a4 = sA4[(j * AP + i4) / 4];         // A[i4 .. i4+3][j]
                            if (i4 + 0 > j) x[i4 + 0] = fmaf(-a4.x, xj, x[i4 + 0]);
                            if (i4 + 1 > j) x[i4 + 1] = fmaf(-a4.y, xj, x[i4 + 1]);
                            if (i4 + 2 > j) x[i4 + 2] = fmaf(-a4.z, xj, x[i4 + 2]);
                            if (i4 + 3 > j) x[i4 + 3] = fmaf(-a4.w, xj, x[i4 + 3]);
                        }
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < GDN_CHUNK; ++i) {
                    float rhs = 0.f;
                    if (i < L) {
                        const float raw = bf16_to_f32(src[i * CI]);
                        rhs = isv ? __fmul_rn(s_beta[i], raw)
                                  : __fmul_rn(__fmul_rn(__fmul_rn(raw, s_ik[i]), s_beta[i]), s_eG[i]);
                    }
                    x[i] = rhs;
                }
#pragma unroll
                for (int i = 1; i < GDN_CHUNK; ++i) {
                    if (i < L) {                        // block-uniform; rows >= L stay 0
                        float s0 = x[i], s1 = 0.f;      // two chains for latency
#pragma unroll
                        for (int j4 = 0; j4 < i; j4 += 4) {
                            const float4 a4 = sA4[(i * AP + j4) / 4];         // A[i][j4 .. j4+3]
                            s0 = fmaf(-a4.x, x[j4], s0);
                            if (j4 + 1 < i) s1 = fmaf(-a4.y, x[j4 + 1], s1);
                            if (j4 + 2 < i) s0 = fmaf(-a4.z, x[j4 + 2], s0);
                            if (j4 + 3 < i) s1 = fmaf(-a4.w, x[j4 + 3], s1);
                        }
                        x[i] = __fadd_rn(s0, s1);
                    }
                }
            }
            if (GDN_SCAN_TC(DK) && !isv) {                     // W [n][h][2][DK] bf16 hi, lo
                bf16_t* dst = reinterpret_cast<bf16_t*>(W) + ((i64_t)t0 * HV + h) * 2 * DK + (col - DV);
                const int rs = HV * 2 * DK;
#pragma unroll
                for (int i = 0; i < GDN_CHUNK; ++i)
                    if (i < L) gdn_hi_lo(x[i], dst[i * rs], dst[i * rs + DK]);
            } else {
                float* dst = isv ? U + ((i64_t)t0 * HV + h) * DV + col : W + ((i64_t)t0 * HV + h) * DK + (col - DV);
                const int rs = isv ? HV * DV : HV * DK;
#pragma unroll
                for (int i = 0; i < GDN_CHUNK; ++i)
                    if (i < L) dst[i * rs] = x[i];
            }
        }
    }
}

template <int DK>
__device__ __forceinline__ void gdn_chunk_scan_body(
    bf16_t* __restrict__ out,          // [N, HV, DV]
    float* __restrict__ state,         // [S, HV, DK, DV]
    const float* __restrict__ U, const float* __restrict__ W, const float* __restrict__ QKD,
    const float4* __restrict__ info, const bf16_t* __restrict__ y,
    const int* __restrict__ slots, const int* __restrict__ cu_seqlens, const int* __restrict__ fresh,
    int N, int HK, int HV, int DV, float scale)
{
    constexpr int MR = (DK + 63) / 64;                 // state rows per thread in the update: cd + 64m
    __shared__ __align__(16) float s_S[DK * GDN_SCAN_COLS];         // S slice [DK][16]
    __shared__ __align__(16) float s_V[GDN_CHUNK * GDN_SCAN_COLS];  // V' [64][16]
    __shared__ float4 s_fac[2][GDN_CHUNK];             // per row {e^G, e^(G_last - G), iq, ik}
    __shared__ float s_last[2];                        // e^G_last
    float4* sS4 = reinterpret_cast<float4*>(s_S);
    float4* sV4 = reinterpret_cast<float4*>(s_V);

    const int tid = threadIdx.x;
    const int h = blockIdx.y, bseq = blockIdx.z;
    const int vb = blockIdx.x * GDN_SCAN_COLS;
    const int lo = cu_seqlens[bseq], hi = cu_seqlens[bseq + 1];
    if (lo < 0 || hi > N || hi <= lo) return;                                  // block-uniform
    const int hk = h / (HV / HK);
    const i64_t C = (i64_t)2 * HK * DK + (i64_t)HV * DV;
    const int slot = slots[bseq];
    const bool zero = fresh[bseq] != 0 || slot < 0;

    // update role: state rows cd + 64m, columns cv .. cv+7 (group cg of the slice)
    const int cd = tid & 63, cg = tid >> 6;
    const int cv = vb + cg * 8;
    const bool cvalid = cv < DV;                       // DV % 8 == 0: a group is all in or all out
    float* sp = state + ((i64_t)(slot < 0 ? 0 : slot) * HV + h) * DK * DV + cv;
    float S[MR][8];
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        const int d = cd + 64 * m;
        float4 f0 = make_float4(0.f, 0.f, 0.f, 0.f), f1 = f0;
        if (cvalid && d < DK && !zero) {
            f0 = *reinterpret_cast<const float4*>(sp + (i64_t)d * DV);
            f1 = *reinterpret_cast<const float4*>(sp + (i64_t)d * DV + 4);
        }
        S[m][0] = f0.x; S[m][1] = f0.y; S[m][2] = f0.z; S[m][3] = f0.w;
        S[m][4] = f1.x; S[m][5] = f1.y; S[m][6] = f1.z; S[m][7] = f1.w;
        if (d < DK) {
            sS4[d * 4 + cg * 2] = f0;
            sS4[d * 4 + cg * 2 + 1] = f1;
        }
    }

    // row role: chunk row ri, columns rv .. rv+7 (group rg of the slice)
    const int ri = tid >> 1, rg = tid & 1;
    const int rv = vb + rg * 8;
    const bool rvalid = rv < DV;

    const int nch = (hi - lo + GDN_CHUNK - 1) / GDN_CHUNK;
    for (int c = 0; c < nch; ++c) {
        const int t0 = lo + c * GDN_CHUNK, L = min(GDN_CHUNK, hi - t0), buf = c & 1;
        // The factor buffer written here was last read by chunk c-2's update, before chunk c-1's first
        // barrier.
        if (tid < GDN_CHUNK) {
            float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
            if (tid < L) {
                const float4 inf = info[(i64_t)(t0 + tid) * HV + h];
                const float Gl = info[(i64_t)(t0 + L - 1) * HV + h].x;
                f = make_float4(expf(inf.x), expf(__fsub_rn(Gl, inf.x)), inf.y, inf.z);
                if (tid == L - 1) s_last[buf] = expf(Gl);
            }
            s_fac[buf][tid] = f;
        }
        __syncthreads();                               // S (previous update), factors ready; V' free

        // rows: V' = U - W S and the first term of O, (q e^G) S
        float vn[8], o[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) vn[j] = o[j] = 0.f;
        if (ri < L && rvalid) {
            const float4 fa = s_fac[buf][ri];
            const i64_t n = (i64_t)(t0 + ri);
            const float4* wr = reinterpret_cast<const float4*>(W + (n * HV + h) * DK);
            const uint2* qr = reinterpret_cast<const uint2*>(y + n * C + (i64_t)hk * DK);
            float ws[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) ws[j] = 0.f;
#pragma unroll 2
            for (int d4 = 0; d4 < DK / 4; ++d4) {
                const float4 w4 = wr[d4];
                const uint2 qw = qr[d4];
                const float2 q01 = bf16x2_to_f32x2(qw.x), q23 = bf16x2_to_f32x2(qw.y);
                const float wv[4] = {w4.x, w4.y, w4.z, w4.w};
                const float qv[4] = {q01.x, q01.y, q23.x, q23.y};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float qg = __fmul_rn(__fmul_rn(__fmul_rn(qv[e], fa.z), scale), fa.x);
                    const float4 s0 = sS4[(4 * d4 + e) * 4 + rg * 2], s1 = sS4[(4 * d4 + e) * 4 + rg * 2 + 1];
                    const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        ws[j] = fmaf(wv[e], sv[j], ws[j]);
                        o[j] = fmaf(qg, sv[j], o[j]);
                    }
                }
            }
            const float4* ur = reinterpret_cast<const float4*>(U + (n * HV + h) * DV + rv);
            const float4 u0 = ur[0], u1 = ur[1];
            const float uv[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
            for (int j = 0; j < 8; ++j) vn[j] = __fsub_rn(uv[j], ws[j]);
        }
        sV4[ri * 4 + rg * 2] = make_float4(vn[0], vn[1], vn[2], vn[3]);        // rows >= L: zeros
        sV4[ri * 4 + rg * 2 + 1] = make_float4(vn[4], vn[5], vn[6], vn[7]);
        __syncthreads();                               // V' ready; S no longer read by the rows

        // rows: O += QKD V' (QKD row ri is zero past ri), written as bf16
        if (ri < L && rvalid) {
            const i64_t n = (i64_t)(t0 + ri);
            const float4* qd = reinterpret_cast<const float4*>(QKD + (n * HV + h) * GDN_CHUNK);
            for (int j4 = 0; j4 <= (ri >> 2); ++j4) {
                const float4 a4 = qd[j4];
                const float av[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float4 v0 = sV4[(4 * j4 + e) * 4 + rg * 2], v1 = sV4[(4 * j4 + e) * 4 + rg * 2 + 1];
                    const float vv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
                    for (int j = 0; j < 8; ++j) o[j] = fmaf(av[e], vv[j], o[j]);
                }
            }
            uint2 p0, p1;
            p0.x = (unsigned)f32_to_bf16(o[0]) | ((unsigned)f32_to_bf16(o[1]) << 16);
            p0.y = (unsigned)f32_to_bf16(o[2]) | ((unsigned)f32_to_bf16(o[3]) << 16);
            p1.x = (unsigned)f32_to_bf16(o[4]) | ((unsigned)f32_to_bf16(o[5]) << 16);
            p1.y = (unsigned)f32_to_bf16(o[6]) | ((unsigned)f32_to_bf16(o[7]) << 16);
            uint2* op = reinterpret_cast<uint2*>(out + (n * HV + h) * DV + rv);
            op[0] = p0;
            op[1] = p1;
        }

        // update: S <- e^{G_last} S + sum_i (k_i e^(G_last - G_i)) V'_i
        if (cvalid) {
            const float last = s_last[buf];
#pragma unroll
            for (int m = 0; m < MR; ++m)
#pragma unroll
                for (int j = 0; j < 8; ++j) S[m][j] = __fmul_rn(S[m][j], last);
            const bf16_t* kc = y + (i64_t)t0 * C + (i64_t)HK * DK + (i64_t)hk * DK + cd;
#pragma unroll 4
            for (int i = 0; i < L; ++i) {
                const float4 f = s_fac[buf][i];
                const float4 v0 = sV4[i * 4 + cg * 2], v1 = sV4[i * 4 + cg * 2 + 1];
                const float vv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
                for (int m = 0; m < MR; ++m) {
                    if (cd + 64 * m < DK) {
                        const float kg = __fmul_rn(__fmul_rn(bf16_to_f32(kc[(i64_t)i * C + 64 * m]), f.w), f.y);
#pragma unroll
                        for (int j = 0; j < 8; ++j) S[m][j] = fmaf(kg, vv[j], S[m][j]);
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                const int d = cd + 64 * m;
                if (d < DK) {
                    sS4[d * 4 + cg * 2] = make_float4(S[m][0], S[m][1], S[m][2], S[m][3]);
                    sS4[d * 4 + cg * 2 + 1] = make_float4(S[m][4], S[m][5], S[m][6], S[m][7]);
                }
            }
        }
    }

    if (slot >= 0 && cvalid) {
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            const int d = cd + 64 * m;
            if (d < DK) {
                *reinterpret_cast<float4*>(sp + (i64_t)d * DV) = make_float4(S[m][0], S[m][1], S[m][2], S[m][3]);
                *reinterpret_cast<float4*>(sp + (i64_t)d * DV + 4) = make_float4(S[m][4], S[m][5], S[m][6], S[m][7]);
            }
        }
    }
}

// ---- Tensor-core scan (DK <= 128). See the note "Tensor-core scan" above the chunked kernels.

// (x0, x1) -> hi + lo, two bf16x2 words (low half = x0): hi = bf16(x), lo = bf16(x - hi), round to
// nearest even; |x - hi - lo| <= 2^-18 |x| (bf16 keeps 8 significant bits, and x - hi is exact in fp32).
__device__ __forceinline__ void gdn_split(float x0, float x1, unsigned& hi, unsigned& lo) {
    asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(x1), "f"(x0));
    const float r0 = __fsub_rn(x0, __uint_as_float(hi << 16));
    const float r1 = __fsub_rn(x1, __uint_as_float(hi & 0xffff0000u));
    asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(r1), "f"(r0));
}

// c0, c1 (two n-tiles of 8) += (ah + al) (Bh + Bl) in split bf16, less the al Bl term (below the
// fp32 accumulation's rounding): Bh and Bl are the ldmatrix .x4 tiles at shared addresses bh and bl.
__device__ __forceinline__ void gdn_mma_split(float (&c0)[4], float (&c1)[4], const unsigned (&ah)[4],
                                              const unsigned (&al)[4], unsigned bh, unsigned bl) {
    unsigned b[4];
    ldsm_x4(bh, b);
    mma_bf16_16816(c0, ah, b[0], b[1]);
    mma_bf16_16816(c1, ah, b[2], b[3]);
    mma_bf16_16816(c0, al, b[0], b[1]);
    mma_bf16_16816(c1, al, b[2], b[3]);
    ldsm_x4(bl, b);
    mma_bf16_16816(c0, ah, b[0], b[1]);
    mma_bf16_16816(c1, ah, b[2], b[3]);
}

// Byte offset of 16-byte chunk c of row r in a bf16 tile of D columns, chunks XOR-swizzled by the row
// so that the 8 rows of an ldmatrix phase (consecutive rows, one logical chunk) hit 8 bank groups.
template <int D>
__device__ __forceinline__ unsigned gdn_swz(int r, int c) {
    constexpr int M = (D / 8 < 8 ? D / 8 : 8) - 1;
    return (unsigned)(r * D + ((c ^ (r & M)) << 3)) * 2u;
}

// ldmatrix (x4) lane roles in a tile of D bf16 columns: lane l addresses row l & 7 of matrix l >> 3.
// Non-transposed B loads (W, q, QKD: chunk rows are the n index) take matrices {rows 0-7, 8-15} x
// {chunk 2e, 2e+1} as row = 8 (m >> 1) + (l & 7), chunk 2e + (m & 1); transposed ones (k: chunk rows
// are the k index) row = 8 (m & 1) + (l & 7), chunk 2e + (m >> 1). o[e] = byte offset of that row and
// chunk (gdn_swz, as the tiles were stored) for e = 0..3; whole steps of 16 rows add 32 D bytes and
// chunk + 8 adds 128 bytes (the XOR reads the row's low 3 bits and changes the chunk's low 3 bits only).
// The lane index comes in through an opaque move at each use, so the offsets live only in the loop
// that reads them.
template <int D>
__device__ __forceinline__ void gdn_lane_offs(int lane, bool trans, unsigned (&o)[4]) {
    const int m = lane >> 3, r = (trans ? 8 * (m & 1) : 8 * (m >> 1)) + (lane & 7), cb = trans ? m >> 1 : m & 1;
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = gdn_swz<D>(r, 2 * e + cb);
}

// Dynamic shared memory of the tensor-core scan: W hi, W lo, q, k [64][DK] bf16, QKD hi, lo [64][64]
// bf16, the per-row factors [2][64] float4 (two chunks: the next one's land while this one's update
// reads them), the block's U rows [64][GDN_SCAN_UP] fp32 (<= 64 value columns, padded).
#define GDN_SCAN_UP 68
#define GDN_SCAN_TC_SMEM(DK) (4 * GDN_CHUNK * (DK) * 2 + 2 * GDN_CHUNK * GDN_CHUNK * 2 + 2 * GDN_CHUNK * 16 \
                              + GDN_CHUNK * GDN_SCAN_UP * 4)

template <int DK>
__device__ __forceinline__ void gdn_chunk_scan_tc_body(
    bf16_t* __restrict__ out,          // [N, HV, DV]
    float* __restrict__ state,         // [S, HV, DK, DV]
    const float* __restrict__ U,       // [N, HV, DV]
    const bf16_t* __restrict__ Wp,     // [N, HV, 2, DK] W hi, lo
    const bf16_t* __restrict__ QKDp,   // [N, HV, 2, 64] QKD hi, lo
    const float4* __restrict__ info,   // [N, HV] {iq scale e^G, ik e^(G_last - G), e^G_last, 0}
    const bf16_t* __restrict__ y,
    const int* __restrict__ slots, const int* __restrict__ cu_seqlens, const int* __restrict__ fresh,
    int N, int HK, int HV, int DV)
{
    constexpr int NT = DK / 8;                         // n-tiles of the state (d)
    constexpr int KS = DK / 16;                        // k-steps over d
    constexpr int NQ = DK >= 128 ? 4 : 2;              // groups of chunk rows per chunk (see the rows below)
    constexpr unsigned TB = GDN_CHUNK * DK * 2;        // bytes of a [64][DK] bf16 tile
    constexpr unsigned DB = GDN_CHUNK * GDN_CHUNK * 2; // bytes of a [64][64] bf16 tile
    extern __shared__ __align__(16) unsigned char gdn_smem[];
    const unsigned sWh = smem_u32(gdn_smem), sWl = sWh + TB, sQ = sWh + 2 * TB, sK = sWh + 3 * TB;
    const unsigned sDh = sWh + 4 * TB, sDl = sDh + DB, sInf = sDl + DB, sU = sInf + 2 * GDN_CHUNK * 16;
    const float4* s_info2 = reinterpret_cast<const float4*>(gdn_smem + 4 * TB + 2 * DB);
    const float* s_U = reinterpret_cast<const float*>(gdn_smem + 4 * TB + 2 * DB + 2 * GDN_CHUNK * 16);

    // An opaque copy of an index: addresses derived from it are recomputed where they are used instead
    // of being kept in registers from an earlier use (e.g. the state addresses across the whole scan).
    auto opaque = [](int x) {
        int r;
        asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
        return r;
    };
    const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, bseq = blockIdx.z;
    const int lo = cu_seqlens[bseq], hi = cu_seqlens[bseq + 1];
    if (lo < 0 || hi > N || hi <= lo) return;                                  // block-uniform
    const int hk = h / (HV / HK);
    const i64_t C = (i64_t)2 * HK * DK + (i64_t)HV * DV;
    const int slot = slots[bseq];
    const bool zero = fresh[bseq] != 0 || slot < 0;
    // this warp: value columns vb .. vb+15 (the mma M rows); a lane holds columns v0 = vb+g, v1 = vb+g+8
    const int vb = (blockIdx.x * (nthr >> 5) + warp) * 16;
    const int v0 = vb + g, v1 = v0 + 8;
    const bool ok0 = v0 < DV, ok1 = v1 < DV;

    // Tile loads, two groups a chunk. A: W, q, QKD, U and the factors, read by the first products
    // (the factors by the update too, so they alternate between two buffers); B: k, read by the update.
    // A for chunk c+1 is issued once every warp is done with chunk c's first products, so it lands
    // during the update; B for chunk c+1 once the update is done, and it lands during chunk c+1's first
    // products (each phase waits for its own group only).
    // The thread index goes through an opaque move in each call: the copy addresses are loop invariant,
    // and hoisted out of the chunk loop they would hold registers all along.
    const int ncol = 16 * (nthr >> 5), vbb = blockIdx.x * ncol;           // the block's value columns
    auto issue_a = [&](int t0, int L, int buf) {
        const int tid = opaque(threadIdx.x);
        for (int idx = tid; idx < GDN_CHUNK * (DK / 4); idx += nthr) {         // W: 2 DK / 8 chunks per row
            const int i = idx / (DK / 4), c = idx - i * (DK / 4);
            const int part = c / (DK / 8), cc = c - part * (DK / 8);
            const bool v = i < L;
            cp_async16((part ? sWl : sWh) + gdn_swz<DK>(i, cc),
                     v ? Wp + ((i64_t)(t0 + i) * HV + h) * 2 * DK + 8 * c : Wp, v ? 16u : 0u);
        }
        for (int idx = tid; idx < GDN_CHUNK * (DK / 8); idx += nthr) {         // q (raw conv output)
            const int i = idx / (DK / 8), c = idx - i * (DK / 8);
            const bool v = i < L;
            cp_async16(sQ + gdn_swz<DK>(i, c), v ? y + (i64_t)(t0 + i) * C + (i64_t)hk * DK + 8 * c : y,
                     v ? 16u : 0u);
        }
        for (int idx = tid; idx < GDN_CHUNK * 16; idx += nthr) {               // QKD: 16 chunks per row
            const int i = idx >> 4, c = idx & 15;
            const bool v = i < L;
            cp_async16(((c >> 3) ? sDl : sDh) + gdn_swz<GDN_CHUNK>(i, c & 7),
                     v ? QKDp + ((i64_t)(t0 + i) * HV + h) * 128 + 8 * c : QKDp, v ? 16u : 0u);
        }
        for (int idx = tid; idx < GDN_CHUNK * (ncol / 4); idx += nthr) {       // U (rows >= L, columns >= DV: 0)
            const int i = idx / (ncol / 4), c = idx - i * (ncol / 4);
            const bool v = i < L && vbb + 4 * c < DV;                         // DV % 4 == 0
            cp_async16(sU + (i * GDN_SCAN_UP + 4 * c) * 4,
                     v ? U + ((i64_t)(t0 + i) * HV + h) * DV + vbb + 4 * c : U, v ? 16u : 0u);
        }
        for (int i = tid; i < GDN_CHUNK; i += nthr) {                          // factors (rows >= L: 0)
            const bool v = i < L;
            cp_async16(sInf + 16 * (GDN_CHUNK * buf + i), v ? info + (i64_t)(t0 + i) * HV + h : info, v ? 16u : 0u);
        }
    };
    auto issue_b = [&](int t0, int L) {
        const int tid = opaque(threadIdx.x);
        for (int idx = tid; idx < GDN_CHUNK * (DK / 8); idx += nthr) {         // k (raw conv output)
            const int i = idx / (DK / 8), c = idx - i * (DK / 8);
            const bool v = i < L;
            cp_async16(sK + gdn_swz<DK>(i, c),
                     v ? y + (i64_t)(t0 + i) * C + (i64_t)(HK + hk) * DK + 8 * c : y, v ? 16u : 0u);
        }
    };

    // S^T [16 value columns x DK] as mma C fragments: st[n][0..1] = S[d = 8n + 2t, +1][v0],
    // st[n][2..3] = S[d, d+1][v1]. The C fragments of n-tiles 2k, 2k+1 are the A fragment of k-step k.
    float* sp = state + ((i64_t)(slot < 0 ? 0 : slot) * HV + h) * DK * DV;
    float st[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const i64_t d = 8 * n + 2 * t;
        st[n][0] = !zero && ok0 ? sp[d * DV + v0] : 0.f;
        st[n][1] = !zero && ok0 ? sp[(d + 1) * DV + v0] : 0.f;
        st[n][2] = !zero && ok1 ? sp[d * DV + v1] : 0.f;
        st[n][3] = !zero && ok1 ? sp[(d + 1) * DV + v1] : 0.f;
    }

    const int nch = (hi - lo + GDN_CHUNK - 1) / GDN_CHUNK;
    issue_a(lo, min(GDN_CHUNK, hi - lo), 0);
    cp_async_commit();
    issue_b(lo, min(GDN_CHUNK, hi - lo));
    cp_async_commit();
    for (int c = 0; c < nch; ++c) {
        const int t0 = lo + c * GDN_CHUNK, L = min(GDN_CHUNK, hi - t0);
        const int t1 = t0 + GDN_CHUNK, L1 = min(GDN_CHUNK, hi - t1);          // next chunk (if c + 1 < nch)
        const float4* s_info = s_info2 + GDN_CHUNK * (c & 1);

        cp_async_wait<1>();                            // group A of this chunk (B, k, may still be in flight)
        __syncthreads();                               // ... landed, every thread's copies

        // NQ groups of 64 / NQ chunk rows (group hq: n-tiles 8/NQ hq ..). Group hq computes
        // V'^T = U^T - S^T W^T for its rows (vt[n], starting from U^T: vt[n][0..1] = U[i = 8n + 2t, +1][v0],
        // vt[n][2..3] at v1) and, in the same pass over k-steps (one split of S^T serves W and q), the
        // first term of its O^T rows, -S^T q^T, in ot; then O^T = (S^T q^T) diag(iq scale e^G) + V'^T QKD^T,
        // where QKD is lower triangular, so a group reads the V' columns of its own and earlier rows only.
        // Groups bound the live O accumulators (8 / NQ n-tiles) at the price of one split of S^T per group:
        // DK 128 needs quarters to stay within 255 registers without spills.
        // Row i = 8n + 2t is valid iff 8n < Lt (i + 1 iff 8n + 1 < Lt): compares with constants. The row
        // stride and the lane's row go through opaque moves each chunk: derived from loop invariants, the
        // row addresses would be hoisted out of the chunk loop and held throughout.
        const i64_t rs = opaque(HV * DV);              // U / out row stride (elements)
        const int tr = opaque(t), Lt = L - 2 * tr;
        float vt[8][4];
#pragma unroll
        for (int hq = 0; hq < NQ; ++hq) {
            float ot[8 / NQ][4];
#pragma unroll
            for (int n = 8 / NQ * hq; n < 8 / NQ * (hq + 1); ++n) {
                // U rows >= L and columns >= DV are zeros in shared memory
                const float* u = s_U + (8 * n + 2 * tr) * GDN_SCAN_UP + (v0 - vbb);
                vt[n][0] = u[0];
                vt[n][1] = u[GDN_SCAN_UP];
                vt[n][2] = u[8];
                vt[n][3] = u[GDN_SCAN_UP + 8];
                ot[n - 8 / NQ * hq][0] = ot[n - 8 / NQ * hq][1] = ot[n - 8 / NQ * hq][2] = ot[n - 8 / NQ * hq][3] = 0.f;
            }

            // vt += (-S^T) W^T: three split products (W and S both fp32); ot += (-S^T) q^T: two (q exact)
            unsigned ow[4];
            gdn_lane_offs<DK>(opaque(lane), false, ow);
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                unsigned ah[4], al[4];
                gdn_split(-st[2 * kk][0], -st[2 * kk][1], ah[0], al[0]);
                gdn_split(-st[2 * kk][2], -st[2 * kk][3], ah[1], al[1]);
                gdn_split(-st[2 * kk + 1][0], -st[2 * kk + 1][1], ah[2], al[2]);
                gdn_split(-st[2 * kk + 1][2], -st[2 * kk + 1][3], ah[3], al[3]);
#pragma unroll
                for (int pp = 0; pp < 4 / NQ; ++pp) {  // chunk rows i = 16p .. 16p+15: n-tiles 2p, 2p+1
                    const int p = 4 / NQ * hq + pp;
                    const unsigned off = ow[kk & 3] + 32 * DK * p + 128 * (kk >> 2);   // row 16p + .., chunk 2kk + ..
                    gdn_mma_split(vt[2 * p], vt[2 * p + 1], ah, al, sWh + off, sWl + off);
                    unsigned b[4];
                    ldsm_x4(sQ + off, b);
                    mma_bf16_16816(ot[2 * pp], ah, b[0], b[1]);
                    mma_bf16_16816(ot[2 * pp + 1], ah, b[2], b[3]);
                    mma_bf16_16816(ot[2 * pp], al, b[0], b[1]);
                    mma_bf16_16816(ot[2 * pp + 1], al, b[2], b[3]);
                }
            }
#pragma unroll
            for (int n = 0; n < 8 / NQ; ++n) {         // ot = (S^T q^T) diag(iq scale e^G)
                const int i = 64 / NQ * hq + 8 * n + 2 * t;
                const float f0 = -s_info[i].x, f1 = -s_info[i + 1].x;
                ot[n][0] = __fmul_rn(ot[n][0], f0);
                ot[n][1] = __fmul_rn(ot[n][1], f1);
                ot[n][2] = __fmul_rn(ot[n][2], f0);
                ot[n][3] = __fmul_rn(ot[n][3], f1);
            }
            // ot += V'^T QKD^T over QKD columns j = 16kj .. 16kj+15 (rows i < 16kj, p < kj, skip: zeros)
            unsigned od[4];
            gdn_lane_offs<GDN_CHUNK>(opaque(lane), false, od);
#pragma unroll
            for (int kj = 0; kj < 4 / NQ * (hq + 1); ++kj) {
                unsigned ah[4], al[4];
                gdn_split(vt[2 * kj][0], vt[2 * kj][1], ah[0], al[0]);
                gdn_split(vt[2 * kj][2], vt[2 * kj][3], ah[1], al[1]);
                gdn_split(vt[2 * kj + 1][0], vt[2 * kj + 1][1], ah[2], al[2]);
                gdn_split(vt[2 * kj + 1][2], vt[2 * kj + 1][3], ah[3], al[3]);
#pragma unroll
                for (int pp = 0; pp < 4 / NQ; ++pp) {
                    const int p = 4 / NQ * hq + pp;
                    if (p < kj) continue;
                    const unsigned off = od[kj] + 32 * GDN_CHUNK * p;    // row 16p + .., chunk 2kj + ..
                    gdn_mma_split(ot[2 * pp], ot[2 * pp + 1], ah, al, sDh + off, sDl + off);
                }
            }
#pragma unroll
            for (int n = 8 / NQ * hq; n < 8 / NQ * (hq + 1); ++n) {
                bf16_t* o = out + ((i64_t)(t0 + 2 * tr) * HV + h) * DV + 8 * n * rs;
                if (8 * n < Lt) {
                    if (ok0) o[v0] = f32_to_bf16(ot[n - 8 / NQ * hq][0]);
                    if (ok1) o[v1] = f32_to_bf16(ot[n - 8 / NQ * hq][2]);
                }
                if (8 * n + 1 < Lt) {
                    if (ok0) o[rs + v0] = f32_to_bf16(ot[n - 8 / NQ * hq][1]);
                    if (ok1) o[rs + v1] = f32_to_bf16(ot[n - 8 / NQ * hq][3]);
                }
            }
        }
        __syncthreads();                               // every warp done with W, q, QKD and U
        if (c + 1 < nch) issue_a(t1, L1, (c + 1) & 1);
        cp_async_commit();                             // (an empty group on the last chunk: the count stays)
        cp_async_wait<1>();                            // group B of this chunk (k)
        __syncthreads();

        // S^T <- e^G_last S^T + (V'^T diag(ik e^(G_last - G))) k   (k exact in bf16: 2 products)
        const float eL = s_info[0].z;                  // row 0 is always valid (L >= 1)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = __fmul_rn(st[n][e], eL);
        unsigned okk[4];
        gdn_lane_offs<DK>(opaque(lane), true, okk);
#pragma unroll
        for (int ki = 0; ki < 4; ++ki) {               // chunk rows i = 16ki .. 16ki+15
            const float fa = s_info[16 * ki + 2 * t].y, fb = s_info[16 * ki + 2 * t + 1].y;
            const float fc = s_info[16 * ki + 8 + 2 * t].y, fd = s_info[16 * ki + 9 + 2 * t].y;
            unsigned ah[4], al[4];
            gdn_split(__fmul_rn(vt[2 * ki][0], fa), __fmul_rn(vt[2 * ki][1], fb), ah[0], al[0]);
            gdn_split(__fmul_rn(vt[2 * ki][2], fa), __fmul_rn(vt[2 * ki][3], fb), ah[1], al[1]);
            gdn_split(__fmul_rn(vt[2 * ki + 1][0], fc), __fmul_rn(vt[2 * ki + 1][1], fd), ah[2], al[2]);
            gdn_split(__fmul_rn(vt[2 * ki + 1][2], fc), __fmul_rn(vt[2 * ki + 1][3], fd), ah[3], al[3]);
#pragma unroll
            for (int p = 0; p < KS; ++p) {             // state rows d = 16p .. 16p+15: n-tiles 2p, 2p+1
                unsigned bk[4];
                ldsm_x4_t(sK + okk[p & 3] + 32 * DK * ki + 128 * (p >> 2), bk);     // row 16ki + .., chunk 2p + ..
                mma_bf16_16816(st[2 * p], ah, bk[0], bk[1]);
                mma_bf16_16816(st[2 * p + 1], ah, bk[2], bk[3]);
                mma_bf16_16816(st[2 * p], al, bk[0], bk[1]);
                mma_bf16_16816(st[2 * p + 1], al, bk[2], bk[3]);
            }
        }
        __syncthreads();                               // every warp done with k
        if (c + 1 < nch) issue_b(t1, L1);
        cp_async_commit();
    }

    // The slot and the state address are read / computed again rather than kept across the chunk loop.
    const int slot_out = slots[opaque(bseq)];
    if (slot_out >= 0) {
        float* so = state + ((i64_t)slot_out * HV + h) * DK * DV;
        const int to = opaque(t);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const i64_t d = 8 * n + 2 * to;
            float* sp = so;
            if (ok0) {
                sp[d * DV + v0] = st[n][0];
                sp[(d + 1) * DV + v0] = st[n][1];
            }
            if (ok1) {
                sp[d * DV + v1] = st[n][2];
                sp[(d + 1) * DV + v1] = st[n][3];
            }
        }
    }
}

#define GDN_CHUNK_PREP_KERNEL(DK)                                                                       \
    extern "C" __global__ void __launch_bounds__(GDN_PREP_THREADS, 2) gdn_chunk_prep_dk##DK(            \
        float* __restrict__ U, float* __restrict__ W, float* __restrict__ QKD, float4* __restrict__ info, \
        const bf16_t* __restrict__ y, const bf16_t* __restrict__ a, const bf16_t* __restrict__ b,       \
        const void* __restrict__ A_log, const void* __restrict__ dt_bias, int flags,                    \
        const int* __restrict__ cu_seqlens, int N, int HK, int HV, int DV, float scale) {               \
        gdn_chunk_prep_body<DK>(U, W, QKD, info, y, a, b, A_log, dt_bias, flags, cu_seqlens, N, HK, HV,  \
                                DV, scale);                                                             \
    }

// the CUDA-core scan (DK 256)
#define GDN_CHUNK_SCAN_KERNEL(DK)                                                                       \
    extern "C" __global__ void __launch_bounds__(GDN_SCAN_THREADS, 4) gdn_chunk_scan_dk##DK(               \
        bf16_t* __restrict__ out, float* __restrict__ state, const float* __restrict__ U,               \
        const float* __restrict__ W, const float* __restrict__ QKD, const float4* __restrict__ info,    \
        const bf16_t* __restrict__ y, const int* __restrict__ slots, const int* __restrict__ cu_seqlens, \
        const int* __restrict__ fresh, int N, int HK, int HV, int DV, float scale) {                    \
        gdn_chunk_scan_body<DK>(out, state, U, W, QKD, info, y, slots, cu_seqlens, fresh, N, HK, HV, DV, \
                                scale);                                                                 \
    }

// the tensor-core scan (DK <= 128): 32 * warps threads (1..4 warps, 16 value columns each), dynamic
// shared memory GDN_SCAN_TC_SMEM(DK)
#define GDN_CHUNK_SCAN_TC_KERNEL(DK)                                                                    \
    extern "C" __global__ void __launch_bounds__(128, 1) gdn_chunk_scan_tc_dk##DK(                       \
        bf16_t* __restrict__ out, float* __restrict__ state, const float* __restrict__ U,               \
        const bf16_t* __restrict__ W, const bf16_t* __restrict__ QKD, const float4* __restrict__ info,  \
        const bf16_t* __restrict__ y, const int* __restrict__ slots, const int* __restrict__ cu_seqlens, \
        const int* __restrict__ fresh, int N, int HK, int HV, int DV) {                                 \
        gdn_chunk_scan_tc_body<DK>(out, state, U, W, QKD, info, y, slots, cu_seqlens, fresh, N, HK, HV, DV); \
    }

GDN_CHUNK_PREP_KERNEL(16)
GDN_CHUNK_PREP_KERNEL(32)
GDN_CHUNK_PREP_KERNEL(64)
GDN_CHUNK_PREP_KERNEL(128)
GDN_CHUNK_PREP_KERNEL(256)
GDN_CHUNK_SCAN_TC_KERNEL(16)
GDN_CHUNK_SCAN_TC_KERNEL(32)
GDN_CHUNK_SCAN_TC_KERNEL(64)
GDN_CHUNK_SCAN_TC_KERNEL(128)
GDN_CHUNK_SCAN_KERNEL(256)

// Gated attention for decode and speculative verification over the paged bf16 KV cache.
//
//   qk_norm_rope_kv_write_bf16   per column: zero-centred RMSNorm of every q and k head, partial
//                                NeoX rotary, q -> q_out [N, H, D], k (normed, roped) and raw v ->
//                                the paged pools at the column's position.
//   gqa_decode_split_g<GC>       flash-decoding: one CTA per (column, kv head x head chunk, key
//                                split); the CTA serves the GC query heads that share the kv head
//                                (K/V read once for all of them). Partial (max, sum, unnormalised
//                                acc) in fp32 scratch, or -- with a single split -- the gated output
//                                directly.
//   gqa_decode_combine           merges the splits of one (column, head) and applies the gate.
//
//   qk_norm_rope_kv_write_i8,    the same over int8 KV pools: codes int8 [P, 64, KV, D] and scales
//   gqa_decode_split_i8_g<GC>    fp32 [P, 64, KV, D / 64], one per (token, kv head, 64 channels):
//                                scale = amax|x| / 127, code = rne(x / scale) clamped to +-127 (a
//                                group with amax < 2^-100 stores codes 0, scale 0). The write
//                                quantises the bf16-rounded k (after norm + rope) and raw v exactly
//                                as kernels/reference.quantize_kv_int8; the decode dequantises in
//                                registers (16-byte loads of 16 codes).
//
// Layouts: pools [P, 64, KV, D] bf16 (or int8 + scales); page_tables [B, max_pages] int32; positions / seq_of_col [N]
// int32. Column n attends to keys 0..positions[n] of sequence seq_of_col[n]. Exponentials are in
// base 2 (q is pre-scaled by scale * log2(e)); partial maxima are stored in that domain.
#include "common.cuh"

#define ATT_PAGE 64
#define ATT_PAGE_SHIFT 6
#define ATT_NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ void unpack8(const uint4 r, float* f) {
    float2 a = bf16x2_to_f32x2(r.x), b = bf16x2_to_f32x2(r.y), c = bf16x2_to_f32x2(r.z), d = bf16x2_to_f32x2(r.w);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 r;
    r.x = pack2(f[0], f[1]); r.y = pack2(f[2], f[3]); r.z = pack2(f[4], f[5]); r.w = pack2(f[6], f[7]);
    return r;
}


// --------------------------------------------------------------------------------------------------
// q/k norm + partial rope + paged KV write. grid (N, ceil((H + 2 KV) / 8)), block 256 (8 warps, one head
// row each); D % 8 == 0, D <= 512, R even, R <= D. Row strides (elements) let qg/k/v be views of a
// fused projection.

#define NR_WARPS 8
#define NR_MAXD 512

typedef signed char i8_t;

#define KV_I8_GROUP 64
#define KV_I8_MIN_AMAX 0x1p-100f           // kernels/reference.KV_INT8_MIN_AMAX

// Quantise the 8 values of chunk c (dims [8c, 8c + 8)) of one head row; the 8 consecutive lanes
// c & ~7 .. c | 7 hold one group of 64 channels (chunk c = lane + 32 i, D % 64 == 0). Every lane
// of the warp must call it (shuffles); `active` lanes (c < D / 8) store their 8 codes and the
// group's first lane its scale. amax, scale and codes as kernels/reference.quantize_kv_int8: IEEE
// fp32 division (the default -prec-div; results are normal or flush to zero on both sides),
// round-half-even conversion.
__device__ __forceinline__ void quant_store8(const float* x, bool active, int c, i8_t* __restrict__ codes,
                                             float* __restrict__ scales) {
    float a = 0.f;
    if (active) {
#pragma unroll
        for (int e = 0; e < 8; ++e) a = fmaxf(a, fabsf(x[e]));
    }
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 4));
    if (!active) return;
    const bool zero = !(a >= KV_I8_MIN_AMAX);
    const float sc = zero ? 0.f : a / 127.f;
    unsigned w[2] = {0u, 0u};
    if (!zero) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            int qv = __float2int_rn(x[e] / sc);
            qv = min(max(qv, -127), 127);
            w[e >> 2] |= ((unsigned)qv & 0xffu) << (8 * (e & 3));
        }
    }
    *reinterpret_cast<uint2*>(codes + c * 8) = make_uint2(w[0], w[1]);
    if ((c & 7) == 0) scales[c >> 3] = sc;
}

// Partial NeoX rope of chunk c (dims 8c .. 8c + 7) of a normed head row: x the chunk's values, row the
// whole row (for the partner dims), cos / sin of the R / 2 frequencies; dims >= R pass through. Each
// product and the sum rounded to bf16, as the reference.
__device__ __forceinline__ void rope8(float (&o)[8], const float (&x)[8], int c, int R, const float* row,
                                      const float* cos_s, const float* sin_s) {
    const int half = R >> 1;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int d = c * 8 + e;
        if (d < R) {
            const bool lo = d < half;
            const int j = lo ? d : d - half;
            const float partner = lo ? -row[d + half] : row[d - half];
            o[e] = bf16_round(bf16_round(x[e] * cos_s[j]) + bf16_round(partner * sin_s[j]));
        } else {
            o[e] = x[e];
        }
    }
}

// KV_T bf16_t: the pools hold bf16 (k_scale / v_scale unused); i8_t: int8 codes + fp32 scales.
template <typename KV_T>
__device__ __forceinline__ void qk_norm_rope_kv_write(bf16_t* __restrict__ q_out, KV_T* __restrict__ k_pool,
                                                      KV_T* __restrict__ v_pool, float* __restrict__ k_scale,
                                                      float* __restrict__ v_scale, const bf16_t* __restrict__ qg,
                                                      const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                                                      const bf16_t* __restrict__ q_w, const bf16_t* __restrict__ k_w,
                                                      const int* __restrict__ positions,
                                                      const int* __restrict__ seq_of_col,
                                                      const int* __restrict__ page_tables, int H, int KV, int D,
                                                      int R, int max_pages, i64_t qg_stride, i64_t k_stride,
                                                      i64_t v_stride, float eps, float theta) {
    constexpr bool I8 = sizeof(KV_T) == 1;
    __shared__ float cos_s[NR_MAXD / 2], sin_s[NR_MAXD / 2];
    __shared__ __align__(16) float row_s[NR_WARPS][NR_MAXD];

    // One head row per warp: unit u = blockIdx.y * NR_WARPS + warp (q heads 0..H-1, then k heads, then
    // v heads; grid.y = ceil((H + 2 KV) / NR_WARPS)), so the heads of a column run in parallel blocks
    // (one block looping over them left a chain of ~3 dependent loads per head). The row's loads and its
    // norm go ahead of the cos/sin table's barrier.
    const int n = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int u = blockIdx.y * NR_WARPS + warp;
    const int units = H + 2 * KV;
    const int pos = positions[n];
    const int half = R >> 1;
    const int page = page_tables[(i64_t)seq_of_col[n] * max_pages + (pos >> ATT_PAGE_SHIFT)];
    const i64_t slot = ((i64_t)page * ATT_PAGE + (pos & (ATT_PAGE - 1))) * KV;   // in units of heads
    const int nc = D >> 3;                      // 16-byte chunks per head
    const bool is_v = u >= H + KV && u < units, is_qk = u < H + KV;

    // cos/sin as the reference: inv_freq = 1 / theta^(2j/R), freq = pos * inv_freq in fp32,
    // cos/sin in fp32 rounded to bf16. Needed only by the rope below (after the barrier).
    for (int j = tid; j < half; j += blockDim.x) {
        const float inv = 1.f / powf(theta, (float)(2 * j) / (float)R);
        const float f = (float)pos * inv;
        cos_s[j] = bf16_round(cosf(f));
        sin_s[j] = bf16_round(sinf(f));
    }

    if (is_v) {                                 // v: raw copy into the pool (no rope: no barrier needed)
        const int h = u - H - KV;
        const uint4* src = reinterpret_cast<const uint4*>(v + n * v_stride + (i64_t)h * D);
        if constexpr (I8) {                     // quantised: chunks lane, lane + 32 (nc <= 64)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int c = lane + 32 * i;
                float xv[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) xv[e] = 0.f;
                if (c < nc) unpack8(src[c], xv);
                quant_store8(xv, c < nc, c, v_pool + (slot + h) * D, v_scale + (slot + h) * (D / KV_I8_GROUP));
            }
        } else {
            uint4* dst = reinterpret_cast<uint4*>(v_pool + (slot + h) * D);
            for (int c = lane; c < nc; c += 32) dst[c] = src[c];
        }
    }

    const bool is_q = u < H;
    const int h = is_q ? u : u - H;
    float x[2][8];
    float* row = row_s[warp];
    if (is_qk) {                                // q / k: zero-centred RMSNorm into x and row
        const bf16_t* src = is_q ? qg + n * qg_stride + (i64_t)h * 2 * D : k + n * k_stride + (i64_t)h * D;
        const bf16_t* w = is_q ? q_w : k_w;
        const float inv_d = 1.f / (float)D;
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = lane + 32 * i;
#pragma unroll
            for (int e = 0; e < 8; ++e) x[i][e] = 0.f;
            if (c < nc) {
                // the norm weights, read after the reduction: asked into L1 now (holding them in
                // registers across the reduction made ptxas spill on sm_120a)
                asm volatile("prefetch.global.L1 [%0];" :: "l"(reinterpret_cast<const uint4*>(w) + c));
                unpack8(reinterpret_cast<const uint4*>(src)[c], x[i]);
#pragma unroll
                for (int e = 0; e < 8; ++e) ss += x[i][e] * x[i][e];
            }
        }
        ss = warp_sum(ss);
        const float rstd = rsqrtf(ss * inv_d + eps);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = lane + 32 * i;
            if (c < nc) {
                float wf[8];
                unpack8(reinterpret_cast<const uint4*>(w)[c], wf);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float y = x[i][e] * rstd;
                    x[i][e] = bf16_round(y * (1.f + wf[e]));
                    row[c * 8 + e] = x[i][e];
                }
            }
        }
    }
    __syncthreads();                            // cos_s / sin_s, and each warp's row
    if (!is_qk) return;
    bf16_t* dst = is_q ? q_out + ((i64_t)n * H + h) * D
                       : (I8 ? nullptr : reinterpret_cast<bf16_t*>(k_pool) + (slot + h) * D);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int c = lane + 32 * i;
        if constexpr (I8) {
            if (!is_q) {                        // k (warp-uniform branch): rope, then quantise
                float o[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = 0.f;
                if (c < nc) rope8(o, x[i], c, R, row, cos_s, sin_s);
                quant_store8(o, c < nc, c, k_pool + (slot + h) * D, k_scale + (slot + h) * (D / KV_I8_GROUP));
                continue;
            }
        }
        if (c < nc) {
            float o[8];
            rope8(o, x[i], c, R, row, cos_s, sin_s);
            reinterpret_cast<uint4*>(dst)[c] = pack8(o);
        }
    }
}

extern "C" __global__ void __launch_bounds__(NR_WARPS * 32)
qk_norm_rope_kv_write_bf16(bf16_t* __restrict__ q_out, bf16_t* __restrict__ k_pool, bf16_t* __restrict__ v_pool,
                           const bf16_t* __restrict__ qg, const bf16_t* __restrict__ k,
                           const bf16_t* __restrict__ v, const bf16_t* __restrict__ q_w,
                           const bf16_t* __restrict__ k_w, const int* __restrict__ positions,
                           const int* __restrict__ seq_of_col, const int* __restrict__ page_tables,
                           int H, int KV, int D, int R, int max_pages, i64_t qg_stride, i64_t k_stride,
                           i64_t v_stride, float eps, float theta) {
    pdl_enter();
    qk_norm_rope_kv_write<bf16_t>(q_out, k_pool, v_pool, nullptr, nullptr, qg, k, v, q_w, k_w, positions, seq_of_col,
                                  page_tables, H, KV, D, R, max_pages, qg_stride, k_stride, v_stride, eps, theta);
}

// int8 pools: D % 64 == 0 (checked by the caller). k_scale / v_scale [P, 64, KV, D / 64] fp32.
extern "C" __global__ void __launch_bounds__(NR_WARPS * 32)
qk_norm_rope_kv_write_i8(bf16_t* __restrict__ q_out, i8_t* __restrict__ k_pool, i8_t* __restrict__ v_pool,
                         float* __restrict__ k_scale, float* __restrict__ v_scale, const bf16_t* __restrict__ qg,
                         const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                         const bf16_t* __restrict__ q_w, const bf16_t* __restrict__ k_w,
                         const int* __restrict__ positions, const int* __restrict__ seq_of_col,
                         const int* __restrict__ page_tables, int H, int KV, int D, int R, int max_pages,
                         i64_t qg_stride, i64_t k_stride, i64_t v_stride, float eps, float theta) {
    pdl_enter();
    qk_norm_rope_kv_write<i8_t>(q_out, k_pool, v_pool, k_scale, v_scale, qg, k, v, q_w, k_w, positions, seq_of_col,
                                page_tables, H, KV, D, R, max_pages, qg_stride, k_stride, v_stride, eps, theta);
}

// --------------------------------------------------------------------------------------------------
// Split (flash-decoding) attention. Grid (N, KV * G / GC, S), block = ATT_WARPS warps; D is a power
// of two in [8, 256]. Lanes are grouped by key: LPK = D / 8 lanes hold one key row (lane sl of the
// group owns dims [8 sl, 8 sl + 8)), KPW = 32 / LPK keys per warp step. Each warp streams its keys
// with an online softmax per lane group (ATT_U steps per iteration, all K and V loads of an
// iteration issued together), then lane groups merge by shuffles and warps merge through shared
// memory (deterministic order).
//
// Keys of split s: [s * chunk, hi) with hi = min((s + 1) * chunk, L), except the last split, which
// runs to L (a length hint that was too small costs speed, never correctness). A split with no keys
// exits; the combine only reads splits s with s * chunk < L.

#define ATT_WARPS 4
#define ATT_U 2
#define ATT_MAXD 256

// The end of a split CTA, both pool formats (E dims per lane: 8 for bf16, 16 for int8): the lane
// groups of a warp merge by shuffles (same dims, different keys); the warps through shared memory
// (common max, rescale, then a fixed-order tree); warp 0's owner lanes (lanes 0..LPK-1, dims
// [E sl, E sl + E)) write the gated output (a single split) or the split's (max, sum, acc) partials.
template <int GC, int E>
__device__ __forceinline__ void attn_split_finish(float (&m)[GC], float (&l)[GC], float (&acc)[GC][E],
                                                  float (&red_m)[ATT_WARPS][GC], float (&red_l)[ATT_WARPS][GC],
                                                  float (&red_acc)[ATT_WARPS / 2][GC][ATT_MAXD], int LPK, int lane,
                                                  int warp, int lg, int sl, bf16_t* __restrict__ out,
                                                  float* __restrict__ part_ml, float* __restrict__ part_acc,
                                                  const bf16_t* __restrict__ gate, int n, int s, int S, int H, int D,
                                                  int h0, i64_t gate_s0, i64_t gate_s1) {
    for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GC; ++g) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float mx = fmaxf(m[g], m2);
            const float ms = mx == ATT_NEG_INF ? 0.f : mx;
            const float c1 = fast_exp2(m[g] - ms), c2 = fast_exp2(m2 - ms);
            m[g] = mx;
            l[g] = l[g] * c1 + l2 * c2;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const float a2 = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
                acc[g][e] = acc[g][e] * c1 + a2 * c2;
            }
        }
    }

    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GC; ++g) red_m[warp][g] = m[g];
    }
    __syncthreads();
    float M[GC];
#pragma unroll
    for (int g = 0; g < GC; ++g) {
        float mx = red_m[0][g];
#pragma unroll
        for (int w = 1; w < ATT_WARPS; ++w) mx = fmaxf(mx, red_m[w][g]);
        M[g] = mx;                                           // finite: the split has >= 1 key
        const float c = fast_exp2(m[g] - mx);                // 0 for a warp without keys
        l[g] *= c;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] *= c;
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GC; ++g) red_l[warp][g] = l[g];
    }
    const bool owner = lg == 0;                              // lanes 0..LPK-1 hold the warp's dims
#pragma unroll
    for (int width = ATT_WARPS / 2; width >= 1; width >>= 1) {
        if (warp >= width && warp < 2 * width && owner) {
#pragma unroll
            for (int g = 0; g < GC; ++g) {
                float4* dst = reinterpret_cast<float4*>(&red_acc[warp - width][g][sl * E]);
#pragma unroll
                for (int i = 0; i < E / 4; ++i)
                    dst[i] = make_float4(acc[g][4 * i], acc[g][4 * i + 1], acc[g][4 * i + 2], acc[g][4 * i + 3]);
            }
        }
        __syncthreads();
        if (warp < width && owner) {
#pragma unroll
            for (int g = 0; g < GC; ++g) {
                const float4* src = reinterpret_cast<const float4*>(&red_acc[warp][g][sl * E]);
#pragma unroll
                for (int i = 0; i < E / 4; ++i) {
                    const float4 a = src[i];
                    acc[g][4 * i] += a.x; acc[g][4 * i + 1] += a.y; acc[g][4 * i + 2] += a.z; acc[g][4 * i + 3] += a.w;
                }
            }
        }
        __syncthreads();
    }
    if (warp != 0 || !owner) return;

#pragma unroll
    for (int g = 0; g < GC; ++g) {
        float lsum = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) lsum += red_l[w][g];
        const int h = h0 + g;
        if (S == 1) {                                        // single split: gated output directly
            const float inv = __fdividef(1.f, lsum);
            const uint4* gp = reinterpret_cast<const uint4*>(gate + n * gate_s0 + h * gate_s1 + sl * E);
            uint4* op = reinterpret_cast<uint4*>(out + ((i64_t)n * H + h) * D + sl * E);
#pragma unroll
            for (int i = 0; i < E / 8; ++i) {
                float gf[8], o[8];
                unpack8(gp[i], gf);
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = gated(acc[g][8 * i + e] * inv, gf[e]);
                op[i] = pack8(o);
            }
        } else {
            const i64_t p = ((i64_t)n * H + h) * S + s;
            if (sl == 0) {
                part_ml[2 * p] = M[g];
                part_ml[2 * p + 1] = lsum;
            }
            float4* dst = reinterpret_cast<float4*>(part_acc + p * D + sl * E);
#pragma unroll
            for (int i = 0; i < E / 4; ++i)
                dst[i] = make_float4(acc[g][4 * i], acc[g][4 * i + 1], acc[g][4 * i + 2], acc[g][4 * i + 3]);
        }
    }
}

template <int GC>
__device__ __forceinline__ void attn_split(bf16_t* __restrict__ out, float* __restrict__ part_ml,
                                           float* __restrict__ part_acc, const bf16_t* __restrict__ q,
                                           const bf16_t* __restrict__ k_pool, const bf16_t* __restrict__ v_pool,
                                           const int* __restrict__ page_tables, const int* __restrict__ positions,
                                           const int* __restrict__ seq_of_col, const bf16_t* __restrict__ gate,
                                           int H, int KV, int D, int max_pages, int chunk, int S,
                                           i64_t gate_s0, i64_t gate_s1, float scale_log2) {
    __shared__ float red_m[ATT_WARPS][GC], red_l[ATT_WARPS][GC];
    __shared__ __align__(16) float red_acc[ATT_WARPS / 2][GC][ATT_MAXD];

    const int n = blockIdx.x, s = blockIdx.z;
    const int G = H / KV, HC = G / GC;
    const int kvh = blockIdx.y / HC;
    const int h0 = kvh * G + (blockIdx.y % HC) * GC;

    const int L = positions[n] + 1;
    const int lo = s * chunk;
    if (lo >= L) return;                                    // no keys: the combine skips this split
    const int hi = (s == S - 1) ? L : min(lo + chunk, L);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int LPK = D >> 3, KPW = 32 / LPK;
    const int lg = lane / LPK, sl = lane - lg * LPK;
    const int* pt = page_tables + (i64_t)seq_of_col[n] * max_pages;
    const i64_t row_stride = (i64_t)KV * D;                 // between consecutive positions of a page
    const i64_t col_off = (i64_t)kvh * D + sl * 8;

    float qf[GC][8];
#pragma unroll
    for (int g = 0; g < GC; ++g) {
        unpack8(*reinterpret_cast<const uint4*>(q + ((i64_t)n * H + h0 + g) * D + sl * 8), qf[g]);
#pragma unroll
        for (int e = 0; e < 8; ++e) qf[g][e] *= scale_log2;
    }

    float m[GC], l[GC], acc[GC][8];
#pragma unroll
    for (int g = 0; g < GC; ++g) {
        m[g] = ATT_NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }

    const int per_iter = ATT_WARPS * ATT_U * KPW;
    for (int base = lo + warp * ATT_U * KPW; base < hi; base += per_iter) {      // warp-uniform
        uint4 kr[ATT_U], vr[ATT_U];
        bool valid[ATT_U];
#pragma unroll
        for (int u = 0; u < ATT_U; ++u) {
            const int j = base + u * KPW + lg;
            valid[u] = j < hi;
            if (valid[u]) {
                const i64_t idx = ((i64_t)pt[j >> ATT_PAGE_SHIFT] * ATT_PAGE + (j & (ATT_PAGE - 1))) * row_stride + col_off;
                kr[u] = *reinterpret_cast<const uint4*>(k_pool + idx);
                vr[u] = *reinterpret_cast<const uint4*>(v_pool + idx);
            } else {
                kr[u] = make_uint4(0u, 0u, 0u, 0u);
                vr[u] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        float sc[ATT_U][GC];
#pragma unroll
        for (int u = 0; u < ATT_U; ++u) {
            float kf[8];
            unpack8(kr[u], kf);
#pragma unroll
            for (int g = 0; g < GC; ++g) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
                for (int o = LPK >> 1; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                sc[u][g] = valid[u] ? d : ATT_NEG_INF;
            }
        }
        float vf[ATT_U][8];
#pragma unroll
        for (int u = 0; u < ATT_U; ++u) unpack8(vr[u], vf[u]);
#pragma unroll
        for (int g = 0; g < GC; ++g) {
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < ATT_U; ++u) mx = fmaxf(mx, sc[u][g]);
            const float ms = mx == ATT_NEG_INF ? 0.f : mx;
            const float corr = fast_exp2(m[g] - ms);
            m[g] = mx;
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] *= corr;
#pragma unroll
            for (int u = 0; u < ATT_U; ++u) {
                const float p = fast_exp2(sc[u][g] - ms);
                l[g] += p;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[u][e], acc[g][e]);
            }
        }
    }

    attn_split_finish<GC, 8>(m, l, acc, red_m, red_l, red_acc, LPK, lane, warp, lg, sl, out, part_ml, part_acc, gate,
                              n, s, S, H, D, h0, gate_s0, gate_s1);
}

#define ATT_SPLIT_KERNEL(GC)                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)                                     \
    gqa_decode_split_g##GC(bf16_t* out, float* part_ml, float* part_acc, const bf16_t* q,            \
                           const bf16_t* k_pool, const bf16_t* v_pool, const int* page_tables,       \
                           const int* positions, const int* seq_of_col, const bf16_t* gate, int H,   \
                           int KV, int D, int max_pages, int chunk, int S, i64_t gate_s0,            \
                           i64_t gate_s1, float scale_log2) {                                        \
        pdl_enter();                                                                               \
        attn_split<GC>(out, part_ml, part_acc, q, k_pool, v_pool, page_tables, positions, seq_of_col, \
                       gate, H, KV, D, max_pages, chunk, S, gate_s0, gate_s1, scale_log2);           \
    }

ATT_SPLIT_KERNEL(1)
ATT_SPLIT_KERNEL(2)
ATT_SPLIT_KERNEL(3)
ATT_SPLIT_KERNEL(4)
ATT_SPLIT_KERNEL(5)
ATT_SPLIT_KERNEL(6)
ATT_SPLIT_KERNEL(7)
ATT_SPLIT_KERNEL(8)

// --------------------------------------------------------------------------------------------------
// Split attention over int8 pools: the structure of attn_split, with LPK = D / 16 lanes per key row
// (lane sl of a group owns dims [16 sl, 16 sl + 16), one 16-byte load of 16 codes for K and one for
// V, plus the fp32 scale of their group of 64 channels). D is 64, 128 or 256; GC <= 4 (16 dims per
// lane double q and acc registers, GC = 8 would not fit). A lane's 16 dims share one scale, so the
// K scale multiplies the lane's partial dot product and the V scale the probability:
//   s = (sum_e q_e c_e) * k_scale,     acc_e += (p * v_scale) * c_e.
// The splits combine with gqa_decode_combine (part_ml / part_acc as attn_split's).

#define ATT_I8_MAXG 4

__device__ __forceinline__ void unpack_i8x16(const uint4 r, float* f) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int b = 0; b < 4; ++b) f[4 * i + b] = (float)((int)(w[i] << (24 - 8 * b)) >> 24);   // sign-extend byte b
    }
}

template <int GC>
__device__ __forceinline__ void attn_split_i8(bf16_t* __restrict__ out, float* __restrict__ part_ml,
                                              float* __restrict__ part_acc, const bf16_t* __restrict__ q,
                                              const i8_t* __restrict__ k_pool, const i8_t* __restrict__ v_pool,
                                              const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                              const int* __restrict__ page_tables, const int* __restrict__ positions,
                                              const int* __restrict__ seq_of_col, const bf16_t* __restrict__ gate,
                                              int H, int KV, int D, int max_pages, int chunk, int S,
                                              i64_t gate_s0, i64_t gate_s1, float scale_log2) {
    __shared__ float red_m[ATT_WARPS][GC], red_l[ATT_WARPS][GC];
    __shared__ __align__(16) float red_acc[ATT_WARPS / 2][GC][ATT_MAXD];

    const int n = blockIdx.x, s = blockIdx.z;
    const int G = H / KV, HC = G / GC;
    const int kvh = blockIdx.y / HC;
    const int h0 = kvh * G + (blockIdx.y % HC) * GC;

    const int L = positions[n] + 1;
    const int lo = s * chunk;
    if (lo >= L) return;                                    // no keys: the combine skips this split
    const int hi = (s == S - 1) ? L : min(lo + chunk, L);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int LPK = D >> 4, KPW = 32 / LPK;
    const int lg = lane / LPK, sl = lane - lg * LPK;
    const int* pt = page_tables + (i64_t)seq_of_col[n] * max_pages;
    const int NG = D / KV_I8_GROUP;
    const i64_t row_stride = (i64_t)KV * D;                 // codes between consecutive positions of a page
    const i64_t col_off = (i64_t)kvh * D + sl * 16;
    const i64_t srow_stride = (i64_t)KV * NG;               // scales between consecutive positions
    const i64_t scol_off = (i64_t)kvh * NG + (sl >> 2);     // 4 lanes (64 dims) per group

    float qf[GC][16];
#pragma unroll
    for (int g = 0; g < GC; ++g) {
        const uint4* qp = reinterpret_cast<const uint4*>(q + ((i64_t)n * H + h0 + g) * D + sl * 16);
        unpack8(qp[0], qf[g]);
        unpack8(qp[1], qf[g] + 8);
#pragma unroll
        for (int e = 0; e < 16; ++e) qf[g][e] *= scale_log2;
    }

    float m[GC], l[GC], acc[GC][16];
#pragma unroll
    for (int g = 0; g < GC; ++g) {
        m[g] = ATT_NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 16; ++e) acc[g][e] = 0.f;
    }

    const int per_iter = ATT_WARPS * ATT_U * KPW;
    for (int base = lo + warp * ATT_U * KPW; base < hi; base += per_iter) {      // warp-uniform
        uint4 kr[ATT_U], vr[ATT_U];
        float ks[ATT_U], vs[ATT_U];
        bool valid[ATT_U];
#pragma unroll
        for (int u = 0; u < ATT_U; ++u) {
            const int j = base + u * KPW + lg;
            valid[u] = j < hi;
            if (valid[u]) {
                const i64_t row = (i64_t)pt[j >> ATT_PAGE_SHIFT] * ATT_PAGE + (j & (ATT_PAGE - 1));
                kr[u] = *reinterpret_cast<const uint4*>(k_pool + row * row_stride + col_off);
                vr[u] = *reinterpret_cast<const uint4*>(v_pool + row * row_stride + col_off);
                ks[u] = k_scale[row * srow_stride + scol_off];
                vs[u] = v_scale[row * srow_stride + scol_off];
            } else {
                kr[u] = make_uint4(0u, 0u, 0u, 0u);
                vr[u] = make_uint4(0u, 0u, 0u, 0u);
                ks[u] = 0.f;
                vs[u] = 0.f;
            }
        }
        float sc[ATT_U][GC];
#pragma unroll
        for (int u = 0; u < ATT_U; ++u) {
            float kf[16];
            unpack_i8x16(kr[u], kf);
#pragma unroll
            for (int g = 0; g < GC; ++g) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 16; ++e) d = fmaf(qf[g][e], kf[e], d);
                d *= ks[u];
#pragma unroll
                for (int o = 8; o > 0; o >>= 1)          // LPK <= 16; unrolled (a runtime loop spills at GC 1)
                    if (o < LPK) d += __shfl_xor_sync(0xffffffffu, d, o);
                sc[u][g] = valid[u] ? d : ATT_NEG_INF;
            }
        }
        float pv[ATT_U][GC];                                 // p * v_scale of key u for head g
#pragma unroll
        for (int g = 0; g < GC; ++g) {
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < ATT_U; ++u) mx = fmaxf(mx, sc[u][g]);
            const float ms = mx == ATT_NEG_INF ? 0.f : mx;
            const float corr = fast_exp2(m[g] - ms);
            m[g] = mx;
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < 16; ++e) acc[g][e] *= corr;
#pragma unroll
            for (int u = 0; u < ATT_U; ++u) {
                const float p = fast_exp2(sc[u][g] - ms);
                l[g] += p;
                pv[u][g] = p * vs[u];
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_U; ++u) {
            float vf[16];
            unpack_i8x16(vr[u], vf);
#pragma unroll
            for (int g = 0; g < GC; ++g) {
#pragma unroll
                for (int e = 0; e < 16; ++e) acc[g][e] = fmaf(pv[u][g], vf[e], acc[g][e]);
            }
        }
    }

    attn_split_finish<GC, 16>(m, l, acc, red_m, red_l, red_acc, LPK, lane, warp, lg, sl, out, part_ml, part_acc, gate,
                              n, s, S, H, D, h0, gate_s0, gate_s1);
}

#define ATT_SPLIT_I8_KERNEL(GC)                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)                                     \
    gqa_decode_split_i8_g##GC(bf16_t* out, float* part_ml, float* part_acc, const bf16_t* q,         \
                              const i8_t* k_pool, const i8_t* v_pool, const float* k_scale,          \
                              const float* v_scale, const int* page_tables, const int* positions,    \
                              const int* seq_of_col, const bf16_t* gate, int H, int KV, int D,       \
                              int max_pages, int chunk, int S, i64_t gate_s0, i64_t gate_s1,         \
                              float scale_log2) {                                                    \
        pdl_enter();                                                                               \
        attn_split_i8<GC>(out, part_ml, part_acc, q, k_pool, v_pool, k_scale, v_scale, page_tables,   \
                          positions, seq_of_col, gate, H, KV, D, max_pages, chunk, S, gate_s0,       \
                          gate_s1, scale_log2);                                                      \
    }

ATT_SPLIT_I8_KERNEL(1)
ATT_SPLIT_I8_KERNEL(2)
ATT_SPLIT_I8_KERNEL(3)
ATT_SPLIT_I8_KERNEL(4)

// --------------------------------------------------------------------------------------------------
#define COMB_S 256          // splits whose (max, sum) pairs the combine stages in shared memory

// Combine: grid (N, H), block 64. Thread t handles dims [4t, 4t + 4) (+ 256 per round). Reads only
// the splits that had keys (s * chunk < L), merges them in split order and applies the gate.

extern "C" __global__ void __launch_bounds__(64)
gqa_decode_combine(bf16_t* __restrict__ out, const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                   const int* __restrict__ positions, const bf16_t* __restrict__ gate, int H, int D, int chunk,
                   int S, i64_t gate_s0, i64_t gate_s1) {
    pdl_enter();
    const int n = blockIdx.x, h = blockIdx.y;
    const int L = positions[n] + 1;
    int active = 0;                                         // splits s with s * chunk < L
    while (active < S && active * chunk < L) ++active;
    const i64_t p0 = ((i64_t)n * H + h) * S;

    // The splits' (max, sum) pairs go to shared memory in one round of parallel loads (a loop over
    // them in global memory left a chain of dependent L2 round trips); the sums below read them in the
    // same order as before, so the result is the same bit for bit. More than COMB_S splits: read in place.
    __shared__ float s_ml[2 * COMB_S];
    const float* ml = part_ml + 2 * p0;
    if (active <= COMB_S) {                                 // block-uniform
        for (int i = threadIdx.x; i < 2 * active; i += blockDim.x) s_ml[i] = ml[i];
        __syncthreads();
        ml = s_ml;
    }
    float M = ATT_NEG_INF;
    for (int s = 0; s < active; ++s) M = fmaxf(M, ml[2 * s]);
    float lsum = 0.f;
    for (int s = 0; s < active; ++s) lsum += ml[2 * s + 1] * fast_exp2(ml[2 * s] - M);
    const float inv = __fdividef(1.f, lsum);

    for (int d = threadIdx.x * 4; d < D; d += blockDim.x * 4) {
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 4
        for (int s = 0; s < active; ++s) {
            const float w = fast_exp2(ml[2 * s] - M);
            const float4 a = *reinterpret_cast<const float4*>(part_acc + (p0 + s) * D + d);
            a0 = fmaf(w, a.x, a0); a1 = fmaf(w, a.y, a1); a2 = fmaf(w, a.z, a2); a3 = fmaf(w, a.w, a3);
        }
        const bf16_t* gp = gate + n * gate_s0 + h * gate_s1 + d;
        const unsigned g01 = *reinterpret_cast<const unsigned*>(gp), g23 = *reinterpret_cast<const unsigned*>(gp + 2);
        const float2 ga = bf16x2_to_f32x2(g01), gb = bf16x2_to_f32x2(g23);
        uint2 r;
        r.x = pack2(gated(a0 * inv, ga.x), gated(a1 * inv, ga.y));
        r.y = pack2(gated(a2 * inv, gb.x), gated(a3 * inv, gb.y));
        *reinterpret_cast<uint2*>(out + ((i64_t)n * H + h) * D + d) = r;
    }
}

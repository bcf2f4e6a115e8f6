// Mixture-of-experts: the router's softmax + top-k, and the routed experts for decode-sized batches.
//
// moe_route_topk:      one warp per token; softmax over X <= 512 router logits in fp32 (expf, per-lane
//                      partial sums then an xor butterfly: the layout of torch's warp softmax), top-k by
//                      k rounds of a warp argmax with ties to the lower expert id, renormalised to sum 1.
// moe_gate_up_swiglu:  h[n, a, :] = bf16(bf16(silu(bf16(gate_e x_n))) * bf16(up_e x_n)), e = ids[n, a]:
//                      one warp per output row j (the gate row j and the up row j of expert e), its
//                      first loads issued before x is staged.
// moe_down_combine:    out[n, r] = bf16(sum_a w[n, a] * (down_e[r, :] . h[n, a, :])) in fp32:
//                      one warp per output row r, its first DOWN_UNROLL loads per lane issued before
//                      h is staged (they need only the ids), up to 32 * DOWN_UNROLL chunks in flight.
// moe_gate_up_swiglu_late, moe_down_combine_late: the same sums in the same order with every load after
//                      the staging (the down kernel 8 per lane): fewer registers, more resident blocks.
//                      kernels/cuda_misc.py takes the early pair for one token, these for more (measured
//                      on the 35B-A3B, docs/perf.md, twelfth session).
//
// Only the selected experts' weights are read; expert ids come from device memory and are clamped
// to [0, X) so that a bad id can never read out of bounds.
#include "common.cuh"

#define ROUTE_MAXJ 16        // router logits per lane: X <= 32 * ROUTE_MAXJ = 512
#define GU_UNROLL 8          // 16-byte loads per lane per row in flight (gate + up: twice that)
#define DOWN_UNROLL 24       // 16-byte loads per lane in flight in the down projection (9 slots of 512: 18)

__device__ __forceinline__ float moe_neg_inf() { return __int_as_float(0xff800000); }

// (v, i) beats (bv, bi): larger value, or equal value and lower index.
__device__ __forceinline__ bool moe_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// grid (ceil(N / warps per block)), block: a multiple of 32. logits [N, X] (bf16, or fp32 when
// logits_f32), weights_out [N, K] bf16, ids_out [N, K] int32; 1 <= K <= min(X, 32), X <= 512.
// shared: the last logit column is the shared expert's gate, not a router logit: the top K come from
// the first X - 1 columns, and slot K (weights_out and ids_out are [N, K + 1], K + 1 <= 32) holds the
// shared expert as expert X - 1 with weight bf16(sigmoid(logit)), as torch.sigmoid rounds it.
// (Routing inside the gate|up kernel instead, one launch fewer, was slower: every block waited for its
// warp's top-k; 35B-A3B 3.68 against 3.41 ms at C = 1, 11.27 against 9.31 at C = 8, docs/perf.md.)
extern "C" __global__ void moe_route_topk(bf16_t* weights_out, int* ids_out, const void* logits, int logits_f32,
                                          int N, int X, int K, int shared) {
    pdl_enter();
    const int ld = X;                                          // logits per row
    const int stride = K + (shared ? 1 : 0);                   // outputs per row
    if (shared) --X;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;                                      // uniform per warp
    const float NEG_INF = moe_neg_inf();
    const long long base = (long long)row * ld;
    float p[ROUTE_MAXJ];
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < ROUTE_MAXJ; ++j) {
        const int c = lane + 32 * j;
        float t = NEG_INF;
        if (c < X)
            t = logits_f32 ? reinterpret_cast<const float*>(logits)[base + c]
                           : bf16_to_f32(reinterpret_cast<const bf16_t*>(logits)[base + c]);
        p[j] = t;
        m = fmaxf(m, t);
    }
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTE_MAXJ; ++j) {
        if (lane + 32 * j < X) {
            p[j] = expf(__fsub_rn(p[j], m));
            s = __fadd_rn(s, p[j]);
        }
    }
    s = warp_sum(s);
    unsigned taken = 0;                                        // bit j: element lane + 32 j taken or absent
#pragma unroll
    for (int j = 0; j < ROUTE_MAXJ; ++j) {
        if (lane + 32 * j < X) {
            const float q = __fdiv_rn(p[j], s);
            p[j] = q == q ? q : NEG_INF;                       // NaN never wins (ids stay valid)
        } else {
            taken |= 1u << j;
        }
    }
    float myv = 0.f;
    int myi = 0;
    for (int r = 0; r < K; ++r) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j) {                  // lane's candidates in increasing id order
            const int c = lane + 32 * j;
            if (!((taken >> j) & 1u) && moe_better(p[j], c, bv, bi)) { bv = p[j]; bi = c; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (moe_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        // every lane now holds the same winner; its owner marks it taken
        if ((bi & 31) == lane) taken |= 1u << ((unsigned)bi >> 5);
        if (r == lane) { myv = bv; myi = bi; }
    }
    const float total = warp_sum(lane < K ? myv : 0.f);
    if (lane < K) {
        weights_out[(long long)row * stride + lane] = f32_to_bf16(__fdiv_rn(myv, total));
        ids_out[(long long)row * stride + lane] = myi;
    } else if (shared && lane == K) {
        const float g = logits_f32 ? reinterpret_cast<const float*>(logits)[base + X]
                                   : bf16_to_f32(reinterpret_cast<const bf16_t*>(logits)[base + X]);
        weights_out[(long long)row * stride + K] = f32_to_bf16(__fdiv_rn(1.f, __fadd_rn(1.f, expf(-g))));
        ids_out[(long long)row * stride + K] = X;
    }
}

__device__ __forceinline__ int moe_expert(const void* ids, int ids64, long long k, int X) {
    const long long e = ids64 ? reinterpret_cast<const i64_t*>(ids)[k] : (long long)reinterpret_cast<const int*>(ids)[k];
    return e < 0 ? 0 : (e >= X ? X - 1 : (int)e);
}

// acc + sum of the 8 products of two 16-byte bf16 vectors.
__device__ __forceinline__ float moe_dot8(uint4 w, uint4 x, float acc) {
    float2 a = bf16x2_to_f32x2(w.x), b = bf16x2_to_f32x2(x.x);
    acc = fmaf(a.x, b.x, acc); acc = fmaf(a.y, b.y, acc);
    a = bf16x2_to_f32x2(w.y); b = bf16x2_to_f32x2(x.y);
    acc = fmaf(a.x, b.x, acc); acc = fmaf(a.y, b.y, acc);
    a = bf16x2_to_f32x2(w.z); b = bf16x2_to_f32x2(x.z);
    acc = fmaf(a.x, b.x, acc); acc = fmaf(a.y, b.y, acc);
    a = bf16x2_to_f32x2(w.w); b = bf16x2_to_f32x2(x.w);
    acc = fmaf(a.x, b.x, acc); acc = fmaf(a.y, b.y, acc);
    return acc;
}

__device__ __forceinline__ float moe_round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// grid (ceil(I / warps per block), A, N), block: a multiple of 32; dynamic smem E * 2 bytes.
// x [N, E] bf16, ids [N, A] (int64 when ids64, else int32), gate_up [X, 2I, E] bf16, h [N, A, I] bf16.
// E % 8 == 0 and I % 8 == 0; x, gate_up and h 16-byte aligned. EARLY: each warp puts its first GU_UNROLL
// gate and up loads per lane in flight before x is staged (they need only the expert id).
template <bool EARLY>
__device__ __forceinline__ void moe_gate_up_body(bf16_t* h, const bf16_t* x, const void* ids, int ids64,
                                                 const bf16_t* __restrict__ gate_up, int E, int I, int X, int A) {
    extern __shared__ uint4 moe_sx[];
    const int n = blockIdx.z, a = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int nvec = E >> 3;
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool live = j < I;                                   // uniform per warp
    const int e = moe_expert(ids, ids64, (long long)n * A + a, X);
    const uint4* g = reinterpret_cast<const uint4*>(gate_up + ((long long)e * 2 * I + (live ? j : 0)) * E);
    const uint4* u = reinterpret_cast<const uint4*>(gate_up + ((long long)e * 2 * I + I + (live ? j : 0)) * E);
    uint4 gv[GU_UNROLL], uv[GU_UNROLL];
    if (EARLY && live) {
#pragma unroll
        for (int k = 0; k < GU_UNROLL; ++k) {
            const int i = lane + 32 * k;
            if (i < nvec) { gv[k] = __ldg(g + i); uv[k] = __ldg(u + i); }
        }
    }
    const uint4* xv = reinterpret_cast<const uint4*>(x + (long long)n * E);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) moe_sx[i] = xv[i];
    __syncthreads();
    if (!live) return;                                         // after the barrier
    float ag = 0.f, au = 0.f;
    for (int b = 0; b < nvec; b += 32 * GU_UNROLL) {
        if (b > 0 || !EARLY) {
#pragma unroll
            for (int k = 0; k < GU_UNROLL; ++k) {
                const int i = b + lane + 32 * k;
                if (i < nvec) { gv[k] = __ldg(g + i); uv[k] = __ldg(u + i); }
            }
        }
#pragma unroll
        for (int k = 0; k < GU_UNROLL; ++k) {
            const int i = b + lane + 32 * k;
            if (i < nvec) {
                const uint4 xx = moe_sx[i];
                ag = moe_dot8(gv[k], xx, ag);
                au = moe_dot8(uv[k], xx, au);
            }
        }
    }
    ag = warp_sum(ag);
    au = warp_sum(au);
    if (lane == 0) {
        const float gb = moe_round_bf16(ag), ub = moe_round_bf16(au);          // F.linear's bf16 outputs
        const float sg = moe_round_bf16(__fdiv_rn(gb, __fadd_rn(1.f, expf(-gb))));   // F.silu in fp32 -> bf16
        h[((long long)n * A + a) * I + j] = f32_to_bf16(__fmul_rn(sg, ub));  // bf16 * bf16 -> bf16
    }
}

// grid (ceil(E / warps per block), N), block: a multiple of 32; dynamic smem A * I * 2 + A * 8 bytes.
// h [N, A, I] bf16, ids [N, A], weights [N, A] (fp32 when w_f32, else bf16), down [X, E, I] bf16,
// out [N, E] bf16. I % 8 == 0; h and down 16-byte aligned.
template <int UNROLL>
__device__ __forceinline__ void moe_down_body(bf16_t* out, const bf16_t* h, const void* ids, int ids64,
                                              const void* weights, int w_f32, const bf16_t* __restrict__ down,
                                              int E, int I, int X, int A) {
    extern __shared__ uint4 moe_sh[];
    const int n = blockIdx.y;
    const int nci = I >> 3;                                   // 16-byte chunks per row
    const int nv = A * nci;
    float* sw = reinterpret_cast<float*>(moe_sh + nv);
    int* se = reinterpret_cast<int*>(sw + A);
    for (int a = threadIdx.x; a < A; a += blockDim.x) {
        const long long k = (long long)n * A + a;
        se[a] = moe_expert(ids, ids64, k, X);
        sw[a] = w_f32 ? reinterpret_cast<const float*>(weights)[k]
                      : bf16_to_f32(reinterpret_cast<const bf16_t*>(weights)[k]);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool live = r < E;                                  // uniform per warp
    uint4 dv[UNROLL];
    if (live) {                                               // the first loads need only the ids
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int t = lane + 32 * k;                        // chunk t = (slot a, chunk c of the row)
            if (t < nv) {
                const int a = t / nci, c = t - a * nci;
                dv[k] = __ldg(reinterpret_cast<const uint4*>(down + ((long long)se[a] * E + r) * I) + c);
            }
        }
    }
    const uint4* hv = reinterpret_cast<const uint4*>(h + (long long)n * A * I);
    for (int i = threadIdx.x; i < nv; i += blockDim.x) moe_sh[i] = hv[i];
    __syncthreads();
    if (!live) return;                                         // after the barrier
    float acc = 0.f;
    for (int b = 0; b < nv; b += 32 * UNROLL) {
        if (b > 0) {
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                const int t = b + lane + 32 * k;
                if (t < nv) {
                    const int a = t / nci, c = t - a * nci;
                    dv[k] = __ldg(reinterpret_cast<const uint4*>(down + ((long long)se[a] * E + r) * I) + c);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int t = b + lane + 32 * k;
            if (t < nv) acc = fmaf(sw[t / nci], moe_dot8(dv[k], moe_sh[t], 0.f), acc);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(long long)n * E + r] = f32_to_bf16(acc);
}

extern "C" __global__ void moe_down_combine(bf16_t* out, const bf16_t* h, const void* ids, int ids64,
                                            const void* weights, int w_f32, const bf16_t* __restrict__ down,
                                            int E, int I, int X, int A) {
    pdl_enter();
    moe_down_body<DOWN_UNROLL>(out, h, ids, ids64, weights, w_f32, down, E, I, X, A);
}

extern "C" __global__ void moe_down_combine_late(bf16_t* out, const bf16_t* h, const void* ids, int ids64,
                                               const void* weights, int w_f32, const bf16_t* __restrict__ down,
                                               int E, int I, int X, int A) {
    pdl_enter();
    moe_down_body<8>(out, h, ids, ids64, weights, w_f32, down, E, I, X, A);
}

extern "C" __global__ void moe_gate_up_swiglu(bf16_t* h, const bf16_t* x, const void* ids, int ids64,
                                              const bf16_t* __restrict__ gate_up, int E, int I, int X, int A) {
    pdl_enter();
    moe_gate_up_body<true>(h, x, ids, ids64, gate_up, E, I, X, A);
}

extern "C" __global__ void moe_gate_up_swiglu_late(bf16_t* h, const bf16_t* x, const void* ids, int ids64,
                                                   const bf16_t* __restrict__ gate_up, int E, int I, int X, int A) {
    pdl_enter();
    moe_gate_up_body<false>(h, x, ids, ids64, gate_up, E, I, X, A);
}

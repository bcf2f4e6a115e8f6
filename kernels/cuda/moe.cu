// Mixture-of-experts: the router's softmax + top-k, and the routed experts for decode-sized batches.
//
// moe_route_topk:      one block per token, a thread per logit; softmax over X <= 512 router logits in
//                      fp32 (expf, per-lane partial sums then an xor butterfly: the layout of torch's
//                      warp softmax), the top k (ties to the lower expert id) by rank counting, then
//                      renormalised to sum 1.
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

#define ROUTE_MAX_X 512      // router logits per token (threads of the route kernel's block)
#define GU_UNROLL 8          // 16-byte loads per lane per row in flight (gate + up: twice that)
#define DOWN_UNROLL 24       // 16-byte loads per lane in flight in the down projection (9 slots of 512: 18)

__device__ __forceinline__ float moe_neg_inf() { return __int_as_float(0xff800000); }

// (v, i) beats (bv, bi): larger value, or equal value and lower index.
__device__ __forceinline__ bool moe_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// grid (N), block 32 * ceil(Xr / 32) threads (Xr = X, or X - 1 with shared; Xr <= 512): one block per
// token. logits [N, X] (bf16, or fp32 when logits_f32), weights_out [N, K] bf16, ids_out [N, K] int32;
// 1 <= K <= min(Xr, 32). Thread c holds logit c. The softmax: block max, p = expf(l - max), the sum
// taken by warp 0 in the order of the earlier one-warp kernel (lane L adds p[L + 32 j] for j = 0, 1, ..,
// then an xor butterfly), q = p / sum (NaN never wins: -inf). The top K in the order "larger q, then
// lower id" in two rounds instead of K rounds of a warp argmax (which left one warp's dependent chain
// as the kernel's whole time, 4.9 us a layer on the 35B-A3B): each warp ranks its 32 candidates by
// shuffles and keeps its best K; then each of those nwarps * K candidates counts how many of them
// beat it, and that count is its output slot. (Absent threads c >= Xr hold -inf with id c: every
// present logit beats them.) The renormalisation sums the winners by a warp butterfly as before, so
// ids and weights are the earlier kernel's bit for bit.
// shared: the last logit column is the shared expert's gate, not a router logit: the top K come from
// the first X - 1 columns, and slot K (weights_out and ids_out are [N, K + 1], K + 1 <= 32) holds the
// shared expert as expert X - 1 with weight bf16(sigmoid(logit)), as torch.sigmoid rounds it.
// (Routing inside the gate|up kernel instead, one launch fewer, was slower: every block waited for its
// warp's top-k; 35B-A3B 3.68 against 3.41 ms at C = 1, 11.27 against 9.31 at C = 8, docs/perf.md.)
extern "C" __global__ void __launch_bounds__(ROUTE_MAX_X) moe_route_topk(
        bf16_t* weights_out, int* ids_out, const void* logits, int logits_f32, int N, int X, int K, int shared) {
    __shared__ float sp[ROUTE_MAX_X];                          // exp(l - max) of each logit
    __shared__ float cv[ROUTE_MAX_X];                          // the warps' best K: value, id
    __shared__ int ci[ROUTE_MAX_X];
    __shared__ float wv[32];                                   // the winners in rank order
    __shared__ int wi[32];
    __shared__ float red[ROUTE_MAX_X / 32];
    __shared__ float total_s;
    pdl_enter();
    const int ld = X;                                          // logits per row
    const int stride = K + (shared ? 1 : 0);                   // outputs per row
    if (shared) --X;
    const int row = blockIdx.x;
    if (row >= N) return;                                      // uniform per block
    const int c = threadIdx.x, lane = c & 31, warp = c >> 5, nwarps = blockDim.x >> 5;
    const float NEG_INF = moe_neg_inf();
    const long long base = (long long)row * ld;
    float v = NEG_INF;
    if (c < X)
        v = logits_f32 ? reinterpret_cast<const float*>(logits)[base + c]
                       : bf16_to_f32(reinterpret_cast<const bf16_t*>(logits)[base + c]);
    float m = warp_max(v);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < nwarps; ++w) m = fmaxf(m, red[w]);   // a max: the order does not matter
    float p = 0.f;
    if (c < X) {
        p = expf(__fsub_rn(v, m));
        sp[c] = p;
    }
    __syncthreads();
    if (warp == 0) {
        float s = 0.f;
        for (int j = lane; j < X; j += 32) s = __fadd_rn(s, sp[j]);
        s = warp_sum(s);                                        // the same bits in every lane
        if (lane == 0) total_s = s;
    }
    __syncthreads();
    float q = NEG_INF;
    if (c < X) {
        q = __fdiv_rn(p, total_s);
        q = q == q ? q : NEG_INF;                              // NaN never wins (ids stay valid)
    }
    int r = 0;                                                 // rank in the warp
#pragma unroll 8
    for (int o = 0; o < 32; ++o) {
        const float ov = __shfl_sync(0xffffffffu, q, o);
        r += moe_better(ov, warp * 32 + o, q, c) ? 1 : 0;
    }
    if (r < K) { cv[warp * K + r] = q; ci[warp * K + r] = c; }
    __syncthreads();
    const int nc = nwarps * K;                                 // <= blockDim.x
    if (c < nc) {
        const float mv = cv[c];
        const int mi = ci[c];
        int rank = 0;
        for (int u = 0; u < nc; ++u) rank += moe_better(cv[u], ci[u], mv, mi) ? 1 : 0;
        if (rank < K) { wv[rank] = mv; wi[rank] = mi; }
    }
    __syncthreads();
    if (warp != 0) return;
    const float myv = lane < K ? wv[lane] : 0.f;
    const float total = warp_sum(myv);
    if (lane < K) {
        weights_out[(long long)row * stride + lane] = f32_to_bf16(__fdiv_rn(myv, total));
        ids_out[(long long)row * stride + lane] = wi[lane];
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
    // Lane chunk t = lane + 32 k is (slot a, chunk c of the row) = (t / nci, t % nci); (la, lc) walks
    // that sequence for the loads and (pa, pc) for the products, by subtraction (a division by the
    // runtime nci costs ~20 instructions: 72 of them in the unrolled kernel were 9% of its time).
    int la = 0, lc = lane;
    while (lc >= nci) { lc -= nci; ++la; }
    const int a0 = la, c0 = lc;
    uint4 dv[UNROLL];
    if (live) {                                               // the first loads need only the ids
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            if (la < A)                                         // t < nv
                dv[k] = __ldg(reinterpret_cast<const uint4*>(down + ((long long)se[la] * E + r) * I) + lc);
            lc += 32;
            while (lc >= nci) { lc -= nci; ++la; }
        }
    }
    const uint4* hv = reinterpret_cast<const uint4*>(h + (long long)n * A * I);
    for (int i = threadIdx.x; i < nv; i += blockDim.x) moe_sh[i] = hv[i];
    __syncthreads();
    if (!live) return;                                         // after the barrier
    float acc = 0.f;
    int pa = a0, pc = c0;
    for (int b = 0; b < nv; b += 32 * UNROLL) {
        if (b > 0) {
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                if (la < A)
                    dv[k] = __ldg(reinterpret_cast<const uint4*>(down + ((long long)se[la] * E + r) * I) + lc);
                lc += 32;
                while (lc >= nci) { lc -= nci; ++la; }
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int t = b + lane + 32 * k;
            if (pa < A) acc = fmaf(sw[pa], moe_dot8(dv[k], moe_sh[t], 0.f), acc);
            pc += 32;
            while (pc >= nci) { pc -= nci; ++pa; }
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

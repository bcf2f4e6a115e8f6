// Embedding gather and zero-centred RMSNorm (optionally fused with the residual add), bf16.
//
// rms_norm:      out = bf16( (x * rsqrt(mean(x^2) + eps)) * (1 + w) ), all maths in fp32, exactly the
//                order of kernels/reference.rms_norm (mean = sum * (1/E), then + eps, rsqrtf, two
//                multiplies); only the fp32 summation order of sum(x^2) differs from torch's.
// add_rms_norm:  x_new = bf16(x + y) (torch's bf16 add: fp32 sum, one RNE rounding), stored to x_out
//                (which may alias x), then out = rms_norm(x_new).
//
// One block per row. The row (and its weights, loaded with it) stays in registers between the sum of
// squares and the output, so x is read once, no load waits behind the reduction, and the in-place
// forms (out == x, x_out == x) are safe: every element is read and written by the same thread, reads
// before the block reduction, writes after it.
#include "common.cuh"

#define NORM_MAXV 4      // fast path: 16-byte vectors (8 elements) per thread
#define NORM_MAXS 16     // generic path: elements per thread

__device__ __forceinline__ float norm_sq8(uint4 v, float acc) {
    float2 a = bf16x2_to_f32x2(v.x), b = bf16x2_to_f32x2(v.y), c = bf16x2_to_f32x2(v.z), d = bf16x2_to_f32x2(v.w);
    acc = fmaf(a.x, a.x, acc); acc = fmaf(a.y, a.y, acc);     // squares of bf16 values are exact in fp32
    acc = fmaf(b.x, b.x, acc); acc = fmaf(b.y, b.y, acc);
    acc = fmaf(c.x, c.x, acc); acc = fmaf(c.y, c.y, acc);
    acc = fmaf(d.x, d.x, acc); acc = fmaf(d.y, d.y, acc);
    return acc;
}

__device__ __forceinline__ unsigned norm_pack2(float lo, float hi) {
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
}

// bf16(a + b) for two packed pairs.
__device__ __forceinline__ unsigned norm_add2(unsigned a, unsigned b) {
    float2 fa = bf16x2_to_f32x2(a), fb = bf16x2_to_f32x2(b);
    return norm_pack2(__fadd_rn(fa.x, fb.x), __fadd_rn(fa.y, fb.y));
}

// bf16((x * r) * (1 + w)) for two packed pairs.
__device__ __forceinline__ unsigned norm_scale2(unsigned x, unsigned w, float r) {
    float2 fx = bf16x2_to_f32x2(x), fw = bf16x2_to_f32x2(w);
    return norm_pack2(__fmul_rn(__fmul_rn(fx.x, r), __fadd_rn(1.f, fw.x)),
                      __fmul_rn(__fmul_rn(fx.y, r), __fadd_rn(1.f, fw.y)));
}

__device__ __forceinline__ float norm_rsqrt(float sumsq, float inv_e, float eps) {
    return rsqrtf(__fadd_rn(__fmul_rn(sumsq, inv_e), eps));      // no fma contraction: mean, then + eps
}

// Fast path: E % 8 == 0, every row pointer 16-byte aligned, E / 8 <= NORM_MAXV * blockDim.x.
template <bool ADD>
__device__ __forceinline__ void norm_row_v8(bf16_t* out, bf16_t* x_out, const bf16_t* x, const bf16_t* y,
                                            const bf16_t* __restrict__ w, int E, float inv_e, float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * E;
    const int nvec = E >> 3;
    const uint4* xv = reinterpret_cast<const uint4*>(x + base);
    const uint4* yv = reinterpret_cast<const uint4*>(y + (ADD ? base : 0));
    uint4* xo = reinterpret_cast<uint4*>(x_out + (ADD ? base : 0));
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    uint4 v[NORM_MAXV], wk[NORM_MAXV];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NORM_MAXV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nvec) {
            wk[k] = __ldg(wv + i);                            // with x: not a round trip after the reduction
            uint4 a = xv[i];
            if (ADD) {
                const uint4 b = yv[i];
                a.x = norm_add2(a.x, b.x); a.y = norm_add2(a.y, b.y);
                a.z = norm_add2(a.z, b.z); a.w = norm_add2(a.w, b.w);
                xo[i] = a;
            }
            v[k] = a;
            ss = norm_sq8(a, ss);
        }
    }
    const float r = norm_rsqrt(block_sum(ss, scratch), inv_e, eps);
    uint4* ov = reinterpret_cast<uint4*>(out + base);
#pragma unroll
    for (int k = 0; k < NORM_MAXV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nvec) {
            uint4 o;
            o.x = norm_scale2(v[k].x, wk[k].x, r); o.y = norm_scale2(v[k].y, wk[k].y, r);
            o.z = norm_scale2(v[k].z, wk[k].z, r); o.w = norm_scale2(v[k].w, wk[k].w, r);
            ov[i] = o;
        }
    }
}

// Generic path: any E <= NORM_MAXS * blockDim.x, 2-byte loads.
template <bool ADD>
__device__ __forceinline__ void norm_row_generic(bf16_t* out, bf16_t* x_out, const bf16_t* x, const bf16_t* y,
                                                 const bf16_t* __restrict__ w, int E, float inv_e, float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * E;
    float v[NORM_MAXS], wf[NORM_MAXS];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NORM_MAXS; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = 0.f;
        if (i < E) {
            wf[k] = bf16_to_f32(__ldg(w + i));
            float a = bf16_to_f32(x[base + i]);
            if (ADD) {
                const bf16_t s = f32_to_bf16(__fadd_rn(a, bf16_to_f32(y[base + i])));
                x_out[base + i] = s;
                a = bf16_to_f32(s);
            }
            v[k] = a;
            ss = fmaf(a, a, ss);
        }
    }
    const float r = norm_rsqrt(block_sum(ss, scratch), inv_e, eps);
#pragma unroll
    for (int k = 0; k < NORM_MAXS; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < E) {
            out[base + i] = f32_to_bf16(__fmul_rn(__fmul_rn(v[k], r), __fadd_rn(1.f, wf[k])));
        }
    }
}

// grid (rows), block: a multiple of 32 (<= 1024) with E / 8 <= NORM_MAXV * block.
extern "C" __global__ void rms_norm_bf16_v8(bf16_t* out, const bf16_t* x, const bf16_t* w, int E, float inv_e,
                                            float eps) {
    pdl_enter();
    norm_row_v8<false>(out, nullptr, x, nullptr, w, E, inv_e, eps);
}

// grid (rows), block: a multiple of 32 (<= 1024) with E <= NORM_MAXS * block.
extern "C" __global__ void rms_norm_bf16_generic(bf16_t* out, const bf16_t* x, const bf16_t* w, int E,
                                                 float inv_e, float eps) {
    pdl_enter();
    norm_row_generic<false>(out, nullptr, x, nullptr, w, E, inv_e, eps);
}

extern "C" __global__ void add_rms_norm_bf16_v8(bf16_t* out, bf16_t* x_out, const bf16_t* x, const bf16_t* y,
                                                const bf16_t* w, int E, float inv_e, float eps) {
    pdl_enter();
    norm_row_v8<true>(out, x_out, x, y, w, E, inv_e, eps);
}

extern "C" __global__ void add_rms_norm_bf16_generic(bf16_t* out, bf16_t* x_out, const bf16_t* x,
                                                     const bf16_t* y, const bf16_t* w, int E, float inv_e,
                                                     float eps) {
    pdl_enter();
    norm_row_generic<true>(out, x_out, x, y, w, E, inv_e, eps);
}

// Embedding gather: out[n, :] = table[clamp(ids[n], 0, V - 1), :]. Out-of-range ids are clamped so
// that nothing is read out of bounds (the host validates ids where it can).
__device__ __forceinline__ long long emb_row(const void* ids, int ids64, int n, int V) {
    long long id = ids64 ? reinterpret_cast<const i64_t*>(ids)[n] : (long long)reinterpret_cast<const int*>(ids)[n];
    return id < 0 ? 0 : (id >= V ? (long long)V - 1 : id);
}

// grid (N, ceil(E / 8 / block)), E % 8 == 0 and 16-byte aligned table and out.
extern "C" __global__ void embedding_bf16_v8(bf16_t* out, const void* ids, int ids64, const bf16_t* table, int V,
                                             int E) {
    pdl_enter();
    const int n = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= (E >> 3)) return;
    const long long row = emb_row(ids, ids64, n, V);
    const uint4* src = reinterpret_cast<const uint4*>(table + row * E);
    reinterpret_cast<uint4*>(out + (long long)n * E)[i] = __ldg(src + i);
}

// grid (N, ceil(E / block)), any E.
extern "C" __global__ void embedding_bf16_generic(bf16_t* out, const void* ids, int ids64, const bf16_t* table,
                                                  int V, int E) {
    pdl_enter();
    const int n = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= E) return;
    const long long row = emb_row(ids, ids64, n, V);
    out[(long long)n * E + i] = __ldg(table + row * E + i);
}

// --------------------------------------------------------------------------------------------------
// SwiGLU of a gate|up matmul's output (prefill: cuBLAS writes y [T, 2F], gate = y[:, :F], up = y[:, F:]):
// out[t, f] = bf16(bf16(silu(gate)) * up), silu = x / (1 + exp(-x)) in fp32: torch's bf16 F.silu then
// bf16 mul, bit for bit (kernels/reference.swiglu_mlp). One pass instead of torch's two strided ones.

__device__ __forceinline__ float swiglu_one(float g, float u) {
    const float s = __uint_as_float((unsigned)f32_to_bf16(g / (1.f + expf(-g))) << 16);
    return __fmul_rn(s, u);
}

// grid (ceil(F / 8 / block), T); F % 8 == 0, y and out 16-byte aligned.
extern "C" __global__ void swiglu_bf16_v8(bf16_t* __restrict__ out, const bf16_t* __restrict__ y, int F) {
    pdl_enter();
    const int t = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (F >> 3)) return;
    const bf16_t* row = y + (long long)t * 2 * F;
    const uint4 g = reinterpret_cast<const uint4*>(row)[i];
    const uint4 u = reinterpret_cast<const uint4*>(row + F)[i];
    const unsigned gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
    unsigned ow[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 a = bf16x2_to_f32x2(gw[j]), b = bf16x2_to_f32x2(uw[j]);
        ow[j] = norm_pack2(swiglu_one(a.x, b.x), swiglu_one(a.y, b.y));
    }
    reinterpret_cast<uint4*>(out + (long long)t * F)[i] = make_uint4(ow[0], ow[1], ow[2], ow[3]);
}

// grid (ceil(F / block), T), any F.
extern "C" __global__ void swiglu_bf16_generic(bf16_t* __restrict__ out, const bf16_t* __restrict__ y, int F) {
    pdl_enter();
    const int t = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= F) return;
    const bf16_t* row = y + (long long)t * 2 * F;
    out[(long long)t * F + i] = f32_to_bf16(swiglu_one(bf16_to_f32(row[i]), bf16_to_f32(row[F + i])));
}

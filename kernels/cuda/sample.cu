// Row argmax over logits [R, V] (bf16 or fp32): per-row maximum (fp32) and its index (int64).
//
// Ties go to the lower index; NaN never wins (a row with no non-NaN element reports (-inf, 0)).
// Pass 1 (argmax_chunks_*): grid (C, R), CTA c scans the chunk [c * chunk, min((c + 1) * chunk, V))
// and writes one (value, index) candidate; when C == 1 it writes the final answer directly.
// Pass 2 (argmax_combine): one CTA per row reduces the C candidates. Scratch is [R, C] floats + ints,
// sized by the host from (R, V) alone, so the pair is capturable in a CUDA graph.
#include "common.cuh"

#define AM_UNROLL 4
#define AM_NONE 0x7fffffff            // "no candidate yet" index: loses every tie

__device__ __forceinline__ float am_neg_inf() { return __int_as_float(0xff800000); }

// (v, i) beats (bv, bi): larger value, or equal value and lower index; NaN compares false and never wins.
__device__ __forceinline__ void am_take(float v, int i, float& bv, int& bi) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

// Block-wide (value, index) reduction; the result is valid in thread 0.
__device__ __forceinline__ void am_block_reduce(float& bv, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        am_take(ov, oi, bv, bi);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = lane < nwarps ? sv[lane] : am_neg_inf();
        bi = lane < nwarps ? si[lane] : AM_NONE;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            am_take(ov, oi, bv, bi);
        }
    }
}

__device__ __forceinline__ void am_store(float bv, int bi, int r, int c, int C, float* pv, int* pi,
                                         float* vals_out, i64_t* ids_out) {
    if (C == 1) {
        vals_out[r] = bv;
        ids_out[r] = bi == AM_NONE ? 0 : (i64_t)bi;
    } else {
        pv[(long long)r * C + c] = bv;
        pi[(long long)r * C + c] = bi;
    }
}

// Scan of one chunk. VEC elements per load: 8 bf16 or 4 fp32 in 16 bytes (V % VEC == 0, rows
// 16-byte aligned, chunk % VEC == 0), or 1 (any V). Each thread visits its indices in increasing
// order, so a strict ">" within the thread keeps the lowest index of equal values.
template <bool F32, int VEC>
__device__ __forceinline__ void am_chunk(const void* logits, int V, int chunk, float& bv, int& bi) {
    const int r = blockIdx.y;
    const int lo = blockIdx.x * chunk;
    const int hi = V - lo < chunk ? V : lo + chunk;
    const long long rb = (long long)r * V;
    const int step = blockDim.x * VEC;
    for (int i0 = lo + threadIdx.x * VEC; i0 < hi; i0 += step * AM_UNROLL) {
        float v[AM_UNROLL][VEC];
#pragma unroll
        for (int k = 0; k < AM_UNROLL; ++k) {
            const int i = i0 + k * step;
            if (i < hi) {
                if (F32) {
                    const float* src = reinterpret_cast<const float*>(logits) + rb + i;
                    if (VEC == 4) {
                        const float4 q = __ldg(reinterpret_cast<const float4*>(src));
                        v[k][0] = q.x; v[k][1 % VEC] = q.y; v[k][2 % VEC] = q.z; v[k][3 % VEC] = q.w;
                    } else {
                        v[k][0] = __ldg(src);
                    }
                } else {
                    const bf16_t* src = reinterpret_cast<const bf16_t*>(logits) + rb + i;
                    if (VEC == 8) {
                        const uint4 q = __ldg(reinterpret_cast<const uint4*>(src));
                        float2 t = bf16x2_to_f32x2(q.x); v[k][0] = t.x; v[k][1 % VEC] = t.y;
                        t = bf16x2_to_f32x2(q.y); v[k][2 % VEC] = t.x; v[k][3 % VEC] = t.y;
                        t = bf16x2_to_f32x2(q.z); v[k][4 % VEC] = t.x; v[k][5 % VEC] = t.y;
                        t = bf16x2_to_f32x2(q.w); v[k][6 % VEC] = t.x; v[k][7 % VEC] = t.y;
                    } else {
                        v[k][0] = bf16_to_f32(__ldg(src));
                    }
                }
            }
        }
#pragma unroll
        for (int k = 0; k < AM_UNROLL; ++k) {
            const int i = i0 + k * step;
            if (i < hi) {
#pragma unroll
                for (int q = 0; q < VEC; ++q) am_take(v[k][q], i + q, bv, bi);
            }
        }
    }
}

#define AM_CHUNK_KERNEL(NAME, F32, VEC)                                                                    \
    extern "C" __global__ void NAME(float* pv, int* pi, float* vals_out, i64_t* ids_out, const void* logits, \
                                    int V, int chunk, int C) {                                             \
        float bv = am_neg_inf();                                                                           \
        int bi = AM_NONE;                                                                                  \
        am_chunk<F32, VEC>(logits, V, chunk, bv, bi);                                                      \
        am_block_reduce(bv, bi);                                                                           \
        if (threadIdx.x == 0) am_store(bv, bi, blockIdx.y, blockIdx.x, C, pv, pi, vals_out, ids_out);      \
    }

// grid (C, R), block: a multiple of 32 (<= 1024).
AM_CHUNK_KERNEL(argmax_chunks_bf16_v8, false, 8)
AM_CHUNK_KERNEL(argmax_chunks_bf16, false, 1)
AM_CHUNK_KERNEL(argmax_chunks_f32_v4, true, 4)
AM_CHUNK_KERNEL(argmax_chunks_f32, true, 1)

// grid (R), block: a multiple of 32 (<= 1024). Reduces pv/pi [R, C] into vals_out [R], ids_out [R].
extern "C" __global__ void argmax_combine(float* vals_out, i64_t* ids_out, const float* pv, const int* pi, int C) {
    const int r = blockIdx.x;
    float bv = am_neg_inf();
    int bi = AM_NONE;
    for (int c = threadIdx.x; c < C; c += blockDim.x) am_take(pv[(long long)r * C + c], pi[(long long)r * C + c], bv, bi);
    am_block_reduce(bv, bi);
    if (threadIdx.x == 0) {
        vals_out[r] = bv;
        ids_out[r] = bi == AM_NONE ? 0 : (i64_t)bi;
    }
}

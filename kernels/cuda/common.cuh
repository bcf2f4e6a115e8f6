// Shared helpers for tandem's CUDA kernels. No CUDA headers: the same source builds under NVRTC
// (CuPy, at run time) and nvcc (the compile test), for sm_80 and newer.
//
// Storage types are raw 16-bit / 8-bit words; conversions are written out so that every
// architecture rounds the same way (round to nearest even, like torch's .to(bfloat16)).
#pragma once

typedef unsigned short bf16_t;     // bfloat16 bits
typedef unsigned char fp8_t;       // float8 e4m3fn bits
typedef unsigned char u8_t;
typedef long long i64_t;

__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);   // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                            // round to nearest even
    return (bf16_t)(u >> 16);
}

// Two bf16 packed in one 32-bit word (low half = element 0).
__device__ __forceinline__ float2 bf16x2_to_f32x2(unsigned w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// float8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities, 0x7f/0xff are NaN.
__device__ __forceinline__ float fp8e4m3_to_f32(fp8_t b) {
    unsigned s = (b & 0x80u) << 24, e = (b >> 3) & 0xfu, m = b & 0x7u;
    if (e == 0) {                                    // subnormal: m * 2^-9
        float v = (float)m * 0.001953125f;
        return s ? -v : v;
    }
    if (e == 0xfu && m == 0x7u) return __uint_as_float(0x7fc00000u);
    return __uint_as_float(s | ((e + 120u) << 23) | (m << 20));
}

// float4 e2m1 (NVFP4 element): values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives.
__device__ __forceinline__ float fp4e2m1_to_f32(unsigned code) {
    const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    float v = mag[code & 7u];
    return (code & 8u) ? -v : v;
}

__device__ __forceinline__ float silu_f32(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float sigmoid_f32(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float softplus_f32(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block whose size is a multiple of 32 (<= 1024). `scratch` holds >= 32 floats.
// Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : 0.f;
    return warp_sum(t);
}

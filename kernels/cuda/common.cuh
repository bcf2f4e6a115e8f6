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

// float4 e2m1 (NVFP4 element): values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives, from the
// bits rather than a table (a per-thread table lands in local memory). The code's sign and 3
// magnitude bits placed at fp16 bits 15 and 9..11 read as an fp16 of value v * 2^-14 (codes 0 and 1
// as zero and a subnormal, which the fp16 -> fp32 conversion keeps exact); times 2^14 gives v.
__device__ __forceinline__ float fp4e2m1_to_f32(unsigned code) {
    const unsigned short h = (unsigned short)(((code & 8u) << 12) | ((code & 7u) << 9));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f * 16384.f;
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

__device__ __forceinline__ float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

__device__ __forceinline__ float fast_exp2(float x) {     // ex2.approx: 2^-inf = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The attention output gate (decode and prefill kernels): torch's sigmoid in fp32 (accurate exp),
// rounded to bf16, times bf16(attn). The division is the 2-ulp one (the IEEE one's slow-path call
// makes ptxas spill); bf16 rounding hides it.
__device__ __forceinline__ float gated(float attn, float gate) {
    const float a = bf16_round(attn);
    const float s = bf16_round(__fdividef(1.f, 1.f + expf(-gate)));
    return a * s;                                 // exact in fp32 (8-bit x 8-bit mantissas); caller rounds
}

// cp.async (sm_80+): global -> shared copies that need no registers while in flight.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, bypassing L1; n = 16, or 0 to zero-fill without reading. The L2::256B
// hint lets L2 fetch the whole aligned 256-byte block (the row's next pieces).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, unsigned n) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}

// 4 bytes global -> shared; n = 4, or 0 to zero-fill.
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, unsigned n) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// ldmatrix .x4 (sm_75+): four 8x8 b16 tiles from shared memory, one row address per lane (lanes 8i..8i+7:
// tile i); _t transposes them. volatile: kept in program order with the cp.async waits and barriers
// around the tiles they read.
__device__ __forceinline__ void ldsm_x4(unsigned a, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned a, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// c += A B, mma.sync m16n8k16, bf16 in, fp32 accumulate (sm_80+). Fragments (lane = 4 g + t; PTX ISA
// layout for m16n8k16 .bf16):
//   A a0 = row g (k 2t, 2t+1)  a1 = row g+8 (k 2t, 2t+1)  a2 = row g (k 2t+8, 2t+9)  a3 = row g+8 (k 2t+8, 2t+9)
//   B b0 = col g (k 2t, 2t+1)  b1 = col g (k 2t+8, 2t+9)
//   C c0, c1 = row g, cols 2t, 2t+1   c2, c3 = row g+8, cols 2t, 2t+1
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma_bf16_16816(c, a[0], a[1], a[2], a[3], b0, b1);
}

// Programmatic dependent launch (sm_90+; no-ops below, where kernels/launch.py never asks for it).
// pdl_trigger: this block lets the next kernel on the stream, if launched with launch(..., pdl=True),
// start; once every block of this grid has triggered or exited, its blocks may be scheduled. It says
// nothing about this kernel's writes: the dependent sees them only after its pdl_wait.
// pdl_wait: wait until the grids this one depends on have completed and their writes are visible.
// A kernel launched with pdl=True must call it before reading what an earlier kernel wrote and
// before writing anything (an earlier kernel may still read the buffer); a kernel launched the
// ordinary way returns from it at once.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Ask L2 to fetch the line holding p (no registers, no completion to wait for).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Entry of a kernel launched with pdl=True that has nothing to do before its inputs are ready: let
// the next kernel start, then wait for the previous ones (so nothing is read or written before).
__device__ __forceinline__ void pdl_enter() {
    pdl_trigger();
    pdl_wait();
}

// Decode linear layers: y[T, O] = x[T, I] @ W[O, I]^T for T <= 16 columns, and weight dequantisation.
//
// Weight kinds (kernels/quant.py describes the layouts):
//   bf16      W bf16 [O, I]                                   I % 8 == 0
//   fp8row    W e4m3 [O, I], scale fp32 [O]                   I % 16 == 0
//   fp8blk    W e4m3 [O, I], scale fp32 [ceil(O/128), sb]     I % 16 == 0 (sb = ceil(I/128))
//   nvfp4     W e2m1 x2 [O, I/2], scale e4m3 [O, I/16], global fp32 [1]   I % 32 == 0
//   nvfp4h    the same with 8-byte chunks, for I % 32 == 16 (slow path, NT = 16 only)
//
// Shape of the work: a block is 8 warps. A warp owns a "unit" of R = 2 weight rows (rows 2u, 2u+1;
// for the SwiGLU epilogue rows u and F+u) and `ks` warps share one unit by splitting I (chunk c of
// a row goes to warp c / 32 % ks), so a block covers 8/ks units. Every lane streams 16-byte chunks
// of both rows (U chunks per row in flight), decodes them once and multiplies them into NT
// accumulators per row (one per column of x), so each weight byte is read once for all columns.
// x stays bf16 in global memory and is read through L1 (weights bypass L1). Lanes reduce with
// shuffles, warps of a unit through shared memory; lane t < T of the unit's first warp writes column t.
//
// Decoding without conversion instructions: an e4m3 byte's 7 magnitude bits are placed at fp32 bits
// 20..26 and the sign at 31, which is the value times 2^-120 (subnormal codes become fp32
// subnormals; CuPy's -ftz=true flushes those, which loses only e4m3 codes below 2^-6 of the scale).
// A chunk's partial sum is brought back with one multiply by 2^120 before the scale. e2m1 goes
// through fp16 instead (see fp4x8_scaled), exact under -ftz. (fp8 products below 2^-126 after the
// 2^-120 scaling are flushed too: |x * w| < 2^-6 * scale, within the bf16 error of the result.)
//
// Epilogue `mode`: 0 store bf16(y); 1 residual: bf16(residual + bf16(y)); 2 SwiGLU over a gate|up
// weight of 2F rows: out[T, F] = bf16(bf16(silu(bf16(gate))) * bf16(up)).
#include "common.cuh"

#define KIND_BF16 0
#define KIND_FP8ROW 1
#define KIND_FP8BLK 2
#define KIND_NVFP4 3
#define KIND_NVFP4H 4

#define GEMV_WARPS 8
#define GEMV_R 2

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ uint2 ld_stream8(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 ld_x16(const void* p) { return __ldg((const uint4*)p); }

__device__ __forceinline__ void unpack_bf16x8(const uint4 v, float* f) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// Four e4m3 bytes of w (byte k = element k) -> values * 2^-120.
__device__ __forceinline__ void fp8x4_scaled(unsigned w, float* f) {
    f[0] = __uint_as_float(((w << 24) & 0x80000000u) | ((w << 20) & 0x07f00000u));
    f[1] = __uint_as_float(((w << 16) & 0x80000000u) | ((w << 12) & 0x07f00000u));
    f[2] = __uint_as_float(((w << 8) & 0x80000000u) | ((w << 4) & 0x07f00000u));
    f[3] = __uint_as_float((w & 0x80000000u) | ((w >> 4) & 0x07f00000u));
}

// Eight e2m1 nibbles of w (nibble j = bits 4j..4j+3 = element j) -> values * 2^-14, exactly: each
// nibble becomes the fp16 with the same sign and its 3 magnitude bits at bits 9..11 (the e2m1 value
// times 2^-14; code 1 = 0.5 is an fp16 subnormal), widened by cvt.f32.f16 (an fp32 normal). CuPy
// compiles with -ftz=true, so a decode through fp32 subnormals would flush 0.5 to zero.
__device__ __forceinline__ void fp4x8_scaled(unsigned w, float* f) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const unsigned nib = (w >> (4 * j)) & 0xfu;
        const unsigned short h = (unsigned short)(((nib & 8u) << 12) | ((nib & 7u) << 9));
        float v;
        asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(h));
        f[j] = v;
    }
}

__device__ __forceinline__ float silu_exact(float x) { return x / (1.f + expf(-x)); }

template <int KIND> struct ChunkInfo;
template <> struct ChunkInfo<KIND_BF16> { enum { EPC = 8, CB = 16 }; };
template <> struct ChunkInfo<KIND_FP8ROW> { enum { EPC = 16, CB = 16 }; };
template <> struct ChunkInfo<KIND_FP8BLK> { enum { EPC = 16, CB = 16 }; };
template <> struct ChunkInfo<KIND_NVFP4> { enum { EPC = 32, CB = 16 }; };
template <> struct ChunkInfo<KIND_NVFP4H> { enum { EPC = 16, CB = 8 }; };

template <int NT, int R>
__device__ __forceinline__ void zero_acc(float (&acc)[R][NT]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
}

// Multiply one chunk (index cu, both rows) into the accumulators.
//   wv[r]   the chunk's 16 (or 8) bytes of row r (zeros for a row past O)
//   sv[r]   fp8blk: the block scale; nvfp4: the two (one) e4m3 scale bytes; else unused
template <int KIND, int NT, int R>
__device__ __forceinline__ void chunk_dot(const uint4 (&wv)[R], const unsigned (&sv)[R], const float (&sf)[R],
                                          const bf16_t* __restrict__ x, int I, int T, int cu,
                                          float (&acc)[R][NT]) {
    if (KIND == KIND_BF16) {
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) unpack_bf16x8(wv[r], wf[r]);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < T) {
                float xf[8];
                unpack_bf16x8(ld_x16(x + (i64_t)t * I + (i64_t)cu * 8), xf);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int k = 0; k < 8; ++k) acc[r][t] = fmaf(xf[k], wf[r][k], acc[r][t]);
            }
        }
    } else if (KIND == KIND_FP8ROW || KIND == KIND_FP8BLK) {
        const float two120 = __uint_as_float(0x7b800000u);          // 2^120
        float wf[R][16];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            fp8x4_scaled(wv[r].x, wf[r]);
            fp8x4_scaled(wv[r].y, wf[r] + 4);
            fp8x4_scaled(wv[r].z, wf[r] + 8);
            fp8x4_scaled(wv[r].w, wf[r] + 12);
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < T) {
                const bf16_t* xp = x + (i64_t)t * I + (i64_t)cu * 16;
                float xf[16];
                unpack_bf16x8(ld_x16(xp), xf);
                unpack_bf16x8(ld_x16(xp + 8), xf + 8);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float p = 0.f;
#pragma unroll
                    for (int k = 0; k < 16; ++k) p = fmaf(xf[k], wf[r][k], p);
                    acc[r][t] = fmaf(p * two120, sf[r], acc[r][t]);
                }
            }
        }
    } else {                                                          // NVFP4 / NVFP4H
        const float two14 = __uint_as_float(0x46800000u);            // 2^14 (undoes fp4x8_scaled's 2^-14)
        constexpr int G = (KIND == KIND_NVFP4) ? 2 : 1;               // 16-element groups per chunk
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float wf[R][16];
            float sg[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned w0 = g == 0 ? wv[r].x : wv[r].z;
                const unsigned w1 = g == 0 ? wv[r].y : wv[r].w;
                fp4x8_scaled(w0, wf[r]);
                fp4x8_scaled(w1, wf[r] + 8);
                sg[r] = fp8e4m3_to_f32((fp8_t)((sv[r] >> (8 * g)) & 0xffu));
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < T) {
                    const bf16_t* xp = x + (i64_t)t * I + ((i64_t)cu * G + g) * 16;
                    float xf[16];
                    unpack_bf16x8(ld_x16(xp), xf);
                    unpack_bf16x8(ld_x16(xp + 8), xf + 8);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        float p = 0.f;
#pragma unroll
                        for (int k = 0; k < 16; ++k) p = fmaf(xf[k], wf[r][k], p);
                        acc[r][t] = fmaf(p * two14, sg[r], acc[r][t]);
                    }
                }
            }
        }
    }
}

template <int KIND, int NT>
__device__ __forceinline__ void gemv_body(bf16_t* __restrict__ y, const bf16_t* __restrict__ x,
                                          const u8_t* __restrict__ w, const void* __restrict__ scale,
                                          const float* __restrict__ gscale, const bf16_t* residual,
                                          int O, int I, int T, int ks, int mode, int F, int sb) {
    constexpr int R = GEMV_R;
    constexpr int U = NT <= 2 ? 4 : (NT <= 8 ? 2 : 1);                // chunks per row in flight
    constexpr int EPC = ChunkInfo<KIND>::EPC, CB = ChunkInfo<KIND>::CB;
    __shared__ float red[GEMV_WARPS][R][NT];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kslot = warp % ks, uslot = warp / ks;
    const int unit = blockIdx.x * (GEMV_WARPS / ks) + uslot;

    int rows[R];
    bool ok[R];
    if (mode == 2) {
        rows[0] = unit; rows[1] = unit + F;
        ok[0] = ok[1] = unit < F;
    } else {
        rows[0] = 2 * unit; rows[1] = 2 * unit + 1;
        ok[0] = rows[0] < O; ok[1] = rows[1] < O;
    }

    const int C = I / EPC;                                           // chunks per row
    const i64_t row_bytes = (i64_t)(I / EPC) * CB;
    const u8_t* wr[R];
    float sf[R];                                                     // fp8 chunk scale (row: 1)
    const u8_t* srow[R];                                             // nvfp4 scale row
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = ok[r] ? rows[r] : 0;
        wr[r] = w + (i64_t)row * row_bytes;
        srow[r] = (const u8_t*)scale + (i64_t)row * (I / 16);
        sf[r] = 1.f;
    }

    float acc[R][NT];
    zero_acc<NT, R>(acc);

    const int step = 32 * ks;
    for (int c = kslot * 32 + lane; c < C; c += step * U) {
        uint4 wv[U][R];
        unsigned sv[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int cu = c + u * step;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                wv[u][r] = make_uint4(0u, 0u, 0u, 0u);
                sv[u][r] = 0u;
                if (ok[r] && cu < C) {
                    if (CB == 16) {
                        wv[u][r] = ld_stream16(wr[r] + (i64_t)cu * 16);
                    } else {
                        const uint2 h = ld_stream8(wr[r] + (i64_t)cu * 8);
                        wv[u][r].x = h.x; wv[u][r].y = h.y;
                    }
                    if (KIND == KIND_NVFP4) sv[u][r] = __ldg((const unsigned short*)srow[r] + cu);
                    if (KIND == KIND_NVFP4H) sv[u][r] = __ldg(srow[r] + cu);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int cu = c + u * step;
            if (cu < C) {
                if (KIND == KIND_FP8BLK) {
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        sf[r] = ok[r] ? __ldg((const float*)scale + (i64_t)(rows[r] >> 7) * sb + (cu >> 3)) : 0.f;
                }
                chunk_dot<KIND, NT, R>(wv[u], sv[u], sf, x, I, T, cu, acc);
            }
        }
    }

#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const float v = warp_sum(acc[r][t]);
            if (lane == 0) red[warp][r][t] = v;
        }
    __syncthreads();

    if (kslot == 0 && lane < NT && lane < T) {
        const int t = lane;
        float v[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float s = 0.f;
            for (int k = 0; k < ks; ++k) s += red[uslot * ks + k][r][t];
            v[r] = s;
        }
        if (KIND == KIND_FP8ROW) {
#pragma unroll
            for (int r = 0; r < R; ++r) v[r] *= ok[r] ? __ldg((const float*)scale + rows[r]) : 0.f;
        }
        if (KIND == KIND_NVFP4 || KIND == KIND_NVFP4H) {
            const float g = __ldg(gscale);
#pragma unroll
            for (int r = 0; r < R; ++r) v[r] *= g;
        }
        if (mode == 2) {
            if (ok[0]) {
                const float gate = bf16_to_f32(f32_to_bf16(v[0]));
                const float up = bf16_to_f32(f32_to_bf16(v[1]));
                const float act = bf16_to_f32(f32_to_bf16(silu_exact(gate)));
                y[(i64_t)t * F + unit] = f32_to_bf16(act * up);
            }
        } else {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (ok[r]) {
                    const i64_t o = (i64_t)t * O + rows[r];
                    bf16_t b = f32_to_bf16(v[r]);
                    if (mode == 1) b = f32_to_bf16(bf16_to_f32(residual[o]) + bf16_to_f32(b));
                    y[o] = b;
                }
            }
        }
    }
}

#define GEMV_ARGS bf16_t* __restrict__ y, const bf16_t* __restrict__ x, const u8_t* __restrict__ w, \
    const void* __restrict__ scale, const float* __restrict__ gscale, const bf16_t* residual, \
    int O, int I, int T, int ks, int mode, int F, int sb
#define GEMV_PASS y, x, w, scale, gscale, residual, O, I, T, ks, mode, F, sb

#define GEMV_KERNEL(name, KIND, NT) \
    extern "C" __global__ void __launch_bounds__(256, 2) name(GEMV_ARGS) { gemv_body<KIND, NT>(GEMV_PASS); }

GEMV_KERNEL(gemv_bf16_t1, KIND_BF16, 1)
GEMV_KERNEL(gemv_bf16_t2, KIND_BF16, 2)
GEMV_KERNEL(gemv_bf16_t4, KIND_BF16, 4)
GEMV_KERNEL(gemv_bf16_t8, KIND_BF16, 8)
GEMV_KERNEL(gemv_bf16_t16, KIND_BF16, 16)
GEMV_KERNEL(gemv_fp8row_t1, KIND_FP8ROW, 1)
GEMV_KERNEL(gemv_fp8row_t2, KIND_FP8ROW, 2)
GEMV_KERNEL(gemv_fp8row_t4, KIND_FP8ROW, 4)
GEMV_KERNEL(gemv_fp8row_t8, KIND_FP8ROW, 8)
GEMV_KERNEL(gemv_fp8row_t16, KIND_FP8ROW, 16)
GEMV_KERNEL(gemv_fp8blk_t1, KIND_FP8BLK, 1)
GEMV_KERNEL(gemv_fp8blk_t2, KIND_FP8BLK, 2)
GEMV_KERNEL(gemv_fp8blk_t4, KIND_FP8BLK, 4)
GEMV_KERNEL(gemv_fp8blk_t8, KIND_FP8BLK, 8)
GEMV_KERNEL(gemv_fp8blk_t16, KIND_FP8BLK, 16)
GEMV_KERNEL(gemv_nvfp4_t1, KIND_NVFP4, 1)
GEMV_KERNEL(gemv_nvfp4_t2, KIND_NVFP4, 2)
GEMV_KERNEL(gemv_nvfp4_t4, KIND_NVFP4, 4)
GEMV_KERNEL(gemv_nvfp4_t8, KIND_NVFP4, 8)
GEMV_KERNEL(gemv_nvfp4_t16, KIND_NVFP4, 16)
GEMV_KERNEL(gemv_nvfp4h_t16, KIND_NVFP4H, 16)

// ------------------------------------------------------------------------------------------------
// Dequantisation to bf16 [O, I] (prefill path and tests). One thread per 16 elements of a row,
// grid-stride. Bit-exact with QuantWeight.dequantize: fp32 product(s), one RNE rounding to bf16.

__device__ __forceinline__ void store_bf16x16(bf16_t* out, const float* v) {
    unsigned p[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) p[k] = (unsigned)f32_to_bf16(v[2 * k]) | ((unsigned)f32_to_bf16(v[2 * k + 1]) << 16);
    uint4* o = (uint4*)out;
    o[0] = make_uint4(p[0], p[1], p[2], p[3]);
    o[1] = make_uint4(p[4], p[5], p[6], p[7]);
}

// kind: 1 fp8row, 2 fp8blk, 3 nvfp4 (any I % 16 == 0)
extern "C" __global__ void __launch_bounds__(256) dequant_bf16(bf16_t* __restrict__ out, const u8_t* __restrict__ w,
                                                                const void* __restrict__ scale,
                                                                const float* __restrict__ gscale,
                                                                int O, int I, int kind, int sb) {
    const int gpr = I / 16;                                           // groups per row
    const i64_t n = (i64_t)O * gpr;
    for (i64_t gi = (i64_t)blockIdx.x * blockDim.x + threadIdx.x; gi < n; gi += (i64_t)gridDim.x * blockDim.x) {
        const int row = (int)(gi / gpr), col = (int)(gi % gpr) * 16;
        float v[16];
        if (kind == 3) {
            const uint2 c = __ldg((const uint2*)(w + (i64_t)row * (I / 2) + col / 2));
            const float s = fp8e4m3_to_f32(__ldg((const u8_t*)scale + gi));
            const float g = __ldg(gscale);
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                const unsigned word = k < 8 ? c.x : c.y;
                const unsigned code = (word >> (4 * (k & 7))) & 0xfu;
                v[k] = (fp4e2m1_to_f32(code) * s) * g;
            }
        } else {
            const uint4 c = __ldg((const uint4*)(w + (i64_t)row * I + col));
            const float s = kind == 1 ? __ldg((const float*)scale + row)
                                      : __ldg((const float*)scale + (i64_t)(row >> 7) * sb + (col >> 7));
            const unsigned words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
            for (int k = 0; k < 16; ++k) v[k] = fp8e4m3_to_f32((fp8_t)((words[k >> 2] >> (8 * (k & 3))) & 0xffu)) * s;
        }
        store_bf16x16(out + (i64_t)row * I + col, v);
    }
}

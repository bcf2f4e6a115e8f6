// Decode linear layers: y[T, O] = x[T, I] @ W[O, I]^T for T <= 16 (bf16) or 32 (quantised) columns, and
// weight dequantisation.
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
// fp8row / fp8blk / nvfp4 (I % 32 == 0) use the tensor-core kernels gemv_*_tc* further down (16-row
// tiles, mma.sync bf16, up to 32 columns; see the comment there); the kernels below serve bf16, nvfp4h and
// quantised layers too small to fill the GPU at T = 1. gemv_*_pipe (after the tensor-core kernels) are
// the same tensor-core GEMV for T <= 8 with the weights streamed through a cp.async ring in shared
// memory (TANDEM_GEMV_VARIANT=pipelined; not the default route yet).
//
// Epilogue `mode`: 0 store bf16(y); 1 residual: bf16(residual + bf16(y)); 2 SwiGLU over a gate|up
// weight of 2F rows: out[T, F] = bf16(bf16(silu(bf16(gate))) * bf16(up)). Every kernel also takes y1..y3
// and o1..o3 (struct Split): the rows of a fused weight (q|k|v, GDN qkv|z, a|b) stored to up to four
// separate outputs in one launch; o1 = o2 = o3 = O leaves y [T, O] alone.
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

// Outputs of a fused weight (modes 0 and 1): rows [0, o1) of the product go to y [T, o1], [o1, o2)
// to y1 [T, o2 - o1], [o2, o3) to y2, [o3, O) to y3, each row-major. o1 = o2 = o3 = O: y [T, O] alone.
struct Split {
    bf16_t* y1;
    bf16_t* y2;
    bf16_t* y3;
    int o1, o2, o3;
};

__device__ __forceinline__ bf16_t* split_out(bf16_t* y, const Split& sp, int O, int col, int row) {
    if (row < sp.o1) return y + (i64_t)col * sp.o1 + row;
    if (row < sp.o2) return sp.y1 + (i64_t)col * (sp.o2 - sp.o1) + (row - sp.o1);
    if (row < sp.o3) return sp.y2 + (i64_t)col * (sp.o3 - sp.o2) + (row - sp.o2);
    return sp.y3 + (i64_t)col * (O - sp.o3) + (row - sp.o3);
}

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
                                          int O, int I, int T, int ks, int mode, int F, int sb, const Split& split) {
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
    // Launched with pdl=True: the first round's weight chunks go to L2 while the previous kernel
    // finishes; nothing the step writes is touched before pdl_wait.
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int cu = kslot * 32 + lane + u * step;
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (ok[r] && cu < C) prefetch_l2(wr[r] + (i64_t)cu * CB);
    }
    pdl_wait();
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
                    *split_out(y, split, O, t, rows[r]) = b;
                }
            }
        }
    }
}

#define GEMV_ARGS bf16_t* __restrict__ y, const bf16_t* __restrict__ x, const u8_t* __restrict__ w, \
    const void* __restrict__ scale, const float* __restrict__ gscale, const bf16_t* residual, \
    int O, int I, int T, int ks, int mode, int F, int sb, bf16_t* y1, bf16_t* y2, bf16_t* y3, int o1, int o2, int o3
#define GEMV_PASS y, x, w, scale, gscale, residual, O, I, T, ks, mode, F, sb, Split{y1, y2, y3, o1, o2, o3}

#define GEMV_KERNEL(name, KIND, NT) \
    extern "C" __global__ void __launch_bounds__(256, 2) name(GEMV_ARGS) { pdl_trigger(); gemv_body<KIND, NT>(GEMV_PASS); }

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
// Tensor-core decode GEMV for quantised weights (sm_80+): gemv_{fp8row,fp8blk,nvfp4}_tc for T <= 8
// columns, _tc16 and _tc32 for T <= 16 and T <= 32 (two and four column tiles of 8 per A tile).
//
// A warp owns a tile of 16 weight rows and multiplies it with mma.sync.m16n8k16 (bf16 in, fp32
// accumulate): the weights are the A operand (16 rows x 16 k, decoded in registers), x the B operand
// (16 k x 8 columns; columns >= T read column 0 and are never stored), so T = 1..8 cost the same and
// the multiply-adds leave the CUDA cores. Lane (g = lane / 4, t = lane % 4) supplies A rows g and g+8
// and B column g at the k slots {2t, 2t+1, 2t+8, 2t+9} of every mma (PTX ISA fragment layout for m16n8k16 .bf16):
//   A reg0 = row g (k 2t, 2t+1)  reg1 = row g+8 (k 2t, 2t+1)  reg2 = row g (k 2t+8, 2t+9)  reg3 = row g+8 (k 2t+8, 2t+9)
//   B reg0 = col g (k 2t, 2t+1)  reg1 = col g (k 2t+8, 2t+9)
//   C c0, c1 = row g, cols 2t, 2t+1   c2, c3 = row g+8, cols 2t, 2t+1
// A lane's A slots and B slots are the same k, so which physical element of I a slot holds is the
// lane's choice, as long as A and B agree and rows g and g+8 use the same positions: lane (g, t)
// streams the 16-byte chunk 4q + t of its two rows (4q .. 4q+3: one "step", 64 k for fp8 and 128 k
// for nvfp4, 4 or 8 mmas) and loads the matching x of column g. Each bf16x2 A word pairs the
// elements that decode with the same shifts, and x is permuted (prmt) to the same pairs.
//
// Rows: mode 0/1 tile u = rows 16u .. 16u+15 (row g = 16u + g, row g+8 = 16u + 8 + g); mode 2
// (SwiGLU) tile u = gate rows f = 8u + g as "row g" and up rows F + f as "row g+8", so lane (g, t)
// ends with gate and up of unit f for columns 2t, 2t+1. ks warps of a block split I (step q goes
// to warp q % ks); a block covers 8 / ks tiles; warps of a tile add their C through shared memory.
//
// Exactness under -ftz=true (fp32 subnormals flush; bf16 arithmetic keeps subnormals):
//   fp8: e4m3 bits placed as bf16 (sign at 15, 7 magnitude bits at 10..4) = value * 2^-120, exact
//        for normal codes (e4m3 subnormals become bf16 subnormals; the mma may flush those, as the
//        CUDA-core path does). x is scaled by 2^64 (exact in bf16 for |x| < 2^64), so products are
//        value * x * 2^-56, far from the fp32 subnormal range; the epilogue multiplies by 2^56.
//   nvfp4: e2m1 placed as bf16 (sign at 15, 3 magnitude bits at 8..6) = value * 2^-126 (code 1 =
//        0.5 is a bf16 subnormal), multiplied in bf16x2 (fma.rn.bf16x2, subnormal inputs honoured)
//        by the group scale * 2^118: the product value * scale * 2^-8 has at most 6 significant
//        bits (e2m1: 2, e4m3: 4) and lies in [2^-18, 2^4], so it is exact and normal. The epilogue
//        multiplies by 2^8 * global scale.

__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// e4m3 bytes b0..b3 of w -> bf16x2 (b0, b2) and (b1, b3), each value * 2^-120.
__device__ __forceinline__ void fp8x4_bf16(unsigned w, unsigned& e, unsigned& o) {
    e = ((w << 4) & 0x07f007f0u) | ((w << 8) & 0x80008000u);
    o = ((w >> 4) & 0x07f007f0u) | (w & 0x80008000u);
}

// e2m1 nibbles n0..n7 of w -> bf16x2 (n_j, n_j+4) for j = 0..3, each value * 2^-126.
template <int J>
__device__ __forceinline__ unsigned fp4pair_bf16(unsigned w) {
    unsigned mag;
    if constexpr (J < 2) mag = w << (6 - 4 * J);
    else mag = w >> (4 * J - 6);
    return (mag & 0x01c001c0u) | ((w << (12 - 4 * J)) & 0x80008000u);
}

// e4m3 scale byte -> bf16x2 (s * 2^118, s * 2^118), exact (s has 4 significant bits; via fp16, so an
// e4m3 subnormal scale stays exact under -ftz).
__device__ __forceinline__ unsigned fp8_scale_bf16x2_2p118(unsigned b) {
    const unsigned short h = (unsigned short)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));   // s * 2^-8
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    f *= __uint_as_float(0x7e800000u);                                                  // 2^126
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(f));
    return d;
}

// 32-bit word m (0..3) of a 16-byte chunk.
__device__ __forceinline__ unsigned word_of(const uint4& v, int m) {
    return m == 0 ? v.x : m == 1 ? v.y : m == 2 ? v.z : v.w;
}

// nvfp4 word (8 e2m1 codes) of a lane's two rows, w0 (row g) and w1 (row g + 8), times their group
// scales sa, sb (bf16x2, * 2^118): the A fragments of the word's two mma, a (codes 0, 1 with 4, 5)
// and h (codes 2, 3 with 6, 7), pairing with x as (x0 x4) (x1 x5) and (x2 x6) (x3 x7).
__device__ __forceinline__ void nvfp4_word_frags(unsigned w0, unsigned w1, unsigned sa, unsigned sb,
                                                 unsigned (&a)[4], unsigned (&h)[4]) {
    const unsigned v0 = w0 >> 8, v1 = w1 >> 8;                       // nibbles 2, 3 (6, 7) at 0, 1 (4, 5)
    a[0] = bf16x2_mul(fp4pair_bf16<0>(w0), sa); a[1] = bf16x2_mul(fp4pair_bf16<0>(w1), sb);
    a[2] = bf16x2_mul(fp4pair_bf16<1>(w0), sa); a[3] = bf16x2_mul(fp4pair_bf16<1>(w1), sb);
    h[0] = bf16x2_mul(fp4pair_bf16<0>(v0), sa); h[1] = bf16x2_mul(fp4pair_bf16<0>(v1), sb);
    h[2] = bf16x2_mul(fp4pair_bf16<1>(v0), sa); h[3] = bf16x2_mul(fp4pair_bf16<1>(v1), sb);
}

// One step of a lane: its chunk of both rows (wv, nvfp4 scale bytes sv) times the matching x of the
// NB column tiles (column 8 nb + g of tile nb, at xq + xoff[nb]; EPC / 8 uint4 each, zeros when not
// `live`) into the accumulators. The A fragments are decoded once and used by every tile. With one
// tile the accumulators come in two sets (S = 2, alternating) to halve the mma dependency chain;
// with several tiles the tiles already interleave. fp8blk: the step's partial sums are scaled by
// the rows' block scales s0, s1.
// XS: xq points into shared memory (gemv_*_xs: x staged per block), read with ordinary loads.
template <int KIND, int NB, int S, bool XS = false>
__device__ __forceinline__ void tc_step(const uint4 (&wv)[2], const unsigned (&sv)[2], const bf16_t* xq,
                                        const i64_t (&xoff)[NB], bool live, float s0, float s1,
                                        float (&acc)[NB][S][4]) {
    const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
    if (KIND == KIND_NVFP4) {
        unsigned s2[2][2];                                            // [row][group]: (s, s) * 2^118
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            s2[r][0] = fp8_scale_bf16x2_2p118(sv[r] & 0xffu);
            s2[r][1] = fp8_scale_bf16x2_2p118((sv[r] >> 8) & 0xffu);
        }
#pragma unroll
        for (int m = 0; m < 4; ++m) {                                 // 32-bit word m: elements 8m .. 8m+7
            unsigned a[4], h[4];
            nvfp4_word_frags(word_of(wv[0], m), word_of(wv[1], m), s2[0][m >> 1], s2[1][m >> 1], a, h);
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                const uint4 xw = !live ? zero4 : XS ? *(const uint4*)(xq + xoff[nb] + 8 * m)
                                                    : ld_x16(xq + xoff[nb] + 8 * m);   // (x0 x1) (x2 x3) (x4 x5) (x6 x7)
                mma_bf16_16816(acc[nb][0], a,
                               prmt(xw.x, xw.z, 0x5410u), prmt(xw.x, xw.z, 0x7632u));  // (x0 x4) (x1 x5)
                mma_bf16_16816(acc[nb][1 % S], h,
                               prmt(xw.y, xw.w, 0x5410u), prmt(xw.y, xw.w, 0x7632u));  // (x2 x6) (x3 x7)
            }
        }
    } else {
        const unsigned two64 = 0x5f805f80u;                           // bf16x2 (2^64, 2^64)
        float cs[NB][S][4];
        if (KIND == KIND_FP8BLK) {
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int k = 0; k < S; ++k)
#pragma unroll
                    for (int i = 0; i < 4; ++i) cs[nb][k][i] = 0.f;
        }
        float (&cc)[NB][S][4] = KIND == KIND_FP8BLK ? cs : acc;
#pragma unroll
        for (int h = 0; h < 2; ++h) {                                 // x uint4 h: elements 8h .. 8h+7
            unsigned e0[2], o0[2], e1[2], o1[2];
#pragma unroll
            for (int mm = 0; mm < 2; ++mm) {                          // 32-bit word m = 2h + mm: elements 4m .. 4m+3
                const int m = 2 * h + mm;
                const unsigned w0 = word_of(wv[0], m), w1 = word_of(wv[1], m);
                fp8x4_bf16(w0, e0[mm], o0[mm]);
                fp8x4_bf16(w1, e1[mm], o1[mm]);
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                const uint4 xw = !live ? zero4 : XS ? *(const uint4*)(xq + xoff[nb] + 8 * h)
                                                    : ld_x16(xq + xoff[nb] + 8 * h);
#pragma unroll
                for (int mm = 0; mm < 2; ++mm) {
                    const unsigned xl = mm ? xw.z : xw.x, xh = mm ? xw.w : xw.y;   // (x0 x1) (x2 x3)
                    mma_bf16_16816(cc[nb][mm % S], e0[mm], e1[mm], o0[mm], o1[mm],
                                   bf16x2_mul(prmt(xl, xh, 0x5410u), two64),
                                   bf16x2_mul(prmt(xl, xh, 0x7632u), two64));            // (x0 x2) (x1 x3)
                }
            }
        }
        if (KIND == KIND_FP8BLK) {
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                float c[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    c[i] = cs[nb][0][i];
#pragma unroll
                    for (int k = 1; k < S; ++k) c[i] += cs[nb][k][i];
                }
                acc[nb][0][0] = fmaf(c[0], s0, acc[nb][0][0]);
                acc[nb][0][1] = fmaf(c[1], s0, acc[nb][0][1]);
                acc[nb][0][2] = fmaf(c[2], s1, acc[nb][0][2]);
                acc[nb][0][3] = fmaf(c[3], s1, acc[nb][0][3]);
            }
        }
    }
}

// The two weight rows lane (g, t) of row tile `tile` supplies (A rows g and g+8), shared by gemv_*_tc
// and gemv_*_pipe: rows 16 tile + g, + 8 (mode 0/1), or gate row f = 8 tile + g and up row F + f
// (mode 2); ok[r]: the row exists (its outputs are stored).
__device__ __forceinline__ void tc_tile_rows(int mode, int tile, int g, int O, int F, int (&rows)[2],
                                             bool (&ok)[2]) {
    if (mode == 2) {
        const int f = tile * 8 + g;
        rows[0] = f; rows[1] = F + f;
        ok[0] = ok[1] = f < F;
    } else {
        rows[0] = tile * 16 + g; rows[1] = rows[0] + 8;
        ok[0] = rows[0] < O; ok[1] = rows[1] < O;
    }
}

// The epilogue shared by gemv_*_tc and gemv_*_pipe. Row scales: mul[r] brings row r's partial sums back
// (nvfp4: 2^8 * global scale; fp8: 2^56, times the row's scale for fp8row; fp8blk scaled per step).
template <int KIND>
__device__ __forceinline__ void tc_row_scales(const void* __restrict__ scale, const float* __restrict__ gscale,
                                              const bool (&ok)[2], const int (&rows)[2], float (&mul)[2]) {
    if (KIND == KIND_BF16) {
        mul[0] = mul[1] = 1.f;
    } else if (KIND == KIND_NVFP4) {
        mul[0] = mul[1] = __ldg(gscale) * 256.f;                      // 2^8
    } else {
        const float two56 = __uint_as_float(0x5b800000u);             // 2^56
        mul[0] = two56; mul[1] = two56;
        if (KIND == KIND_FP8ROW) {
            mul[0] *= ok[0] ? __ldg((const float*)scale + rows[0]) : 0.f;
            mul[1] *= ok[1] ? __ldg((const float*)scale + rows[1]) : 0.f;
        }
    }
}

// Store a lane's outputs: v[0], v[1] = rows[0] at columns c0, c0 + 1; v[2], v[3] = rows[1], the same
// columns (columns >= T are not stored), through the `mode` epilogue.
__device__ __forceinline__ void tc_store(bf16_t* __restrict__ y, const bf16_t* residual, const float (&v)[4],
                                         const float (&mul)[2], const bool (&ok)[2], const int (&rows)[2], int c0,
                                         int T, int O, int F, int mode, const Split& split) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int col = c0 + j;
        if (col >= T) continue;
        const float r0 = v[j] * mul[0], r1 = v[2 + j] * mul[1];
        if (mode == 2) {
            if (ok[0]) {
                const float gate = bf16_to_f32(f32_to_bf16(r0));
                const float up = bf16_to_f32(f32_to_bf16(r1));
                const float act = bf16_to_f32(f32_to_bf16(silu_exact(gate)));
                y[(i64_t)col * F + rows[0]] = f32_to_bf16(act * up);
            }
        } else {
            const float rv[2] = {r0, r1};
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                if (ok[r]) {
                    const i64_t o = (i64_t)col * O + rows[r];
                    bf16_t b = f32_to_bf16(rv[r]);
                    if (mode == 1) b = f32_to_bf16(bf16_to_f32(residual[o]) + bf16_to_f32(b));
                    *split_out(y, split, O, col, rows[r]) = b;
                }
            }
        }
    }
}

// The end of gemv_*_tc and gemv_*_xs, in the kslot-0 warp of each row tile: the ks warps' partial sums
// of its NB column tiles (red, after the barrier), scaled per row and stored through the epilogue. v[0],
// v[1]: rows[0], columns 8 nb + 2t, +1; v[2], v[3]: rows[1], the same columns.
template <int KIND, int NB>
__device__ __forceinline__ void tc_reduce_store(const float (*red)[NB][4][32], int uslot, int ks, int lane, int t,
                                                bf16_t* __restrict__ y, const bf16_t* residual,
                                                const void* __restrict__ scale, const float* __restrict__ gscale,
                                                const bool (&ok)[2], const int (&rows)[2], int T, int O, int F,
                                                int mode, const Split& split) {
    float mul[2];
    tc_row_scales<KIND>(scale, gscale, ok, rows, mul);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float s = 0.f;
            for (int k = 0; k < ks; ++k) s += red[uslot * ks + k][nb][i][lane];
            v[i] = s;
        }
        tc_store(y, residual, v, mul, ok, rows, 8 * nb + 2 * t, T, O, F, mode, split);
    }
}

// NB column tiles of 8: T <= 8 NB. Steps in flight per lane (U) shrink as NB grows, to keep the
// accumulators in registers.
template <int KIND, int NB>
__device__ __forceinline__ void gemv_tc_body(bf16_t* __restrict__ y, const bf16_t* __restrict__ x,
                                             const u8_t* __restrict__ w, const void* __restrict__ scale,
                                             const float* __restrict__ gscale, const bf16_t* residual,
                                             int O, int I, int T, int ks, int mode, int F, int sb, const Split& split) {
    constexpr int S = NB == 1 ? 2 : 1;                               // accumulator sets per tile
    constexpr int U = NB == 1 ? (KIND == KIND_NVFP4 ? 2 : 4) : 2;    // steps in flight per lane
    constexpr int EPC = KIND == KIND_NVFP4 ? 32 : 16;               // elements per 16-byte chunk
    __shared__ float red[GEMV_WARPS][NB][4][32];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kslot = warp % ks, uslot = warp / ks;
    const int tile = blockIdx.x * (GEMV_WARPS / ks) + uslot;

    int rows[2];
    bool ok[2];
    tc_tile_rows(mode, tile, g, O, F, rows, ok);

    // A row past O (or past F) reads row 0: its A values only reach C rows that are never stored.
    // A column 8 nb + g >= T reads column 0: B column g of tile nb only reaches C column 8 nb + g,
    // never stored either. Chunks past the row end (only in the last, partial step) get x = 0, so
    // their A adds nothing.
    const int C = I / EPC;                                            // 16-byte chunks per row
    const int full = C / 4, steps = (C + 3) / 4;                      // steps with 4 valid chunks; all
    const int c0 = kslot * 4 + t;                                     // this lane's chunk in step kslot
    const u8_t* wp[2];
    const u8_t* sp[2];
    const float* bs[2];                                               // fp8blk: the rows' block-scale rows
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = ok[r] ? rows[r] : 0;
        wp[r] = w + (i64_t)row * ((i64_t)C * 16) + (i64_t)c0 * 16;
        sp[r] = (const u8_t*)scale + (i64_t)row * (I / 16) + (i64_t)c0 * 2;
        bs[r] = (const float*)scale + (i64_t)(row >> 7) * sb;
    }
    i64_t xoff[NB];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const int col = 8 * nb + g;
        xoff[nb] = (i64_t)(col < T ? col : 0) * I;
    }
    const bf16_t* xp = x + (i64_t)c0 * EPC;
    const int wstep = ks * 4 * 16, sstep = ks * 4 * 2, xstep = ks * 4 * EPC;   // per step of this warp

    float acc[NB][S][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int k = 0; k < S; ++k)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[nb][k][i] = 0.f;
    // pdl=True launches: the first U steps' weight chunks go to L2 under the previous kernel's tail.
#pragma unroll
    for (int u = 0; u < U; ++u)
        if ((kslot + u * ks) * 4 + t < C) {
#pragma unroll
            for (int r = 0; r < 2; ++r) prefetch_l2(wp[r] + (i64_t)u * wstep);
        }
    pdl_wait();
    int q = kslot;
    for (; q + (U - 1) * ks < full; q += U * ks) {                    // U full steps, no guards
        uint4 wv[U][2];
        unsigned sv[U][2];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                wv[u][r] = ld_stream16(wp[r] + (i64_t)u * wstep);
                sv[u][r] = KIND == KIND_NVFP4 ? (unsigned)__ldg((const unsigned short*)(sp[r] + (i64_t)u * sstep)) : 0u;
            }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float s0 = 1.f, s1 = 1.f;
            if (KIND == KIND_FP8BLK) { s0 = __ldg(bs[0] + ((q + u * ks) >> 1)); s1 = __ldg(bs[1] + ((q + u * ks) >> 1)); }
            tc_step<KIND, NB, S>(wv[u], sv[u], xp + (i64_t)u * xstep, xoff, true, s0, s1, acc);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) { wp[r] += (i64_t)U * wstep; sp[r] += (i64_t)U * sstep; }
        xp += (i64_t)U * xstep;
    }
    for (; q < steps; q += ks) {                                      // the rest, one step at a time
        const bool live = q < full || q * 4 + t < C;                  // this lane's chunk exists
        uint4 wv[2];
        unsigned sv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            wv[r] = ld_stream16(live ? wp[r] : wp[r] - 16 * t);       // chunk 4q (exists) when not live
            sv[r] = KIND == KIND_NVFP4 ? (unsigned)__ldg((const unsigned short*)(live ? sp[r] : sp[r] - 2 * t)) : 0u;
        }
        float s0 = 1.f, s1 = 1.f;
        if (KIND == KIND_FP8BLK) { s0 = __ldg(bs[0] + (q >> 1)); s1 = __ldg(bs[1] + (q >> 1)); }
        tc_step<KIND, NB, S>(wv, sv, xp, xoff, live, s0, s1, acc);
#pragma unroll
        for (int r = 0; r < 2; ++r) { wp[r] += wstep; sp[r] += sstep; }
        xp += xstep;
    }

#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float v = acc[nb][0][i];
#pragma unroll
            for (int k = 1; k < S; ++k) v += acc[nb][k][i];
            red[warp][nb][i][lane] = v;
        }
    __syncthreads();
    if (kslot != 0) return;
    tc_reduce_store<KIND, NB>(red, uslot, ks, lane, t, y, residual, scale, gscale, ok, rows, T, O, F, mode, split);
}

// Two blocks per SM (<= 128 registers) up to two column tiles; four tiles need more registers than
// that without spilling, so they run one block per SM.
#define GEMV_TC_KERNEL(name, KIND, NB)                                        \
    extern "C" __global__ void __launch_bounds__(256, NB <= 2 ? 2 : 1) name(GEMV_ARGS) { \
        pdl_trigger();                                                        \
        gemv_tc_body<KIND, NB>(GEMV_PASS);                                    \
    }

GEMV_TC_KERNEL(gemv_fp8row_tc, KIND_FP8ROW, 1)
GEMV_TC_KERNEL(gemv_fp8blk_tc, KIND_FP8BLK, 1)
GEMV_TC_KERNEL(gemv_nvfp4_tc, KIND_NVFP4, 1)
GEMV_TC_KERNEL(gemv_fp8row_tc16, KIND_FP8ROW, 2)
GEMV_TC_KERNEL(gemv_fp8blk_tc16, KIND_FP8BLK, 2)
GEMV_TC_KERNEL(gemv_nvfp4_tc16, KIND_NVFP4, 2)
GEMV_TC_KERNEL(gemv_fp8row_tc32, KIND_FP8ROW, 4)
GEMV_TC_KERNEL(gemv_fp8blk_tc32, KIND_FP8BLK, 4)
GEMV_TC_KERNEL(gemv_nvfp4_tc32, KIND_NVFP4, 4)

// ------------------------------------------------------------------------------------------------
// Tensor-core GEMV with x staged in shared memory, 9..32 columns per launch (2 or 4 column tiles):
// gemv_{fp8row,fp8blk,nvfp4}_xs16 / _xs32 (kernels/cuda_linear.py: STAGED_ENV).
//
// gemv_*_tc16 / tc32 read each lane's x straight from global memory (L1 / L2) for every step of every
// warp: at 32 columns a warp moves 8 KiB of x for each KiB of nvfp4 weights, and the four-tile kernel
// runs one block per SM with little in flight (docs/perf.md: the 27B nvfp4 step at C = 32 is 3.4x the
// C = 1 step). Here the block walks I in lock step: iteration j covers the steps j*ks .. j*ks + ks - 1
// (warp kslot takes step j*ks + kslot, the same steps gemv_*_tc gives it), and before it the block
// copies that range of x, for the launch's T columns, into shared memory (cp.async, double buffered:
// the copy of iteration j+1 flies during iteration j; one barrier per iteration). Elements past I are
// zero-filled, which is what gemv_*_tc's `live = false` gives a partial last step, so the products,
// their order and the reduction are gemv_*_tc's: the outputs are equal bit for bit for the same ks.
// The weights come through registers, XS_U steps ahead per lane. x per iteration: T x ks * 4 * EPC
// elements, at most XS_KT (ks <= 2 for nvfp4, <= 4 for fp8; the route caps ks).
#define XS_KT 256                                                     // x elements per column per iteration
#define XS_ROW (XS_KT + 8)                                            // + 16 bytes: rows start on other banks
#define XS_U 4                                                        // weight steps in flight per lane

template <int KIND, int NB>
__device__ __forceinline__ void gemv_xs_body(bf16_t* __restrict__ y, const bf16_t* __restrict__ x,
                                             const u8_t* __restrict__ w, const void* __restrict__ scale,
                                             const float* __restrict__ gscale, const bf16_t* residual,
                                             int O, int I, int T, int ks, int mode, int F, int sb, const Split& split) {
    constexpr int EPC = KIND == KIND_NVFP4 ? 32 : 16;               // elements per 16-byte chunk
    constexpr int U = XS_U;
    constexpr int XS_BYTES = 2 * 8 * NB * XS_ROW * 2;                // two buffers of 8 NB rows
    constexpr int RED_BYTES = GEMV_WARPS * NB * 4 * 32 * 4;          // the reduction, after the loop
    __shared__ __align__(16) unsigned char smem[XS_BYTES > RED_BYTES ? XS_BYTES : RED_BYTES];
    bf16_t (*xs)[8 * NB][XS_ROW] = reinterpret_cast<bf16_t (*)[8 * NB][XS_ROW]>(smem);
    float (*red)[NB][4][32] = reinterpret_cast<float (*)[NB][4][32]>(smem);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kslot = warp % ks, uslot = warp / ks;
    const int tile = blockIdx.x * (GEMV_WARPS / ks) + uslot;

    int rows[2];
    bool ok[2];
    tc_tile_rows(mode, tile, g, O, F, rows, ok);
    const int C = I / EPC;                                            // 16-byte chunks per row
    const int steps = (C + 3) / 4;
    const int J = (steps + ks - 1) / ks;                              // iterations of the block
    const int KT = ks * 4 * EPC;                                      // x elements per column per iteration
    const u8_t* wrow[2];
    const u8_t* srow[2];
    const float* bs[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = ok[r] ? rows[r] : 0;
        wrow[r] = w + (i64_t)row * ((i64_t)C * 16);
        srow[r] = (const u8_t*)scale + (i64_t)row * (I / 16);
        bs[r] = (const float*)scale + (i64_t)(row >> 7) * sb;
    }
    i64_t xoff[NB];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const int col = 8 * nb + g;
        xoff[nb] = (i64_t)(col < T ? col : 0) * XS_ROW;
    }
    const bf16_t* xq = &xs[0][0][0] + (4 * kslot + t) * EPC;        // this lane's chunk in a staged row

    // Weights of iteration j: step q = j ks + kslot, chunk 4q + t (chunk 4q when 4q + t is past the row
    // end, as gemv_*_tc loads it: x is zero there).
    uint4 wv[U][2];
    unsigned sv[U][2];
    auto load_w = [&](int u, int j) {
        const int q = j * ks + kslot;
        if (q >= steps) return;
        const int c = 4 * q + t < C ? 4 * q + t : 4 * q;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            wv[u][r] = ld_stream16(wrow[r] + (i64_t)c * 16);
            sv[u][r] = KIND == KIND_NVFP4 ? (unsigned)__ldg((const unsigned short*)(srow[r] + (i64_t)c * 2)) : 0u;
        }
    };
    // x of iteration j -> buffer b: columns 0..T-1, elements j KT .. j KT + KT - 1 (zeros past I)
    auto stage_x = [&](int j, int b) {
        const int per_col = KT / 8, n = T * per_col;
        const int e0 = j * KT;
        for (int i = tid; i < n; i += GEMV_WARPS * 32) {
            const int col = i / per_col, e = (i - col * per_col) * 8;
            const bool in = e0 + e < I;
            cp_async16(smem_u32(&xs[b][col][e]), in ? (const void*)(x + (i64_t)col * I + e0 + e) : (const void*)x,
                       in ? 16u : 0u);
        }
    };

    float acc[NB][1][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nb][0][i] = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (u < J) load_w(u, u);                                      // weights only: before the wait
    pdl_wait();
    stage_x(0, 0);
    cp_async_commit();
    for (int j0 = 0; j0 < J; j0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u;
            if (j >= J) break;                                        // block-uniform
            cp_async_wait<0>();                                       // this thread's copies of iteration j
            __syncthreads();                                          // everyone's; and iteration j-1 is done
            if (j + 1 < J) stage_x(j + 1, (j + 1) & 1);
            cp_async_commit();
            const int q = j * ks + kslot;
            if (q < steps) {
                float s0 = 1.f, s1 = 1.f;
                if (KIND == KIND_FP8BLK) { s0 = __ldg(bs[0] + (q >> 1)); s1 = __ldg(bs[1] + (q >> 1)); }
                tc_step<KIND, NB, 1, true>(wv[u], sv[u], xq + (j & 1) * (8 * NB * XS_ROW), xoff, true, s0, s1, acc);
            }
            if (j + U < J) load_w(u, j + U);
        }
    }
    cp_async_wait<0>();
    __syncthreads();                                                  // the buffers become the reduction

#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][nb][i][lane] = acc[nb][0][i];
    __syncthreads();
    if (kslot != 0) return;
    tc_reduce_store<KIND, NB>(red, uslot, ks, lane, t, y, residual, scale, gscale, ok, rows, T, O, F, mode, split);
}

// Two blocks per SM for both widths (<= 128 registers without spills: x is not held in registers).
#define GEMV_XS_KERNEL(name, KIND, NB)                                        \
    extern "C" __global__ void __launch_bounds__(256, 2) name(GEMV_ARGS) { \
        pdl_trigger();                                                        \
        gemv_xs_body<KIND, NB>(GEMV_PASS);                                    \
    }

GEMV_XS_KERNEL(gemv_fp8row_xs16, KIND_FP8ROW, 2)
GEMV_XS_KERNEL(gemv_fp8blk_xs16, KIND_FP8BLK, 2)
GEMV_XS_KERNEL(gemv_nvfp4_xs16, KIND_NVFP4, 2)
GEMV_XS_KERNEL(gemv_fp8row_xs32, KIND_FP8ROW, 4)
GEMV_XS_KERNEL(gemv_fp8blk_xs32, KIND_FP8BLK, 4)
GEMV_XS_KERNEL(gemv_nvfp4_xs32, KIND_NVFP4, 4)

// ------------------------------------------------------------------------------------------------
// Quantised GEMM for 9..64 columns: gemm_{fp8row,fp8blk,nvfp4}_n16 / n32 / n64 (kernels/cuda_linear.py:
// MM_ENV, _route_mm). The decode side of gemv_*_tc (a warp's lanes decode 16-byte chunks of two rows of
// a 16-row tile in registers, tc_step's A fragments), organised as a GEMM instead of a GEMV:
//   - a warp owns MT row tiles (16 MT rows) and every column: each B fragment read from shared memory
//     feeds MT mma; the block's 8 warps own 128 MT consecutive rows (a tile of the grid's x axis);
//   - the weights come P steps (an iteration) ahead through registers, or with D > 0 (the _r kernels)
//     D - 1 iterations ahead through a per-thread cp.async ring in dynamic shared memory;
//   - x is staged per block, once per iteration of P steps (64 or 128 elements of I per step), already
//     in the order the A fragments want (tc_step's prmt pairs; fp8: times 2^64), so a B fragment pair is
//     one conflict-free 16-byte shared load; registers carry the next iteration's x while the current
//     one computes, and one barrier per iteration separates the two buffers;
//   - the grid's y axis splits I (S = gridDim.y slices): slice partials go to an fp32 workspace, and the
//     last block of a row tile to arrive (a counter per row tile, reset by that block, so graph replays
//     need no host reset) sums them in slice order (the same bits whichever block is last) and runs the
//     epilogue. S = 1 stores straight through the epilogue.
// Numerics: tc_step's products and scales; the sum order differs from gemv_*_tc (per-slice, then across
// slices), so outputs agree with it to rounding, not bit for bit. The workspace and counters belong to
// one stream at a time (the launches of a stream are ordered; pdl_wait precedes every workspace access).
#define MM_WARPS 8
#define MM_PAD 4                                                      // 16-byte units after each staged column

template <int KIND>
__device__ __forceinline__ uint4 mm_perm_x(uint4 v) {
    if (KIND == KIND_NVFP4)                                           // (x0 x4) (x1 x5) (x2 x6) (x3 x7)
        return make_uint4(prmt(v.x, v.z, 0x5410u), prmt(v.x, v.z, 0x7632u), prmt(v.y, v.w, 0x5410u),
                          prmt(v.y, v.w, 0x7632u));
    const unsigned two64 = 0x5f805f80u;                               // (x0 x2) (x1 x3) (x4 x6) (x5 x7) * 2^64
    return make_uint4(bf16x2_mul(prmt(v.x, v.y, 0x5410u), two64), bf16x2_mul(prmt(v.x, v.y, 0x7632u), two64),
                      bf16x2_mul(prmt(v.z, v.w, 0x5410u), two64), bf16x2_mul(prmt(v.z, v.w, 0x7632u), two64));
}

// One step of a lane over its MT tiles: chunk wv[mt][r] of rows r of tile mt times the staged x of the
// NB column tiles (xb: this lane's unit for column g of tile 0; column tile nb at + 8 nb ROWU units,
// word m at + 4 m). fp8blk: the step's sums scaled by the rows' block scales s[mt][r].
template <int KIND, int NB, int MT, int ROWU>
__device__ __forceinline__ void mm_step(const uint4 (&wv)[MT][2], const unsigned (&sv)[MT][2], const uint4* xb,
                                        const float (&s)[MT][2], float (&acc)[MT][NB][4]) {
    if (KIND == KIND_NVFP4) {
        unsigned s2[MT][2][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                s2[mt][r][0] = fp8_scale_bf16x2_2p118(sv[mt][r] & 0xffu);
                s2[mt][r][1] = fp8_scale_bf16x2_2p118((sv[mt][r] >> 8) & 0xffu);
            }
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            unsigned a[MT][4], h[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                nvfp4_word_frags(word_of(wv[mt][0], m), word_of(wv[mt][1], m), s2[mt][0][m >> 1], s2[mt][1][m >> 1],
                                 a[mt], h[mt]);
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                const uint4 b = xb[nb * 8 * ROWU + 4 * m];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16_16816(acc[mt][nb], a[mt], b.x, b.y);
                    mma_bf16_16816(acc[mt][nb], h[mt], b.z, b.w);
                }
            }
        }
    } else {
        float cs[MT][NB][4];
        if (KIND == KIND_FP8BLK) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                    for (int i = 0; i < 4; ++i) cs[mt][nb][i] = 0.f;
        }
        float (&cc)[MT][NB][4] = KIND == KIND_FP8BLK ? cs : acc;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {                              // x unit hh: elements 8 hh .. 8 hh + 7
            unsigned e0[MT][2], o0[MT][2], e1[MT][2], o1[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int mm = 0; mm < 2; ++mm) {
                    const int m = 2 * hh + mm;
                    fp8x4_bf16(word_of(wv[mt][0], m), e0[mt][mm], o0[mt][mm]);
                    fp8x4_bf16(word_of(wv[mt][1], m), e1[mt][mm], o1[mt][mm]);
                }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                const uint4 b = xb[nb * 8 * ROWU + 4 * hh];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16_16816(cc[mt][nb], e0[mt][0], e1[mt][0], o0[mt][0], o1[mt][0], b.x, b.y);
                    mma_bf16_16816(cc[mt][nb], e0[mt][1], e1[mt][1], o0[mt][1], o1[mt][1], b.z, b.w);
                }
            }
        }
        if (KIND == KIND_FP8BLK) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    acc[mt][nb][0] = fmaf(cs[mt][nb][0], s[mt][0], acc[mt][nb][0]);
                    acc[mt][nb][1] = fmaf(cs[mt][nb][1], s[mt][0], acc[mt][nb][1]);
                    acc[mt][nb][2] = fmaf(cs[mt][nb][2], s[mt][1], acc[mt][nb][2]);
                    acc[mt][nb][3] = fmaf(cs[mt][nb][3], s[mt][1], acc[mt][nb][3]);
                }
        }
    }
}

#define GEMM_ARGS GEMV_ARGS, float* __restrict__ ws, int* __restrict__ counters
// ks (GEMV_ARGS) is unused: the I-split is gridDim.y.
template <int KIND, int NB, int MT, int P, int D>
__device__ __forceinline__ void gemm_q_body(bf16_t* __restrict__ y, const bf16_t* __restrict__ x,
                                            const u8_t* __restrict__ w, const void* __restrict__ scale,
                                            const float* __restrict__ gscale, const bf16_t* residual,
                                            int O, int I, int T, int mode, int F, int sb, const Split& split,
                                            float* __restrict__ ws, int* __restrict__ counters) {
    constexpr int EPC = KIND == KIND_NVFP4 ? 32 : 16;               // elements per 16-byte chunk
    constexpr int WD = EPC / 8;                                       // x units per lane per step per column
    constexpr int NC = 8 * NB;                                        // staged columns
    constexpr int UPC = P * 4 * WD;                                   // units per column per iteration
    constexpr int ROWU = UPC + MM_PAD;                                // = 4 mod 8: columns g, g+1 on other banks
    constexpr int NX = (NC * UPC + 255) / 256;                        // units a thread stages per iteration
    __shared__ uint4 xs[2][NC * ROWU];
    __shared__ int last_block;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int bm = blockIdx.x, sk = blockIdx.y, S = gridDim.y;
    int rows[MT][2];
    bool ok[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) tc_tile_rows(mode, (bm * MM_WARPS + warp) * MT + mt, g, O, F, rows[mt], ok[mt]);

    const int C = I / EPC;                                            // 16-byte chunks per row
    const int steps = (C + 3) / 4;
    const int sps = (((steps + S - 1) / S) + P - 1) / P * P;           // steps per slice, whole iterations
    const int q0 = sk * sps, q1 = min(steps, q0 + sps);
    const int J = q1 > q0 ? (q1 - q0 + P - 1) / P : 0;

    const u8_t* wrow[MT][2];
    const u8_t* srow[MT][2];
    const float* bs[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = ok[mt][r] ? rows[mt][r] : 0;
            wrow[mt][r] = w + (i64_t)row * ((i64_t)C * 16);
            srow[mt][r] = (const u8_t*)scale + (i64_t)row * (I / 16);
            bs[mt][r] = (const float*)scale + (i64_t)(row >> 7) * sb;
        }

    uint4 wv[D > 0 ? 1 : P][MT][2];
    unsigned sv[D > 0 ? 1 : P][MT][2];
    // D > 0: each thread's weight chunks (and nvfp4 scale words) of iteration j go to stage j % D of a
    // per-thread ring in dynamic shared memory, D - 1 iterations ahead (cp.async); only the thread
    // that copies a slot reads it, so the ring needs no barrier. Word w = t / 2 of a step's scales
    // holds chunks 4q + 2w, 4q + 2w + 1 (I % 64 == 0: 4-byte aligned, C even).
    extern __shared__ uint4 mm_ring[];
    constexpr int RSLOTS = P * MT * 2;                                // 16-byte slots per thread per stage
    constexpr int DR = D > 0 ? D : 1;                                 // (the register path instantiates the lambdas too)
    auto ring_w = [&](int stage, int p, int mt, int r) {
        return smem_u32(&mm_ring[((stage * RSLOTS + (p * MT + mt) * 2 + r) << 8) + tid]);
    };
    auto ring_s = [&](int stage, int p, int mt, int r) {
        return smem_u32((const unsigned*)&mm_ring[(D * RSLOTS) << 8] + ((stage * RSLOTS + (p * MT + mt) * 2 + r) << 8) + tid);
    };
    auto issue_w = [&](int j) {
        const int stage = j % DR;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int q = q0 + j * P + p;
            if (q >= q1) break;
            const int c = 4 * q + t < C ? 4 * q + t : 4 * q;
            const bool sw = 4 * q + 2 * (t >> 1) < C;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    cp_async16(ring_w(stage, p, mt, r), wrow[mt][r] + (i64_t)c * 16, 16u);
                    if (KIND == KIND_NVFP4)
                        cp_async4(ring_s(stage, p, mt, r), sw ? (const void*)(srow[mt][r] + (i64_t)q * 8 + 4 * (t >> 1)) : scale,
                                  sw ? 4u : 0u);
                }
        }
    };
    auto load_w = [&](int p, int j) {                                 // step q0 + j P + p: chunk 4q + t (4q past the row end)
        const int q = q0 + j * P + p;
        if (q >= q1) return;
        const int c = 4 * q + t < C ? 4 * q + t : 4 * q;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                wv[p][mt][r] = ld_stream16(wrow[mt][r] + (i64_t)c * 16);
                sv[p][mt][r] = KIND == KIND_NVFP4 ? (unsigned)__ldg((const unsigned short*)(srow[mt][r] + (i64_t)c * 2)) : 0u;
            }
    };
    // x of iteration j: unit u of column col holds natural elements (4 q + tt) EPC + 8 m .. + 7 of step
    // q = q0 + j P + s, where u = (s WD + m) 4 + tt; zeros past I and for columns >= T.
    uint4 xr[NX];
    auto load_x = [&](int j) {
#pragma unroll
        for (int n = 0; n < NX; ++n) {
            const int i = tid + 256 * n;
            const int col = i / UPC, u = i % UPC;                     // UPC: a power of two
            const int s = u / (4 * WD), m = (u >> 2) % WD, tt = u & 3;
            const int e = (4 * (q0 + j * P + s) + tt) * EPC + 8 * m;
            xr[n] = (i < NC * UPC && col < T && e < I) ? ld_x16(x + (i64_t)col * I + e) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    auto store_x = [&](int b) {
#pragma unroll
        for (int n = 0; n < NX; ++n) {
            const int i = tid + 256 * n;
            if (i < NC * UPC) xs[b][(i / UPC) * ROWU + i % UPC] = mm_perm_x<KIND>(xr[n]);
        }
    };

    float acc[MT][NB][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nb][i] = 0.f;

    if constexpr (D > 0) {                                            // weights only: before the wait
        for (int s = 0; s < D - 1; ++s) {
            if (s < J) issue_w(s);
            cp_async_commit();
        }
    } else {
#pragma unroll
        for (int p = 0; p < P; ++p)
            if (J > 0) load_w(p, 0);
    }
    pdl_wait();
    if (J > 0) { load_x(0); store_x(0); }
    __syncthreads();
    for (int j = 0; j < J; ++j) {
        const bool more = j + 1 < J;                                  // block-uniform
        if constexpr (D > 0) {                                        // one group per iteration, maybe empty
            if (j + D - 1 < J) issue_w(j + D - 1);
            cp_async_commit();
        }
        if (more) load_x(j + 1);
        if constexpr (D > 0) cp_async_wait<D - 1>();                  // this thread's copies of iteration j
        const uint4* xb = &xs[j & 1][g * ROWU + t];
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int q = q0 + j * P + p;
            if (q < q1) {
                float sc[MT][2];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int r = 0; r < 2; ++r) sc[mt][r] = KIND == KIND_FP8BLK ? __ldg(bs[mt][r] + (q >> 1)) : 1.f;
                if constexpr (D > 0) {
                    const int stage = j % DR;
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            wv[0][mt][r] = mm_ring[((stage * RSLOTS + (p * MT + mt) * 2 + r) << 8) + tid];
                            if (KIND == KIND_NVFP4) {
                                const unsigned word = ((const unsigned*)&mm_ring[(D * RSLOTS) << 8])
                                    [((stage * RSLOTS + (p * MT + mt) * 2 + r) << 8) + tid];
                                sv[0][mt][r] = (t & 1) ? word >> 16 : word & 0xffffu;
                            }
                        }
                    mm_step<KIND, NB, MT, ROWU>(wv[0], sv[0], xb + p * 4 * WD, sc, acc);
                } else {
                    mm_step<KIND, NB, MT, ROWU>(wv[p], sv[p], xb + p * 4 * WD, sc, acc);
                }
            }
            if constexpr (D == 0) {
                if (more) load_w(p, j + 1);
            }
        }
        if (more) store_x((j + 1) & 1);
        __syncthreads();
    }
    if constexpr (D > 0) cp_async_wait<0>();                          // only empty groups remain

    if (S > 1) {                                                      // slice partials, then the last block sums them
        const int per_warp = MT * NB * 4 * 32;
        float* part = ws + (((i64_t)sk * gridDim.x + bm) * MM_WARPS + warp) * per_warp;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[((mt * NB + nb) * 4 + i) * 32 + lane] = acc[mt][nb][i];
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            const int done = atomicAdd(counters + bm, 1);
            last_block = done == S - 1;
            if (done == S - 1) atomicExch(counters + bm, 0);          // every slice has counted: ready for the next launch
        }
        __syncthreads();
        if (!last_block) return;
        __threadfence();
        const i64_t slice = (i64_t)gridDim.x * MM_WARPS * per_warp;
        const float* mine = ws + ((i64_t)bm * MM_WARPS + warp) * per_warp;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int o = ((mt * NB + nb) * 4 + i) * 32 + lane;
                    float v = __ldcg(mine + o);
                    for (int k = 1; k < S; ++k) v += __ldcg(mine + k * slice + o);
                    acc[mt][nb][i] = v;
                }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float mul[2];
        tc_row_scales<KIND>(scale, gscale, ok[mt], rows[mt], mul);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) tc_store(y, residual, acc[mt][nb], mul, ok[mt], rows[mt], 8 * nb + 2 * t, T, O, F, mode, split);
    }
}

#define GEMM_Q_KERNEL(name, KIND, NB, MT, P, MINB) GEMM_Q_RING_KERNEL(name, KIND, NB, MT, P, MINB, 0)
#define GEMM_Q_RING_KERNEL(name, KIND, NB, MT, P, MINB, D)                     \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(GEMM_ARGS) {  \
        pdl_trigger();                                                        \
        gemm_q_body<KIND, NB, MT, P, D>(y, x, w, scale, gscale, residual, O, I, T, mode, F, sb, \
                                  Split{y1, y2, y3, o1, o2, o3}, ws, counters); \
    }

// (name, kind, column tiles NB, row tiles per warp MT, steps per iteration P, blocks per SM): <= 128
// registers without spills for two blocks per SM; the 64-column fp8blk kernel needs more and runs one
// block per SM (sm_90a: 164 registers). nvfp4 has no 64-column kernel: one (MT 1, P 1, 140 registers,
// one block per SM) lost to two 32-column launches on every 27B layer (docs/perf.md, fifteenth session).
GEMM_Q_KERNEL(gemm_fp8row_n16, KIND_FP8ROW, 2, 2, 2, 2)
GEMM_Q_KERNEL(gemm_fp8blk_n16, KIND_FP8BLK, 2, 2, 2, 2)
GEMM_Q_KERNEL(gemm_nvfp4_n16, KIND_NVFP4, 2, 2, 2, 2)
GEMM_Q_KERNEL(gemm_fp8row_n32, KIND_FP8ROW, 4, 2, 2, 2)
GEMM_Q_KERNEL(gemm_fp8blk_n32, KIND_FP8BLK, 4, 1, 2, 2)
GEMM_Q_KERNEL(gemm_nvfp4_n32, KIND_NVFP4, 4, 2, 1, 2)
GEMM_Q_KERNEL(gemm_fp8row_n64, KIND_FP8ROW, 8, 1, 1, 2)
GEMM_Q_KERNEL(gemm_fp8blk_n64, KIND_FP8BLK, 8, 1, 1, 1)
// Other tile shapes, for comparisons (kernels/cuda_linear.py MM_SHAPE_ENV): one row tile per warp (_m1),
// four steps per iteration (_p4: more weight bytes in flight per warp).
GEMM_Q_KERNEL(gemm_fp8row_n16_m1, KIND_FP8ROW, 2, 1, 2, 2)
GEMM_Q_KERNEL(gemm_fp8blk_n16_m1, KIND_FP8BLK, 2, 1, 2, 2)
GEMM_Q_KERNEL(gemm_nvfp4_n16_m1, KIND_NVFP4, 2, 1, 2, 2)
GEMM_Q_KERNEL(gemm_fp8row_n32_m1, KIND_FP8ROW, 4, 1, 2, 2)
GEMM_Q_KERNEL(gemm_nvfp4_n32_m1, KIND_NVFP4, 4, 1, 2, 2)
GEMM_Q_KERNEL(gemm_fp8row_n16_p4, KIND_FP8ROW, 2, 1, 4, 2)
GEMM_Q_KERNEL(gemm_fp8blk_n16_p4, KIND_FP8BLK, 2, 1, 4, 2)
GEMM_Q_KERNEL(gemm_nvfp4_n16_p4, KIND_NVFP4, 2, 1, 4, 2)
GEMM_Q_KERNEL(gemm_fp8row_n32_p4, KIND_FP8ROW, 4, 1, 4, 2)
GEMM_Q_KERNEL(gemm_fp8blk_n32_p4, KIND_FP8BLK, 4, 1, 4, 2)
// The weights through a ring of D iterations in dynamic shared memory (_r; kernels/cuda_linear.py sizes
// it: D P MT 2 x 256 x (16 + 4 for nvfp4's scale words) bytes; nvfp4 needs I % 64 == 0).
GEMM_Q_RING_KERNEL(gemm_fp8row_n16_r, KIND_FP8ROW, 2, 1, 2, 2, 3)
GEMM_Q_RING_KERNEL(gemm_fp8blk_n16_r, KIND_FP8BLK, 2, 1, 2, 2, 3)
GEMM_Q_RING_KERNEL(gemm_nvfp4_n16_r, KIND_NVFP4, 2, 1, 2, 2, 3)
GEMM_Q_RING_KERNEL(gemm_fp8row_n32_r, KIND_FP8ROW, 4, 1, 2, 2, 3)
GEMM_Q_RING_KERNEL(gemm_fp8blk_n32_r, KIND_FP8BLK, 4, 1, 2, 2, 3)
GEMM_Q_RING_KERNEL(gemm_nvfp4_n32_r, KIND_NVFP4, 4, 1, 2, 2, 3)
GEMM_Q_RING_KERNEL(gemm_fp8row_n64_r, KIND_FP8ROW, 8, 1, 1, 2, 4)

// ------------------------------------------------------------------------------------------------
// Pipelined tensor-core decode GEMV for quantised weights, T <= 8 columns (one column tile of 8):
// gemv_{fp8row,fp8blk,nvfp4}_pipe. Chosen by TANDEM_GEMV_VARIANT=pipelined (kernels/cuda_linear.py
// route); not the default route yet.
//
// Same tiles, fragments, math and epilogue as gemv_*_tc with one column tile (see above): a warp owns
// 16 rows, lane (g, t) supplies rows g and g+8 of chunk 4q + t in step q, and ks warps of a block
// split the steps (warp kslot takes q = kslot, kslot + ks, ...). What differs is how the weight bytes
// travel. gemv_*_tc loads U steps into registers and then decodes them, so a warp has nothing in
// flight while it decodes, and the registers holding loads cap the occupancy (~127 registers, 2
// blocks per SM, at most ~32 KiB in flight per SM). Here every lane copies its own chunks (and nvfp4
// scale words) with cp.async into a private ring of D stages in shared memory, D steps ahead:
//
//   prologue: issue steps 0 .. D-1 (one commit group per step, empty groups past the last step)
//   step j:   cp.async.wait_group D-1 (group j has landed), read the stage from shared memory,
//             decode and multiply it, then issue step j + D into the same slot
//
// so D-1 .. D steps of weight loads stay in flight during the decode without holding registers. A lane
// reads only the slots it wrote itself, so no barrier is needed: wait_group makes a thread's own
// copies visible to it, and a slot is refilled only after the mma that consumed its bytes has been
// issued (in-order issue, so the shared loads feeding it have completed). Chunks past the row end are
// zero-filled (src-size 0, the source is then the tensor base and is not read) and get x = 0.
//
// Shared memory per block (static, <= 48 KiB, so no opt-in attribute): weights D x 2 rows x 256
// lanes x 16 B, nvfp4 scale words D x 2 x 256 x 4 B, the reduction 4 KiB; nvfp4 D = 4, fp8 D = 5,
// 44 KiB either way. __launch_bounds__(256, PIPE_MIN_BLOCKS): as many blocks per SM as its shared
// memory holds. sm_90/100 (228 KiB per SM): 4 blocks, <= 64 registers (ptxas emits the same loop at
// 64 as at 80), 32 warps with ~3.5 KiB of weight loads in flight each, ~112 KiB per SM; sm_80/87
// (164 KiB): 3; sm_86/89/120 (100 KiB): 2 (at 64 registers sm_120 would spill). The gemv_*_tc
// kernels: 2 blocks (16 warps), <= ~32 KiB in flight.
//
// nvfp4 scales: lane t copies the 4-byte word holding the scale bytes of chunks 4q + (t & 2) and +1
// (lanes t and t^1 copy the same word) and uses half t & 1. cp.async needs 4-byte aligned sources,
// hence I % 64 == 0 (cuda_linear.route keeps other nvfp4 shapes on the older kernels).
//
// The arithmetic is tc_step's (pipe_step below is its one-tile case), with two cheaper nvfp4 decodes
// that give the same bf16x2 words bit for bit (fp4x8_bf16x4: 13 integer operations per weight word
// instead of 17; fp8x2_scales_bf16x2_2p118: both group scales of a chunk at once), so the products,
// and the results, are those of gemv_nvfp4_tc. Every step but a row's last, partial one runs a copy
// of the step compiled for all-live lanes (no zeroing of x), and issues its copies without the
// zero-fill selects. Measured with ptxas (sm_90a): ~190 instructions per step of the nvfp4 decode and
// ~40 of ring and loop per KiB of weights; gemv_nvfp4_tc: ~233 per KiB in its unrolled loop.

#define PIPE_D_NVFP4 4
#define PIPE_D_FP8 5
// Blocks per SM the register budget is cut for: as many as the SM's shared memory holds.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1200
#define PIPE_MIN_BLOCKS 4                                             // sm_90, sm_100: 228 KiB per SM
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870)
#define PIPE_MIN_BLOCKS 3                                             // sm_80, sm_87: 164 KiB
#else
#define PIPE_MIN_BLOCKS 2                                             // sm_86, sm_89, sm_120: 100 KiB
#endif

// volatile: never hoisted above the cp.async.wait_group that makes the bytes visible.
__device__ __forceinline__ uint4 lds16(unsigned a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

__device__ __forceinline__ unsigned lds4(unsigned a) {
    unsigned v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}

// (a & C) | (b & ~C) for a constant C, as one LOP3 (the compiler splits the C++ form into two).
template <unsigned C>
__device__ __forceinline__ unsigned mux_bits(unsigned a, unsigned b) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xe4;" : "=r"(d) : "r"(a), "r"(b), "n"(C));
    return d;
}

// e2m1 nibbles n0..n7 of w -> d[j] = bf16x2 (n_j, n_j+4), each value * 2^-126: the same words as
// fp4pair_bf16<0>(w), <1>(w), <0>(w >> 8), <1>(w >> 8) in tc_step, with fewer integer operations (13
// instead of 17; checked bit for bit against fp4pair_bf16). A bf16 keeps the sign 9 bits above the
// lowest magnitude bit (bits 15 and 6..8), a nibble 3 bits above (bits 3 and 0..2), so every word
// needs bits from two shifted copies of w. pa takes the magnitudes of n0, n1, n4, n5 from w (mask
// 0x00770077: bits 0-2, 4-6, 16-18, 20-22) and every other bit from w << 6, which puts the signs of
// n0, n1, n4, n5 (bits 3, 7, 19, 23) at bits 9, 13, 25, 29, 9 above their magnitudes; pb does the
// same for v = w >> 8 (n2, n3, n6, n7). One shift and one mask then place each pair:
// pa << 6 -> (n0, n4), pa << 2 -> (n1, n5), pb << 6 -> (n2, n6), pb << 2 -> (n3, n7).
__device__ __forceinline__ void fp4x8_bf16x4(unsigned w, unsigned (&d)[4]) {
    constexpr unsigned OUT = 0x81c081c0u;
    const unsigned v = w >> 8;
    const unsigned pa = mux_bits<0x00770077u>(w, w << 6);
    const unsigned pb = mux_bits<0x00770077u>(v, v << 6);
    d[0] = (pa << 6) & OUT;
    d[1] = (pa << 2) & OUT;
    d[2] = (pb << 6) & OUT;
    d[3] = (pb << 2) & OUT;
}

// Bytes sel picks from `word` (prmt selector 0x4140: bytes 0, 1; 0x4342: bytes 2, 3) are the e4m3
// scales s0, s1 of a chunk's two groups -> p0 = bf16x2 (s0, s0) * 2^118, p1 = (s1, s1) * 2^118:
// the words fp8_scale_bf16x2_2p118 gives, exactly (s has 4 significant bits): the bytes are placed as
// bf16 (s0, s1) * 2^-120 (as fp8x4_bf16 does; subnormal e4m3 become bf16 subnormals, which
// fma.rn.bf16x2 honours, as it does for the e2m1 code 1) and multiplied twice by 2^119. Checked against
// fp8_scale_bf16x2_2p118 for every non-NaN code.
__device__ __forceinline__ void fp8x2_scales_bf16x2_2p118(unsigned word, unsigned sel, unsigned& p0, unsigned& p1) {
    const unsigned b = prmt(word, 0u, sel);                          // (s0, 0, s1, 0)
    const unsigned e = ((b << 4) & 0x07f007f0u) | ((b << 8) & 0x80008000u);
    const unsigned s = bf16x2_mul(bf16x2_mul(e, 0x7b007b00u), 0x7b007b00u);   // * 2^119 * 2^119
    p0 = prmt(s, s, 0x1010u);
    p1 = prmt(s, s, 0x3232u);
}

// One step of a lane with one column tile (rows g, g+8; its chunk wv of each row; x of its column at
// the chunk, xq; zeros when not `live`; ALL: every lane of the warp is live, known at compile time).
// nvfp4: tc_step<KIND_NVFP4, 1, 2> with fp4x8_bf16x4 and fp8x2_scales_bf16x2_2p118; sw = the rows'
// scale words, ssel = the prmt selector of this lane's half. fp8: tc_step<KIND, 1, 2>, the same code.
template <int KIND, bool ALL>
__device__ __forceinline__ void pipe_step(const uint4 (&wv)[2], const unsigned (&sw)[2], unsigned ssel,
                                          const bf16_t* xq, bool live, float s0, float s1, float (&acc)[2][4]) {
    const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
    if (KIND == KIND_BF16) {
        // bf16: the chunk's 8 weights are the A words as they are (pairs (0 1) (2 3) in slots 2t, 2t+1
        // and (4 5) (6 7) in 2t+8, 2t+9 of the first mma, and so on), x's chunk the B words.
        const uint4 xw = (ALL || live) ? ld_x16(xq) : zero4;
        mma_bf16_16816(acc[0], wv[0].x, wv[1].x, wv[0].y, wv[1].y, xw.x, xw.y);
        mma_bf16_16816(acc[1], wv[0].z, wv[1].z, wv[0].w, wv[1].w, xw.z, xw.w);
    } else if (KIND == KIND_NVFP4) {
        unsigned s2[2][2];                                            // [row][group]: (s, s) * 2^118
#pragma unroll
        for (int r = 0; r < 2; ++r) fp8x2_scales_bf16x2_2p118(sw[r], ssel, s2[r][0], s2[r][1]);
#pragma unroll
        for (int m = 0; m < 4; ++m) {                                 // 32-bit word m: elements 8m .. 8m+7
            const unsigned w0 = word_of(wv[0], m), w1 = word_of(wv[1], m);
            unsigned d0[4], d1[4];
            fp4x8_bf16x4(w0, d0);
            fp4x8_bf16x4(w1, d1);
            const unsigned sa = s2[0][m >> 1], sb = s2[1][m >> 1];
            const uint4 xw = (ALL || live) ? ld_x16(xq + 8 * m) : zero4;   // (x0 x1) (x2 x3) (x4 x5) (x6 x7)
            mma_bf16_16816(acc[0], bf16x2_mul(d0[0], sa), bf16x2_mul(d1[0], sb), bf16x2_mul(d0[1], sa),
                           bf16x2_mul(d1[1], sb),
                           prmt(xw.x, xw.z, 0x5410u), prmt(xw.x, xw.z, 0x7632u));   // (x0 x4) (x1 x5)
            mma_bf16_16816(acc[1], bf16x2_mul(d0[2], sa), bf16x2_mul(d1[2], sb), bf16x2_mul(d0[3], sa),
                           bf16x2_mul(d1[3], sb),
                           prmt(xw.y, xw.w, 0x5410u), prmt(xw.y, xw.w, 0x7632u));   // (x2 x6) (x3 x7)
        }
    } else {
        const unsigned two64 = 0x5f805f80u;                           // bf16x2 (2^64, 2^64)
        float cs[2][4];
        if (KIND == KIND_FP8BLK) {
#pragma unroll
            for (int k = 0; k < 2; ++k)
#pragma unroll
                for (int i = 0; i < 4; ++i) cs[k][i] = 0.f;
        }
        float (&cc)[2][4] = KIND == KIND_FP8BLK ? cs : acc;
#pragma unroll
        for (int h = 0; h < 2; ++h) {                                 // x uint4 h: elements 8h .. 8h+7
            unsigned e0[2], o0[2], e1[2], o1[2];
#pragma unroll
            for (int mm = 0; mm < 2; ++mm) {                          // 32-bit word m = 2h + mm: elements 4m .. 4m+3
                const int m = 2 * h + mm;
                const unsigned w0 = word_of(wv[0], m), w1 = word_of(wv[1], m);
                fp8x4_bf16(w0, e0[mm], o0[mm]);
                fp8x4_bf16(w1, e1[mm], o1[mm]);
            }
            const uint4 xw = (ALL || live) ? ld_x16(xq + 8 * h) : zero4;
#pragma unroll
            for (int mm = 0; mm < 2; ++mm) {
                const unsigned xl = mm ? xw.z : xw.x, xh = mm ? xw.w : xw.y;   // (x0 x1) (x2 x3)
                mma_bf16_16816(cc[mm], e0[mm], e1[mm], o0[mm], o1[mm],
                               bf16x2_mul(prmt(xl, xh, 0x5410u), two64),
                               bf16x2_mul(prmt(xl, xh, 0x7632u), two64));          // (x0 x2) (x1 x3)
            }
        }
        if (KIND == KIND_FP8BLK) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[0][i] = fmaf(cs[0][i] + cs[1][i], i < 2 ? s0 : s1, acc[0][i]);
        }
    }
}

template <int KIND, int D>
__device__ __forceinline__ void gemv_pipe_body(bf16_t* __restrict__ y, const bf16_t* __restrict__ x,
                                               const u8_t* __restrict__ w, const void* __restrict__ scale,
                                               const float* __restrict__ gscale, const bf16_t* residual,
                                               int O, int I, int T, int ks, int mode, int F, int sb, const Split& split) {
    constexpr bool NVFP4 = KIND == KIND_NVFP4;
    constexpr int EPC = NVFP4 ? 32 : (KIND == KIND_BF16 ? 8 : 16);  // elements per 16-byte chunk
    constexpr int NL = GEMV_WARPS * 32;                               // lanes per block
    __shared__ __align__(16) uint4 ring_w[D][2][NL];                  // [slot][row g / g+8][lane]
    __shared__ __align__(16) unsigned ring_s[NVFP4 ? D : 1][2][NVFP4 ? NL : 1];
    __shared__ float red[GEMV_WARPS][4][32];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kslot = warp % ks, uslot = warp / ks;
    const int tile = blockIdx.x * (GEMV_WARPS / ks) + uslot;

    int rows[2];
    bool ok[2];
    tc_tile_rows(mode, tile, g, O, F, rows, ok);

    // As in gemv_tc_body: a row past O (or F) reads row 0 and is never stored; a column g >= T reads
    // column 0 and is never stored.
    const int C = I / EPC;                                            // 16-byte chunks per row
    const int steps = (C + 3) / 4;
    const int n = kslot < steps ? (steps - 1 - kslot) / ks + 1 : 0;  // steps of this warp
    const u8_t* wi[2];                                                // next chunk to issue, per row
    const u8_t* si[2];                                                // nvfp4: next scale word to issue
    const float* bs[2];                                               // fp8blk: the rows' block-scale rows
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = ok[r] ? rows[r] : 0;
        wi[r] = w + (i64_t)row * ((i64_t)C * 16) + (i64_t)(kslot * 4 + t) * 16;
        si[r] = (const u8_t*)scale + (i64_t)row * (I / 16) + (i64_t)(kslot * 4 + (t & 2)) * 2;
        bs[r] = (const float*)scale + (i64_t)(row >> 7) * sb;
    }
    const int col = g < T ? g : 0;
    const bf16_t* xp = x + (i64_t)col * I + (i64_t)(kslot * 4 + t) * EPC;   // x of the step consumed next
    const i64_t wstep = (i64_t)ks * 4 * 16, sstep = (i64_t)ks * 4 * 2, xstep = (i64_t)ks * 4 * EPC;

    const unsigned sw = smem_u32(&ring_w[0][0][tid]);
    const unsigned ss = smem_u32(&ring_s[0][0][NVFP4 ? tid : 0]);
    constexpr unsigned SW_ROW = NL * 16, SW_SLOT = 2 * NL * 16, SS_ROW = NL * 4, SS_SLOT = 2 * NL * 4;

    int qi = kslot * 4;                                               // first chunk of the next step to issue
    auto issue = [&](int slot) {
        const unsigned dw = sw + slot * SW_SLOT, ds = ss + slot * SS_SLOT;
        if (qi + 4 <= C) {                                            // the whole step exists (warp-uniform)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                cp_async16(dw + r * SW_ROW, wi[r], 16u);
                if (NVFP4) cp_async4(ds + r * SS_ROW, si[r], 4u);
            }
        } else {                                                      // the last step of a row: zero-fill
            const bool lw = qi + t < C, ls = qi + (t & 2) < C;        // C is even for nvfp4 (I % 64 == 0)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                cp_async16(dw + r * SW_ROW, lw ? (const void*)wi[r] : (const void*)w, lw ? 16u : 0u);
                if (NVFP4) cp_async4(ds + r * SS_ROW, ls ? (const void*)si[r] : scale, ls ? 4u : 0u);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            wi[r] += wstep;
            si[r] += sstep;
        }
        qi += 4 * ks;
    };

    float acc[2][4];                                                  // two alternating sets (tc: S = 2)
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[k][i] = 0.f;
    const unsigned ssel = (t & 1) ? 0x4342u : 0x4140u;              // this lane's half of its scale word

#pragma unroll
    for (int s = 0; s < D; ++s) {
        if (s < n) issue(s);
        cp_async_commit();
    }
    pdl_wait();                                       // pdl=True: the ring's first D steps are weights only
    int qc = kslot * 4;                                               // first chunk of the step consumed
    int slot = 0;
    for (int j = 0; j < n; ++j) {
        cp_async_wait<D - 1>();                                       // groups 0 .. j have landed
        uint4 wv[2];
        unsigned sw2[2] = {0u, 0u};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            wv[r] = lds16(sw + slot * SW_SLOT + r * SW_ROW);
            if (NVFP4) sw2[r] = lds4(ss + slot * SS_SLOT + r * SS_ROW);
        }
        float s0 = 1.f, s1 = 1.f;
        if (KIND == KIND_FP8BLK) {                                    // step qc / 4: k = 16 qc .. 16 qc + 63
            s0 = __ldg(bs[0] + (qc >> 3));
            s1 = __ldg(bs[1] + (qc >> 3));
        }
        if (qc + 4 <= C) pipe_step<KIND, true>(wv, sw2, ssel, xp, true, s0, s1, acc);   // all 4 chunks exist
        else pipe_step<KIND, false>(wv, sw2, ssel, xp, qc + t < C, s0, s1, acc);        // the last, partial step
        xp += xstep;
        qc += 4 * ks;
        if (j + D < n) issue(slot);
        cp_async_commit();
        slot = slot + 1 == D ? 0 : slot + 1;
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][i][lane] = acc[0][i] + acc[1][i];
    __syncthreads();
    if (kslot != 0) return;
    // v[0], v[1]: rows[0], columns 2t, 2t+1; v[2], v[3]: rows[1], the same columns.
    float mul[2];
    tc_row_scales<KIND>(scale, gscale, ok, rows, mul);
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float s = 0.f;
        for (int k = 0; k < ks; ++k) s += red[uslot * ks + k][i][lane];
        v[i] = s;
    }
    tc_store(y, residual, v, mul, ok, rows, 2 * t, T, O, F, mode, split);
}

#define GEMV_PIPE_KERNEL(name, KIND, D)                                                     \
    extern "C" __global__ void __launch_bounds__(256, PIPE_MIN_BLOCKS) name(GEMV_ARGS) { \
        pdl_trigger();                                                                   \
        gemv_pipe_body<KIND, D>(GEMV_PASS);                                              \
    }

GEMV_PIPE_KERNEL(gemv_bf16_pipe, KIND_BF16, PIPE_D_FP8)
GEMV_PIPE_KERNEL(gemv_fp8row_pipe, KIND_FP8ROW, PIPE_D_FP8)
GEMV_PIPE_KERNEL(gemv_fp8blk_pipe, KIND_FP8BLK, PIPE_D_FP8)
GEMV_PIPE_KERNEL(gemv_nvfp4_pipe, KIND_NVFP4, PIPE_D_NVFP4)

// ------------------------------------------------------------------------------------------------
// Dequantisation to bf16 [O, I] (prefill path and tests). One warp per row (grid-stride over rows),
// lane l takes the row's 16-element groups l, l + 32, ...: a warp's loads and stores are contiguous
// and no thread divides a 64-bit index. Bit-exact with QuantWeight.dequantize: fp32 product(s), one
// RNE rounding to bf16.

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
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    const float g = kind == 3 ? __ldg(gscale) : 1.f;
    for (int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < O; row += warps) {
        bf16_t* orow = out + (i64_t)row * I;
        if (kind == 3) {
            const uint2* wrow = (const uint2*)(w + (i64_t)row * (I / 2));
            const u8_t* srow = (const u8_t*)scale + (i64_t)row * gpr;
#pragma unroll 2
            for (int gi = lane; gi < gpr; gi += 32) {
                const uint2 c = __ldg(wrow + gi);
                const float s = fp8e4m3_to_f32(__ldg(srow + gi));
                float v[16];
#pragma unroll
                for (int k = 0; k < 16; ++k) {
                    const unsigned word = k < 8 ? c.x : c.y;
                    v[k] = (fp4e2m1_to_f32((word >> (4 * (k & 7))) & 0xfu) * s) * g;
                }
                store_bf16x16(orow + gi * 16, v);
            }
        } else {
            const uint4* wrow = (const uint4*)(w + (i64_t)row * I);
            const float* srow = (const float*)scale + (kind == 1 ? (i64_t)row : (i64_t)(row >> 7) * sb);
#pragma unroll 2
            for (int gi = lane; gi < gpr; gi += 32) {
                const uint4 c = __ldg(wrow + gi);
                const float s = __ldg(srow + (kind == 1 ? 0 : (gi >> 3)));     // 8 groups per 128 columns
                const unsigned words[4] = {c.x, c.y, c.z, c.w};
                float v[16];
#pragma unroll
                for (int k = 0; k < 16; ++k)
                    v[k] = fp8e4m3_to_f32((fp8_t)((words[k >> 2] >> (8 * (k & 3))) & 0xffu)) * s;
                store_bf16x16(orow + gi * 16, v);
            }
        }
    }
}

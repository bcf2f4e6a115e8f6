// Prefill attention over the paged KV cache on tensor cores (flash-attention style, mma.sync).
//
//   prefill_attn_d<D>_w<W>       bf16 pools [P, 64, KV, D]
//   prefill_attn_i8_d<D>_w<W>    int8 pools + fp32 scales [P, 64, KV, D / 64] (as gqa_decode_split_i8_g*)
//   prefill_attn_split_[i8_]d<D>_w4   the key-split form for decode and verification columns against long
//                                contexts (cuda_attention.decode_attention_tc): split s of S takes the key
//                                pages [s * chunk_tiles, (s + 1) * chunk_tiles) (the last split to the end)
//                                and writes gqa_decode_split's partials (max in the base-2 domain, sum,
//                                unnormalised acc) for gqa_decode_combine (attention.cu) instead of the
//                                gated output; grid (KV, B, S * ntiles)
//
// Same contract as gqa_decode_split_g* (kernels/cuda/attention.cu), for many columns per sequence: column
// n of sequence b attends to keys 0..positions[n] of b's page table; query head h reads kv head
// h / (H / KV); out [N, H * D] = bf16(attn) * bf16(sigmoid(gate)) in bf16, gate a strided [N, H, D] view.
// Columns of sequence b are cu_seqlens[b] .. cu_seqlens[b + 1] - 1. D is 64, 128 or 256.
//
// Rows. The G = H / KV query heads of a kv head share every K/V tile, so they are folded into the rows
// of one CTA: for (sequence b, kv head) the rows are rho = t * G + g (column t of the sequence, head g
// of the group), and CTA tile i owns rows [16 W i, 16 W (i + 1)). Warp w owns 16 of them, the M of its
// mma tiles. Positions grow with rho, so the last rows of a tile bound its keys (the kernel still takes
// the max over its rows, so any positions work as long as their keys are written).
//
// Grid (KV, B, tiles): blockIdx.z counts tiles from the end of each sequence, so the CTAs with the most
// keys start first and the short ones fill the tail; CTAs past a sequence's tiles exit.
//
// Per key tile j (one 64-token page, keys 64 j .. 64 j + 63):
//   S = Q K^T      16 x 64 per warp, fp32: D / 16 k-steps x 8 n-tiles of mma.m16n8k16.
//   softmax        online, base 2 (scores times scale * log2 e inside the exponent), fp32 row max and
//                  sum; a lane holds rows g and g + 8 (g = lane / 4) and its row sum stays partial
//                  over the 4 lanes of a row until the end.
//   O += P V       P stays in registers: the C fragments of two S n-tiles are the A fragment of one
//                  16-key k-step (bf16). O is 16 x D per warp, D / 2 fp32 per lane (128 at D 256).
// Register budget at D 256: O 128, S 32, plus fragments and addresses; Q therefore lives in shared
// memory (reloaded by ldmatrix for every key tile) and not in registers (another 64 per lane).
//
// Shared memory (dynamic), bf16 tiles with 16-byte chunk c of row r stored at chunk c ^ (r & 7), so the
// 8 row addresses of every ldmatrix phase fall in 8 different bank groups:
//   Qs [16 W][D], Ks [64][D], Vs [64][D]; int8 adds staging for codes [64][D] and scales [64][D / 64] of
//   K and V (cp.async lands codes there; one pass per tile dequantises them into Ks / Vs).
// Fragments come from ldmatrix.x4: Q (A, plain), K (B, plain: K rows are B columns), V (B, .trans).
//
// Pipeline (one buffer each for K and V; every barrier is reached by all warps):
//   (A) wait K(j), barrier -> issue V(j) [int8: then dequantise K(j), barrier] -> S(j), softmax
//   (B) wait V(j), barrier -> issue K(j+1) [int8: then dequantise V(j), barrier] -> O += P V(j)
// so V(j) lands while S(j) runs and K(j+1) while P V(j) runs. A buffer is refilled only after a barrier
// that every warp reaches after its last read of it: Ks after (B) (S(j) done), Vs after (A) of j + 1
// (P V(j) done). Only tiles 0 .. pmax / 64 are visited (pmax: the CTA's largest position); a warp whose
// rows all lie before tile j skips its math (the warp still takes part in loads and barriers), and
// only a tile that reaches past a warp's smallest position is masked. Key rows past pmax are not read:
// cp.async zero-fills them, so unwritten pool slots (any bits) never reach the mma.
//
// Sizes: W = 8 warps (128 rows per K/V tile) or 4 (64 rows, for grids that would not fill the SMs
// and devices with less shared memory; the wrapper picks). At D 256 ptxas gives ~245-255 registers
// with no spills, so an SM holds one CTA of 8 warps (Qs 64 KiB + Ks/Vs 64 KiB; int8 staging +34 KiB)
// or two of 4 (96 KiB each, bf16). An 8k-column prompt of the 27B at tp 1 (H 24, KV 4) is
// 4 x 8192 * 6 / 128 = 1536 CTAs, at tp 2 768: several waves on 132 SMs.
//
// Numerics: fp32 accumulation and softmax; P rounded to bf16 for the P V mma (as the reference's bf16
// path rounds probabilities), row sum from the fp32 probabilities; int8 K/V dequantised as the
// reference's bf16 path: fp32 code * scale rounded to bf16. Epilogue: O / l rounded to bf16, staged in
// the warp's own rows of Qs (no other warp reads them), then written out in 16-byte chunks with the gate
// applied by `gated` (common.cuh), as the decode kernels do.
#include "common.cuh"

#define PF_PAGE 64
#define PF_NEG_INF (__int_as_float(0xff800000))

typedef signed char i8_t;

// Two fp32 -> bf16x2 (round to nearest even, as f32_to_bf16 for every non-NaN); lo in the low half.
__device__ __forceinline__ unsigned pf_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}


// Shared byte offset of 16-byte chunk c of row r in a swizzled bf16 tile of D columns.
template <int D>
__device__ __forceinline__ unsigned pf_swz(int r, int c) {
    return (unsigned)(r * D + ((c ^ (r & 7)) << 3)) * 2u;
}

// Tile loads. Thread tid copies 16-byte chunks tid, tid + NT, ...; NT is a multiple of the chunks per
// row, so a thread keeps one chunk column (c = tid % CH) and steps RS = NT / CH rows: its addresses are
// one base plus multiples of a fixed step, not a table of per-chunk offsets held across the key loop.
// Offsets inside a page fit 32 bits (64 * KV * D elements).
template <int D, int NT>
struct PfLoad {
    static constexpr int CH = D / 8, RS = NT / CH;       // bf16 tile: chunks per row, rows per step
    static constexpr int CC = D / 16, RSC = NT / CC;     // int8 codes: the same
    static constexpr int NG = D / 64;                    // scales per row
    int r0, rc0;                                         // first row (bf16 chunks, int8 chunks)
    unsigned goff, gstep, coff, cstep, soff;            // global offsets (elements) inside a page
    unsigned sdst, cdst;                                 // shared byte offsets of the first chunk

    __device__ __forceinline__ PfLoad(int tid, int kvh, int KV) {
        const unsigned kvd = (unsigned)(KV * D);
        r0 = tid / CH;
        const int c = tid % CH;
        goff = (unsigned)r0 * kvd + (unsigned)(kvh * D + c * 8);
        gstep = (unsigned)RS * kvd;
        sdst = (unsigned)(r0 * D) * 2u + (unsigned)(c << 4);             // before the swizzle
        rc0 = tid / CC;
        const int cc = tid % CC;
        coff = (unsigned)rc0 * kvd + (unsigned)(kvh * D + cc * 16);
        cstep = (unsigned)RSC * kvd;
        cdst = (unsigned)(rc0 * D + cc * 16);
        soff = (unsigned)(kvh * NG);
    }

    // Chunk i's swizzled shared offset: row r = r0 + i RS, chunk c ^ (r & 7). Row offsets are multiples of
    // 128 bytes and the swizzle only flips bits 4-6, so (a + rows) ^ x = (a ^ x) + rows; RS is 4 or a
    // multiple of 8, so r & 7 is r0 & 7, flipped by 4 on odd i when RS = 4.
    __device__ __forceinline__ unsigned swz(int i) const {
        return (sdst ^ (unsigned)((((r0 & 7) ^ ((i * RS) & 7)) << 4))) + (unsigned)(i * RS * D * 2);
    }
};

// One key tile (page `page`, keys base .. base + 63) of a bf16 pool -> swizzled tile at dst. Rows past
// pmax are zero-filled.
template <int D, int NT>
__device__ __forceinline__ void pf_issue_bf16(const PfLoad<D, NT>& ld, const bf16_t* __restrict__ pool, unsigned dst,
                                              int page, int base, int pmax, int KV) {
    using LD = PfLoad<D, NT>;
    const bf16_t* src = pool + (i64_t)page * PF_PAGE * KV * D;
    const int lim = pmax - base - ld.r0;                 // chunk i is live when i * RS <= lim
    unsigned off = ld.goff;
#pragma unroll
    for (int i = 0; i < PF_PAGE / LD::RS; ++i) {
        const bool ok = i * LD::RS <= lim;
        cp_async16(dst + ld.swz(i), ok ? (const void*)(src + off) : (const void*)pool, ok ? 16u : 0u);
        off += ld.gstep;
    }
}

// The same tile of an int8 pool: codes [64][D] (unswizzled) and scales [64][D / 64] into staging.
template <int D, int NT>
__device__ __forceinline__ void pf_issue_i8(const PfLoad<D, NT>& ld, const i8_t* __restrict__ pool,
                                            const float* __restrict__ scl, unsigned dcodes, unsigned dscales,
                                            int page, int base, int pmax, int KV) {
    using LD = PfLoad<D, NT>;
    const int tid = threadIdx.x;
    const i8_t* src = pool + (i64_t)page * PF_PAGE * KV * D;
    const int lim = pmax - base - ld.rc0;
    unsigned off = ld.coff;
#pragma unroll
    for (int i = 0; i < PF_PAGE / LD::RSC; ++i) {
        const bool ok = i * LD::RSC <= lim;
        cp_async16(dcodes + ld.cdst + (unsigned)(i * LD::RSC * D), ok ? (const void*)(src + off) : (const void*)pool,
                ok ? 16u : 0u);
        off += ld.cstep;
    }
    const float* s0 = scl + (i64_t)page * PF_PAGE * KV * LD::NG + ld.soff;
#pragma unroll
    for (int i = 0; i < (PF_PAGE * LD::NG + NT - 1) / NT; ++i) {
        const int e = tid + i * NT;
        if (PF_PAGE * LD::NG % NT == 0 || e < PF_PAGE * LD::NG) {
            const int r = e / LD::NG, gi = e % LD::NG;
            const bool ok = base + r <= pmax;
            cp_async4(dscales + (unsigned)e * 4u, ok ? (const void*)(s0 + r * KV * LD::NG + gi) : (const void*)scl,
                   ok ? 4u : 0u);
        }
    }
}

// Staged int8 tile -> bf16 swizzled tile: fp32 code * scale, rounded to bf16 (reference bf16 path).
template <int D, int NT>
__device__ __forceinline__ void pf_dequant(const PfLoad<D, NT>& ld, const i8_t* codes, const float* scales,
                                           unsigned char* dst) {
    using LD = PfLoad<D, NT>;
    const int c = threadIdx.x % LD::CH;
#pragma unroll
    for (int i = 0; i < PF_PAGE / LD::RS; ++i) {
        const int r = ld.r0 + i * LD::RS;
        const uint2 w = *reinterpret_cast<const uint2*>(codes + r * D + c * 8);
        const float s = scales[r * LD::NG + (c >> 3)];
        float f[8];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            f[b] = (float)((int)(w.x << (24 - 8 * b)) >> 24) * s;          // sign-extend byte b
            f[4 + b] = (float)((int)(w.y << (24 - 8 * b)) >> 24) * s;
        }
        uint4 o;
        o.x = pf_pack(f[0], f[1]); o.y = pf_pack(f[2], f[3]); o.z = pf_pack(f[4], f[5]); o.w = pf_pack(f[6], f[7]);
        *reinterpret_cast<uint4*>(dst + ld.swz(i)) = o;
    }
}

template <int D, int W, bool I8, bool SPLIT>
__device__ __forceinline__ void prefill_tile(bf16_t* __restrict__ out, const bf16_t* __restrict__ q,
                                             const void* __restrict__ k_pool, const void* __restrict__ v_pool,
                                             const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                             const int* __restrict__ page_tables, const int* __restrict__ positions,
                                             const int* __restrict__ cu_seqlens, const bf16_t* __restrict__ gate,
                                             int H, int KV, int max_pages, i64_t gate_s0, i64_t gate_s1,
                                             float scale_log2, int ntiles = 0, int chunk_tiles = 0, int S = 1,
                                             float* __restrict__ part_ml = nullptr,
                                             float* __restrict__ part_acc = nullptr) {
    constexpr int ROWS = 16 * W, NT = 32 * W;
    constexpr int CH = D / 8;               // 16-byte chunks of a bf16 row; also the O n-tiles (8 dims each)
    constexpr int KS = D / 16;              // k-steps of Q K^T
    extern __shared__ __align__(128) unsigned char pf_smem[];
    bf16_t* Qs = reinterpret_cast<bf16_t*>(pf_smem);
    bf16_t* Ks = Qs + ROWS * D;
    bf16_t* Vs = Ks + PF_PAGE * D;
    i8_t* Kc = reinterpret_cast<i8_t*>(Vs + PF_PAGE * D);                // int8 staging (codes, scales)
    i8_t* Vc = Kc + PF_PAGE * D;
    float* Ksc = reinterpret_cast<float*>(Vc + PF_PAGE * D);
    float* Vsc = Ksc + PF_PAGE * (D / 64);
    int* red = I8 ? reinterpret_cast<int*>(Vsc + PF_PAGE * (D / 64)) : reinterpret_cast<int*>(Kc);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kvh = blockIdx.x, b = blockIdx.y;
    const int c0 = cu_seqlens[b];
    const int G = H / KV;
    const int rows = (cu_seqlens[b + 1] - c0) * G;
    // SPLIT: blockIdx.z = split * ntiles + (tile counted from the end)
    const int sidx = SPLIT ? (int)blockIdx.z / ntiles : 0;
    const int zt = SPLIT ? (int)blockIdx.z - sidx * ntiles : (int)blockIdx.z;
    const int tile = (rows + ROWS - 1) / ROWS - 1 - zt;
    if (tile < 0) return;                                                // CTA-uniform
    const int rho0 = tile * ROWS;
    const int* pt = page_tables + (i64_t)b * max_pages;
    const unsigned qs = smem_u32(Qs), ks = smem_u32(Ks), vs = smem_u32(Vs);

    // Q rows -> Qs (rows past the sequence zero-filled).
#pragma unroll 4
    for (int i = 0; i < ROWS * CH / NT; ++i) {
        const int e = tid + i * NT;
        const int r = e / CH, c = e % CH;
        const int rho = rho0 + r;
        const bool ok = rho < rows;
        const bf16_t* src = q;
        if (ok) src = q + ((i64_t)(c0 + rho / G) * H + kvh * G + rho % G) * D + c * 8;
        cp_async16(qs + pf_swz<D>(r, c), src, ok ? 16u : 0u);
    }

    // Positions of this lane's rows (g, g + 8); -1 for rows past the sequence (every key masked).
    int pr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int rho = rho0 + warp * 16 + g + 8 * i;
        pr[i] = rho < rows ? positions[c0 + rho / G] : -1;
    }
    int pw = max(pr[0], pr[1]), pmn = min(pr[0], pr[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        pw = max(pw, __shfl_xor_sync(0xffffffffu, pw, o));
        pmn = min(pmn, __shfl_xor_sync(0xffffffffu, pmn, o));
    }
    if (lane == 0) red[warp] = pw;
    __syncthreads();
    int pmax = red[0];
#pragma unroll
    for (int w = 1; w < W; ++w) pmax = max(pmax, red[w]);           // >= 0: the tile has a row
    const int J = (pmax >> 6) + 1;
    // key tiles of this CTA: all of them, or (SPLIT) split sidx's chunk_tiles, the last split to the end
    const int j0 = SPLIT ? sidx * chunk_tiles : 0;
    const int j1 = SPLIT ? (sidx == S - 1 ? J : min(J, j0 + chunk_tiles)) : J;
    if (SPLIT && j0 >= J) {                                              // CTA-uniform: no keys here
        cp_async_wait<0>();                                              // (the Q copies) before leaving
        return;
    }

    const PfLoad<D, NT> ld(tid, kvh, KV);
    const bf16_t* kp = reinterpret_cast<const bf16_t*>(k_pool);
    const bf16_t* vp = reinterpret_cast<const bf16_t*>(v_pool);
    const i8_t* kq = reinterpret_cast<const i8_t*>(k_pool);
    const i8_t* vq = reinterpret_cast<const i8_t*>(v_pool);
    if constexpr (I8)
        pf_issue_i8<D, NT>(ld, kq, k_scale, smem_u32(Kc), smem_u32(Ksc), pt[j0], j0 * PF_PAGE, pmax, KV);
    else
        pf_issue_bf16<D, NT>(ld, kp, ks, pt[j0], j0 * PF_PAGE, pmax, KV);
    cp_async_commit();                                                         // one group: Q and K(0)

    // ldmatrix lane addresses. Lane l supplies row l & 7 of matrix l >> 3; with the swizzle, logical
    // chunk 2s + x (x = 0, 1) of a row whose r & 7 = l & 7 sits at chunk (2s) ^ (x ^ (l & 7)) =
    // 8 (s >> 2) + ((2 (s & 3)) ^ x ^ (l & 7)): four per-lane bases (s & 3) plus immediates (the XOR
    // written out per k-step would cost a register per k-step).
    const int l7 = lane & 7, l8 = (lane >> 3) & 1, l16 = lane >> 4;
    //   Q (A): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) -> a0 a1 a2 a3: row l7 + 8 l8, chunk 2kk + l16
    //   K (B): matrices (keys 0-7: k lo | k hi) (keys 8-15: k lo | k hi) -> b0 b1 of n-tile 2np, of 2np+1:
    //          key row l7 + 8 l16, chunk 2kk + l8
    //   V (B, .trans): matrices (dims 0-7: keys 0-7 | 8-15) (dims 8-15: ...) -> b0 b1 of n-tile 2dp, of
    //          2dp+1: key row l7 + 8 l8, chunk 2dp + l16
    unsigned qb[4], kb[4], vb[4];
#pragma unroll
    for (int s4 = 0; s4 < 4; ++s4) {
        qb[s4] = qs + (unsigned)((warp * 16 + l7 + 8 * l8) * D * 2) + (unsigned)(((2 * s4) ^ l16 ^ l7) << 4);
        kb[s4] = ks + (unsigned)((l7 + 8 * l16) * D * 2) + (unsigned)(((2 * s4) ^ l8 ^ l7) << 4);
        vb[s4] = vs + (unsigned)((l7 + 8 * l8) * D * 2) + (unsigned)(((2 * s4) ^ l16 ^ l7) << 4);
    }

    float o[CH][4];
#pragma unroll
    for (int nt = 0; nt < CH; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m[2] = {PF_NEG_INF, PF_NEG_INF}, l[2] = {0.f, 0.f};
    unsigned pa[4][4];                                                   // P as A fragments, per 16-key k-step

    for (int j = j0; j < j1; ++j) {
        // (A) K(j) landed and every warp is done with Vs (P V(j-1)).
        cp_async_wait<0>();
        __syncthreads();
        if constexpr (I8) {
            pf_issue_i8<D, NT>(ld, vq, v_scale, smem_u32(Vc), smem_u32(Vsc), pt[j], j * PF_PAGE, pmax, KV);
            cp_async_commit();
            pf_dequant<D, NT>(ld, Kc, Ksc, reinterpret_cast<unsigned char*>(Ks));
            __syncthreads();
        } else {
            pf_issue_bf16<D, NT>(ld, vp, vs, pt[j], j * PF_PAGE, pmax, KV);
            cp_async_commit();
        }

        const bool live = j * PF_PAGE <= pw;                             // warp-uniform
        if (live) {
            float s[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                unsigned a[4];
                ldsm_x4(qb[kk & 3] + (unsigned)((kk >> 2) << 7), a);
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    unsigned bb[4];
                    ldsm_x4(kb[kk & 3] + (unsigned)(np * 32 * D + ((kk >> 2) << 7)), bb);
                    mma_bf16_16816(s[2 * np], a, bb[0], bb[1]);
                    mma_bf16_16816(s[2 * np + 1], a, bb[2], bb[3]);
                }
            }
            if (j * PF_PAGE + PF_PAGE - 1 > pmn) {                       // the tile reaches past some row
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = j * PF_PAGE + nt * 8 + 2 * t + (e & 1);
                        if (key > pr[e >> 1]) s[nt][e] = PF_NEG_INF;
                    }
                }
            }
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                mx[0] = fmaxf(mx[0], fmaxf(s[nt][0], s[nt][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[nt][2], s[nt][3]));
            }
            float ms[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
                ms[i] = mx[i] == PF_NEG_INF ? 0.f : mx[i] * scale_log2;  // a row with no key yet: p = 0
                const float corr = fast_exp2(m[i] * scale_log2 - ms[i]);   // 0 while m is -inf
                m[i] = mx[i];
                l[i] *= corr;
#pragma unroll
                for (int nt = 0; nt < CH; ++nt) {
                    o[nt][2 * i] *= corr;
                    o[nt][2 * i + 1] *= corr;
                }
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -ms[e >> 1]));
                    l[e >> 1] += s[nt][e];
                }
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                pa[kk][0] = pf_pack(s[2 * kk][0], s[2 * kk][1]);
                pa[kk][1] = pf_pack(s[2 * kk][2], s[2 * kk][3]);
                pa[kk][2] = pf_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[kk][3] = pf_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
        } else {
            // Not needed for the result (P V is skipped too), but without a definition on this path the
            // compiler keeps pa live across the next S (16 registers).
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
        }

        // (B) V(j) landed and every warp is done with Ks (S(j)).
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < j1) {
            if constexpr (I8)
                pf_issue_i8<D, NT>(ld, kq, k_scale, smem_u32(Kc), smem_u32(Ksc), pt[j + 1], (j + 1) * PF_PAGE,
                                   pmax, KV);
            else
                pf_issue_bf16<D, NT>(ld, kp, ks, pt[j + 1], (j + 1) * PF_PAGE, pmax, KV);
        }
        cp_async_commit();
        if constexpr (I8) {
            pf_dequant<D, NT>(ld, Vc, Vsc, reinterpret_cast<unsigned char*>(Vs));
            __syncthreads();
        }

        if (live) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    unsigned bb[4];
                    ldsm_x4_t(vb[dp & 3] + (unsigned)(kk * 32 * D + ((dp >> 2) << 7)), bb);
                    mma_bf16_16816(o[2 * dp], pa[kk], bb[0], bb[1]);
                    mma_bf16_16816(o[2 * dp + 1], pa[kk], bb[2], bb[3]);
                }
            }
        }
    }

    // Epilogue: row sums over the 4 lanes of a row, O / l -> bf16 into this warp's rows of Qs (read
    // only by this warp, last in S(J-1), before barrier (B)), then 16-byte chunks with the gate.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    if constexpr (SPLIT) {
        // the split's partials, as gqa_decode_split_g* writes them (attention.cu): max in the base-2
        // domain (scores * scale * log2 e), sum of exp2(s - max), unnormalised acc; gqa_decode_combine
        // merges them. A row reads split sidx only if it has keys there, so its max is finite.
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int rho = rho0 + warp * 16 + g + 8 * i;
            if (rho < rows) {
                const int n = c0 + rho / G, h = kvh * G + rho % G;
                const i64_t pidx = ((i64_t)n * H + h) * S + sidx;
                if (t == 0) {
                    part_ml[2 * pidx] = m[i] == PF_NEG_INF ? PF_NEG_INF : m[i] * scale_log2;
                    part_ml[2 * pidx + 1] = l[i];
                }
                float* dst = part_acc + pidx * D + 2 * t;
#pragma unroll
                for (int nt = 0; nt < CH; ++nt)
                    *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(o[nt][2 * i], o[nt][2 * i + 1]);
            }
        }
        return;
    }
    const float inv0 = __fdividef(1.f, l[0]), inv1 = __fdividef(1.f, l[1]);    // l >= 1 on rows with keys
    unsigned char* qrow = reinterpret_cast<unsigned char*>(Qs) + (warp * 16 + g) * D * 2;
#pragma unroll
    for (int nt = 0; nt < CH; ++nt) {
        const unsigned off = (unsigned)((((nt ^ g) << 3) + 2 * t) * 2);
        *reinterpret_cast<unsigned*>(qrow + off) = pf_pack(o[nt][0] * inv0, o[nt][1] * inv0);
        *reinterpret_cast<unsigned*>(qrow + 8 * D * 2 + off) = pf_pack(o[nt][2] * inv1, o[nt][3] * inv1);
    }
    __syncwarp();
#pragma unroll 4
    for (int i = 0; i < 16 * CH / 32; ++i) {
        const int e = lane + 32 * i;
        const int r = e / CH, c = e % CH;
        const int rho = rho0 + warp * 16 + r;
        if (rho < rows) {
            const int n = c0 + rho / G, h = kvh * G + rho % G;
            const uint4 av = *reinterpret_cast<const uint4*>(pf_smem + pf_swz<D>(warp * 16 + r, c));
            const uint4 gv = *reinterpret_cast<const uint4*>(gate + n * gate_s0 + h * gate_s1 + c * 8);
            const unsigned aw[4] = {av.x, av.y, av.z, av.w}, gw[4] = {gv.x, gv.y, gv.z, gv.w};
            unsigned ow[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 af = bf16x2_to_f32x2(aw[k]), gf = bf16x2_to_f32x2(gw[k]);
                ow[k] = pf_pack(gated(af.x, gf.x), gated(af.y, gf.y));
            }
            *reinterpret_cast<uint4*>(out + ((i64_t)n * H + h) * D + c * 8) = make_uint4(ow[0], ow[1], ow[2], ow[3]);
        }
    }
}

// MINB: CTAs per SM the register budget is cut for (65536 / (32 W MINB) registers per thread).
#define PREFILL_KERNEL(NAME, D, W, I8, MINB)                                                              \
    extern "C" __global__ void __launch_bounds__(W * 32, MINB)                                            \
    NAME(bf16_t* out, const bf16_t* q, const void* k_pool, const void* v_pool, const float* k_scale,      \
         const float* v_scale, const int* page_tables, const int* positions, const int* cu_seqlens,       \
         const bf16_t* gate, int H, int KV, int max_pages, i64_t gate_s0, i64_t gate_s1, float scale_log2) { \
        prefill_tile<D, W, I8, false>(out, q, k_pool, v_pool, k_scale, v_scale, page_tables, positions,     \
                                      cu_seqlens, gate, H, KV, max_pages, gate_s0, gate_s1, scale_log2);  \
    }

// The key-split form (decode and verification columns against long contexts): grid (KV, B, S * ntiles),
// split s takes key tiles [s * chunk_tiles, (s + 1) * chunk_tiles) (the last one to the end) and writes
// partials for gqa_decode_combine instead of the gated output.
#define PREFILL_SPLIT_KERNEL(NAME, D, W, I8, MINB)                                                        \
    extern "C" __global__ void __launch_bounds__(W * 32, MINB)                                            \
    NAME(const bf16_t* q, const void* k_pool, const void* v_pool, const float* k_scale,                   \
         const float* v_scale, const int* page_tables, const int* positions, const int* cu_seqlens,       \
         int H, int KV, int max_pages, float scale_log2, int ntiles, int chunk_tiles, int S,              \
         float* part_ml, float* part_acc) {                                                               \
        prefill_tile<D, W, I8, true>(nullptr, q, k_pool, v_pool, k_scale, v_scale, page_tables, positions,  \
                                     cu_seqlens, nullptr, H, KV, max_pages, 0, 0, scale_log2, ntiles,     \
                                     chunk_tiles, S, part_ml, part_acc);                                  \
    }

PREFILL_KERNEL(prefill_attn_d64_w4, 64, 4, false, 4)
PREFILL_KERNEL(prefill_attn_d64_w8, 64, 8, false, 2)
PREFILL_KERNEL(prefill_attn_d128_w4, 128, 4, false, 2)
PREFILL_KERNEL(prefill_attn_d128_w8, 128, 8, false, 1)
PREFILL_KERNEL(prefill_attn_d256_w4, 256, 4, false, 2)
PREFILL_KERNEL(prefill_attn_d256_w8, 256, 8, false, 1)
PREFILL_KERNEL(prefill_attn_i8_d64_w4, 64, 4, true, 4)
PREFILL_KERNEL(prefill_attn_i8_d64_w8, 64, 8, true, 2)
PREFILL_KERNEL(prefill_attn_i8_d128_w4, 128, 4, true, 2)
PREFILL_KERNEL(prefill_attn_i8_d128_w8, 128, 8, true, 1)
PREFILL_KERNEL(prefill_attn_i8_d256_w4, 256, 4, true, 2)
PREFILL_KERNEL(prefill_attn_i8_d256_w8, 256, 8, true, 1)

PREFILL_SPLIT_KERNEL(prefill_attn_split_d64_w4, 64, 4, false, 2)
PREFILL_SPLIT_KERNEL(prefill_attn_split_d128_w4, 128, 4, false, 2)
PREFILL_SPLIT_KERNEL(prefill_attn_split_d256_w4, 256, 4, false, 2)
PREFILL_SPLIT_KERNEL(prefill_attn_split_i8_d64_w4, 64, 4, true, 2)
PREFILL_SPLIT_KERNEL(prefill_attn_split_i8_d128_w4, 128, 4, true, 2)
PREFILL_SPLIT_KERNEL(prefill_attn_split_i8_d256_w4, 256, 4, true, 2)

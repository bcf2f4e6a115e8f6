// The mailbox exchange (GPU flavor of transport/mailbox.py): all-reduce and all-gather between rank
// processes through one shared-memory segment registered as mapped pinned host memory in every process.
//
// Layout (transport/mailbox.py defines it): a 64-byte header (hang word at byte 24), then for rank r and
// slot s in {0, 1}: `words` u64 words at header + (r * 2 + s) * words. A word is a float32's bits (or,
// for bf16 payloads, two bf16 elements: half the words, half the PCIe traffic) in its low half and the
// epoch of the exchange that wrote it in its high half, so a reader knows a word is current by the word
// itself: no flags, no fences. Exchange e writes slot e % 2.
//
// Epochs come from device memory, so a captured CUDA graph replays with fresh epochs without the host:
// state[0] holds the last epoch used; every block reads it at its start and uses e = state[0] % (2^32 - 2)
// + 1 (1 .. 2^32 - 2, an even period: the slots keep alternating across the wrap); the block that finishes
// last (state[1] counts finished blocks) stores e into state[0] and resets state[1]. Consecutive exchanges
// are consecutive launches on one stream, so the next launch sees the new epoch.
//
// Why a slot can be rewritten: a rank writes exchange e + 2 (same slot as e) only after its launch for
// e + 1 finished, which needed every peer's e + 1 words, which each peer wrote only after its launch for
// e had finished reading (stream order: launches of one rank do not overlap).
//
// Thread layout: a thread owns chunks of 2 consecutive words (one 16-byte pair: 4 bf16 or 2 float32
// elements), grid-strided.
// Phase 1 writes all its chunks' words to the own slot; phase 2 polls every peer's words of the same
// chunks, sums in float32 in rank order 0 .. tp-1 (bit-identical on every rank) and stores. A block waits
// only for words that peer threads write unconditionally in their own phase 1, so blocks never depend on
// each other; the host caps the grid so all blocks are resident anyway.
//
// Hang guard: a thread that waits longer than timeout_ns (%globaltimer) sets the sticky hang word to
// 1 + rank if it is still 0 and gives up; every thread also gives up when it sees the hang word set
// (checked while waiting, after the first 64 polls: reading host memory at the start would put a PCIe
// round trip in front of every exchange). Outputs of a failed exchange are undefined; the host reads the
// hang word. (No atomics on host memory: they need PCIe atomics; the CPU flavor also stores plainly.)
//
// Stale words: a word carries the epoch of its last write, so a word not rewritten for a whole pass of
// 2^32 - 2 epochs could pass for current. At the first and the last use of each slot in a pass (e in
// {1, 2, 2^32 - 3, 2^32 - 2}) every word past n of the own slot is cleared (then a system fence, so the
// clearing is visible before any later exchange's words): after epochs 2^32 - 3 and 2^32 - 2 no word
// carries 1 or 2, and after 1 and 2 no word carries an epoch of the previous pass.

#include "common.cuh"

typedef unsigned long long u64_t;

#define MB_THREADS 256
#define MB_MAX_TP 8
#define MB_HEADER_WORDS 8          // 64 bytes
#define MB_HANG_WORD 3             // byte offset 24
#define MB_PERIOD 0xFFFFFFFEu      // epochs run 1 .. MB_PERIOD
// Tuning flags (kernel mailbox_exchange_f<flags>, transport/mailbox_cuda.py FLAGS):
#define MB_FLAG_FENCE 1            // a system fence after publishing, before polling
#define MB_FLAG_HANG_LANE0 2       // only lane 0 of a warp polls the hang word (the others rely on their timeout)

// Volatile accesses: not cached in L1, system-scope relaxed semantics (PTX: .volatile == .relaxed.sys).
__device__ __forceinline__ void st_word(u64_t* p, u64_t v) {
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_words2(u64_t* p, u64_t a, u64_t b) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ u64_t ld_word(const u64_t* p) {
    u64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void ld_words2(const u64_t* p, u64_t& a, u64_t& b) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64_t global_ns() {
    u64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void sleep_ns(unsigned ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }

// Word k of this rank's payload: float32 input, element k's bits; bf16 input (packed), the raw bits of
// elements 2k (low half) and 2k + 1 (high half; 0 past n).
__device__ __forceinline__ u64_t make_word(const void* in, long long k, int n, int packed, u64_t tag) {
    if (!packed) return tag | (u64_t)__float_as_uint(((const float*)in)[k]);
    const unsigned short* h = (const unsigned short*)in;
    const unsigned lo = h[2 * k];
    const unsigned hi = 2 * k + 1 < n ? (unsigned)h[2 * k + 1] : 0u;
    return tag | (u64_t)(lo | (hi << 16));
}

// The float32 value of one element of a word (half: which bf16 of a packed word).
__device__ __forceinline__ float word_value(u64_t w, int half, int packed) {
    const unsigned d = (unsigned)w;
    if (!packed) return __uint_as_float(d);
    return __uint_as_float(half ? (d & 0xffff0000u) : (d << 16));
}

__device__ __forceinline__ bool current(u64_t a, u64_t b, bool two, unsigned e) {
    return (unsigned)(a >> 32) == e && (!two || (unsigned)(b >> 32) == e);
}

// Wait until the peer's words at p (one, or two when `two`) carry epoch e; a and b hold the first poll.
// false: gave up (hang word set by another rank, or timed out here and set it).
template <int flags>
__device__ __forceinline__ bool wait_words(const u64_t* p, bool two, bool vec, unsigned e, u64_t& a, u64_t& b,
                                           u64_t* hang, int rank, u64_t timeout_ns, u64_t& deadline) {
    unsigned spins = 0, ns = 32;
    const bool reads_hang = !(flags & MB_FLAG_HANG_LANE0) || (threadIdx.x & 31) == 0;
    while (!current(a, b, two, e)) {
        if (++spins > 64) {
            if ((spins & 15) == 0) {
                if (reads_hang && ld_word(hang) != 0ull) return false;
                const u64_t now = global_ns();
                if (deadline == 0ull) {
                    deadline = now + timeout_ns;
                } else if (now > deadline) {
                    if (ld_word(hang) == 0ull) st_word(hang, (u64_t)(rank + 1));
                    return false;
                }
            }
            sleep_ns(ns);
            ns = ns < 64u ? ns * 2u : 100u;
        }
        if (two && vec) {
            ld_words2(p, a, b);
        } else {
            a = ld_word(p);
            if (two) b = ld_word(p + 1);
        }
    }
    return true;
}

// One exchange of n elements (n <= words); kernels mailbox_exchange_f0 .. _f3 (the MB_FLAG_* set).
//   in:    [n] bf16 (in_f32 = 0) or float32 (in_f32 = 1)
//   out:   gather = 0: the sum, [n] bf16 (out_f32 = 0) or float32 (out_f32 = 1); may alias in
//          gather = 1: every rank's elements as float32, row p at out + p * out_stride
//   seg:   the mapped segment (host memory; header first)
//   state: device u32 [2]: last epoch used, blocks finished with the current exchange (0 between launches)
template <int flags>
__device__ __forceinline__ void mailbox_exchange_body(const void* in, void* out, u64_t* seg, unsigned* state, int rank,
                                                      int tp, long long words, int n, int in_f32, int out_f32,
                                                      int gather, long long out_stride, u64_t timeout_ns) {
    __shared__ unsigned s_epoch;
    u64_t* hang = seg + MB_HANG_WORD;
    if (threadIdx.x == 0) s_epoch = ld_acquire_u32(state) % MB_PERIOD + 1u;   // ordered before the atomic below
    __syncthreads();
    const unsigned e = s_epoch;
    const u64_t tag = (u64_t)e << 32;
    u64_t* slots = seg + MB_HEADER_WORDS + (long long)(e & 1u) * words;     // rank r's slot: slots + r*2*words
    u64_t* mine = slots + (long long)rank * 2 * words;
    const bool vec = (((unsigned long long)mine) & 15ull) == 0ull;          // same for every rank's slot
    const long long G = (long long)gridDim.x * blockDim.x;
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // bf16 payloads travel packed, two elements per word (half the PCIe traffic); float32 ones one per word.
    const int packed = !in_f32;
    const long long nw = packed ? ((long long)n + 1) >> 1 : (long long)n;    // words of this exchange
    const long long chunks = (nw + 1) >> 1;                                  // a thread's unit: 2 words

    {
        // Phase 1: publish this rank's words.
        for (long long c = g; c < chunks; c += G) {
            const long long k = 2 * c;
            const u64_t w0 = make_word(in, k, n, packed, tag);
            if (k + 1 < nw) {
                const u64_t w1 = make_word(in, k + 1, n, packed, tag);
                if (vec) {
                    st_words2(mine + k, w0, w1);
                } else {
                    st_word(mine + k, w0);
                    st_word(mine + k + 1, w1);
                }
            } else {
                st_word(mine + k, w0);
            }
        }
        if (flags & MB_FLAG_FENCE) __threadfence_system();     // push this rank's words out before polling
        if (e <= 2u || e >= MB_PERIOD - 1u) {                   // first and last use of a slot in a pass
            for (long long k = nw + g; k < words; k += G) st_word(mine + k, 0ull);
            __threadfence_system();      // cleared before any later exchange's words become visible
        }

        // Phase 2: collect every peer's words of the same chunks.
        u64_t deadline = 0ull;
        for (long long c = g; c < chunks; c += G) {
            const long long k = 2 * c;
            const bool two = k + 1 < nw;
            // own words again from the input (read before out is written: out may alias in)
            const u64_t w0 = make_word(in, k, n, packed, tag);
            const u64_t w1 = two ? make_word(in, k + 1, n, packed, tag) : 0ull;
            u64_t a[MB_MAX_TP], b[MB_MAX_TP];
#pragma unroll
            for (int p = 0; p < MB_MAX_TP; ++p) {                 // first poll of every peer, all in flight
                a[p] = w0;
                b[p] = w1;
                if (p < tp && p != rank) {
                    const u64_t* q = slots + (long long)p * 2 * words + k;
                    if (two && vec) {
                        ld_words2(q, a[p], b[p]);
                    } else {
                        a[p] = ld_word(q);
                        if (two) b[p] = ld_word(q + 1);
                    }
                }
            }
            bool ok = true;
#pragma unroll
            for (int p = 0; p < MB_MAX_TP; ++p) {
                if (ok && p < tp && p != rank)
                    ok = wait_words<flags>(slots + (long long)p * 2 * words + k, two, vec, e, a[p], b[p], hang, rank,
                                           timeout_ns, deadline);
            }
            if (!ok) break;                                       // the hang word is set; the host will see it
            // element j of the chunk (0 .. 3 packed, 0 .. 1 not): word j >> packed, half j & packed
            const long long i0 = packed ? 2 * k : k;              // the chunk's first element
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const long long i = i0 + j;
                if (j >= (packed ? 4 : 2) || i >= n) continue;
                const bool second = (packed ? j >> 1 : j) != 0;
                const int half = packed ? j & 1 : 0;
                if (gather) {
                    float* o = (float*)out;
#pragma unroll
                    for (int p = 0; p < MB_MAX_TP; ++p)
                        if (p < tp) o[p * out_stride + i] = word_value(second ? b[p] : a[p], half, packed);
                } else {
                    float s = word_value(second ? b[0] : a[0], half, packed);
#pragma unroll
                    for (int p = 1; p < MB_MAX_TP; ++p)           // float32, rank order 0, 1, ..., tp-1
                        if (p < tp) s += word_value(second ? b[p] : a[p], half, packed);
                    if (out_f32) ((float*)out)[i] = s;
                    else ((bf16_t*)out)[i] = f32_to_bf16(s);
                }
            }
        }
    }

    // The last block to finish publishes the epoch for the next launch (every block has read it by now).
    __syncthreads();
    if (threadIdx.x == 0) {
        if (atomicAdd(state + 1, 1u) == gridDim.x - 1u) {
            state[1] = 0u;
            *(volatile unsigned*)state = e;
        }
    }
}

#define MB_KERNEL(F) \
    extern "C" __global__ void __launch_bounds__(MB_THREADS) mailbox_exchange_f##F( \
        const void* in, void* out, u64_t* seg, unsigned* state, int rank, int tp, long long words, int n, \
        int in_f32, int out_f32, int gather, long long out_stride, u64_t timeout_ns) { \
        mailbox_exchange_body<F>(in, out, seg, state, rank, tp, words, n, in_f32, out_f32, gather, out_stride, \
                                 timeout_ns); \
    }
MB_KERNEL(0)
MB_KERNEL(1)
MB_KERNEL(2)
MB_KERNEL(3)

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
// last (state[1] counts finished blocks) stores e into state[0] and resets state[1] (the lean kernel counts
// warps in state[MB_LEAN_TICKET] instead). Consecutive exchanges are consecutive launches on one stream, so
// the next launch sees the new epoch. Both kernels are dependent launches (pdl_enter() first: the kernel
// after them may be scheduled at once; they read nothing, the epoch included, before the grid in front of
// them has completed), which keeps the stream order this relies on.
//
// Why a slot can be rewritten: a rank writes exchange e + 2 (same slot as e) only after its launch for
// e + 1 finished, which needed every peer's e + 1 words, which each peer wrote only after its launch for
// e had finished reading (stream order: launches of one rank do not overlap).
//
// Two kernels share this protocol (same words, same epochs, same state; any launch of either may follow
// any launch of the other on one mailbox): mailbox_exchange_f<flags> (below: the classic kernel) and
// mailbox_lean_w<1|2> (the lean kernel, after it: its own comment says what it does differently).
//
// Thread layout (classic kernel): a thread owns chunks of 2 consecutive words (one 16-byte pair: 4 bf16
// or 2 float32 elements), grid-strided.
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
#define MB_STATE_WORDS 64          // device state words (transport/mailbox_cuda.py STATE_WORDS)
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
//   state: device u32 [MB_STATE_WORDS]: [0] last epoch used, [1] blocks finished with the current exchange
//          (0 between launches); [MB_LEAN_TICKET] the lean kernel's counter (below; also 0 between launches)
template <int flags>
__device__ __forceinline__ void mailbox_exchange_body(const void* in, void* out, u64_t* seg, unsigned* state, int rank,
                                                      int tp, long long words, int n, int in_f32, int out_f32,
                                                      int gather, long long out_stride, u64_t timeout_ns) {
    pdl_enter();   // a dependent launch: the next kernel may be scheduled now; the input and epoch after the wait
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

// ------------------------------------------------------------------------------------------------------
// The lean kernel: the same words, epochs, slots, clearing and hang word as the classic kernel above, with
// less fixed cost around the two PCIe trips (write the own slot, read the peer's). Kernels
// mailbox_lean_w1 (a thread owns 1 word: 8-byte stores and polls, twice the warps of the classic kernel
// for a payload) and mailbox_lean_w2 (2 words: 16-byte pairs, as the classic kernel); flags 4 and 4 | 8 in
// transport/mailbox_cuda.py. What differs:
//
// * Start: no block-wide epoch broadcast. Every warp issues its own input loads first and then has lane 0
//   read the epoch (ld.acquire, shuffled to the warp), so the two device-memory latencies overlap instead of
//   "thread 0 loads, __syncthreads, every thread loads its input". No __syncthreads anywhere.
// * End: no __syncthreads + atomic round trip after the work. Lane 0 of every warp draws a ticket
//   (atomicAdd on state[MB_LEAN_TICKET], a counter of its own 128 bytes after the epoch, so that the
//   tickets do not queue in front of other warps' epoch reads in one L2 line) right after reading the
//   epoch; the ticket's value is needed only when the warp is done, so its latency hides behind the PCIe
//   trips. The warp holding the last ticket (every warp of the launch has read state[0] before drawing its
//   ticket: the acquire orders the read before the atomic) stores the counter back to 0 and state[0] = e
//   when it is done, as the classic kernel's last block does with its own counter state[1]; so the two
//   kernels keep the same state (last epoch in state[0], both counters 0 between launches).
// * Polling is warp-collective: every warp issues the first polls of all its words (every peer, every unit
//   of the round) at once, then loops while any lane still holds a stale word (__any_sync), re-polling only
//   the stale units; lane 0 reads the hang word and the clock (after the first 64 polls, every 16th) and
//   the whole warp gives up together, so a warp never waits out its own timeout after another rank's.
// * Optional first-poll delay (delay_cycles, clock64 spin after publishing): when both ranks publish at the
//   same moment, a poll issued right after the own stores can reach host memory before the peer's words
//   do, and every miss costs one more full PCIe read round trip (the next look is the next load; more
//   loads in flight would not help: a warp still waits for its outstanding loads before it can finish).
//   The exchange ends when its slowest warp has a hit, so with many warps some first poll nearly always
//   misses. A delay a bit longer than the write/read skew turns the first poll into a hit; it costs the
//   delay when the peer was there first. 0 = poll at once (a tuning knob: measure).
// * Rounds: for tp == 2 a thread handles up to 4 / W units per round (stores of all its units first, then
//   the polls of a round all in flight); other tp one unit per round and up to 8 ranks' words in registers.
//   Round r's unit i of thread g is ((r * B + i) * G + g): a warp's units are contiguous (coalesced) and
//   loop bounds depend on the warp's first thread only, so every loop is warp-uniform.
// * Input words are read with 4- or 8-byte loads when the input is aligned (two 16-bit loads otherwise),
//   and round 0's input stays in registers for phase 2 (no re-read).
//
// Launch: blockDim.x a multiple of 32 (<= MB_THREADS); the host caps the grid so every block is resident
// (launch bounds: 2 blocks of MB_THREADS per SM, at most 128 registers).

#define MB_FULL_MASK 0xffffffffu
#define MB_LEAN_TICKET 32          // state[32]: the lean kernel's warp counter (128 bytes after the epoch)

// Own data of word k (the low half of the word): float32 bits, or two packed bf16 (0 past n).
__device__ __forceinline__ unsigned own_data(const void* in, long long k, int n, int packed, bool al4) {
    if (!packed) return ((const unsigned*)in)[k];
    if (al4 && 2 * k + 1 < n) return ((const unsigned*)in)[k];
    const unsigned short* h = (const unsigned short*)in;
    const unsigned lo = h[2 * k];
    const unsigned hi = 2 * k + 1 < n ? (unsigned)h[2 * k + 1] : 0u;
    return lo | (hi << 16);
}

// The own data of unit words k0 .. k0 + W - 1 (0 past nw).
template <int W>
__device__ __forceinline__ void load_unit(const void* in, long long k0, long long nw, int n, int packed, bool al4,
                                          bool al8, unsigned* d) {
    if (W == 2 && al8 && (packed ? 2 * k0 + 3 < n : k0 + 1 < n)) {
        const uint2 v = *(const uint2*)((const unsigned*)in + k0);
        d[0] = v.x;
        d[1] = v.y;
        return;
    }
#pragma unroll
    for (int j = 0; j < W; ++j) d[j] = k0 + j < nw ? own_data(in, k0 + j, n, packed, al4) : 0u;
}

// Publish unit words k0 .. (< nw) with the tag.
template <int W>
__device__ __forceinline__ void store_unit(u64_t* mine, long long k0, long long nw, bool vec, u64_t tag,
                                           const unsigned* d) {
    if (W == 2 && k0 + 1 < nw) {
        if (vec) {
            st_words2(mine + k0, tag | d[0], tag | d[1]);
        } else {
            st_word(mine + k0, tag | d[0]);
            st_word(mine + k0 + 1, tag | d[1]);
        }
    } else {
        st_word(mine + k0, tag | d[0]);
    }
}

// Poll unit words k0 .. (< nw) of a peer's slot into w (words past nw keep their value).
template <int W>
__device__ __forceinline__ void poll_unit(const u64_t* q, long long k0, long long nw, bool vec, u64_t* w) {
    if (W == 2 && k0 + 1 < nw) {
        if (vec) {
            ld_words2(q + k0, w[0], w[1]);
        } else {
            w[0] = ld_word(q + k0);
            w[1] = ld_word(q + k0 + 1);
        }
    } else {
        w[0] = ld_word(q + k0);
    }
}

// The own data of round r's units (0 for units past the payload).
template <int W, int B>
__device__ __forceinline__ void load_round(const void* in, long long r, long long G, long long g, long long units,
                                           long long nw, int n, int packed, bool al4, bool al8, unsigned (&d)[B * W]) {
#pragma unroll
    for (int i = 0; i < B; ++i) {
        const long long u = (r * B + i) * G + g;
        if (u < units) {
            load_unit<W>(in, u * W, nw, n, packed, al4, al8, d + i * W);
        } else {
#pragma unroll
            for (int j = 0; j < W; ++j) d[i * W + j] = 0u;
        }
    }
}

template <int W, int B>
__device__ __forceinline__ void store_round(u64_t* mine, long long r, long long G, long long g, long long units,
                                            long long nw, bool vec, u64_t tag, const unsigned (&d)[B * W]) {
#pragma unroll
    for (int i = 0; i < B; ++i) {
        const long long u = (r * B + i) * G + g;
        if (u < units) store_unit<W>(mine, u * W, nw, vec, tag, d + i * W);
    }
}

// Wait (warp-collectively) until every peer word in a carries epoch e. Words that are current from the start
// (the own row, rows past tp, words past the payload) are never polled. false: the warp gives up (the hang
// word is set, by another rank or by lane 0 here after its timeout).
template <int W, int P, int B>
__device__ __forceinline__ bool lean_wait(const u64_t* slots, long long words, int rank, int tp, long long r,
                                          long long G, long long g, long long units, long long nw, bool vec,
                                          unsigned e, u64_t (&a)[P][B * W], u64_t* hang, u64_t timeout_ns,
                                          u64_t& deadline) {
    unsigned spins = 0, ns = 32;
    while (true) {
        bool stale = false;
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
            for (int j = 0; j < B * W; ++j) stale |= (unsigned)(a[p][j] >> 32) != e;
        if (!__any_sync(MB_FULL_MASK, stale)) return true;
        if (++spins > 64) {
            if ((spins & 15) == 0) {                            // warp-uniform: spins is the same in every lane
                int stop = 0;
                if ((threadIdx.x & 31) == 0) {
                    if (ld_word(hang) != 0ull) {
                        stop = 1;
                    } else {
                        const u64_t now = global_ns();
                        if (deadline == 0ull) {
                            deadline = now + timeout_ns;
                        } else if (now > deadline) {
                            if (ld_word(hang) == 0ull) st_word(hang, (u64_t)(rank + 1));
                            stop = 1;
                        }
                    }
                }
                if (__shfl_sync(MB_FULL_MASK, stop, 0)) return false;
            }
            sleep_ns(ns);
            ns = ns < 64u ? ns * 2u : 100u;
        }
        // re-poll the stale units only (all of them in flight at once)
#pragma unroll
        for (int p = 0; p < P; ++p) {
#pragma unroll
            for (int i = 0; i < B; ++i) {
                bool st = false;
#pragma unroll
                for (int j = 0; j < W; ++j) st |= (unsigned)(a[p][i * W + j] >> 32) != e;
                if (st)                                         // implies p < tp, p != rank, the unit exists
                    poll_unit<W>(slots + (long long)p * 2 * words, ((r * B + i) * G + g) * W, nw, vec,
                                 a[p] + i * W);
            }
        }
    }
}

// Write word k's elements: the rank-order float32 sum (or every rank's value when gathering).
template <int P>
__device__ __forceinline__ void lean_emit(const u64_t (&w)[P], long long k, void* out, int tp, int n, int packed,
                                          int out_f32, int gather, long long out_stride, bool oal4) {
    const int m = packed ? 2 : 1;
    const long long i0 = packed ? 2 * k : k;
    if (gather) {
        float* o = (float*)out;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (p >= tp) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (h < m && i0 + h < n) o[p * out_stride + i0 + h] = word_value(w[p], h, packed);
        }
        return;
    }
    float s[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        s[h] = word_value(w[0], h, packed);
#pragma unroll
        for (int p = 1; p < P; ++p)                               // float32, rank order 0, 1, ..., tp-1
            if (p < tp) s[h] += word_value(w[p], h, packed);
    }
    if (out_f32) {
        float* o = (float*)out;
        o[i0] = s[0];
        if (m == 2 && i0 + 1 < n) o[i0 + 1] = s[1];
    } else if (m == 2 && i0 + 1 < n && oal4) {
        ((unsigned*)out)[k] = (unsigned)f32_to_bf16(s[0]) | ((unsigned)f32_to_bf16(s[1]) << 16);
    } else {
        bf16_t* o = (bf16_t*)out;
        o[i0] = f32_to_bf16(s[0]);
        if (m == 2 && i0 + 1 < n) o[i0 + 1] = f32_to_bf16(s[1]);
    }
}

// W words per unit, P rank rows in registers (2 when tp == 2, else MB_MAX_TP), B units per round.
template <int W, int P, int B>
__device__ __forceinline__ void lean_body(const void* in, void* out, u64_t* seg, unsigned* state, int rank, int tp,
                                          long long words, int n, int in_f32, int out_f32, int gather,
                                          long long out_stride, u64_t timeout_ns, long long delay_cycles) {
    pdl_enter();   // as in the classic kernel
    const int lane = threadIdx.x & 31;
    const long long G = (long long)gridDim.x * blockDim.x;
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long g0 = g - lane;                          // the warp's first thread: warp-uniform bounds
    const int packed = !in_f32;
    const long long nw = packed ? ((long long)n + 1) >> 1 : (long long)n;   // words of this exchange
    const long long units = (nw + W - 1) / W;
    const bool al4 = (((unsigned long long)in) & 3ull) == 0ull;
    const bool al8 = (((unsigned long long)in) & 7ull) == 0ull;
    u64_t* hang = seg + MB_HANG_WORD;

    // Round 0's input first: those loads are in flight while lane 0 reads the epoch.
    unsigned d0[B * W];
    load_round<W, B>(in, 0, G, g, units, nw, n, packed, al4, al8, d0);
    unsigned e = 0u, ticket = 0u;
    if (lane == 0) {
        e = ld_acquire_u32(state) % MB_PERIOD + 1u;        // acquire: the read is ordered before the ticket
        ticket = atomicAdd(state + MB_LEAN_TICKET, 1u);    // its value is needed only at the end
    }
    e = __shfl_sync(MB_FULL_MASK, e, 0);
    const u64_t tag = (u64_t)e << 32;
    u64_t* slots = seg + MB_HEADER_WORDS + (long long)(e & 1u) * words;     // rank r's slot: slots + r*2*words
    u64_t* mine = slots + (long long)rank * 2 * words;
    const bool vec = (((unsigned long long)mine) & 15ull) == 0ull;          // same for every rank's slot

    // Phase 1: publish this rank's words (every unit of this thread, all rounds).
    store_round<W, B>(mine, 0, G, g, units, nw, vec, tag, d0);
    for (long long r = 1; r * B * G + g0 < units; ++r) {
        unsigned d[B * W];
        load_round<W, B>(in, r, G, g, units, nw, n, packed, al4, al8, d);
        store_round<W, B>(mine, r, G, g, units, nw, vec, tag, d);
    }
    if (e <= 2u || e >= MB_PERIOD - 1u) {                   // first and last use of a slot in a pass
        for (long long k = nw + g; k < words; k += G) st_word(mine + k, 0ull);
        __threadfence_system();      // cleared before any later exchange's words become visible
    }
    if (delay_cycles > 0) {
        const long long t0 = clock64();
        while (clock64() - t0 < delay_cycles) {
        }
    }

    // Phase 2: collect every peer's words of the same units, a round at a time.
    const bool oal4 = (((unsigned long long)out) & 3ull) == 0ull;
    u64_t deadline = 0ull;
    for (long long r = 0; r * B * G + g0 < units; ++r) {
        unsigned d[B * W];
        if (r == 0) {
#pragma unroll
            for (int j = 0; j < B * W; ++j) d[j] = d0[j];
        } else {                            // read before this round's outputs are written (out may alias in)
            load_round<W, B>(in, r, G, g, units, nw, n, packed, al4, al8, d);
        }
        u64_t a[P][B * W];
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
            for (int j = 0; j < B * W; ++j) a[p][j] = tag | d[j];        // current: never polled
#pragma unroll
        for (int p = 0; p < P; ++p) {                                      // first polls, all in flight
            if (p >= tp || p == rank) continue;
#pragma unroll
            for (int i = 0; i < B; ++i) {
                const long long u = (r * B + i) * G + g;
                if (u < units) poll_unit<W>(slots + (long long)p * 2 * words, u * W, nw, vec, a[p] + i * W);
            }
        }
        if (!lean_wait<W, P, B>(slots, words, rank, tp, r, G, g, units, nw, vec, e, a, hang, timeout_ns, deadline))
            break;                                                         // the hang word is set
#pragma unroll
        for (int i = 0; i < B; ++i) {
            const long long u = (r * B + i) * G + g;
            if (u >= units) continue;
#pragma unroll
            for (int j = 0; j < W; ++j) {
                const long long k = u * W + j;
                if (k >= nw) continue;
                u64_t w[P];
#pragma unroll
                for (int p = 0; p < P; ++p) w[p] = a[p][i * W + j];
                lean_emit<P>(w, k, out, tp, n, packed, out_f32, gather, out_stride, oal4);
            }
        }
    }

    // The warp with the last ticket publishes the epoch for the next launch (every warp has read it).
    if (lane == 0 && ticket == gridDim.x * (blockDim.x >> 5) - 1u) {
        *(volatile unsigned*)(state + MB_LEAN_TICKET) = 0u;
        *(volatile unsigned*)state = e;
    }
}

#define MB_LEAN_KERNEL(W) \
    extern "C" __global__ void __launch_bounds__(MB_THREADS, 2) mailbox_lean_w##W( \
        const void* in, void* out, u64_t* seg, unsigned* state, int rank, int tp, long long words, int n, \
        int in_f32, int out_f32, int gather, long long out_stride, u64_t timeout_ns, long long delay_cycles) { \
        if (tp == 2) \
            lean_body<W, 2, 4 / W>(in, out, seg, state, rank, tp, words, n, in_f32, out_f32, gather, out_stride, \
                                   timeout_ns, delay_cycles); \
        else \
            lean_body<W, MB_MAX_TP, 1>(in, out, seg, state, rank, tp, words, n, in_f32, out_f32, gather, \
                                       out_stride, timeout_ns, delay_cycles); \
    }
MB_LEAN_KERNEL(1)
MB_LEAN_KERNEL(2)

// Memory-bandwidth probe for the benchmarks: every thread streams 16-byte words of a buffer
// (several loads in flight, bypassing L1) and folds them into one word per block, so the reads
// cannot be optimised away. The time of one pass over a large buffer gives the HBM read rate
// the decode floor is computed from.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(512) read_probe(const uint4* __restrict__ src, long long n16,
                                                             unsigned* __restrict__ sink) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a, b, c, d;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w) : "l"(src + i));
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w) : "l"(src + i + stride));
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(c.x), "=r"(c.y), "=r"(c.z), "=r"(c.w) : "l"(src + i + 2 * stride));
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(d.x), "=r"(d.y), "=r"(d.z), "=r"(d.w) : "l"(src + i + 3 * stride));
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        const uint4 a = src[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;      // practically never taken, but not provably
}

// Probe of programmatic dependent launch (tests/test_cuda_launch.py). pdl_probe_primary triggers its
// dependents, then one thread waits (up to `spin_cycles` clocks) for pdl_probe_secondary, launched
// right after it on the stream, to raise `flag`, which the secondary does before its pdl_wait (what a
// real kernel may not do; here it is the point): result[0] = 1 if the secondary ran while the primary
// was still running, 2 if the wait ran out (the secondary only started after the primary: an
// ordinary launch, or PDL not in effect). result[1] = 1 once the secondary is past its pdl_wait.
extern "C" __global__ void pdl_probe_primary(int* flag, int* result, long long spin_cycles) {
    pdl_trigger();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const long long t0 = clock64();
        while (*(volatile int*)flag == 0 && clock64() - t0 < spin_cycles) __nanosleep(200);
        result[0] = *(volatile int*)flag != 0 ? 1 : 2;
    }
}

extern "C" __global__ void pdl_probe_secondary(int* flag, int* result) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicExch(flag, 1);
    pdl_wait();
    if (blockIdx.x == 0 && threadIdx.x == 0) result[1] = 1;
}

// The latency floor of a mailbox exchange on this machine (scripts/bench/allreduce.py --floor): what
// the exchange kernel cannot avoid, measured in the same run as the exchanges.
//   floor_empty       a kernel that does nothing (a dependent launch under TANDEM_PDL=all): the cost of
//                     one more kernel in a captured graph.
//   floor_host_read   one thread, `iters` reads of a word of mapped pinned host memory, each address
//                     depending on the value before (mask = 0, unknown to the compiler): the PCIe read
//                     round trip. out[0] = ns for all of them.
//   floor_ping_pong   two ranks, one thread each, over two words of a segment both map: rank 0 stores
//                     v, rank 1 waits for v and stores v, rank 0 waits for it, v + 1, ...; out[0] = ns for
//                     `iters` round trips after a first untimed one (each round trip = two one-way
//                     latencies: store, visible in host memory, seen by the peer's poll). Values start
//                     at `base` and grow by one per round trip (the caller gives every launch a fresh
//                     range, larger than any value the segment holds). out[1] = round trips done (fewer
//                     when timeout_ns ran out: the peer never came).
__device__ __forceinline__ unsigned long long floor_ld(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void floor_st(unsigned long long* p, unsigned long long v) {
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long floor_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void floor_empty() { pdl_enter(); }

extern "C" __global__ void floor_host_read(const unsigned long long* host, int iters, unsigned long long mask,
                                           unsigned long long* out) {
    unsigned long long v = floor_ld(host);
    const unsigned long long t0 = floor_ns();
    for (int i = 0; i < iters; ++i) v = floor_ld(host + (v & mask));
    out[0] = floor_ns() - t0;
    out[1] = v;
}

extern "C" __global__ void floor_ping_pong(unsigned long long* words, int rank, int iters, unsigned long long base,
                                           unsigned long long timeout_ns, unsigned long long* out) {
    unsigned long long* mine = words + rank * 16;                 // the two words 128 bytes apart
    const unsigned long long* peer = words + (1 - rank) * 16;
    const unsigned long long deadline = floor_ns() + timeout_ns;
    unsigned long long t0 = 0;
    for (int i = 0; i <= iters; ++i) {
        const unsigned long long v = base + i;
        if (rank == 0) floor_st(mine, v);
        while (floor_ld(peer) < v) {
            if (floor_ns() > deadline) {
                out[0] = floor_ns() - t0;
                out[1] = i > 0 ? i - 1 : 0;
                return;
            }
        }
        if (rank != 0) floor_st(mine, v);
        if (i == 0) t0 = floor_ns();
    }
    out[0] = floor_ns() - t0;
    out[1] = iters;
}

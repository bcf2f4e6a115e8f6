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

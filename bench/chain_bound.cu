// Reads of a decode step's product weights, one launch a product or one persistent launch for the whole chain:
// what a persistent form of the step's products could gain, in reads alone (bench/chain_bound.py times them).
//
// A product is `rows` rows of THREADS 16-byte words (4 KB a row). Block b of B reads its share of the rows:
//   layout 0 (contiguous): rows [b R / B, (b + 1) R / B), as a product's stream-K units fall to its blocks;
//   layout 1 (interleaved): rows b, b + B, b + 2 B, ..., as a grid-stride read (decapybara/kernels/probe.cu).
// Its first `ahead` rows are copied to shared memory (cp.async, one 16-byte word a thread and row) before it
// waits for the product before; the rest it reads after the wait, four rows in flight a thread. Each block xors
// every word it read into sums[product] (the caller checks them against the buffers: a row read twice or never
// shows). `work` FMAs after each four rows stand in for a product's arithmetic.
//   chain_launch: one product; waits with griddepcontrol (pdl.cuh: the kernel before has completed) and lets the
//     next kernel launch once its reads are done, as the skinny products do.
//   chain_persistent: the whole chain in one launch whose blocks are all resident (the caller's grid); a block
//     done with product p adds one to counters[p]; product p + 1's reads past its `ahead` rows wait until
//     counters[p] == B (every block done with p: the data dependence of a step's products). `wait` 0 leaves the
//     waits out (the chain's bytes at the read rate).
//     The last block to finish zeroes the counters for the next launch. A wait that exceeds TIMEOUT cycles
//     (blocks not all resident) sets *err, and every wait after it returns at once. `seen` (null: not kept) gets,
//     for each product p >= 1, the fewest blocks done with p - 1 that a block saw where it went on to p's reads
//     (its wait's last count; without waits, one read of the counter): the waits hold iff every one is B.
#include "count_wait.cuh"
#include "pdl.cuh"
#include "smem.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

#define THREADS 256  // a block; chain_launch takes at most 32 registers a thread (8 blocks an SM), chain_persistent 40 (6)
#define TIMEOUT (1ll << 32)  // cycles, ~2 s

struct Share {
    u64 first, count, step;  // rows first, first + step, ..., count of them
};

__device__ __forceinline__ Share share_of(u64 rows, u64 b, u64 blocks, int layout) {
    if (layout == 0) {
        const u64 s = rows * b / blocks, e = rows * (b + 1) / blocks;
        return {s, e - s, 1};
    }
    return {b, b < rows ? (rows - b + blocks - 1) / blocks : 0, blocks};
}

__device__ __forceinline__ uint4 ld_weights(const uint4* p) {  // volatile: kept after the waits, as written
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ u32 fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// Rows [0, a) of the share into stage[j * THREADS + threadIdx.x] (each thread its own words).
__device__ __forceinline__ void issue_ahead(const uint4* src, Share s, u64 a, uint4* stage) {
    for (u64 j = 0; j < a; ++j)
        cp_async16(smem_u32(stage + j * THREADS + threadIdx.x),
                   src + (s.first + j * s.step) * THREADS + threadIdx.x, 16);
    cp_commit();
}

// The xor of this thread's words of the share: rows [0, a) from the stage, the rest from global memory, with `work`
// dependent FMAs after each four rows' loads (a stand-in for a product's arithmetic; 0: none).
__device__ __forceinline__ u32 read_share(const uint4* src, Share s, u64 a, const uint4* stage, int work) {
    u32 acc = 0;
    float f = (float)threadIdx.x;
    cp_wait_groups<0>();
    for (u64 j = 0; j < a; ++j) acc ^= fold(stage[j * THREADS + threadIdx.x]);
    const uint4* p = src + s.first * THREADS + threadIdx.x;
    const u64 step = s.step * THREADS;
    u64 j = a;
    for (; j + 4 <= s.count; j += 4) {
        const uint4 v0 = ld_weights(p + j * step), v1 = ld_weights(p + (j + 1) * step);
        const uint4 v2 = ld_weights(p + (j + 2) * step), v3 = ld_weights(p + (j + 3) * step);
        acc ^= fold(v0) ^ fold(v1) ^ fold(v2) ^ fold(v3);
        for (int k = 0; k < work; ++k) f = fmaf(f, 1.0001f, (float)(acc & 7u));
    }
    for (; j < s.count; ++j) acc ^= fold(ld_weights(p + j * step));
    return f == -1.0f ? ~acc : acc;  // f >= 0: the FMAs stay, the xor does not change
}

// This block's xor into *sum: a butterfly in each warp, then one atomic a warp.
__device__ __forceinline__ void add_sum(u32 acc, u32* sum) {
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicXor(sum, acc);
}

extern "C" __global__ void __launch_bounds__(THREADS, 8)
    chain_launch(const uint4* src, long long rows, int ahead, int layout, int work, u32* sum) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* stage = (uint4*)smem;
    const Share s = share_of((u64)rows, blockIdx.x, gridDim.x, layout);
    const u64 a = s.count < (u64)ahead ? s.count : (u64)ahead;
    issue_ahead(src, s, a, stage);
    pdl_wait();
    const u32 acc = read_share(src, s, a, stage, work);
    pdl_trigger();
    add_sum(acc, sum);
}

extern "C" __global__ void __launch_bounds__(THREADS, 6)
    chain_persistent(const u64* ptrs, const u64* rows, int products, int ahead, int layout, int work, int wait,
                     u32* counters, u32* sums, u32* err, u32* seen) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* stage = (uint4*)smem;
    const u32 blocks = gridDim.x;
    for (int p = 0; p < products; ++p) {
        const uint4* src = (const uint4*)ptrs[p];
        const Share s = share_of(rows[p], blockIdx.x, blocks, layout);
        const u64 a = s.count < (u64)ahead ? s.count : (u64)ahead;
        issue_ahead(src, s, a, stage);  // each thread's stage words are its own: no barrier before reuse
        if (p > 0 && (wait || seen)) {
            const u32 got = wait ? block_wait_count(counters + p - 1, blocks, err, TIMEOUT)
                                 : threadIdx.x == 0 ? ld_acquire_u32(counters + p - 1) : 0u;
            if (seen && threadIdx.x == 0) atomicMin(seen + p, got);
        }
        const u32 acc = read_share(src, s, a, stage, work);
        add_sum(acc, sums + p);
        block_count_done(counters + p);  // every thread's reads of p done
    }
    if (threadIdx.x == 0 && last_block_done(counters + products, blocks)) {  // the last block zeroes the counts
        for (int p = 0; p <= products; ++p) counters[p] = 0;
        __threadfence();
    }
}

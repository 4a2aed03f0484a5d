// Skinny GEMM over block-quantised weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small (decode: 1..12,
// speculative verification: up to 64 per launch, more through grid.z M-tiles).
//
// Weights, as decapybara.model.quant stores them (docs/quant.md), row-major, K along the row:
//   BF16   codes u16 [N, K] (raw bf16 bits), no scales                  K % 8 == 0
//   MXFP8  codes u8 [N, Kp] E4M3, scales u8 [N, Kp/32] E8M0             Kp % 32 == 0
//   MXFP6  codes u8 [N, Kp*3/4] E2M3, 4 codes in 3 bytes little-endian  Kp % 64 == 0
//   MXFP4  codes u8 [N, Kp/2] E2M1, element 2j in the low nibble         Kp % 32 == 0
//   NVFP4  codes u8 [N, Kp/2] E2M1, scales u8 [N, Kp/16] E4M3, fp32 tensor scale `post`
// except that MXFP4 / NVFP4 codes may instead be stored in the split-field layout (MX_E2M1 = 1; the weight's
// `PackedWeight.e2m1_split`, repacked at load by decapybara/backend/gemv_plan.py `e2m1_split_words`): each
// 32-bit word keeps its 8 codes, in each 16-bit half the 3-bit magnitudes side by side and the signs in the top
// 4 bits (mx_pairs.cuh `e2m1_pairs_split`), which decodes in fewer instructions; and where N % 16 == 0 and
// whole 256-code chunks cover K, in band tiles (MX_TILED = 1, `PackedWeight.tiled`, `gemv_plan.band_tiles`): the
// rows of each band of 16 stored chunk by chunk, 16 rows x 128 bytes, so that the 16 rows one warp streams are
// one contiguous 2 KB block per chunk (DRAM pages read whole rather than in 128-byte pieces of 16 rows), and
// their scales likewise (16 rows x a chunk's 8 / 16 scale bytes).
// Every row must start 16-byte aligned (the wrapper asserts it). A stacked [E, N, K] expert tensor is E such
// matrices `w_gstride` bytes apart (grouped mode, see below).
//
// Tensor cores: mma.sync m16n8k16 bf16 -> fp32 with A = a 16-row tile of W (dequantised in registers) and
// B = x^T (8 rows of x per n-tile). Lane (g = lane/4, t = lane%4) streams rows g and g+8 of its warp's tile:
// per 4*LANE_K-wide chunk it owns the contiguous codes [t*LANE_K, (t+1)*LANE_K), fetched with 128-bit loads.
// The reduction order inside an MMA is free, so each lane feeds its own codes as the MMA's k-slots and x is
// staged into shared memory in the matching permutation (PERM below); every weight loaded is used for all
// rows of x. Codes become bf16 by shifting their bits into a bf16 (value * 2^-126 for E2M1/E2M3, * 2^-120 for
// E4M3, subnormals included) and one bf16x2 FMA by the block scale (exact: power-of-two scale, or E4M3 block
// scale times an E2M1 element); x is staged times 2^64 so that the scale factor 2^(s - 65) stays a normal
// bf16 for any E8M0 code s <= 192 (weights of any real model). fp32 accumulation; the K range may be split
// over blocks (grid.y), combined deterministically by the last block of each tile (counters self-reset), or
// the launch may be stream-K (A.stream: a wave of blocks sharing the tile-major (tile, chunk) units evenly;
// decapybara/backend/gemv_plan.py plans both and mirrors the index arithmetic).
// Grouped mode (MoE): group_counts != 0, grid.z = groups * mtiles; group j reads rows gather[off_j + m] of x,
// writes rows off_j + m of y (M: y's rows), uses weights W + e * w_gstride for expert e = g_ids[j] (j where
// g_ids is null). Its K range may be split as a dense launch's: partial sums by y row, a counter per (group,
// M tile, output tile).
// Early refill (MX_EARLY, by kernel kind): in the loop over whole chunks, a register stage's next chunk is loaded
// while the stage's own chunk is computed, each 16-byte piece of a lane-row as soon as its words are decoded and
// the scales once read (`Refill`), instead of after the chunk's MMAs, so that a warp has loads in flight while it
// computes; the same loads, pointer walk and sums, so the same bytes.
// Programmatic dependent launch (pdl.cuh): a dense launch loads its first register stages of weights, then
// waits for the kernel before it; it lets its own dependents launch once its K loop is done.
// Fused residual add and RMSNorm across two dense products (decapybara/backend/cupy_ops_extra.py
// `mx_linear_add_norm`, `NormedRows`), so that no norm kernel runs between them:
// - the producer (res != 0) stores y = x @ W^T * post + bias + res (res: the residual stream, y's shape and
//   stride; the same float operations as the product then a separate add), xg = y * (gw_off + gw[n]) (the
//   next norm's weight applied; same shape, in bf16 bits or float32 (xg_kind: bf16 from TUNE `bf16_rows`
//   rows up, decapybara/backend/cupy_ops_extra.py): bf16 is the rounding the consumer's staging applies to
//   any x (but for x below 2^-126, which the float32 staging scales by 2^64 before it rounds), so it stages
//   half the bytes for the same result) and each output tile's sums of squares of its y rows, sq[m,
//   tile] (tiles of TILE_ROWS columns) in a fixed order for a given launch plan: where one block computes the
//   whole tile, a butterfly over each warp's 16 columns, then the warps in order; where the tile's last K
//   split reduces it, a butterfly over each 32 columns, then those in order;
// - the consumer (nsq != 0) takes x = such an xg and divides each output by its row's denom = sqrt(sum / K +
//   n_eps), the sum of the producer's nsq_tiles partial sums (a fixed order: lane-strided, then a butterfly;
//   loaded before the x staging, summed after it): the product of rms_norm(y) = y / denom * (gw_off
//   + gw), with y (gw_off + gw) rounded to bf16 as any x. A grouped consumer (an MoE block's experts over
//   gathered rows) reads the sums by y row: moe.cu's moe_route_dispatch copies each gathered row's there
//   (MX_GROUPED_NORM below: the wrapper's test that this file reads them so).
// Fused SwiGLU (the `mx_gemm_<fmt>_1s`, `_2s`, `_4s`, `_8s` kernels, up to 8, 16, 32, 64 rows of x; decapybara/backend/
// cupy_ops_extra.py `mx_swiglu`): W is [gate; up] stacked along rows (N rows, N % 16 == 0, no bias, no fused
// residual) and y [M, N / 2] = silu(x @ gate^T) * (x @ up^T). The kernel's output rows are taken in bands of 16
// whose rows 0-7 are gate rows 8 b.. and rows 8-15 the up rows N / 2 + 8 b.. of the same columns (each lane's
// two rows, g and g + 8: one gate, one up), so the epilogue finishes both sums of a column in one lane (direct
// store) or one pass (the split tile's last block) and stores silu(gate) * up (silu.cuh) with the plain
// epilogue's float operations, then decode_ops' silu_mul_halves': the bits of those two launches wherever each
// column's K range is split at the same chunks (tile grids split every tile alike; under stream-K a column's
// tile, so its split points, may differ, and its sums then by float32 rounding). The `_1s` kernels may also be
// fused norm consumers (x = NormedRows' xg). Grouped launches (MoE, no fused norms) too: W an expert stack
// [E, N, K] of each expert's [gate; up] (cupy_ops_extra.py `moe`'s gate_up), y [y rows, N / 2].
// Only the one-n-tile kernels (M <= 8: decode of up to 8 sequences) fuse; the others ignore these arguments
// (their code cost the twelve-row products ~5% of speed; the wrapper gives them no fused work).
// One row of x, MXFP4 / NVFP4 (the `mx_gemm_<fmt>_1r` / `_1rs` kernels; cupy_ops_extra.py `one_row`): with one
// row, 7 of an MMA's 8 columns would repeat it. Here each column of a chunk's MMAs sums one block alone (x where
// the lane's codes are that block, zeros elsewhere: each lane's k-slots are its own blocks), so the codes enter
// the MMAs unscaled and each lane applies its (row, block) scales to float32 block sums once a chunk
// (`mma_chunk_r1`) instead of a bf16x2 FMA per code pair: the same products within float32 rounding (the sums
// are grouped by block) wherever the `_1` kernels' scaled bf16 codes are exact (MXFP4 block scales from 2^-61
// up; below, those lose bits that the float32 factors here keep), but for blocks whose unscaled sum of x times
// codes is under 2^-64, which enter their scale as float32 subnormals (flushed where subnormals are, e.g. the
// NVRTC build); the same epilogues (fused norms, SwiGLU) after a sum over the lanes of a row.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define FMT_BF16 0
#define FMT_MXFP8 1
#define FMT_MXFP6 2
#define FMT_MXFP4 3
#define FMT_NVFP4 4
#include "act_kind.cuh"
#include "mx_pairs.cuh"
#include "norm_sums.cuh"
#include "pdl.cuh"
#include "smem.cuh"
#ifndef MX_WARPS
#define MX_WARPS 8  // warps per block (16 weight rows each); 4 doubles the blocks of a mid-sized matrix
#endif
#ifndef MX_WARPS2
#define MX_WARPS2 MX_WARPS  // warps per block of the two-n-tile kernels (9 <= M <= 16)
#endif
#ifndef MX_WARPS4
#define MX_WARPS4 MX_WARPS  // warps per block of the kernels of 4 and 8 n-tiles (17 <= M <= 64)
#endif
// Warps of an NT-n-tile kernel's block and the output rows of its tile (TILE_ROWS in the functions below).
template <int NT> struct Wp {
    static constexpr int W = NT == 2 ? MX_WARPS2 : NT >= 4 ? MX_WARPS4 : MX_WARPS, ROWS = 16 * W;
};

#ifndef MX_SEGK2
#define MX_SEGK2 1024  // codes a row of the two-n-tile kernels' x staging buffer holds: up to 1440 in static shared
#endif                 // memory, past that in dynamic shared memory of 32 (MX_SEGK2 + 32) bytes (the launch's:
                       // decapybara/backend/cupy_ops_extra.py `staging_bytes`)
#ifndef MX_SEGK4
#define MX_SEGK4 0  // codes a row of the 4- and 8-n-tile kernels' x staging buffer holds, rounded down to a multiple
#endif              // of 256: up to the nominal 2048 / NT in static shared memory, past it in dynamic shared memory
                    // of 16 NT (SEGK + 32) bytes (the launch's, fitted to the device: cupy_ops_extra.py `fit_many_segk`)
// x staging buffer: MT rows of RS bf16 (SEGK codes + 32 of bank padding); the two-n-tile kernels' ring depth
// follows NSEGK, the codes of the buffer of 2048 / NT a row that every build had before MX_SEGK2, the wider
// kernels' their SEGK (see ST in mx_segment)
template <int NT> struct XBuf {
    static constexpr int NSEGK = 2048 / NT;
    static constexpr int SEGK4 = MX_SEGK4 / 256 * 256;
    static constexpr int SEGK = NT == 2 ? MX_SEGK2 : NT >= 4 && SEGK4 > NSEGK ? SEGK4 : NSEGK, RS = SEGK + 32;
    static constexpr bool DYN = NT == 2 ? SEGK > 1440 : SEGK > NSEGK;  // in dynamic shared memory
    static_assert(SEGK >= NSEGK, "a staging row of at least the nominal segment");
};
template <int FMT> struct Fmt;  // LANE_K codes per lane per chunk, LB bytes per lane-row, NS scale bytes
#ifndef MX_STAGES
#define MX_STAGES 4
#endif
// STAGES: chunks in flight per lane (MXFP6's wider lane-rows take one fewer above 2, to stay within registers)
#ifndef MX_ACC
#define MX_ACC 1  // independent accumulator chains of a one-n-tile (M <= 8) block: the two MMAs of a slice pair
#endif                // do not wait on each other (wider tiles already have one chain per n-tile)
template <int NT> struct Acc { static constexpr int N = NT == 1 ? MX_ACC : 1; };
#define MX_GROUPED_NORM 1  // grouped fused norm consumers read the sums of squares by y row (header)
#ifndef MX_MINB
#define MX_MINB 2  // resident 8-warp blocks per SM the one-n-tile kernels are built for (registers: 65536 / (256
                   // MINB)); blocks of W warps: MX_BLOCKS(MINB, W) of them
#endif
#ifndef MX_MINB2
#define MX_MINB2 2  // the same for the two-n-tile (9 <= M <= 16) kernels
#endif
#ifndef MX_STAGES2
#define MX_STAGES2 0  // register stages of the two-n-tile kernels; 0: max(2, the format's STAGES)
#endif
#ifndef MX_STAGES4
#define MX_STAGES4 2  // register stages of the kernels of 4 and 8 n-tiles (at most the staging segment's chunks)
#endif
#ifndef MX_E2M1
#define MX_E2M1 0  // layout of MXFP4 / NVFP4 codes: 0 plain nibbles, 1 split fields (header); mx_dequant_rows reads both
#endif
#ifndef MX_TILED
#define MX_TILED 0  // code layout: 0 row-major, 1 in 16-row bands of 2 KB chunk tiles (header; E2M1 formats)
#endif
#ifndef MX_TRACE
#define MX_TRACE 0  // measurement only (bench/gemv_trace.py): per-block timestamps of up to two launches
#endif
#ifndef MX_R1_CHAINS
#define MX_R1_CHAINS 1  // MMA chains of each of the NVFP4 `_1r` kernels' two sets of block sums (R1Cols)
#endif
#ifndef MX_EARLY
#define MX_EARLY 0  // kernels whose loop over whole chunks loads each ring slot's next chunk inside its MMAs
#endif              // (Refill), by bits: 1 the one-row `_1r` / `_1rs`, 2 the other one-n-tile ones, 4 the two-n-tile
                    // ones, 8 those of 4 and 8 n-tiles
#ifndef MX_PART_BATCH
#define MX_PART_BATCH 8  // split-K partial sums a thread of a one-row (`_1r`) tile's last block loads at once (sum_parts)
#endif
#ifndef MX_DIAG
#define MX_DIAG 0  // measurement only (bench/gemv_sweep.py), results wrong: bit 0 skips the code decoding, bit 1
#endif             // has kernels of two n-tiles and more compute their first only (no others' x fragments or MMAs),
                   // bit 2 skips the x staging (its barriers kept)
template <> struct Fmt<FMT_BF16> { static constexpr int LANE_K = 16, LB = 32, NS = 0, XSHIFT = 0, STAGES = MX_STAGES; };
template <> struct Fmt<FMT_MXFP8> { static constexpr int LANE_K = 32, LB = 32, NS = 1, XSHIFT = 64, STAGES = MX_STAGES; };
#ifndef MX_FP6_STAGES
#define MX_FP6_STAGES (MX_STAGES > 2 ? MX_STAGES - 1 : MX_STAGES)
#endif
template <> struct Fmt<FMT_MXFP6> { static constexpr int LANE_K = 64, LB = 48, NS = 2, XSHIFT = 64,
                                    STAGES = MX_FP6_STAGES; };
template <> struct Fmt<FMT_MXFP4> { static constexpr int LANE_K = 64, LB = 32, NS = 2, XSHIFT = 64, STAGES = MX_STAGES; };
template <> struct Fmt<FMT_NVFP4> { static constexpr int LANE_K = 64, LB = 32, NS = 4, XSHIFT = 64, STAGES = MX_STAGES; };

// Source offset (within 8 consecutive codes of a lane) of staged x element p: the k-slot permutation.
__device__ __forceinline__ int perm8(int fmt, int p) {
    if (fmt == FMT_BF16) return p;
    if (fmt == FMT_MXFP8) return (p & 4) | ((p & 1) << 1) | ((p >> 1) & 1);       // 0,2,1,3,4,6,5,7
    return ((p >> 2) << 1) | ((p & 1) << 2) | ((p >> 1) & 1);                      // 0,4,1,5,2,6,3,7
}

__device__ __forceinline__ uint4 u4(u32 a, u32 b, u32 c, u32 d) {
    uint4 r;
    r.x = a; r.y = b; r.z = c; r.w = d;
    return r;
}
// (lo, hi) -> bf16x2 bits, each rounded to nearest even (the bits of two f2bf calls, in one instruction)
__device__ __forceinline__ u32 bf16x2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
// s[q] += p[k * stride + off[q]] for k = 0 .. n - 1 in that order (the split tile's reduction: the same sums as
// one load and add at a time), the loads issued BATCH at a time (NP sums share them) so that a tile's last block
// waits for one L2 round trip a batch rather than one a part; a batch past n reloads part n - 1 and does not add
// it. The one-row kernels batch (MX_PART_BATCH): their products 1.7% faster; the others load one part at a time
// (BATCH 1, as before): with batches the twelve-row products were 2.3% slower, 12x1k steps 1.3-4.4% (docs/perf.md).
template <int BATCH, int NP>
__device__ __forceinline__ void sum_parts(const float* p, long long stride, int n, const int (&off)[NP], float (&s)[NP]) {
    constexpr int B = BATCH / NP > 0 ? BATCH / NP : 1;
    for (int k0 = 0; k0 < n; k0 += B) {
        float v[B][NP];
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const long long k = min(k0 + j, n - 1);
#pragma unroll
            for (int q = 0; q < NP; ++q) v[j][q] = ld_cg(p + k * stride + off[q]);
        }
#pragma unroll
        for (int j = 0; j < B; ++j)
            if (k0 + j < n)
#pragma unroll
                for (int q = 0; q < NP; ++q) s[q] += v[j][q];
    }
}
__device__ __forceinline__ int atom_add_acq_rel(int* p, int v) {
    int r;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(r) : "l"(p), "r"(v) : "memory");
    return r;
}
#if MX_TRACE
// Launches whose weight pointer is mx_trace_key[i] write, per block (thread 0; block x + gridDim.x y, z = 0),
// globaltimer ns at: entry (0, with the SM id at 5), after the wait, after the first x staging, the end of
// warp 0's last K loop, the exit.
__device__ unsigned long long mx_trace_key[2];
__device__ unsigned long long mx_trace[2][4096][6];
__device__ __forceinline__ void trace_at(const void* W, int i) {
    const unsigned int b = blockIdx.x + gridDim.x * blockIdx.y;
    if (threadIdx.x || b >= 4096 || blockIdx.z) return;
    const int slot = (unsigned long long)W == mx_trace_key[0] ? 0 : (unsigned long long)W == mx_trace_key[1] ? 1 : -1;
    if (slot < 0) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    mx_trace[slot][b][i] = t;
    if (i == 0) {
        unsigned int sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        mx_trace[slot][b][5] = sm;
    }
}
#define TRACE(W, i) trace_at(W, i)
#else
#define TRACE(W, i)
#endif
__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// E4M3 code -> float32 built from integer fields (no subnormal float arithmetic: safe under -ftz).
__device__ __forceinline__ float e4m3_f32(u32 c) {
    const u32 e = (c >> 3) & 15u, m = c & 7u;
    if (e == 15u && m == 7u) return __int_as_float(0x7FC00000);
    const float mag = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0x1p-9f;
    return (c & 0x80u) ? -mag : mag;
}

// Block scale -> bf16x2 factor (same value in both halves); see the header for the 2^-64 bias.
template <int FMT> __device__ __forceinline__ u32 scale_factor(u32 s) {
    u32 h;
    if (FMT == FMT_NVFP4) {  // E4M3 block scale * 2^126 (bit trick) * 2^-64 = e4m3(s) * 2^62, exact
        const float v = e4m3_f32(s) * 0x1p62f;
        h = __float_as_uint(v) >> 16;
    } else {
        h = mx_factor16<FMT == FMT_MXFP8 ? 120 : 126>(s);
    }
    return h | (h << 16);
}

// scale_factor<MXFP4 / MXFP6> of both E8M0 bytes of s at once: its bf16 bits in 16-bit lanes (byte 0 low).
// e = min(s + 62, 255) saturates to infinity as above, and s = 255 sets the quiet-NaN bit.
__device__ __forceinline__ u32 scale_halves(const u32 s) {
    const u32 t = __byte_perm(s, 0u, 0x4140);  // {s0, s1} in 16-bit lanes
    const u32 e = __vminu2(t + 0x003E003Eu, 0x00FF00FFu);  // one VIMNMX.U16x2 on sm_90, emulated before
    return (e << 7) | (((t + 0x00010001u) >> 2) & 0x00400040u);
}
// as bf16x2 factors: f[0] from byte 0, f[1] from byte 1
__device__ __forceinline__ void scale_pair(const u32 s, u32 (&f)[4]) {
    const u32 h = scale_halves(s);
    f[0] = __byte_perm(h, 0u, 0x1010);
    f[1] = __byte_perm(h, 0u, 0x3232);
}
// as float32 (the same value: bf16 bits are a float's top half): f[0] from byte 0, f[1] from byte 1
__device__ __forceinline__ void scale_pair_f32(const u32 s, float (&f)[2]) {
    const u32 h = scale_halves(s);
    f[0] = __uint_as_float(h << 16);
    f[1] = __uint_as_float(h & 0xFFFF0000u);
}

// Codes of one lane-row (LB bytes as words w) -> the four A-operand bf16x2 pairs of slice pair JJ:
// {P0 of slice 2JJ, P1 of slice 2JJ, P0 of slice 2JJ+1, P1 of slice 2JJ+1}.
// JJ is a loop index of a fully unrolled loop, so every array index below folds to a constant.
template <int FMT>
__device__ __forceinline__ void dequant(const u32 (&w)[Fmt<FMT>::LB / 4], const u32 (&f)[4], const int JJ,
                                        u32 (&a)[4]) {
    if (FMT == FMT_BF16) {
        a[0] = w[4 * JJ]; a[1] = w[4 * JJ + 1]; a[2] = w[4 * JJ + 2]; a[3] = w[4 * JJ + 3];
    } else if (MX_DIAG & 1) {  // the same words, undecoded (timing of everything but the decode)
        const u32 v = w[(JJ * (Fmt<FMT>::LB / 4)) / (Fmt<FMT>::LANE_K / 8)];
        a[0] = v; a[1] = v ^ f[0]; a[2] = v >> 1; a[3] = v << 1;
    } else if (FMT == FMT_MXFP8) {  // (b0, b2) and (b1, b3) of a word share their shifts
        e4m3_pairs(w[2 * JJ], f[0], a[0], a[1]);
        e4m3_pairs(w[2 * JJ + 1], f[0], a[2], a[3]);
    } else if (FMT == FMT_MXFP6) {  // groups 2JJ and 2JJ+1 side by side: (c_r of A, c_r of B) per pair
        const int wb = (6 * JJ) / 4;
        const u32 g01 = __byte_perm(w[wb], w[wb + 1], (JJ & 1) ? 0x6532 : 0x4310);
        const u32 g23 = __byte_perm(w[wb], w[wb + 1], (JJ & 1) ? 0x7643 : 0x5421);
        e2m3_pairs(g01, g23, f[JJ / 4], a);
    } else if (MX_E2M1) {  // E2M1, split fields: codes (i, i+4) share their shifts
        e2m1_pairs_split(w[JJ], FMT == FMT_MXFP4 ? f[JJ / 4] : f[JJ / 2], a);
    } else {  // E2M1: nibbles (i, i+4) share their shifts
        e2m1_pairs(w[JJ], FMT == FMT_MXFP4 ? f[JJ / 4] : f[JJ / 2], a);
    }
}

template <int FMT> struct LaneRow {  // one lane's codes and scales of one row for one chunk
    u32 w[Fmt<FMT>::LB / 4];
    u32 s;
};

// Byte offsets of the codes (LB bytes a lane-row) or scales (NS bytes) of (weight row r, lane-row lr = chunk *
// 4 + t) within one matrix: row_off(r) + lane_off(lr). Row-major: r * row_bytes + lr * LB. Tiled (MX_TILED):
// the rows of band r / 16 chunk by chunk, each chunk 16 rows x 4 lane-rows (2 KB of E2M1 codes, 128 / 256
// bytes of MXFP4 / NVFP4 scales), so that a warp's chunk is one contiguous block.
template <int LB> __device__ __forceinline__ u32 row_off(u32 r, u32 row_bytes) {
    return MX_TILED ? (r & ~15u) * row_bytes + (r & 15u) * (4 * LB) : r * row_bytes;
}
template <int LB> __device__ __forceinline__ u32 lane_off(u32 lr) {
    return MX_TILED ? (lr >> 2) * (64 * LB) + (lr & 3u) * LB : lr * LB;
}
#define CHUNK_STEP(LB) ((MX_TILED ? 64 : 4) * (LB))  // bytes from a lane-row to the next chunk's

template <int NS> __device__ __forceinline__ u32 ld_scales(const u8* p) {  // NS-byte aligned, NS in {1, 2, 4}
    if (NS == 1) return __ldg(p);
    if (NS == 2) return __ldg((const unsigned short*)p);
    return __ldg((const u32*)p);
}

// Lane-row lr (chunk * 4 + t) of one weight row, every load bounded by Kp (the loop over chunks that are not
// all whole, see mx_segment): byte loads of the scales, so scale rows need no alignment.
template <int FMT>
__device__ __forceinline__ void load_row(LaneRow<FMT>& r, const u8* W, u32 wo, const u8* S, u32 so, bool row_ok,
                                         int lr, int Kp) {
    constexpr int LK = Fmt<FMT>::LANE_K, LB = Fmt<FMT>::LB, NLD = LB / 16;
    constexpr int NS = Fmt<FMT>::NS, SPAN = NS ? LK / NS : LK;  // codes per scale
    const int k0 = lr * LK;
    const u8* wp = W + (wo + lane_off<LB>((u32)lr));
    const u8* sp = S + (so + lane_off<NS>((u32)lr));
#pragma unroll
    for (int p = 0; p < NLD; ++p) {
        bool ok = row_ok && (FMT == FMT_MXFP6 ? k0 < Kp : k0 + p * (LK / NLD) < Kp);
        uint4 v = ok ? ld_stream(wp + p * 16) : u4(0, 0, 0, 0);
        r.w[4 * p] = v.x; r.w[4 * p + 1] = v.y; r.w[4 * p + 2] = v.z; r.w[4 * p + 3] = v.w;
    }
    r.s = 0;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const u32 b = row_ok && k0 + i * SPAN < Kp ? __ldg(sp + i) : 0u;
        r.s |= b << (8 * i);
    }
}

// The next lane-row of one weight row in the loop over whole chunks (WHOLE below): its code and scale
// addresses, each load advancing them one chunk (4 lane-rows): two pointer bumps a chunk, no bounds. A row
// past N reads row N - 1 instead (its MMA rows are never stored), so no load is predicated or zero-filled.
struct RowPtr {
    const u8* w;
    const u8* s;
};
// piece q (16 bytes: words 4q..4q+3) of the lane-row at p
template <int FMT> __device__ __forceinline__ void load_piece(LaneRow<FMT>& r, const RowPtr& p, int q) {
    const uint4 v = ld_stream(p.w + q * 16);
    r.w[4 * q] = v.x; r.w[4 * q + 1] = v.y; r.w[4 * q + 2] = v.z; r.w[4 * q + 3] = v.w;
}
template <int FMT> __device__ __forceinline__ void load_next(LaneRow<FMT>& r, RowPtr& p) {
    constexpr int LB = Fmt<FMT>::LB, NLD = LB / 16, NS = Fmt<FMT>::NS;
#pragma unroll
    for (int q = 0; q < NLD; ++q) load_piece<FMT>(r, p, q);
    r.s = NS ? ld_scales<NS>(p.s) : 0u;
    p.w += CHUNK_STEP(LB);
    p.s += CHUNK_STEP(NS);
}

// Chunk lr / 4's lane-rows of weight rows g and g + 8 into one ring slot: the next chunk of the pointer walk
// (WHOLE), or lane-row lr bounded by Kp.
template <int FMT, bool WHOLE>
__device__ __forceinline__ void load_chunk(LaneRow<FMT>& a, LaneRow<FMT>& b, RowPtr& p0, RowPtr& p8, const u8* W,
                                           const u8* S, u32 wo0, u32 wo8, u32 so0, u32 so8, bool ok0, bool ok8,
                                           int lr, int Kp) {
    if (WHOLE) {
        load_next<FMT>(a, p0);
        load_next<FMT>(b, p8);
    } else {
        load_row<FMT>(a, W, wo0, S, so0, ok0, lr, Kp);
        load_row<FMT>(b, W, wo8, S, so8, ok8, lr, Kp);
    }
}

// The next chunk's loads into a ring slot while the slot's own chunk is computed (MX_EARLY, the loop over whole
// chunks): piece q (16 bytes a row: words 4q..4q+3) of rows g and g + 8 as soon as the chunk's MMAs have read that
// piece's words, the scales once read; load_next's loads and pointer walk, each part when the chunk frees its
// registers. `on` false (no chunk ST ahead): nothing loaded. A piece's registers are dead once read, so the copy
// in flight needs none.
template <int FMT> struct Refill {
    LaneRow<FMT>& a;
    LaneRow<FMT>& b;
    RowPtr& p0;
    RowPtr& p8;
    bool on;
    __device__ __forceinline__ void codes(int q) {
        constexpr int NLD = Fmt<FMT>::LB / 16;
        if (on) {
            load_piece<FMT>(a, p0, q);
            load_piece<FMT>(b, p8, q);
            if (q == NLD - 1) {
                p0.w += CHUNK_STEP(Fmt<FMT>::LB);
                p8.w += CHUNK_STEP(Fmt<FMT>::LB);
            }
        }
    }
    __device__ __forceinline__ void scales() {
        constexpr int NS = Fmt<FMT>::NS;
        if (NS && on) {
            a.s = ld_scales<NS>(p0.s);
            b.s = ld_scales<NS>(p8.s);
            p0.s += CHUNK_STEP(NS);
            p8.s += CHUNK_STEP(NS);
        }
    }
};
struct NoRefill {  // the plain loop: the slot refilled after its chunk (load_chunk)
    __device__ __forceinline__ void codes(int) {}
    __device__ __forceinline__ void scales() {}
};
// formats whose dequant reads a lane-row's words in order, a 16-byte piece every S2 / NLD slices (not MXFP6's)
template <int FMT> __host__ __device__ constexpr bool early_ok() { return Fmt<FMT>::LB == 32; }

// One chunk's MMAs: xa[nt] is the shared-window byte address of n-tile nt's staged x for this lane and chunk
// (its row, the chunk's codes, lane t's 8-code slot).
// rf: the slot's refill (Refill, MX_EARLY) or none (NoRefill): the scales once their factors are taken, each
// piece of codes after its last slice.
template <int FMT, int NT, class RF>
__device__ __forceinline__ void mma_chunk(float (&acc)[Acc<NT>::N][NT][4], const LaneRow<FMT>& r0,
                                          const LaneRow<FMT>& r1, const u32 (&xa)[NT], RF&& rf) {
    constexpr int S2 = Fmt<FMT>::LANE_K / 8, NS = Fmt<FMT>::NS, PS = S2 / (Fmt<FMT>::LB / 16);  // slices a piece
    u32 f0[4] = {0, 0, 0, 0}, f1[4] = {0, 0, 0, 0};
    if (FMT == FMT_MXFP4 || FMT == FMT_MXFP6) {
        scale_pair(r0.s, f0);
        scale_pair(r1.s, f1);
    } else {
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            f0[i] = scale_factor<FMT>((r0.s >> (8 * i)) & 0xFFu);
            f1[i] = scale_factor<FMT>((r1.s >> (8 * i)) & 0xFFu);
        }
    }
    rf.scales();
#pragma unroll
    for (int jj = 0; jj < S2; ++jj) {
        u32 a0[4], a1[4];
        dequant<FMT>(r0.w, f0, jj, a0);
        dequant<FMT>(r1.w, f1, jj, a1);
        if (PS > 0 && (jj + 1) % PS == 0) rf.codes((jj + 1) / PS - 1);
#pragma unroll
        for (int nt = 0; nt < ((MX_DIAG & 2) ? 1 : NT); ++nt) {
            const uint4 b = ld_shared_v4(xa[nt] + 64 * jj);  // codes 32 jj.. of the lane's slot
            mma16816(acc[0][nt], a0[0], a1[0], a0[1], a1[1], b.x, b.y);
            mma16816(acc[Acc<NT>::N - 1][nt], a0[2], a1[2], a0[3], a1[3], b.z, b.w);
        }
    }
}

// One row of x, MXFP4 / NVFP4 (the `_1r` kernels, header): chunk partial sums by block, the block scales applied
// to them. MMA column n sums one block's codes only: lane (g, t) feeds the A k-slots of its own codes, and B
// column g holds x where g is the column of the block the lane's word jj belongs to (R1Cols::second(jj): 0,
// pointer xa, column 2t; 1, pointer xb, column 2t + 1) and zeros elsewhere (the caller points the other lanes
// at a zero row). MXFP4: blocks 2t (words 0-3) and 2t + 1 (words 4-7), one set of sums; NVFP4 (16-code
// blocks): blocks 4t + jj / 2, so words 0-3 (blocks 4t, 4t + 1) and words 4-7 (4t + 2, 4t + 3) take two sets.
// The lane's D fragment, rows g / g + 8 by columns 2t / 2t + 1, is then exactly its own (row, block) pairs,
// whose scales it holds: fin[0] (row g) += D[g][2t] * s(g, block of column 2t) + D[g][2t + 1] * s(g, ...),
// fin[1] (row g + 8) likewise. Codes enter the MMA unscaled (value * 2^-126, bf16 subnormals for +-0.5) and x
// staged times 2^64, so a block's sum is 2^-62 of its true dot product and the float32 factor restores it:
// 2^(s - 65) for an E8M0 code s (scale_pair_f32), e4m3(s) * 2^62 for an NVFP4 block (its tensor scale `post`
// in the epilogue, as before).
// zero codes (u16) at the end of the x staging buffer that the `_1r` kernels' off lanes read (R1Cols)
__host__ __device__ constexpr int r1_zero_codes(int fmt) { return fmt == FMT_MXFP4 ? 128 : 192; }
template <int FMT> struct R1Cols {
    static_assert(FMT == FMT_MXFP4 || FMT == FMT_NVFP4, "one-row block sums: E2M1 codes");
    static constexpr int SETS = FMT == FMT_MXFP4 ? 1 : 2;  // sums a chunk keeps apart: words 0-3 and 4-7 (NVFP4)
    // independent MMA chains of a set (the two MMAs of a word on accumulators of their own): MXFP4's one set two,
    // NVFP4's two sets MX_R1_CHAINS each (1: the `_1r` build spills no more than the `_1` one)
    static constexpr int CHAINS = SETS == 1 ? 2 : MX_R1_CHAINS;
    static_assert(CHAINS == 1 || CHAINS == 2, "MX_R1_CHAINS: 1 or 2");
    // the off lanes read zero codes at xa + 32 jj (+8) from the zero area's start (r1_zero_codes), and at xb = that
    // start - XB for the words that take xb
    static constexpr int XB = FMT == FMT_MXFP4 ? 128 : 64;
    static __device__ __forceinline__ bool second(int jj) { return FMT == FMT_MXFP4 ? jj >= 4 : (jj >> 1) & 1; }
};
// A word of E2M1 codes as the unscaled MMA operand pairs of its layout (MX_E2M1), or undecoded (MX_DIAG: timing)
__device__ __forceinline__ void e2m1_raw(const u32 w, u32 (&a)[4]) {
    if (MX_DIAG & 1) {
        a[0] = w; a[1] = w >> 1; a[2] = w << 1; a[3] = ~w;
    } else if (MX_E2M1) {
        e2m1_pairs_split_raw(w, a);
    } else {
        e2m1_pairs_raw(w, a);
    }
}
template <int FMT, class RF>
__device__ __forceinline__ void mma_chunk_r1(float (&fin)[2], const LaneRow<FMT>& r0, const LaneRow<FMT>& r1,
                                             const u32 xa, const u32 xb, RF&& rf) {
    constexpr int SETS = R1Cols<FMT>::SETS, CH = R1Cols<FMT>::CHAINS;
    float d[SETS][CH][4];  // [set][MMA chain: slices 2jj, 2jj + 1 where two][fragment]
#pragma unroll
    for (int i = 0; i < SETS; ++i)
#pragma unroll
        for (int c = 0; c < CH; ++c) d[i][c][0] = d[i][c][1] = d[i][c][2] = d[i][c][3] = 0.f;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
        u32 a0[4], a1[4];
        e2m1_raw(r0.w[jj], a0);
        e2m1_raw(r1.w[jj], a1);
        if (jj % 4 == 3) rf.codes(jj / 4);  // words 4q..4q+3: piece q
        const int set = SETS == 1 ? 0 : jj >> 2;
        const uint4 b = ld_shared_v4((R1Cols<FMT>::second(jj) ? xb : xa) + 64 * jj);
        mma16816(d[set][0], a0[0], a1[0], a0[1], a1[1], b.x, b.y);
        mma16816(d[set][CH - 1], a0[2], a1[2], a0[3], a1[3], b.z, b.w);
    }
    float f0[2 * SETS], f1[2 * SETS];  // the scales of rows g / g + 8 by block: column 2t, 2t + 1 of each set
    if constexpr (FMT == FMT_MXFP4) {
        scale_pair_f32(r0.s, f0);
        scale_pair_f32(r1.s, f1);
    } else {
#pragma unroll
        for (int i = 0; i < 2 * SETS; ++i) {
            f0[i] = e4m3_f32((r0.s >> (8 * i)) & 0xFFu) * 0x1p62f;
            f1[i] = e4m3_f32((r1.s >> (8 * i)) & 0xFFu) * 0x1p62f;
        }
    }
    rf.scales();
#pragma unroll
    for (int i = 0; i < SETS; ++i) {
        float v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = CH == 2 ? d[i][0][q] + d[i][CH - 1][q] : d[i][0][q];
        fin[0] = fmaf(v[0], f0[2 * i], fin[0]);
        fin[0] = fmaf(v[1], f0[2 * i + 1], fin[0]);
        fin[1] = fmaf(v[2], f1[2 * i], fin[1]);
        fin[1] = fmaf(v[3], f1[2 * i + 1], fin[1]);
    }
}

// One group of 8 bf16 codes of x (16 bytes, k order) staged: scaled by 2^XSHIFT, in the k-slot permutation, as
// bf16x2 words.
// Each output pair is one byte permute of two input words and, for the microscaled formats, one bf16x2 FMA by
// 2^64 (XSHIFT): the bits of converting each code to float32, multiplying by 2^64 and rounding (exact either
// way: a bf16 times a power of two, past the range infinity in both), as nvcc builds it. (An NVRTC build's
// -ftz flushes the float32 path's subnormal x to zero; the bf16x2 FMA keeps them: x below 2^-126 in bf16 bits
// then stages as its exact value, in float32 as zero.)
template <int FMT>
__device__ __forceinline__ uint4 stage_bf16(const uint4 q) {
    const u32 qq[4] = {q.x, q.y, q.z, q.w};
    u32 o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int p = perm8(FMT, 2 * e), r = perm8(FMT, 2 * e + 1);  // codes of the low / high half
        const u32 sel = (2u * (p & 1)) | (2u * (p & 1) + 1u) << 4 | (4u + 2u * (r & 1)) << 8 | (5u + 2u * (r & 1)) << 12;
        const u32 v = __byte_perm(qq[p >> 1], qq[r >> 1], sel);
        o[e] = Fmt<FMT>::XSHIFT ? mx_bfma2(v, ((127u + Fmt<FMT>::XSHIFT) << 7) * 0x10001u) : v;
    }
    return u4(o[0], o[1], o[2], o[3]);
}

struct Args {
    const u8* W; const u8* S; float post; const float* bias;
    const void* x; int x_kind; i64 ldx; const int* gather;
    void* y; int y_kind; i64 ldy;
    float* partial; int* counters;
    int M, N, K, Kp; i64 w_row, s_row, w_gstride, s_gstride;
    const int* g_off; const int* g_cnt; int mtiles, cps, x_vec, stream;
    const float* res; float* sq; void* xg; const float* gw; float gw_off;  // fused producer (header), else null
    const float* nsq; int nsq_tiles; float n_eps;                          // fused consumer, else nsq null
    int xg_kind;  // the fused producer's xg: KIND_BF16 or KIND_F32 (header)
    const int* g_ids;  // grouped mode: the expert of each group (null: group j is expert j)
};

// Fused producer: sq[m0 + m, tile] = the tile's partial sums of squares of row m, sqp[m * ms + p * ps] for
// parts p < np, added in order (thread m of the block, m < m_valid; after the barrier that publishes sqp).
__device__ __forceinline__ void store_tile_sums(const Args& A, const float* sqp, int ms, int ps, int np, int m0,
                                                int m_valid, int ntiles, int tile) {
    const int m = threadIdx.x;
    if (m >= m_valid) return;
    float s = 0.f;
    for (int p = 0; p < np; ++p) s += sqp[m * ms + p * ps];
    A.sq[(i64)(m0 + m) * ntiles + tile] = s;
}

// One output tile's K range [c0, c1) of chunks, as contributor `part` of `nparts` (nparts 1: the whole K range,
// stored directly; else float32 partial sums, and the tile's last contributor to finish reduces them in a
// fixed order, so the result does not depend on timing).
// WHOLE (uniform, a template parameter so that the loop carries no bounds code): every chunk lies inside Kp
// and the scale rows are NS-byte aligned; loads then walk two RowPtrs. Otherwise load_row bounds each load.
template <int FMT, int NT, bool WHOLE, bool SWI, bool R1, class SYNC>
__device__ __forceinline__ void mx_segment(const Args& A, SYNC& sync, u16* xs, float* nden, float* sqp, bool first,
                                           int& last_flag, const int grp, const int mt, const int tile, const int c0,
                                           const int c1, const int part, const int nparts) {
    constexpr int LK = Fmt<FMT>::LANE_K, CK = 4 * LK, MT = 8 * NT, RS = XBuf<NT>::RS;
    constexpr bool FUSE = NT == 1;  // fused norms (header): one-n-tile kernels only, the wider ones keep their code
    static_assert(!R1 || (NT == 1 && (FMT == FMT_MXFP4 || FMT == FMT_NVFP4)),
                  "one-row block sums: the one-n-tile MXFP4 / NVFP4 kernels");
    constexpr int WARPS = Wp<NT>::W, TILE_ROWS = Wp<NT>::ROWS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int m_cnt = A.g_cnt ? A.g_cnt[grp] : A.M, y_off = A.g_cnt ? A.g_off[grp] : 0;
    const int m0 = mt * MT;
    const int m_valid = min(MT, m_cnt - m0);
    // Row addresses of the bounded loop (!WHOLE) as 32-bit offsets (a matrix of one group is < 4 GB, the
    // wrapper checks) from the block's base pointers; the loop over whole chunks walks RowPtrs from them.
    const i64 expert = A.g_ids ? A.g_ids[grp] : grp;
    const u8* W = A.W + expert * A.w_gstride;
    const u8* S = A.S + expert * A.s_gstride;
    const int rows0 = tile * TILE_ROWS + warp * 16;
    const bool ok0 = rows0 + g < A.N, ok8 = rows0 + g + 8 < A.N, warp_on = rows0 < A.N;
    constexpr int NS = Fmt<FMT>::NS, LB = Fmt<FMT>::LB;
    // the matrix rows behind the lane's rows g and g + 8 of its band (SWI: gate row 8 b + g and up row N / 2 +
    // 8 b + g for band b, header; else the same rows)
    const int pr0 = SWI ? (rows0 >> 1) + g : rows0 + g, pr8 = SWI ? (A.N >> 1) + (rows0 >> 1) + g : rows0 + g + 8;
    const u32 wo0 = row_off<LB>(pr0, A.w_row), wo8 = row_off<LB>(pr8, A.w_row);
    const u32 so0 = row_off<NS>(pr0, A.s_row), so8 = row_off<NS>(pr8, A.s_row);
    const u32 lr0 = (u32)(c0 * 4 + t), last = (u32)(A.N - 1);
    const u32 rg0 = min((u32)pr0, last), rg8 = min((u32)pr8, last);
    RowPtr p0{W + (row_off<LB>(rg0, A.w_row) + lane_off<LB>(lr0)), S + (row_off<NS>(rg0, A.s_row) + lane_off<NS>(lr0))};
    RowPtr p8{W + (row_off<LB>(rg8, A.w_row) + lane_off<LB>(lr0)), S + (row_off<NS>(rg8, A.s_row) + lane_off<NS>(lr0))};

    float acc[Acc<NT>::N][NT][4];
#pragma unroll
    for (int a = 0; a < Acc<NT>::N; ++a)
#pragma unroll
        for (int i = 0; i < NT; ++i) acc[a][i][0] = acc[a][i][1] = acc[a][i][2] = acc[a][i][3] = 0.f;

    // STAGES chunks of codes in flight per lane (a register ring; indices fold to constants): a decode GEMV
    // is bound by memory latency x bytes in flight, so each block streams a long K range deeply pipelined.
    // x is staged once per segment of `segc` chunks, outside the unrolled ring, so that the loop's code stays
    // small (one copy of the chunk's MMAs per stage). Tiles of <= 2 n-tiles stage only the m_valid real rows,
    // so a segment is as long as the buffer allows (M = 1: 64 chunks of 256 codes, 8x the 8-row segment);
    // wider tiles stage all MT rows, zero-filled (no per-row predicate: their registers are spoken for).
    // ST divides CPSEG (the nominal segment's chunks, or the 4- and 8-n-tile kernels' whole buffer's: segc is at
    // least as long) and segc, so every segment starts at ring slot 0.
    // wide M tiles: MX_STAGES4 (registers for acc); two-n-tile tiles keep >= 2 stages unless MX_STAGES2 says otherwise
    constexpr int CPSEG = (NT >= 4 ? XBuf<NT>::SEGK : XBuf<NT>::NSEGK) / CK;
    constexpr int ST0 = NT >= 4                            ? MX_STAGES4
                        : NT == 2 && MX_STAGES2 > 0        ? MX_STAGES2
                        : NT == 2 && Fmt<FMT>::STAGES < 2 ? 2
                                                           : Fmt<FMT>::STAGES;
    constexpr int ST = CPSEG % ST0 == 0 ? ST0 : (CPSEG % 2 == 0 && ST0 >= 2 ? 2 : 1);
    const int mrows = NT > 2 ? MT : m_valid;
    // R1: the buffer's last ZX codes stay zero (the B columns of other blocks, mma_chunk_r1); x row 0 before them
    constexpr int ZX = R1 ? r1_zero_codes(FMT) : 0;
    const int segc = (((MT * RS - ZX) / mrows - 32) / CK) / ST * ST, rs = segc * CK + 32;
    u16* const zx = xs + (MT * RS - ZX);
    if (R1 && first && tid < ZX / 8) *(uint4*)(zx + 8 * tid) = u4(0, 0, 0, 0);  // published by the staging's barrier
    const u32 zxa = R1 ? smem_u32(zx) : 0u;  // its shared-window address
    float fin[2] = {0.f, 0.f};  // R1: this lane's sums of rows g and g + 8 (its own blocks of each chunk)
    // Staged row of x that feeds MMA column g of n-tile nt. Rows past m_valid are not staged (<= 2 n-tiles):
    // their columns read the last real row instead, and those output columns are never stored.
    // Its shared-window byte address at the segment's first chunk, lane t's slot; a chunk's is one add from it.
    // (ptxas at 94 registers recomputes it every chunk from the lane index anyway, ~15 instructions; a copy it
    // cannot recompute, held in a register, was no faster: docs/perf.md, twenty-first session.)
    u32 xrow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
        xrow[nt] = smem_u32(xs + (NT > 2 ? nt * 8 + g : min(nt * 8 + g, m_valid - 1)) * rs + 8 * t);
    LaneRow<FMT> r0[ST], r1[ST];
#pragma unroll
    for (int s = 0; s < ST; ++s)
        if (c0 + s < c1)
            load_chunk<FMT, WHOLE>(r0[s], r1[s], p0, p8, W, S, wo0, wo8, so0, so8, ok0, ok8, (c0 + s) * 4 + t, A.Kp);
    if (FUSE && A.res && lane == 0 && rows0 < A.N) prefetch_l2(A.gw + rows0);  // fused producer: a persistent weight
    if (WHOLE && sync.will_wait() && t == 0 && warp_on) {  // a block about to wait (a chain's item, MX_PDL_PF): the
        const int pe = min(c1, c0 + ST + sync.prefetch_chunks());  // L2 fetches the band's next chunks meanwhile,
        const u32 wr0 = row_off<LB>(rg0, A.w_row), wr8 = row_off<LB>(rg8, A.w_row);  // a line a (row, chunk)
        for (int c = c0 + ST; c < pe; ++c) {
            prefetch_l2(W + (wr0 + lane_off<LB>((u32)(c * 4))));
            prefetch_l2(W + (wr8 + lane_off<LB>((u32)(c * 4))));
        }
    }
    sync.wait();  // x, partials and counters belong to the kernels before this one
    if (first) TRACE(A.W, 1);
    // Fused consumer: each real row's denominator, read by the epilogues (after a barrier that follows the K
    // loop); a warp a row: lane-strided tile sums, then a butterfly. Once a block (its first segment): every
    // segment of the block has the same rows of x. The first two sums of each row are loaded here and added
    // after the first x staging, so that their round trip overlaps the staging's.
    constexpr int NR = FUSE ? (MT + WARPS - 1) / WARPS : 1;  // rows a warp takes: m = warp + r WARPS
    NormSums nq[NR];
    const bool norm_rows = FUSE && A.nsq && first;
    // the sums of y row y_off + m0 + m's x row (grouped: the dispatch's copy by y row of the gathered rows' sums;
    // y_off is 0 in dense launches, and written out so, ptxas left the one-row kernels fewer spills)
    const auto nsq_row = [&](int m) { return A.nsq + (i64)((A.g_cnt ? y_off : 0) + m0 + m) * A.nsq_tiles; };
    if (norm_rows) {
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const int m = warp + r * WARPS;
            nq[r] = norm_sums_first(nsq_row(m), A.nsq_tiles, lane, m < m_valid);
        }
    }
    const float xmul = Fmt<FMT>::XSHIFT ? 0x1p64f : 1.f;
    for (int sb = c0; sb < c1; sb += segc) {
        // stage x[m0:m0+m_valid, chunks sb..sb+segc) in the k-slot permutation
        __syncthreads();
        const i64 kseg = (i64)sb * CK;
        const int se = min(c1, sb + segc), seg8 = (se - sb) * (CK / 8);
        // groups of 8 codes: thread tid takes items tid, tid + blockDim.x, ... of the mrows x segi grid, its
        // (row m, item i) stepped without dividing. An item is one group d, or for bf16 rows in 16-byte loads
        // two, d and d + 4 (16 consecutive codes of k: both loads in flight at once, so that a twelve-row
        // segment takes half the round trips to L2 in a row; G % 8 == 0, so seg8 is even)
        const int pairs = A.x_kind == KIND_BF16 && A.x_vec, segi = seg8 >> pairs;
        int m = tid / segi, i = tid - m * segi;
        while (!(MX_DIAG & 4) && m < mrows) {
            // group d: chunk d / G, lane t = d % 4, its 8-code slot jj = (d % G) / 4 (G = CK / 8 groups a chunk)
            constexpr u32 G = CK / 8;
            static_assert((G & (G - 1)) == 0 && G % 8 == 0, "groups of a chunk: a power of two, 4 lanes x 2");
            const u32 iu = (u32)i, du = pairs ? ((iu >> 2) << 3) | (iu & 3u) : iu, d8 = du * 8u;
            const i64 k0 = kseg + (i64)((du / G) * CK + (du & 3u) * LK + ((du & (G - 1)) >> 2) * 8u);
            const bool live = m < m_valid && k0 < A.K;
            const int row = !live ? 0 : A.gather ? A.gather[y_off + m0 + m] : y_off + m0 + m;
            const i64 base = (i64)row * A.ldx + k0;
            if (pairs) {  // k0 + 8 <= K where k0 < K (x_vec: K % 8 == 0)
                const uint4* p = (const uint4*)((const u16*)A.x + base);
                const uint4 q0 = live ? p[0] : u4(0, 0, 0, 0), q1 = live && k0 + 8 < A.K ? p[1] : u4(0, 0, 0, 0);
                *(uint4*)(xs + m * rs + d8) = stage_bf16<FMT>(q0);
                *(uint4*)(xs + m * rs + d8 + 32) = stage_bf16<FMT>(q1);
            } else {
                float v[8];
                if (live && A.x_vec && k0 + 8 <= A.K) {  // a whole group: 16- / 32-byte loads
                    if (A.x_kind == KIND_F32) {  // the model's activations
                        const float4* p = (const float4*)((const float*)A.x + base);
                        const float4 a = p[0], b = p[1];
                        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
                    } else {
                        const uint4 q = *(const uint4*)((const u16*)A.x + base);
                        const u32 qq[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            const u32 h = (e & 1) ? qq[e >> 1] >> 16 : qq[e >> 1] & 0xFFFFu;
                            v[e] = A.x_kind == KIND_BF16 ? __uint_as_float(h << 16) : h2f((u16)h);
                        }
                    }
                } else if (live) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = k0 + e < A.K ? load_kind(A.x, A.x_kind, base + e) : 0.f;
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = 0.f;
                }
                u32 o[4];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    o[e] = bf16x2_rn(v[perm8(FMT, 2 * e)] * xmul, v[perm8(FMT, 2 * e + 1)] * xmul);
                *(uint4*)(xs + m * rs + d8) = u4(o[0], o[1], o[2], o[3]);
            }
            i += blockDim.x;
            if (i >= segi) {  // the next row; a division only where segments are shorter than half a block
                i -= segi;
                ++m;
                if (i >= segi) {
                    const int q = i / segi;
                    m += q;
                    i -= q * segi;
                }
            }
        }
        __syncthreads();
        if (first && sb == c0) TRACE(A.W, 2);
        if (norm_rows && sb == c0) {
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const int m = warp + r * WARPS;
                if (m >= m_valid) break;  // uniform per warp
                const float d = norm_denominator(nq[r], nsq_row(m), A.nsq_tiles, A.K, A.n_eps, lane);
                if (lane == 0) nden[m] = d;
            }
        }
        for (int cb = sb; cb < se; cb += ST) {
#pragma unroll
            for (int s = 0; s < ST; ++s) {
                const int c = cb + s;
                if (c >= se) break;  // uniform per block
                const u32 co = (u32)(c - sb) * (2 * CK);  // the chunk's bytes into the staged rows
                // refill this stage with the chunk ST ahead: inside the chunk's MMAs, piece by piece (MX_EARLY,
                // whole chunks), or after them
                const bool more = c + ST < c1;
                constexpr int KIND = R1 ? 1 : NT == 1 ? 2 : NT == 2 ? 4 : 8;  // this kernel's MX_EARLY bit
                constexpr bool EARLY = WHOLE && early_ok<FMT>() && (MX_EARLY & KIND);
                const auto compute = [&](auto&& rf) {
                    if constexpr (R1) {
                        const u32 xc = xrow[0] + co;  // x row 0 (R1: m_valid == 1)
                        mma_chunk_r1<FMT>(fin, r0[s], r1[s], g == 2 * t ? xc : zxa,
                                          g == 2 * t + 1 ? xc : zxa - 2 * R1Cols<FMT>::XB, rf);
                    } else {
                        u32 xa[NT];
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) xa[nt] = xrow[nt] + co;
                        mma_chunk<FMT, NT>(acc, r0[s], r1[s], xa, rf);
                    }
                };
                if (EARLY && warp_on) {
                    compute(Refill<FMT>{r0[s], r1[s], p0, p8, more});
                } else {
                    if (warp_on) compute(NoRefill{});
                    if (more)
                        load_chunk<FMT, WHOLE>(r0[s], r1[s], p0, p8, W, S, wo0, wo8, so0, so8, ok0, ok8,
                                               (c + ST) * 4 + t, A.Kp);
                }
            }
        }
    }

    if (R1) {  // the four lanes t of rows g, g + 8 hold disjoint blocks: their sum, into the (row g / g + 8, m 0) slots
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
            fin[0] += __shfl_xor_sync(0xffffffffu, fin[0], o);
            fin[1] += __shfl_xor_sync(0xffffffffu, fin[1], o);
        }
        acc[0][0][0] = fin[0];
        acc[0][0][2] = fin[1];
    }
    sync.trigger();  // the next product may start loading its weights (pdl.cuh)
    TRACE(A.W, 3);
    if (FUSE && A.nsq) __syncthreads();  // the row denominators of the first segment, for every warp's epilogue
    // Epilogue. acc[0][nt] = {(row g, m 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)} with m += 8 nt.
#pragma unroll
    for (int a = 1; a < Acc<NT>::N; ++a)
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[0][i][q] += acc[a][i][q];
    const int ntiles = (A.N + TILE_ROWS - 1) / TILE_ROWS;
    const bool split = nparts > 1;
    float sq2[NT][2];  // fused producer, direct stores: this lane's sums of squares of rows m = nt 8 + 2t + j
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) sq2[nt][0] = sq2[nt][1] = 0.f;
    if (SWI && warp_on && !split) {  // rows g (gate) and g + 8 (up) of the band: h column rows0 / 2 + g
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int m = nt * 8 + 2 * t + j;
                if (m >= m_valid) continue;
                const float ag = FUSE && A.nsq ? acc[0][nt][j] / nden[m] : acc[0][nt][j];
                const float au = FUSE && A.nsq ? acc[0][nt][j + 2] / nden[m] : acc[0][nt][j + 2];
                const float vg = ag * A.post + 0.f, vu = au * A.post + 0.f;  // the plain epilogue's operations
                store_kind(A.y, A.y_kind, (i64)(y_off + m0 + m) * A.ldy + (rows0 >> 1) + g, silu_f(vg) * vu);
            }
    } else if (warp_on) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int m = nt * 8 + 2 * t + (q & 1), n = rows0 + g + 8 * (q >> 1);
                if (m >= m_valid || n >= A.N) continue;
                if (split) {
                    A.partial[((i64)part * A.M + y_off + m0 + m) * A.N + n] = acc[0][nt][q];
                } else {
                    const float a = FUSE && A.nsq ? acc[0][nt][q] / nden[m] : acc[0][nt][q];
                    float v = a * A.post + (A.bias ? A.bias[n] : 0.f);
                    const i64 o = (i64)(y_off + m0 + m) * A.ldy + n;
                    if (FUSE && A.res) {
                        v += A.res[o];
                        sq2[nt][q & 1] += v * v;  // rows g then g + 8
                        store_kind(A.xg, A.xg_kind, o, v * (A.gw_off + __ldg(A.gw + n)));
                    }
                    store_kind(A.y, A.y_kind, o, v);
                }
            }
    }
    if (!split) {
        if (FUSE && A.res) {
            // the tile's sums of squares: over the warp's 16 rows (lanes of one t), then over the warps in order
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    float s = sq2[nt][j];
#pragma unroll
                    for (int o = 4; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                    if (g == 0) sqp[warp * MT + nt * 8 + 2 * t + j] = s;
                }
            __syncthreads();
            store_tile_sums(A, sqp, 1, MT, WARPS, m0, m_valid, ntiles, tile);
        }
        return;
    }
    // every partial sum of this block before the count: the barrier, then one acq_rel add whose release covers
    // the block's stores (the barrier orders them before it) and whose acquire, in the last block, the others'
    __syncthreads();
    int* ctr = A.counters + ((i64)grp * A.mtiles + mt) * ntiles + tile;
    if (tid == 0) last_flag = atom_add_acq_rel(ctr, 1) == nparts - 1;
    __syncthreads();
    if (!last_flag) return;
    if (SWI) {  // pairs (gate n, up n + 8) of the tile's bands, each summed in the plain order
        for (int i = tid; i < MT * TILE_ROWS / 2; i += blockDim.x) {
            const int m = i / (TILE_ROWS / 2), c = i % (TILE_ROWS / 2);
            const int n = tile * TILE_ROWS + (c >> 3) * 16 + (c & 7);
            if (m >= m_valid || n >= A.N) continue;
            float su2[2] = {0.f, 0.f};
            constexpr int off2[2] = {0, 8};
            sum_parts<R1 ? MX_PART_BATCH : 1, 2>(A.partial + (i64)(y_off + m0 + m) * A.N + n, (i64)A.M * A.N, nparts, off2, su2);
            float sg = su2[0], su = su2[1];
            if (FUSE && A.nsq) {
                sg /= nden[m];
                su /= nden[m];
            }
            const float vg = sg * A.post + 0.f, vu = su * A.post + 0.f;
            store_kind(A.y, A.y_kind, (i64)(y_off + m0 + m) * A.ldy + ((tile * TILE_ROWS) >> 1) + c, silu_f(vg) * vu);
        }
    }
    // blockDim.x = 2 TILE_ROWS: each pass covers rows m, m + 1 of the tile, each warp 32 of one row's columns
    for (int i0 = 0; !SWI && i0 < MT * TILE_ROWS; i0 += blockDim.x) {
        const int i = i0 + tid, m = i / TILE_ROWS, n = tile * TILE_ROWS + i % TILE_ROWS;
        float v = 0.f;
        if (m < m_valid && n < A.N) {
            const i64 o = (i64)(y_off + m0 + m) * A.ldy + n;
            // the fused producer's operands first, so that their loads overlap the partial sums'
            const float r = FUSE && A.res ? A.res[o] : 0.f, gn = FUSE && A.res ? __ldg(A.gw + n) : 0.f;
            float s1[1] = {0.f};
            constexpr int off1[1] = {0};
            sum_parts<R1 ? MX_PART_BATCH : 1, 1>(A.partial + (i64)(y_off + m0 + m) * A.N + n, (i64)A.M * A.N, nparts, off1, s1);
            float s = s1[0];
            if (FUSE && A.nsq) s /= nden[m];
            v = s * A.post + (A.bias ? A.bias[n] : 0.f);
            if (FUSE && A.res) {
                v += r;
                store_kind(A.xg, A.xg_kind, o, v * (A.gw_off + gn));
            }
            store_kind(A.y, A.y_kind, o, v);
        }
        if (FUSE && A.res) {  // fused producer: this warp's 32 columns, then (below) the row's warps in order
            float s = v * v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) sqp[m * (TILE_ROWS / 32) + (i % TILE_ROWS) / 32] = s;
        }
    }
    if (FUSE && A.res) {
        __syncthreads();
        store_tile_sums(A, sqp, TILE_ROWS / 32, 1, TILE_ROWS / 32, m0, m_valid, ntiles, tile);
    }
    if (tid == 0) *ctr = 0;
}

// Block b of a stream-K launch (A.stream, dense only) takes units [b U / B, (b + 1) U / B) of the U = tiles x
// chunks units, tile-major: long contiguous K ranges, every block the same work (+-1 chunk), whatever the
// shape. A tile's contributors are the blocks whose ranges meet its units: block_of(u) = ((u + 1) B - 1) / U.
// Unit u of block bx (up to u_end) -> its tile, chunk range [c0, c1) and contributor index, in
// unsigned 32-bit arithmetic (the plan keeps U B < 2^32).
__device__ __forceinline__ void stream_unit(u32 u, u32 u_end, u32 U, u32 B, u32 bx, int nchunks, int& tile, int& c0,
                                            int& c1, int& part, int& nparts) {
    tile = (int)(u / (u32)nchunks);
    c0 = (int)(u - (u32)tile * (u32)nchunks);
    c1 = (int)min((u32)nchunks, (u32)c0 + (u_end - u));
    const u32 f = (u32)tile * (u32)nchunks;  // the tile's first unit
    const int first = (int)(((f + 1) * B - 1) / U), last = (int)(((f + (u32)nchunks) * B - 1) / U);
    part = (int)bx - first;
    nparts = last - first + 1;
}

// A block's place in its grid: the launch's own (blockIdx, gridDim: `launch_blk`), or a virtual block of a
// product that a persistent chain's block runs (MX_CHAIN below).
struct Blk {
    u32 x, y, z, gx, gy;
};
__device__ __forceinline__ Blk launch_blk() { return {blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y}; }
// The wait for the kernel before and the trigger of the next one, of a launched product: pdl.cuh's. With
// MX_PDL_PF > 0 a block's first segment has the L2 fetch its next MX_PDL_PF chunks of weights (past its register
// stages) before that wait, as a chain's block does before its own (MX_CHAIN_PF): under an overlapped launch the
// wait may be long (the kernel before is latency-bound); under a plain one it returns at once. A cache hint only.
#ifndef MX_PDL_PF
#define MX_PDL_PF 0
#endif
struct PdlSync {
    bool waited = false;
    __device__ __forceinline__ void wait() {
        waited = true;
        pdl_wait();
    }
    __device__ __forceinline__ void trigger() { pdl_trigger(); }
    __device__ __forceinline__ bool will_wait() const { return MX_PDL_PF > 0 && !waited; }
    __device__ static constexpr int prefetch_chunks() { return MX_PDL_PF; }
};

// Block `b` of a product: its segments (a tile grid's one, or its stream-K units'), over the block's shared
// memory xs (the x staging buffer), nden, sqp and last_flag (mx_gemm_impl's, or a chain's), waiting for and
// triggering other kernels through `sync`.
template <int FMT, int NT, bool SWI, bool R1, class SYNC>
__device__ __forceinline__ void mx_gemm_block(const Args& A, const Blk& b, SYNC& sync, u16* xs, float* nden,
                                              float* sqp, int& last_flag) {
    constexpr int CK = 4 * Fmt<FMT>::LANE_K, MT = 8 * NT, TILE_ROWS = Wp<NT>::ROWS;
    TRACE(A.W, 0);
    if (A.g_cnt) sync.wait();  // group counts come from the router's kernels
    const int grp = b.z / A.mtiles, mt = b.z % A.mtiles;
    const int m_cnt = A.g_cnt ? A.g_cnt[grp] : A.M;
    if (mt * MT >= m_cnt) return;  // uniform per block
    const int nchunks = (A.Kp + CK - 1) / CK;
    constexpr int NS = Fmt<FMT>::NS;
    const bool whole = A.Kp % CK == 0 && (NS == 0 || ((A.s_row | A.s_gstride | (i64)A.S) % NS == 0));
    // tile grid (!A.stream): one segment, b.x = output tile, b.y = K split of A.cps chunks.
    // The unit arithmetic is unsigned 32-bit (the plan keeps U B < 2^32): a 64-bit division is a long software
    // routine on the way to a block's first weight loads.
    const u32 B = b.gx, U = (u32)((A.N + TILE_ROWS - 1) / TILE_ROWS) * (u32)nchunks;
    const u32 u0 = !A.stream ? 0u : b.x * U / B, u_end = !A.stream ? 1u : (b.x + 1) * U / B;
    for (u32 u = u0; u < u_end;) {
        int tile = b.x, c0 = b.y * A.cps, c1 = min(nchunks, c0 + A.cps);
        int part = b.y, nparts = b.gy;
        if (A.stream) stream_unit(u, u_end, U, B, b.x, nchunks, tile, c0, c1, part, nparts);
        if (whole)
            mx_segment<FMT, NT, true, SWI, R1>(A, sync, xs, nden, sqp, u == u0, last_flag, grp, mt, tile, c0, c1, part,
                                               nparts);
        else
            mx_segment<FMT, NT, false, SWI, R1>(A, sync, xs, nden, sqp, u == u0, last_flag, grp, mt, tile, c0, c1, part,
                                                nparts);
        u += A.stream ? (u32)(c1 - c0) : 1u;
    }
    TRACE(A.W, 4);
}

// The block's shared memory of an NT-n-tile product: the x staging buffer (static, or XDYN: the launch's dynamic
// shared memory), the fused norms' row denominators and sums, the split reduction's last-block flag.
template <int NT> struct MxShared {
    static constexpr int MT = 8 * NT, RS = XBuf<NT>::RS, NF = NT == 1 ? MT : 1;  // fused norms: one n-tile only
    static constexpr int WARPS = Wp<NT>::W;
    static constexpr bool XDYN = XBuf<NT>::DYN;
    static constexpr int BYTES = (XDYN ? 16 : MT * RS * 2) + 4 * (NF + WARPS * NF) + 4;
};

// A launched product's block.
template <int FMT, int NT, bool SWI, bool R1>
__device__ __forceinline__ void mx_gemm_impl(const Args& A) {
    using SM = MxShared<NT>;
    static_assert(SM::BYTES <= 48 * 1024, "shared memory over the static limit");
    __shared__ __align__(16) u16 xs_static[SM::XDYN ? 8 : SM::MT * SM::RS];
    extern __shared__ __align__(16) u16 xs_dynamic[];  // XDYN: MT * RS codes
    u16* const xs = SM::XDYN ? xs_dynamic : xs_static;
    __shared__ float nden[SM::NF], sqp[SM::WARPS * SM::NF];  // fused consumer's row denominators, producer's row sums
    __shared__ int last_flag;
    PdlSync sync;
    mx_gemm_block<FMT, NT, SWI, R1>(A, launch_blk(), sync, xs, nden, sqp, last_flag);
}

// resident blocks of W warps for B of 8 warps (at least 1)
#define MX_BLOCKS(B, W) ((B) * 8 / (W) > 0 ? (B) * 8 / (W) : 1)
#define MX_KERNEL(NAME, FMT, NT, SWI, R1)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * Wp<NT>::W, MX_BLOCKS(NT == 1 ? MX_MINB : NT == 2 ? MX_MINB2 : NT <= 4 ? 2 : 1, Wp<NT>::W)) NAME( \
        const u8* W, const u8* S, float post, const float* bias, const void* x, int x_kind, i64 ldx,         \
        const int* gather, void* y, int y_kind, i64 ldy, float* partial, int* counters, int M, int N, int K,  \
        int Kp, i64 w_row, i64 s_row, i64 w_gstride, i64 s_gstride, const int* g_off, const int* g_cnt,      \
        int mtiles, int cps, int x_vec, int stream, const float* res, float* sq, void* xg, const float* gw,  \
        float gw_off, const float* nsq, int nsq_tiles, float n_eps, int xg_kind, const int* g_ids) {         \
        Args a{W, S, post, bias, x, x_kind, ldx, gather, y, y_kind, ldy, partial, counters, M, N, K, Kp,    \
               w_row, s_row, w_gstride, s_gstride, g_off, g_cnt, mtiles, cps, x_vec, stream, res, sq, xg,   \
               gw, gw_off, nsq, nsq_tiles, n_eps, xg_kind, g_ids};                                          \
        mx_gemm_impl<FMT, NT, SWI, R1>(a);                                                                     \
    }
#define MX_FORMAT(NAME, FMT) \
    MX_KERNEL(mx_gemm_##NAME##_1, FMT, 1, false, false) MX_KERNEL(mx_gemm_##NAME##_2, FMT, 2, false, false) \
    MX_KERNEL(mx_gemm_##NAME##_4, FMT, 4, false, false) MX_KERNEL(mx_gemm_##NAME##_8, FMT, 8, false, false) \
    MX_KERNEL(mx_gemm_##NAME##_1s, FMT, 1, true, false) MX_KERNEL(mx_gemm_##NAME##_2s, FMT, 2, true, false) \
    MX_KERNEL(mx_gemm_##NAME##_4s, FMT, 4, true, false) MX_KERNEL(mx_gemm_##NAME##_8s, FMT, 8, true, false)
// the one-row kernels with block sums (header), MXFP4 and NVFP4
#define MX_FORMAT_R1(NAME, FMT) \
    MX_KERNEL(mx_gemm_##NAME##_1r, FMT, 1, false, true) MX_KERNEL(mx_gemm_##NAME##_1rs, FMT, 1, true, true)
// Persistent chains of one-n-tile products (MX_CHAIN builds: `mx_chain_<fmt>`, MX_CHAIN a mask of the kernel kinds
// it runs, bit k for kind k below, the others left out of its code; decapybara/backend/product_chain.py).
// A decode step runs runs of products back to back, each one's x the output of the one before (out, gate|up, down,
// the next layer's input product). Launched one a product, each pays its blocks' start, its wait for the kernel
// before and its blocks' spread at the end. Here one launch of resident blocks (the caller's grid: all of them at
// once) takes the products in turn: item i's virtual blocks (its own launch's grid, so its own plan, sums and
// bytes) are dealt round-robin to the chain's blocks; a block's segments load their first weights, then wait
// until every block is done with item i - 1 (done[i - 1] == gridDim.x: a counter a block adds to after its last
// virtual block of an item, its stores and its split reductions, counter resets included, before it), and go on
// as a launched block would after its pdl_wait. So a block done with one product streams the next one's first
// weights while the others finish. The first item's x comes from the kernels before the chain: its blocks wait
// for them as a launched product's do (pdl_wait: at once under a plain launch, stream order). The last block to
// finish zeroes done[] (n + 1 counters, the last counting finished blocks) for the next launch. A wait past
// MX_CHAIN_TIMEOUT clock cycles (blocks not all resident) sets err[1] and returns, and every later wait of that
// launch returns at once (wrong results, reported, rather than a hung device); the last block moves err[1] into
// err[0], which stays set (the caller's to clear), and clears err[1] for the next launch.
#ifdef MX_CHAIN
#include "count_wait.cuh"
#ifndef MX_CHAIN_TIMEOUT
#define MX_CHAIN_TIMEOUT (1ll << 32)
#endif
#ifndef MX_CHAIN_PF
#define MX_CHAIN_PF 4  // chunks of weights past its register stages a block asks of the L2 before a wait (0: none)
#endif
struct ChainItem {  // one product: its launch's arguments, kernel kind and grid
    Args a;
    int kind;  // bit 0: SwiGLU (`_1s`), bit 1: one-row block sums (`_1r`)
    u32 gx, gy, gz;
};
struct ChainSync {  // a chain block's wait for the item before (once an item: `waited`), no trigger
    const u32* ctr;  // null: the first item, which waits for the kernel before (pdl.cuh)
    u32 target;
    u32* stop;  // err + 1: set by a wait that timed out, read by every wait after it
    bool waited;
    __device__ __forceinline__ void wait() {
        if (waited) return;  // uniform across the block
        waited = true;
        if (ctr)
            block_wait_count(ctr, target, stop, MX_CHAIN_TIMEOUT);
        else
            pdl_wait();
    }
    __device__ __forceinline__ void trigger() {}
    // about to wait on other blocks (not on the kernel before): the segment has the L2 fetch its next
    // prefetch_chunks() chunks of weights meanwhile (MX_CHAIN_PF)
    __device__ __forceinline__ bool will_wait() const { return MX_CHAIN_PF > 0 && !waited && ctr; }
    __device__ static constexpr int prefetch_chunks() { return MX_CHAIN_PF; }
};
template <int FMT>
__device__ __forceinline__ void mx_chain_impl(const ChainItem* items, int n, u32* done, u32* err) {
    using SM = MxShared<1>;
    static_assert(!SM::XDYN, "the chain stages x in static shared memory");
    __shared__ __align__(16) u16 xs[SM::MT * SM::RS];
    __shared__ float nden[SM::NF], sqp[SM::WARPS * SM::NF];
    __shared__ int last_flag;
    __shared__ __align__(16) ChainItem it;
    static_assert(sizeof(ChainItem) % 4 == 0, "items copied by words");
    for (int i = 0; i < n; ++i) {
        __syncthreads();  // every thread done with the item before's fields
        for (int w = threadIdx.x; w < (int)(sizeof(ChainItem) / 4); w += blockDim.x)
            ((u32*)&it)[w] = ((const u32*)(items + i))[w];
        __syncthreads();
        ChainSync sync{i > 0 ? done + i - 1 : nullptr, gridDim.x, err + 1, false};
        const u32 total = it.gx * it.gy * it.gz;
        for (u32 v = blockIdx.x; v < total; v += gridDim.x) {
            const Blk b{v % it.gx, (v / it.gx) % it.gy, v / (it.gx * it.gy), it.gx, it.gy};
            if ((MX_CHAIN & 1) && it.kind == 0)
                mx_gemm_block<FMT, 1, false, false>(it.a, b, sync, xs, nden, sqp, last_flag);
            if ((MX_CHAIN & 2) && it.kind == 1)
                mx_gemm_block<FMT, 1, true, false>(it.a, b, sync, xs, nden, sqp, last_flag);
            if constexpr (FMT == FMT_MXFP4 || FMT == FMT_NVFP4) {  // the one-row kernels' formats
                if ((MX_CHAIN & 4) && it.kind == 2)
                    mx_gemm_block<FMT, 1, false, true>(it.a, b, sync, xs, nden, sqp, last_flag);
                if ((MX_CHAIN & 8) && it.kind == 3)
                    mx_gemm_block<FMT, 1, true, true>(it.a, b, sync, xs, nden, sqp, last_flag);
            }
            __syncthreads();  // the next virtual block reuses the block's shared memory
        }
        if (i == 0) sync.wait();  // a block without virtual blocks of item 0 too: the kernel before has completed
                                  // (a PDL launch), so its reads of done[] below see this launch's zeros
        block_count_done(done + i);  // every thread's stores of the item's virtual blocks before the count
    }
    if (threadIdx.x == 0 && last_block_done(done + n, gridDim.x)) {  // done[n] counts finished blocks; the last
        for (int i = 0; i <= n; ++i) done[i] = 0;                          // zeroes them all
        if (err[1]) err[0] = 1;
        err[1] = 0;
        __threadfence();
    }
}
#define MX_CHAIN_KERNEL(NAME, FMT)                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * Wp<1>::W, MX_BLOCKS(MX_MINB, Wp<1>::W))                 \
        mx_chain_##NAME(const ChainItem* items, int n, u32* done, u32* err) {                                 \
        mx_chain_impl<FMT>(items, n, done, err);                                                              \
    }
#else
#define MX_CHAIN_KERNEL(NAME, FMT)
#endif

// MX_ONLY = a format id builds only that format's kernels (six; MXFP4 and NVFP4 eight: each format has its own
// tuning defines, so a module per format; a fifth of the compile), -1 none of them (mx_dequant_rows, gemv_f32);
// unset, all five.
#ifndef MX_ONLY
#define MX_ONLY_IS(F) 1
#else
#define MX_ONLY_IS(F) (MX_ONLY == (F))
#endif
#if MX_ONLY_IS(FMT_BF16)
MX_FORMAT(bf16, FMT_BF16)
MX_CHAIN_KERNEL(bf16, FMT_BF16)
#endif
#if MX_ONLY_IS(FMT_MXFP8)
MX_FORMAT(mxfp8, FMT_MXFP8)
MX_CHAIN_KERNEL(mxfp8, FMT_MXFP8)
#endif
#if MX_ONLY_IS(FMT_MXFP6)
MX_FORMAT(mxfp6, FMT_MXFP6)
MX_CHAIN_KERNEL(mxfp6, FMT_MXFP6)
#endif
#if MX_ONLY_IS(FMT_MXFP4)
MX_FORMAT(mxfp4, FMT_MXFP4)
MX_FORMAT_R1(mxfp4, FMT_MXFP4)
MX_CHAIN_KERNEL(mxfp4, FMT_MXFP4)
#endif
#if MX_ONLY_IS(FMT_NVFP4)
MX_FORMAT(nvfp4, FMT_NVFP4)
MX_FORMAT_R1(nvfp4, FMT_NVFP4)
MX_CHAIN_KERNEL(nvfp4, FMT_NVFP4)
#endif

// Dequantise rows: out[r, k] = W[rows ? rows[r] : r, k] for k < K (fp32 / bf16 / f16 by out_kind). Used for
// embedding lookups of quantised tables and for the large-M path (dequantise once, then a dense GEMM).
// NVFP4 follows docs/quant.md: fl32(fl32(elem * e4m3) * tensor_scale). e2m1_split: MXFP4 / NVFP4 codes in the
// split-field layout (header), else plain nibbles.
__device__ __forceinline__ float decode_code(int fmt, u32 c) {
    if (fmt == FMT_MXFP8) return e4m3_f32(c);
    const u32 sign = fmt == FMT_MXFP6 ? (c & 0x20u) << 26 : (c & 0x8u) << 28;
    const u32 e = fmt == FMT_MXFP6 ? (c >> 3) & 3u : (c >> 1) & 3u, m = fmt == FMT_MXFP6 ? c & 7u : c & 1u;
    const float mag = e ? __uint_as_float(((e + 126u) << 23) | (m << (fmt == FMT_MXFP6 ? 20 : 22)))
                        : (float)m * (fmt == FMT_MXFP6 ? 0.125f : 0.5f);
    return __uint_as_float(__float_as_uint(mag) | sign);
}
// Byte j of weight row `row`'s codes (piece 128) or scales (piece: a chunk's scale bytes): row-major, or
// (tiled, E2M1 formats) in 16-row bands of `piece`-byte row pieces, band by band and within a band chunk by
// chunk (row_off / lane_off above).
__device__ __forceinline__ const u8* tile_byte(const u8* W, i64 row, i64 row_bytes, int j, int tiled, int piece) {
    if (!tiled) return W + row * row_bytes + j;
    return W + (row & ~15LL) * row_bytes + (i64)(j / piece) * (16 * piece) + (row & 15) * piece + j % piece;
}
__device__ __forceinline__ const u8* code_byte(const u8* W, i64 row, i64 w_row, int j, int tiled) {
    return tile_byte(W, row, w_row, j, tiled, 128);
}
// E2M1 code k of a row: nibble k % 2 of byte k / 2, or (split) code r = k % 4 of 16-bit half k / 4 (bytes
// 2 (k / 4), little-endian, in one 128-byte piece): magnitude at bits 3r..3r+2, sign at bit 12 + (r ^ 1).
// Code r (< 4) of a split-layout 16-bit half.
__device__ __forceinline__ u32 e2m1_split_code(u32 half, u32 r) {
    return ((half >> (3 * r)) & 7u) | (((half >> (12 + (r ^ 1))) & 1u) << 3);
}
__device__ __forceinline__ u32 e2m1_code(const u8* W, i64 row, i64 w_row, int k, int split, int tiled) {
    if (!split) return (*code_byte(W, row, w_row, k >> 1, tiled) >> (4 * (k & 1))) & 0xFu;
    const u8* b = code_byte(W, row, w_row, 2 * (k >> 2), tiled);
    return e2m1_split_code(b[0] | ((u32)b[1] << 8), k & 3);
}
extern "C" __global__ void mx_dequant_rows(const u8* W, const u8* S, float ts, int fmt, int e2m1_split, int tiled,
                                           const i64* rows, int R, int K, i64 w_row, i64 s_row, void* out,
                                           int out_kind) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)R * K) return;
    const int r = (int)(i / K), k = (int)(i % K);
    const i64 row = rows ? rows[r] : r;
    const u8* w = W + row * w_row;
    float v;
    if (fmt == FMT_BF16) {
        v = __uint_as_float((u32)((const u16*)w)[k] << 16);
    } else {
        u32 c;
        if (fmt == FMT_MXFP8) c = w[k];
        else if (fmt == FMT_MXFP6) {
            const u8* b = w + (k >> 2) * 3;
            u32 word = b[0] | ((u32)b[1] << 8) | ((u32)b[2] << 16);
            c = (word >> (6 * (k & 3))) & 0x3Fu;
        } else c = e2m1_code(W, row, w_row, k, e2m1_split, tiled);
        const int blk = fmt == FMT_NVFP4 ? 16 : 32;
        const u32 s = *tile_byte(S, row, s_row, k / blk, tiled, 256 / blk);
        if (fmt == FMT_NVFP4) {
            v = (decode_code(fmt, c) * e4m3_f32(s)) * ts;
        } else {
            float sc = s == 255u ? __int_as_float(0x7FC00000) : s == 0u ? 0x1p-127f : __uint_as_float(s << 23);
            v = decode_code(fmt, c) * sc;
        }
    }
    store_kind(out, out_kind, i, v);
}

// All rows of a weight as bf16 bits, the bits of mx_dequant_rows with out_kind bf16 (the same float values, then
// the same rounding; cvt.rn.bf16x2 rounds each half as cvt.rn.bf16 does): the large-M path's dequantisation
// (decapybara/backend/cupy_ops_extra.py `mx_dequant`, `dequant_bf16_ok`). Needs K % block == 0 (no padding
// codes: 8 consecutive elements of a row are one run of code bytes and share one scale byte) and
// rows * K / 8 < 2^31. Formats MXFP8 / MXFP6 / MXFP4 / NVFP4, E2M1 codes plain or split, row-major or tiled.
// A thread takes MX_DQ_OCTETS octets (8 elements: 4 code bytes of E2M1, 8 of E4M3, 6 of E2M3; one scale byte)
// DQ_THREADS apart, loads all of their codes and scales, then stores each octet as one 16-byte vector: the
// threads of a warp take consecutive octets, so a warp reads one run of code bytes (a 128-byte piece of a tiled
// band) and writes 512 contiguous output bytes a store. Octet o is output elements 8o..8o+7 of the dense
// [N, K] result; its row and column (for the codes) come from one division a thread, then steps of DQ_THREADS.
// Values: MXFP4 blocks with scale 2 <= s <= 252 take the bf16x2 path (codes as bf16 of value * 2^-126,
// mx_pairs.cuh; times 2^126, then times 2^(s - 127): both products exact, every result a normal bf16 or +-0,
// so the bits of the float path); so do NVFP4 blocks with a tensor scale of 1 and a finite E4M3 scale s (times
// e4m3(s) instead: an E2M1 value (<= 2 significant bits) times an E4M3 one (<= 4) is exact in bf16 and normal
// (|product| >= 0.5 * 2^-9) or +-0, the sign the XOR of the two signs, as in float32); everything else (other
// scales, other formats) the float32 expressions of mx_dequant_rows element by element.
#ifndef MX_DQ_OCTETS
#define MX_DQ_OCTETS 4
#endif
#define DQ_THREADS 256
// Code c_i (i < 8) of an octet's code words w (E2M1: w[0]; E4M3: w[0..1]; E2M3: the 6 bytes in w[0], w[1]).
template <int FMT, bool SPLIT> __device__ __forceinline__ u32 dq_code(const u32 (&w)[2], int i) {
    if (FMT == FMT_MXFP8) return (w[i >> 2] >> (8 * (i & 3))) & 0xFFu;
    if (FMT == FMT_MXFP6) {
        const u32 g = i < 4 ? w[0] & 0xFFFFFFu : (w[0] >> 24) | (w[1] << 8);
        return (g >> (6 * (i & 3))) & 0x3Fu;
    }
    if (!SPLIT) return (w[0] >> (4 * i)) & 0xFu;
    return e2m1_split_code((w[0] >> (16 * (i >> 2))) & 0xFFFFu, i & 3);
}
// The octet as mx_dequant_rows computes it, element by element.
template <int FMT, bool SPLIT> __device__ __forceinline__ uint4 dq_exact(const u32 (&w)[2], u32 s, float ts) {
    float v[8];
    if (FMT == FMT_NVFP4) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = (decode_code(FMT, dq_code<FMT, SPLIT>(w, i)) * e4m3_f32(s)) * ts;
    } else {
        const float sc = s == 255u ? __int_as_float(0x7FC00000) : s == 0u ? 0x1p-127f : __uint_as_float(s << 23);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = decode_code(FMT, dq_code<FMT, SPLIT>(w, i)) * sc;
    }
    return u4(bf16x2_rn(v[0], v[1]), bf16x2_rn(v[2], v[3]), bf16x2_rn(v[4], v[5]), bf16x2_rn(v[6], v[7]));
}
// E2M1 octet w times the block's bf16x2 factor f (one value in both halves; every product exact, header): pairs
// (c_r, c_{r+4}) of value * 2^-126, times 2^126 (the exact unscaled values), times f, then regrouped as
// (c_0, c_1) .. (c_6, c_7). f: 2^(s - 127) for MXFP4 (2 <= s <= 252), e4m3(s) for NVFP4 (s not NaN, ts 1).
template <bool SPLIT> __device__ __forceinline__ uint4 dq_e2m1_fast(u32 w, u32 f) {
    u32 a[4];
    if (SPLIT) e2m1_pairs_split_raw(w, a);
    else e2m1_pairs_raw(w, a);
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = mx_bfma2(mx_bfma2(a[r], 0x7E807E80u), f);
    return u4(__byte_perm(a[0], a[1], 0x5410), __byte_perm(a[2], a[3], 0x5410), __byte_perm(a[0], a[1], 0x7632),
              __byte_perm(a[2], a[3], 0x7632));
}
template <int FMT, bool SPLIT>
__device__ __forceinline__ void dq_bf16(const u8* W, const u8* S, float ts, int tiled, u32 N, u32 Q, i64 w_row,
                                        i64 s_row, uint4* out) {
    constexpr u32 OPB = FMT == FMT_NVFP4 ? 2u : 4u;  // octets a scale block
    const u32 total = N * Q, o0 = blockIdx.x * (u32)(DQ_THREADS * MX_DQ_OCTETS) + threadIdx.x;
    u32 row = o0 / Q, col = o0 - row * Q;
    u32 w[MX_DQ_OCTETS][2], s[MX_DQ_OCTETS];
#pragma unroll
    for (int j = 0; j < MX_DQ_OCTETS; ++j) {
        if (j) {
            col += DQ_THREADS;
            while (col >= Q) {
                col -= Q;
                ++row;
            }
        }
        w[j][0] = w[j][1] = s[j] = 0u;
        if (o0 + (u32)(j * DQ_THREADS) >= total) continue;
        if (FMT == FMT_MXFP8) {
            const uint2 v = __ldg((const uint2*)(W + (i64)row * w_row + col * 8u));
            w[j][0] = v.x;
            w[j][1] = v.y;
        } else if (FMT == FMT_MXFP6) {
            const u16* p = (const u16*)(W + (i64)row * w_row + col * 6u);
            w[j][0] = __ldg(p) | ((u32)__ldg(p + 1) << 16);
            w[j][1] = __ldg(p + 2);
        } else {
            w[j][0] = __ldg((const u32*)code_byte(W, row, w_row, (int)(col * 4u), tiled));
        }
        s[j] = __ldg(tile_byte(S, row, s_row, (int)(col / OPB), tiled, FMT == FMT_NVFP4 ? 16 : 8));
    }
#pragma unroll
    for (int j = 0; j < MX_DQ_OCTETS; ++j) {
        const u32 o = o0 + (u32)(j * DQ_THREADS);
        if (o >= total) break;
        uint4 v;
        if (FMT == FMT_MXFP4 && s[j] - 2u <= 250u) v = dq_e2m1_fast<SPLIT>(w[j][0], (s[j] << 7) | (s[j] << 23));
        else if (FMT == FMT_NVFP4 && ts == 1.0f && (s[j] & 0x7Fu) != 0x7Fu)  // f: e4m3(s)'s exact bf16, twice
            v = dq_e2m1_fast<SPLIT>(w[j][0], __byte_perm(__float_as_uint(e4m3_f32(s[j])), 0u, 0x3232));
        else v = dq_exact<FMT, SPLIT>(w[j], s[j], ts);
        out[o] = v;
    }
}
extern "C" __global__ void __launch_bounds__(DQ_THREADS) mx_dequant_bf16(const u8* W, const u8* S, float ts, int fmt,
                                                                     int e2m1_split, int tiled, int N, int K,
                                                                     i64 w_row, i64 s_row, uint4* out) {
    const u32 n = (u32)N, q = (u32)K / 8u;
    if (fmt == FMT_MXFP8) dq_bf16<FMT_MXFP8, false>(W, S, ts, 0, n, q, w_row, s_row, out);
    else if (fmt == FMT_MXFP6) dq_bf16<FMT_MXFP6, false>(W, S, ts, 0, n, q, w_row, s_row, out);
    else if (fmt == FMT_MXFP4 && e2m1_split) dq_bf16<FMT_MXFP4, true>(W, S, ts, tiled, n, q, w_row, s_row, out);
    else if (fmt == FMT_MXFP4) dq_bf16<FMT_MXFP4, false>(W, S, ts, tiled, n, q, w_row, s_row, out);
    else if (fmt == FMT_NVFP4 && e2m1_split) dq_bf16<FMT_NVFP4, true>(W, S, ts, tiled, n, q, w_row, s_row, out);
    else if (fmt == FMT_NVFP4) dq_bf16<FMT_NVFP4, false>(W, S, ts, tiled, n, q, w_row, s_row, out);
}

// Skinny float32 GEMM for the reference-precision backend: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small.
// One warp per output column n, 8 rows of x per grid.y tile; lanes stride K (fma), then a butterfly sum:
// a fixed summation order, so results are deterministic and need no cuBLAS (decode graphs can capture it).
extern "C" __global__ void gemv_f32(const float* __restrict__ W, const float* __restrict__ x, const float* bias,
                                    float* y, int M, int N, int K) {
    const int n = (int)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (n >= N) return;
    const int m0 = blockIdx.y * 8, mc = min(8, M - m0);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const float* w = W + (i64)n * K;
    const float* xm = x + (i64)m0 * K;
    for (int k = lane; k < K; k += 32) {
        const float wv = __ldg(w + k);
#pragma unroll
        for (int m = 0; m < 8; ++m)
            if (m < mc) acc[m] = fmaf(wv, xm[(i64)m * K + k], acc[m]);
    }
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        float v = acc[m];
#pragma unroll
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && m < mc) y[(i64)(m0 + m) * N + n] = v + (bias ? bias[n] : 0.f);
    }
}

// y[M, N] = x[M, K] @ W[N, K]^T for bf16 weights of few rows (N) and few rows of x (M <= 16): products too
// small for mx_gemv.cu's tiles, whose K splits across blocks then cost more than the bytes (an MoE router
// stacked with its shared expert's gate: 257 rows of 2,048; the DeltaNet b|a: 2 Hv rows;
// decapybara/backend/cupy_ops_extra.py `small_product`).
//
// W: bf16 bits [N, K], rows ldw codes apart (K % 8 == 0, rows and ldw 16-byte aligned); x: float32 / bf16 / f16
// rows ldx apart (act_kind.cuh), rounded to bf16 (nearest even) as the skinny kernels round bf16 weights' x;
// y: float32 / bf16 / f16 rows ldy apart. `vec` (the wrapper's): x's rows start 16-byte aligned, so its 8-code
// groups load as 16 bytes; else element by element.
//
// One block a tile of 16 weight rows (grid ceil(N / 16)), its SG_WARPS warps splitting K in whole 32-code steps
// (warp w: steps w S / W .. (w + 1) S / W - 1 of S = ceil(K / 32)). Tensor cores: mma.sync m16n8k16 bf16 ->
// float32, A = the tile's rows, B = x^T (n-tile nt: rows 8 nt .. 8 nt + 7 of x). Lane (g = lane / 4, t = lane
// % 4) of a step loads the 8 contiguous codes k = 32 s + 8 t .. + 7 of rows g and g + 8 (16 bytes each) and
// the same 8 elements of x row 8 nt + g, and feeds them as two MMAs' k-slots (codes 0-3 to the first, 4-7 to
// the second; the reduction order inside an MMA is free, so no permutation is staged): no shared-memory
// staging, no barrier before the MMAs. The warp's first SG_PRE steps of codes load before the wait (pdl.cuh;
// load-time weights only: the wrapper launches overlapped for those alone); x after it, a batch of steps at
// once. The warps' float32 sums meet in shared memory and one thread a (row, x row) adds them in warp order:
// a fixed order for a given K and SG_WARPS.
// Fused norm consumer (nsq != 0; decapybara/backend/cupy_ops_extra.py `NormedRows`): x is the producer's xg =
// h * (offset + weight) and each output of x row m is divided by its denominator sqrt(sum / K + n_eps), the sum
// of the producer's nsq_tiles sums of squares nsq[m, :] (norm_sums.cuh: mx_gemv.cu's consumers' arithmetic, so the
// same bits). The sums load after the wait and are added after the K loop.
#include "act_kind.cuh"
#include "mma.cuh"
#include "norm_sums.cuh"
#include "pdl.cuh"

#ifndef SG_WARPS
#define SG_WARPS 16  // warps a block (the K split of its 16-row tile)
#endif
#ifndef SG_PRE
#define SG_PRE 4  // 32-code steps of a warp's codes in registers at once (the first batch before the wait)
#endif

// The 8 elements x[m, k .. k + 7] as bf16x2 words (element k in the low half of word 0); zeros where !ok.
__device__ __forceinline__ uint4 x_group(const void* x, int kind, int vec, long long i, bool ok) {
    uint4 r = {0u, 0u, 0u, 0u};
    if (!ok) return r;
    if (vec && kind == KIND_BF16) return *(const uint4*)((const u16*)x + i);
    float f[8];
    if (vec && kind == KIND_F32) {
        const float4 a = *(const float4*)((const float*)x + i), b = *(const float4*)((const float*)x + i + 4);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else if (vec) {  // f16
        const uint4 h = *(const uint4*)((const u16*)x + i);
        const u32 hw[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            f[2 * e] = h2f((u16)(hw[e] & 0xFFFFu));
            f[2 * e + 1] = h2f((u16)(hw[e] >> 16));
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = load_kind(x, kind, i + e);
    }
    r.x = bf16x2_rne(f[0], f[1]);
    r.y = bf16x2_rne(f[2], f[3]);
    r.z = bf16x2_rne(f[4], f[5]);
    r.w = bf16x2_rne(f[6], f[7]);
    return r;
}

template <int NT>  // n-tiles: rows of x up to 8 NT
__device__ __forceinline__ void small_tile(const u16* __restrict__ W, long long ldw, const void* x, int x_kind,
                                           long long ldx, int vec, int M, int N, int K, void* y, int y_kind,
                                           long long ldy, const float* nsq, int nsq_tiles, float n_eps) {
    __shared__ float red[SG_WARPS][16][8 * NT + 1];  // each warp's sums: [weight row of the tile][x row]
    __shared__ float den[8 * NT];                    // fused consumer: each x row's denominator
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * 16;
    const int steps = (K + 31) >> 5, s0 = warp * steps / SG_WARPS, s1 = (warp + 1) * steps / SG_WARPS;
    // rows past N read row N - 1 (their sums are never stored)
    const u16* wa = W + (long long)min(r0 + g, N - 1) * ldw + 8 * t;
    const u16* wb = W + (long long)min(r0 + g + 8, N - 1) * ldw + 8 * t;
    uint4 wr[SG_PRE][2];
    auto load_w = [&](int sb) {
#pragma unroll
        for (int i = 0; i < SG_PRE; ++i) {
            const int s = sb + i;
            const bool ok = s < s1 && 32 * s + 8 * t < K;
            const uint4 z = {0u, 0u, 0u, 0u};
            wr[i][0] = ok ? __ldg((const uint4*)(wa + 32 * s)) : z;
            wr[i][1] = ok ? __ldg((const uint4*)(wb + 32 * s)) : z;
        }
    };
    load_w(s0);
    pdl_begin();  // x comes from the kernel before
    // fused consumer: rows m = warp + r SG_WARPS of x, their first two sums a lane (the rest after the K loop)
    constexpr int NR = (8 * NT + SG_WARPS - 1) / SG_WARPS;
    NormSums nq[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int m = warp + r * SG_WARPS;
        nq[r] = norm_sums_first(nsq + (long long)m * nsq_tiles, nsq_tiles, lane, nsq && m < M);
    }
    float acc[2][NT][4];  // [MMA chain: codes 0-3 / 4-7 of a lane's group][n-tile][fragment]
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[c][nt][0] = acc[c][nt][1] = acc[c][nt][2] = acc[c][nt][3] = 0.0f;
    for (int sb = s0; sb < s1; sb += SG_PRE) {
        if (sb != s0) load_w(sb);
        uint4 xv[SG_PRE][NT];
#pragma unroll
        for (int i = 0; i < SG_PRE; ++i) {
            const int s = sb + i, k = 32 * s + 8 * t;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int m = 8 * nt + g;
                xv[i][nt] = x_group(x, x_kind, vec, (long long)m * ldx + k, s < s1 && k < K && m < M);
            }
        }
#pragma unroll
        for (int i = 0; i < SG_PRE; ++i) {
            const uint4 a = wr[i][0], b = wr[i][1];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                mma(acc[0][nt], a.x, b.x, a.y, b.y, xv[i][nt].x, xv[i][nt].y);
                mma(acc[1][nt], a.z, b.z, a.w, b.w, xv[i][nt].z, xv[i][nt].w);
            }
        }
    }
    // fragment: d0 (row g, x row 2t), d1 (g, 2t + 1), d2 (g + 8, 2t), d3 (g + 8, 2t + 1) of each n-tile
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int c = 8 * nt + 2 * t;
        red[warp][g][c] = acc[0][nt][0] + acc[1][nt][0];
        red[warp][g][c + 1] = acc[0][nt][1] + acc[1][nt][1];
        red[warp][g + 8][c] = acc[0][nt][2] + acc[1][nt][2];
        red[warp][g + 8][c + 1] = acc[0][nt][3] + acc[1][nt][3];
    }
    if (nsq) {
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const int m = warp + r * SG_WARPS;
            if (m >= M) break;  // uniform per warp
            const float d = norm_denominator(nq[r], nsq + (long long)m * nsq_tiles, nsq_tiles, K, n_eps, lane);
            if (lane == 0) den[m] = d;
        }
    }
    __syncthreads();
    for (int o = threadIdx.x; o < 16 * 8 * NT; o += 32 * SG_WARPS) {
        const int r = o & 15, m = o >> 4;  // consecutive threads: consecutive columns of y
        if (m < M && r0 + r < N) {
            float s = red[0][r][m];
#pragma unroll
            for (int w = 1; w < SG_WARPS; ++w) s += red[w][r][m];
            if (nsq) s /= den[m];
            store_kind(y, y_kind, (long long)m * ldy + r0 + r, s);
        }
    }
}

// up to 8 rows of x
extern "C" __global__ void __launch_bounds__(SG_WARPS * 32) gemv_bf16_small_1(
    const u16* __restrict__ W, long long ldw, const void* x, int x_kind, long long ldx, int vec, int M, int N, int K,
    void* y, int y_kind, long long ldy, const float* nsq, int nsq_tiles, float n_eps) {
    small_tile<1>(W, ldw, x, x_kind, ldx, vec, M, N, K, y, y_kind, ldy, nsq, nsq_tiles, n_eps);
}
// 9 to 16 rows of x
extern "C" __global__ void __launch_bounds__(SG_WARPS * 32) gemv_bf16_small_2(
    const u16* __restrict__ W, long long ldw, const void* x, int x_kind, long long ldx, int vec, int M, int N, int K,
    void* y, int y_kind, long long ldy, const float* nsq, int nsq_tiles, float n_eps) {
    small_tile<2>(W, ldw, x, x_kind, ldx, vec, M, N, K, y, y_kind, ldy, nsq, nsq_tiles, n_eps);
}

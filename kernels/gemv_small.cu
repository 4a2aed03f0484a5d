// y[M, N] = x[M, K] @ W[N, K]^T for bf16 weights of few rows (N) and few rows of x (M <= SG_M): products too
// small for mx_gemv.cu's tiles, whose K splits then cost more than the bytes (an MoE router stacked with its
// shared expert's gate: 257 rows of 2,048; decapybara/backend/cupy_ops_extra.py `small_product`).
//
// W: bf16 bits [N, K], rows ldw codes apart (K % 8 == 0, rows 16-byte aligned); x: float32 / bf16 / f16 rows ldx
// apart (act_kind.cuh), rounded to bf16 as the skinny kernels round x; y: float32 / bf16 / f16 rows ldy apart.
// Float32 products and sums: lane l of a warp sums its codes k = 8 (32 i + l) .. + 8 for i = 0, 1, .. in order,
// then the 32 lanes' sums by a butterfly (a fixed order for a given K).
// A block of SG_WARPS warps stages x (M rows, rounded to bf16, as float32) in dynamic shared memory; each warp
// computes SG_R weight rows. An overlapped launch (pdl.cuh): the warp's first SG_PRE groups of weight codes load
// before the wait (load-time weights only: the wrapper launches it overlapped for those alone).
#include "act_kind.cuh"
#include "pdl.cuh"

typedef unsigned int u32;
typedef unsigned short u16;

#ifndef SG_M
#define SG_M 16  // rows of x at most
#endif
#ifndef SG_R
#define SG_R 2  // weight rows a warp
#endif
#ifndef SG_WARPS
#define SG_WARPS 4
#endif
#define SG_XB 16  // groups of 4 elements of x a thread loads at once while staging
#define SG_PRE 8  // 8-code groups of each row a lane loads before the wait (K = 2,048: all of them)

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

extern "C" __global__ void __launch_bounds__(SG_WARPS * 32) gemv_bf16_small(
    const u16* __restrict__ W, long long ldw, const void* x, int x_kind, long long ldx, int M, int N, int K,
    void* y, int y_kind, long long ldy) {
    extern __shared__ float xs[];  // [M][K]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * SG_WARPS + warp) * SG_R;
    const int groups = K >> 3;  // 8-code groups a row
    uint4 pre[SG_R][SG_PRE];
#pragma unroll
    for (int r = 0; r < SG_R; ++r) {
        const int row = min(r0 + r, N - 1);  // rows past N load row N - 1 (never stored)
#pragma unroll
        for (int i = 0; i < SG_PRE; ++i) {
            const int g = i * 32 + lane;
            uint4 v = {0u, 0u, 0u, 0u};
            if (g < groups) v = __ldg((const uint4*)(W + (long long)row * ldw) + g);
            pre[r][i] = v;
        }
    }
    pdl_begin();  // x comes from the kernel before
    // x by groups of 4 elements, SG_XB groups a thread in flight at once (a block's staging is a few round trips)
    const int nq = (M * K) >> 2;
    for (int q0 = threadIdx.x; q0 < nq; q0 += SG_XB * blockDim.x) {
        float v[SG_XB][4];
#pragma unroll
        for (int b = 0; b < SG_XB; ++b) {
            const int q = q0 + b * blockDim.x;
            if (q < nq) {
                const int m = (4 * q) / K, k = 4 * q - m * K;
#pragma unroll
                for (int e = 0; e < 4; ++e) v[b][e] = load_kind(x, x_kind, (long long)m * ldx + k + e);
            }
        }
#pragma unroll
        for (int b = 0; b < SG_XB; ++b) {
            const int q = q0 + b * blockDim.x;
            if (q < nq) {
#pragma unroll
                for (int e = 0; e < 4; ++e) xs[4 * q + e] = __uint_as_float((u32)f2bf(v[b][e]) << 16);
            }
        }
    }
    __syncthreads();
    float acc[SG_R][SG_M];
#pragma unroll
    for (int r = 0; r < SG_R; ++r)
#pragma unroll
        for (int m = 0; m < SG_M; ++m) acc[r][m] = 0.0f;
    for (int i0 = 0; i0 * 32 < groups; i0 += SG_PRE) {
        if (i0) {  // rows longer than SG_PRE groups a lane: the pass's codes, all loads in flight at once
#pragma unroll
            for (int r = 0; r < SG_R; ++r) {
                const int row = min(r0 + r, N - 1);
#pragma unroll
                for (int i = 0; i < SG_PRE; ++i) {
                    const int g = (i0 + i) * 32 + lane;
                    if (g < groups) pre[r][i] = __ldg((const uint4*)(W + (long long)row * ldw) + g);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < SG_PRE; ++i) {
            const int g = (i0 + i) * 32 + lane;
            if (g >= groups) break;
            uint4 wv[SG_R];
#pragma unroll
            for (int r = 0; r < SG_R; ++r) wv[r] = pre[r][i];
#pragma unroll
            for (int m = 0; m < SG_M; ++m) {
                if (m >= M) break;
                const float4 a = *(const float4*)(xs + m * K + 8 * g);
                const float4 b = *(const float4*)(xs + m * K + 8 * g + 4);
#pragma unroll
                for (int r = 0; r < SG_R; ++r) {
                    float s = acc[r][m];
                    s = fmaf(a.x, bf16_lo(wv[r].x), s);
                    s = fmaf(a.y, bf16_hi(wv[r].x), s);
                    s = fmaf(a.z, bf16_lo(wv[r].y), s);
                    s = fmaf(a.w, bf16_hi(wv[r].y), s);
                    s = fmaf(b.x, bf16_lo(wv[r].z), s);
                    s = fmaf(b.y, bf16_hi(wv[r].z), s);
                    s = fmaf(b.z, bf16_lo(wv[r].w), s);
                    s = fmaf(b.w, bf16_hi(wv[r].w), s);
                    acc[r][m] = s;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < SG_R; ++r)
#pragma unroll
        for (int m = 0; m < SG_M; ++m) {
            if (m >= M) break;
            float s = acc[r][m];
#pragma unroll
            for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
            if (lane == m && r0 + r < N) store_kind(y, y_kind, (long long)m * ldy + r0 + r, s);
        }
}

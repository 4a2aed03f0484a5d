// The wgmma building blocks of decapybara/kernels/wgmma.cuh on their own (tests/gpu/test_wgmma.py against numpy): one
// warpgroup, operands staged by ordinary stores into chunk-major tiles (layout 0) or 128-byte swizzled ones
// (layout 2) with the header's descriptors, or with their leading and stride byte offsets exchanged (layouts 1
// and 3: a probe of the descriptor's fields). Dynamic shared memory 1 KB more than the tiles (aligned start).
#include "common.cuh"
#include "smem.cuh"
#include "wgmma.cuh"

// rows x K bf16 (row-major, K contiguous) into a chunk-major (layout < 2) or swizzled tile at `dst`
__device__ __forceinline__ void stage_rows(unsigned char* dst, const u16* __restrict__ src, int rows, int K,
                                           int layout) {
  for (int i = threadIdx.x; i < rows * (K / 8); i += blockDim.x) {
    const int r = i / (K / 8), c = i - r * (K / 8);
    const int at = layout < 2 ? wg_chunk(r, c, rows) : wg_sw_chunk(r, c, rows);
    *(uint4*)(dst + at) = *(const uint4*)(src + (i64)r * K + 8 * c);
  }
}
// the dynamic shared memory's first 1024-byte aligned byte
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
  return raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u);
}

template <int N, int NR>
__device__ __forceinline__ void store_acc(float* __restrict__ D, const float (&d)[NR]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int i = 0; i < N / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) D[(16 * warp + gid + 8 * (e >> 1)) * N + 8 * i + 2 * tig + (e & 1)] = d[4 * i + e];
}

template <int N, typename FA, typename FB>
__device__ __forceinline__ void ss_product(float* __restrict__ D, FA da, FB db, int K) {
  float d[N / 2];
  wg_fence();
  for (int s = 0; s < K / 16; ++s) wg_ss<N>(d, da(s), db(s), s);
  wg_commit();
  wg_wait<0>();
  store_acc<N>(D, d);
}

// D [64, N] = A [64, K] @ B [N, K]^T, N = 32 or 64, both operands from shared memory (K-major). 128 threads,
// dynamic shared memory (64 + N) * K * 2 bytes.
extern "C" __global__ void wg_probe_ss(const u16* __restrict__ A, const u16* __restrict__ B, float* __restrict__ D,
                                       int K, int N, int layout) {
  DYN_SMEM_DECL(raw);
  unsigned char* const smem = aligned_smem(raw);
  unsigned char* const b_p = smem + 64 * K * 2;
  stage_rows(smem, A, 64, K, layout);
  stage_rows(b_p, B, N, K, layout);
  wg_fence_smem();
  __syncthreads();
  const u32 a_s = smem_u32(smem), b_s = smem_u32(b_p);
  auto desc = [&](u32 base, int rows, int s) {
    if (layout == 0) return wg_desc_k(base, rows, s);
    if (layout == 1) return wg_desc(base + 32u * s * rows, 128u, 16u * rows);
    if (layout == 2) return wg_desc_k_sw(base, rows, s);
    return wg_desc_sw(base + 128u * rows * (s >> 2) + 32u * (s & 3), 1024u, 16u);
  };
  auto da = [&](int s) { return desc(a_s, 64, s); };
  auto db = [&](int s) { return desc(b_s, N, s); };
  if (N == 32) ss_product<32>(D, da, db, K);
  else ss_product<64>(D, da, db, K);
}

// D [64, 256] = A [64, K] @ V [K, 256]: A from registers (mma.sync A fragments loaded from global), V from a
// chunk-major tile of K rows read MN-major. 128 threads, dynamic shared memory K * 512 bytes.
extern "C" __global__ void wg_probe_rs(const u16* __restrict__ A, const u16* __restrict__ V, float* __restrict__ D,
                                       int K, int layout) {
  DYN_SMEM_DECL(raw);
  unsigned char* const smem = aligned_smem(raw);
  stage_rows(smem, V, K, 256, layout);
  wg_fence_smem();
  __syncthreads();
  const u32 v_s = smem_u32(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tig = lane & 3;
  const int r0 = 16 * warp + gid;
  auto pair = [&](int r, int k) { return *(const u32*)(A + (i64)r * K + k); };
  float d[128];
  for (int s = 0; s < K / 16; ++s) {
    const int k = 16 * s + 2 * tig;
    const u32 a0 = pair(r0, k), a1 = pair(r0 + 8, k), a2 = pair(r0, k + 8), a3 = pair(r0 + 8, k + 8);
    wg_fence();  // A's registers are written before each wgmma
    const u64 db = layout == 0 ? wg_desc_mn(v_s, K, s)
                   : layout == 1 ? wg_desc(v_s + 256u * s, 16u * K, 128u)
                   : layout == 2 ? wg_desc_mn_sw(v_s, K, s)
                                 : wg_desc_sw(v_s + 2048u * s, 1024u, 128u * K);
    wg_rs_n256_t(d, a0, a1, a2, a3, db, s);
  }
  wg_commit();
  wg_wait<0>();
  store_acc<256>(D, d);
}

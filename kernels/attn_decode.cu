// Decode attention on tensor cores over bf16 KV pages: one new token per sequence, the g <= BLOCK_M <= 8 query
// heads of one KV head per CTA, keys [key_begin, key_end) of one work item (kernels/attn_prefill.cu's work and
// split-K partial layout, so its attention_reduce merges the parts; decapybara/backend/cupy_attention.py plans).
//
// Compile-time: HEAD_DIM (D: 64, 128 or 256), BLOCK_M (rows of a work tile: 4 or 8, the partial buffers'
// stride), DEC_WARPS (warps per CTA), DEC_STAGES (16-key tiles each warp has in flight).
//
// Each warp streams its own 16-key tiles (tile w, w + NW, ... of the CTA's range) through a ring of
// DEC_STAGES shared-memory stages filled by cp.async (zero-filled past key_end), so there is no block barrier
// in the loop; the warps' (max, sum, output) merge once at the end. Per tile, with mma.sync m16n8k16 (bf16 in,
// fp32 accumulate):
//   S^T [16 rows, 16 keys] = Qa [16 rows, D] @ K^T   rows 0-7: bf16(q) of head r, rows 8-15: bf16(q - bf16(q)),
//                                                    so S = rows r + r+8 carries q to ~2^-16 (K is exact bf16)
//   O^T [D, 8 heads]     += V^T [D, 16 keys] @ P^T   P split the same way into two bf16 MMAs
// The S^T accumulator fragment of a lane (head g, keys 2t, 2t+1, 8+2t, 9+2t) is exactly the P^T operand
// fragment the second product needs, so P never leaves registers. K and V tiles sit in shared memory as
// [16 keys][D] bf16 with 16-byte chunks XOR-swizzled by key (chunk ^ key % 8): ldmatrix (K, as the B operand)
// and ldmatrix.trans (V, as the A operand) then read 8 keys of one chunk column without bank conflicts.
// Scores are scaled by scale * log2(e) inside q, so the online softmax runs on exp2; partial maxima are stored
// in natural-log units, as attention_reduce expects.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 256
#endif
#ifndef BLOCK_M
#define BLOCK_M 8
#endif
#ifndef DEC_WARPS
#define DEC_WARPS 4
#endif
#ifndef DEC_STAGES
#define DEC_STAGES 3
#endif

constexpr int D = HEAD_DIM, NW = DEC_WARPS, NSTAGE = DEC_STAGES;
constexpr int KT = 16;                  // keys per tile
constexpr int CH = D / 8;               // 16-byte chunks per key row
constexpr int ROW_B = 2 * D;            // bytes per key row
constexpr int TILE_B = 2 * KT * ROW_B;  // K rows then V rows of one tile
constexpr int KS = D / 16;              // k-steps of Q K^T = 16-row tiles of O^T
constexpr int KPI = 32 / CH;            // key rows one warp-wide copy instruction covers
static_assert(D == 64 || D == 128 || D == 256, "decode attention: head_dim 64, 128 or 256");
static_assert(BLOCK_M == 4 || BLOCK_M == 8, "decode attention: at most 8 query heads per KV head");
static_assert(4 * NW * 8 * (D + 2) <= NW * NSTAGE * TILE_B, "the merge area must fit in the stage memory");

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 bytes) {  // bytes 0: zero-fill
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
__device__ __forceinline__ void ldsm4(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void ldsm4t(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// (a, b) -> bf16x2 {a low, b high} of the rounded values, and of the remainders a - bf16(a), b - bf16(b).
__device__ __forceinline__ void split2(float a, float b, u32& hi, u32& lo) {
  const u16 ha = f32_to_bf16(a), hb = f32_to_bf16(b);
  hi = (u32)ha | ((u32)hb << 16);
  lo = (u32)f32_to_bf16(a - bf16_to_f32(ha)) | ((u32)f32_to_bf16(b - bf16_to_f32(hb)) << 16);
}

// q: [T, nq, D] float32 (row `start` of each sequence); k/v codes: bf16 bits [pages, page_size, nkv, D];
// out / part_o / part_ml as paged_attention_fwd (rows = heads of the KV head, row0 = 0). Grid (nwork, nkv),
// NW * 32 threads, dynamic shared memory NW * NSTAGE * TILE_B bytes.
extern "C" __global__ void __launch_bounds__(NW * 32, 1)
    paged_decode_attention(const float* __restrict__ q, const u16* __restrict__ k_codes,
                           const u16* __restrict__ v_codes, const int* __restrict__ block_tables,
                           const int* __restrict__ seq_info, const int* __restrict__ work, float* __restrict__ out,
                           float* __restrict__ part_o, float* __restrict__ part_ml, int nq, int nkv, int max_pages,
                           int page_size, float scale) {
  DYN_SMEM_DECL(smem);
  const int* w = work + 5 * (i64)blockIdx.x;
  const int seq = w[0], kbeg = w[2], kend = w[3], part = w[4];
  const int kvh = blockIdx.y, g = nq / nkv;
  const int start = seq_info[3 * seq];
  const int* bt = block_tables + (i64)seq * max_pages;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gr = lane >> 2, t = lane & 3;

  // Q operand: qa[ks] = {hi(2t), lo(2t), hi(2t+8), lo(2t+8)} of head gr, dims 16 ks + ...; zero past g.
  u32 qa[KS][4];
  {
    const float* qr = q + ((i64)start * nq + kvh * g + min(gr, g - 1)) * D;
    const float sc = gr < g ? scale * 1.4426950408889634f : 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 v = *(const float2*)(qr + 16 * ks + 8 * h + 2 * t);
        split2(v.x * sc, v.y * sc, qa[ks][2 * h], qa[ks][2 * h + 1]);
      }
  }

  const int ntiles = kend > kbeg ? (kend - kbeg + KT - 1) / KT : 0;
  const int mine = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;
  const u32 ring = smem_u32(smem) + (u32)(warp * NSTAGE * TILE_B);

  // Tile `it` of this warp -> stage `s`: lane l < KT finds key l's element offset, the copies take it by shuffle.
  auto load_tile = [&](int it, int s) {
    const int k0 = kbeg + (warp + it * NW) * KT;
    const int j = k0 + (lane & (KT - 1));
    const bool ok = j < kend;
    const int jj = ok ? j : kbeg;
    const i64 off = (((i64)bt[jj / page_size] * page_size + jj % page_size) * nkv + kvh) * D;
    const u32 dst = ring + (u32)(s * TILE_B);
#pragma unroll
    for (int i = 0; i < KT / KPI; ++i) {
      const int r = i * KPI + lane / CH, c = lane % CH;
      const i64 o = __shfl_sync(FULL_MASK, off, r) + c * 8;
      const u32 bytes = __shfl_sync(FULL_MASK, (int)ok, r) ? 16u : 0u;
      const u32 d = dst + (u32)(r * ROW_B + ((c ^ (r & 7)) << 4));
      cp_async16(d, k_codes + o, bytes);
      cp_async16(d + KT * ROW_B, v_codes + o, bytes);
    }
  };

  float acc[KS][4];
#pragma unroll
  for (int i = 0; i < KS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m = NEG_INF, l = 0.0f;  // of head gr, in log2 units; l: this lane's keys only (summed at the end)
  // ldmatrix row address of this lane: key lk of the tile, chunk column 2 ks + lc (x4: keys 0-7 / 8-15, lo / hi)
  const int lk = (lane & 7) + ((lane >> 4) << 3), lc = (lane >> 3) & 1;

#pragma unroll
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < mine) load_tile(s, s);
    cp_commit();
  }
  for (int it = 0; it < mine; ++it) {
    if (it + NSTAGE - 1 < mine) load_tile(it + NSTAGE - 1, (it + NSTAGE - 1) % NSTAGE);
    cp_commit();
    cp_wait<NSTAGE - 1>();
    __syncwarp();
    const u32 kb = ring + (u32)((it % NSTAGE) * TILE_B) + (u32)(lk * ROW_B), vb = kb + KT * ROW_B;

    float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};  // keys 0-7 / 8-15
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 b0, b1, b2, b3;
      ldsm4(kb + (u32)((((2 * ks + lc) ^ (lk & 7))) << 4), b0, b1, b2, b3);
      mma(s0, qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);
      mma(s1, qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b2, b3);
    }
    // scores of head gr for keys 2t, 2t+1, 8+2t, 9+2t of the tile
    const int k0 = kbeg + (warp + it * NW) * KT + 2 * t;
    float sc[4] = {s0[0] + s0[2], s0[1] + s0[3], s1[0] + s1[2], s1[1] + s1[3]};
    if (k0 + 9 >= kend) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (k0 + (e & 1) + 8 * (e >> 1) >= kend) sc[e] = NEG_INF;
    }
    float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
    const float mn = fmaxf(m, mx);  // finite: a tile's first key is in range
    const float alpha = exp2f(m - mn);
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) p[e] = exp2f(sc[e] - mn);
    l = l * alpha + ((p[0] + p[1]) + (p[2] + p[3]));
    m = mn;
    if (__any_sync(FULL_MASK, alpha != 1.0f)) {  // O^T columns are heads 2t, 2t+1: their alphas by shuffle
      const float a0 = __shfl_sync(FULL_MASK, alpha, 8 * t), a1 = __shfl_sync(FULL_MASK, alpha, 8 * t + 4);
#pragma unroll
      for (int i = 0; i < KS; ++i) {
        acc[i][0] *= a0; acc[i][1] *= a1; acc[i][2] *= a0; acc[i][3] *= a1;
      }
    }
    u32 ph0, pl0, ph1, pl1;
    split2(p[0], p[1], ph0, pl0);
    split2(p[2], p[3], ph1, pl1);
#pragma unroll
    for (int i = 0; i < KS; ++i) {
      u32 a0, a1, a2, a3;
      ldsm4t(vb + (u32)((((2 * i + lc) ^ (lk & 7))) << 4), a0, a1, a2, a3);
      mma(acc[i], a0, a1, a2, a3, ph0, ph1);
      mma(acc[i], a0, a1, a2, a3, pl0, pl1);
    }
    __syncwarp();  // every lane's ldmatrix of this stage is done before a later copy refills it
  }
  cp_wait<0>();
  l += __shfl_xor_sync(FULL_MASK, l, 1);
  l += __shfl_xor_sync(FULL_MASK, l, 2);

  // Merge the warps: mo [NW][8 heads][D], mml [NW][8][2] over the (now idle) stage memory.
  __syncthreads();
  float* mo = (float*)smem;
  float* mml = mo + NW * 8 * D;
#pragma unroll
  for (int i = 0; i < KS; ++i) {
    float* o0 = mo + ((warp * 8 + 2 * t) * D) + 16 * i + gr;
    o0[0] = acc[i][0];
    o0[D] = acc[i][1];
    o0[8] = acc[i][2];
    o0[D + 8] = acc[i][3];
  }
  if (t == 0) {
    mml[2 * (warp * 8 + gr)] = m;
    mml[2 * (warp * 8 + gr) + 1] = l;
  }
  __syncthreads();
  for (int idx = tid; idx < g * D; idx += NW * 32) {
    const int h = idx / D, d = idx - h * D;
    float mx = NEG_INF;
#pragma unroll
    for (int ww = 0; ww < NW; ++ww) mx = fmaxf(mx, mml[2 * (ww * 8 + h)]);
    float o = 0.0f, sum = 0.0f;
#pragma unroll
    for (int ww = 0; ww < NW; ++ww) {
      const float mw = mml[2 * (ww * 8 + h)];
      const float wgt = mw == NEG_INF ? 0.0f : exp2f(mw - mx);
      o += mo[(ww * 8 + h) * D + d] * wgt;
      sum += mml[2 * (ww * 8 + h) + 1] * wgt;
    }
    if (part < 0) {
      out[((i64)start * nq + kvh * g + h) * D + d] = o / sum;
    } else {
      const i64 pr = ((i64)part * nkv + kvh) * BLOCK_M + h;
      part_o[pr * D + d] = o;
      if (d == 0) {
        part_ml[2 * pr] = mx * 0.6931471805599453f;  // natural-log units (-inf stays -inf)
        part_ml[2 * pr + 1] = sum;
      }
    }
  }
}

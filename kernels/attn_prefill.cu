// Causal attention over paged KV (FlashAttention-style online softmax, float32 math), prefill and decode.
//
// Compile-time: HEAD_DIM (D, a multiple of 4, up to 256), KBITS / VBITS (32 float, 16 bf16, 8 / 6 / 4 MXFP:
// keys and values are dequantised on load into shared memory), ROWS_PER_WARP (query rows per warp).
//
// A CTA owns BLOCK_M = 4 * ROWS_PER_WARP query rows of one sequence and one KV head: row rho of a sequence is
// (token rho / g, query head kvh * g + rho % g), g = nq / nkv (GQA: the g query heads of a KV head share its
// K/V tiles). It streams keys [key_begin, key_end) in tiles of 32 (one key per lane for the scores, then
// P @ V with each lane owning head_dim / 32 output dims) under the causal rule key <= context + token.
// Split-K: work items with part >= 0 write unnormalised partial outputs plus (max, sum); attention_reduce
// merges the parts of a tile. Host metadata (decapybara/backend/cupy_attention.py):
//   seq_info [nseq, 3] int32: first row in q, new tokens, cached tokens (context)
//   block_tables [nseq, max_pages] int32; work [nwork, 5] int32: seq, row0, key_begin, key_end, part (-1: final)
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef KBITS
#define KBITS 16
#endif
#ifndef VBITS
#define VBITS 16
#endif
#ifndef ROWS_PER_WARP
#define ROWS_PER_WARP 4
#endif

constexpr int D = HEAD_DIM;
constexpr int NWARPS = 4;
constexpr int NTHREADS = NWARPS * 32;
constexpr int RPW = ROWS_PER_WARP;
constexpr int BLOCK_M = NWARPS * RPW;
constexpr int BLOCK_N = 32;
constexpr int DPL = (D + 31) / 32;  // output dims per lane
constexpr int KSTRIDE = D + 4;      // padded K row: conflict-free 16-byte reads, one key per lane
static_assert(D % 4 == 0 && D <= 256, "head_dim must be a multiple of 4, at most 256");

// q: [T, nq, D] float32; k/v codes + scales: the layer's page parts (see common.cuh kv_load);
// out: [T, nq, D] float32; part_o: [nparts, nkv, BLOCK_M, D]; part_ml: [nparts, nkv, BLOCK_M, 2].
// Grid (nwork, nkv), NTHREADS threads, dynamic shared memory attention_smem_bytes().
extern "C" __global__ void __launch_bounds__(NTHREADS)
paged_attention_fwd(const float* __restrict__ q, const void* __restrict__ k_codes, const u8* __restrict__ k_scales,
                    const void* __restrict__ v_codes, const u8* __restrict__ v_scales,
                    const int* __restrict__ block_tables, const int* __restrict__ seq_info,
                    const int* __restrict__ work, float* __restrict__ out, float* __restrict__ part_o,
                    float* __restrict__ part_ml, int nq, int nkv, int max_pages, int page_size, float scale) {
  DYN_SMEM_DECL(smem_raw);
  float* Qs = (float*)smem_raw;       // [BLOCK_M][D]
  float* Ks = Qs + BLOCK_M * D;       // [BLOCK_N][KSTRIDE]
  float* Vs = Ks + BLOCK_N * KSTRIDE;  // [BLOCK_N][D]

  const int* w = work + 5 * (i64)blockIdx.x;
  const int seq = w[0], row0 = w[1], kbeg = w[2], kend = w[3], part = w[4];
  const int kvh = blockIdx.y, g = nq / nkv;
  const int start = seq_info[3 * seq], length = seq_info[3 * seq + 1], context = seq_info[3 * seq + 2];
  const int nrows = length * g;
  const int* bt = block_tables + (i64)seq * max_pages;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  for (int i = tid; i < BLOCK_M * D; i += NTHREADS) {
    const int r = i / D, d = i - r * D, rho = row0 + r;
    float v = 0.0f;
    if (rho < nrows) {
      const int t = rho / g, qh = kvh * g + (rho - t * g);
      v = q[((i64)(start + t) * nq + qh) * D + d];
    }
    Qs[i] = v;
  }

  float m[RPW], l[RPW], acc[RPW][DPL];
  int pos[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int rho = row0 + warp * RPW + r;
    pos[r] = rho < nrows ? context + rho / g : -1;  // -1: padding row, every key masked
    m[r] = NEG_INF;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[r][i] = 0.0f;
  }

  for (int k0 = kbeg; k0 < kend; k0 += BLOCK_N) {
    __syncthreads();  // the previous tile is consumed (and Qs is complete on the first pass)
    if constexpr (D % 8 == 0) {  // groups of 8 elements: one vector load of codes each
      constexpr int GPR = D / 8;
      for (int i = tid; i < BLOCK_N * GPR; i += NTHREADS) {
        const int n = i / GPR, d0 = (i - n * GPR) * 8, j = k0 + n;
        float kx[8], vx[8];
        if (j < kend) {
          const i64 vi = ((i64)bt[j / page_size] * page_size + (j % page_size)) * nkv + kvh;
          kv_load8<KBITS>(k_codes, k_scales, vi, D, d0, kx);
          kv_load8<VBITS>(v_codes, v_scales, vi, D, d0, vx);
        } else {  // keys past the range are zeros: P = 0 must not meet garbage (0 * NaN)
#pragma unroll
          for (int e = 0; e < 8; ++e) kx[e] = vx[e] = 0.0f;
        }
        float4* kd = (float4*)&Ks[n * KSTRIDE + d0];
        float4* vd = (float4*)&Vs[n * D + d0];
        kd[0] = make_float4(kx[0], kx[1], kx[2], kx[3]);
        kd[1] = make_float4(kx[4], kx[5], kx[6], kx[7]);
        vd[0] = make_float4(vx[0], vx[1], vx[2], vx[3]);
        vd[1] = make_float4(vx[4], vx[5], vx[6], vx[7]);
      }
    } else {
      for (int i = tid; i < BLOCK_N * D; i += NTHREADS) {
        const int n = i / D, d = i - n * D, j = k0 + n;
        float kx = 0.0f, vx = 0.0f;
        if (j < kend) {
          const i64 vi = ((i64)bt[j / page_size] * page_size + (j % page_size)) * nkv + kvh;
          kx = kv_load<KBITS>(k_codes, k_scales, vi, D, d);
          vx = kv_load<VBITS>(v_codes, v_scales, vi, D, d);
        }
        Ks[n * KSTRIDE + d] = kx;
        Vs[n * D + d] = vx;
      }
    }
    __syncthreads();

    float s[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) s[r] = 0.0f;
    for (int d = 0; d < D; d += 4) {
      const float4 kk = *(const float4*)&Ks[lane * KSTRIDE + d];
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const float4 qq = *(const float4*)&Qs[(warp * RPW + r) * D + d];
        s[r] = fmaf(qq.x, kk.x, s[r]);
        s[r] = fmaf(qq.y, kk.y, s[r]);
        s[r] = fmaf(qq.z, kk.z, s[r]);
        s[r] = fmaf(qq.w, kk.w, s[r]);
      }
    }
    const int j = k0 + lane;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const float sr = (j < kend && j <= pos[r]) ? s[r] * scale : NEG_INF;
      const float mn = fmaxf(m[r], warp_max(sr));
      float p = 0.0f, alpha = 1.0f;
      if (mn != NEG_INF) {  // some key of this row is visible so far
        p = expf(sr - mn);
        alpha = expf(m[r] - mn);
      }
      l[r] = l[r] * alpha + warp_sum(p);
      m[r] = mn;
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[r][i] *= alpha;
      s[r] = p;
    }
    for (int n = 0; n < BLOCK_N; ++n) {
      float pn[RPW];
#pragma unroll
      for (int r = 0; r < RPW; ++r) pn[r] = __shfl_sync(FULL_MASK, s[r], n);
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (D % 32 == 0 || d < D) {
          const float vv = Vs[n * D + d];
#pragma unroll
          for (int r = 0; r < RPW; ++r) acc[r][i] = fmaf(pn[r], vv, acc[r][i]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int lr = warp * RPW + r, rho = row0 + lr;
    if (rho >= nrows) continue;
    if (part < 0) {
      const int t = rho / g, qh = kvh * g + (rho - t * g);
      float* o = out + ((i64)(start + t) * nq + qh) * D;
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < D) o[d] = acc[r][i] / l[r];
      }
    } else {
      const i64 pr = ((i64)part * nkv + kvh) * BLOCK_M + lr;
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < D) part_o[pr * D + d] = acc[r][i];
      }
      if (lane == 0) {
        part_ml[2 * pr] = m[r];
        part_ml[2 * pr + 1] = l[r];
      }
    }
  }
}

// Merge split-K parts: items [nitems, 4] int32 = seq, row0, first part, number of parts. Grid (nitems, nkv,
// BLOCK_M): one CTA per query row, threads over head dims (the parts' loads are independent: they overlap).
extern "C" __global__ void attention_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                            const int* __restrict__ items, const int* __restrict__ seq_info,
                                            float* __restrict__ out, int nq, int nkv) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  const int* it = items + 4 * (i64)blockIdx.x;
  const int seq = it[0], row0 = it[1], p0 = it[2], np = it[3];
  const int kvh = blockIdx.y, g = nq / nkv, r = blockIdx.z, rho = row0 + r;
  const int start = seq_info[3 * seq], nrows = seq_info[3 * seq + 1] * g;
  if (rho >= nrows) return;
  float mx = NEG_INF;
#pragma unroll 8  // independent loads in flight: a decode tile may have dozens of parts
  for (int p = p0; p < p0 + np; ++p) mx = fmaxf(mx, part_ml[2 * (((i64)p * nkv + kvh) * BLOCK_M + r)]);
  const int t = rho / g, qh = kvh * g + (rho - t * g);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.0f, o = 0.0f;
#pragma unroll 8
    for (int p = p0; p < p0 + np; ++p) {
      const i64 pr = ((i64)p * nkv + kvh) * BLOCK_M + r;
      const float mp = part_ml[2 * pr];
      const float wgt = mp == NEG_INF ? 0.0f : expf(mp - mx);
      sum += part_ml[2 * pr + 1] * wgt;
      o += part_o[pr * D + d] * wgt;
    }
    out[((i64)(start + t) * nq + qh) * D + d] = o / sum;
  }
}

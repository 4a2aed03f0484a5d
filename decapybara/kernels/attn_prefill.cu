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
//
// PREFILL_TC 1 builds the tensor-core kernel (paged_prefill_attention_tc, below) and the reduce for its tiles of
// 16 TC_WARPS rows (ROWS_PER_WARP 16) in place of paged_attention_fwd.
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
#ifndef PREFILL_TC
#define PREFILL_TC 0
#endif

#ifndef TC_WARPS
#define TC_WARPS 4  // warps of the tensor-core prefill kernel's CTA (4 or 8: 64 or 128 query rows)
#endif

constexpr int D = HEAD_DIM;
constexpr int NWARPS = PREFILL_TC ? TC_WARPS : 4;
constexpr int NTHREADS = NWARPS * 32;
constexpr int RPW = ROWS_PER_WARP;
constexpr int BLOCK_M = NWARPS * RPW;
static_assert(D % 4 == 0 && D <= 256, "head_dim must be a multiple of 4, at most 256");

// This CTA's work item (blockIdx.x) and its sequence's metadata.
struct WorkItem {
  int seq, row0, kbeg, kend, part;  // the item: sequence, first row, key range, part (-1: final output)
  int start, nrows, context;        // the sequence: first row in q, rows (new tokens x g), cached tokens
  const int* bt;                    // its block table
};
__device__ __forceinline__ WorkItem work_item(const int* __restrict__ work, const int* __restrict__ seq_info,
                                              const int* __restrict__ block_tables, int max_pages, int g) {
  const int* w = work + 5 * (i64)blockIdx.x;
  WorkItem it;
  it.seq = w[0]; it.row0 = w[1]; it.kbeg = w[2]; it.kend = w[3]; it.part = w[4];
  it.start = seq_info[3 * it.seq];
  it.nrows = seq_info[3 * it.seq + 1] * g;
  it.context = seq_info[3 * it.seq + 2];
  it.bt = block_tables + (i64)it.seq * max_pages;
  return it;
}

#if !PREFILL_TC
constexpr int BLOCK_N = 32;
constexpr int DPL = (D + 31) / 32;  // output dims per lane
constexpr int KSTRIDE = D + 4;      // padded K row: conflict-free 16-byte reads, one key per lane

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

  const int kvh = blockIdx.y, g = nq / nkv;
  const WorkItem it = work_item(work, seq_info, block_tables, max_pages, g);
  const int row0 = it.row0, kbeg = it.kbeg, kend = it.kend, part = it.part;
  const int start = it.start, nrows = it.nrows, context = it.context;
  const int* bt = it.bt;
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

#endif  // !PREFILL_TC

// Eight floats as eight bf16 (round to nearest even), element 0 in the low half of .x.
__device__ __forceinline__ uint4 pack_bf16x8(const float* x) {
  uint4 w;
  w.x = (u32)f32_to_bf16(x[0]) | ((u32)f32_to_bf16(x[1]) << 16);
  w.y = (u32)f32_to_bf16(x[2]) | ((u32)f32_to_bf16(x[3]) << 16);
  w.z = (u32)f32_to_bf16(x[4]) | ((u32)f32_to_bf16(x[5]) << 16);
  w.w = (u32)f32_to_bf16(x[6]) | ((u32)f32_to_bf16(x[7]) << 16);
  return w;
}

// Merge split-K parts: items [nitems, 4] int32 = seq, row0, first part, number of parts. Grid (nitems, nkv,
// BLOCK_M): one CTA per query row, threads over head dims (the parts' loads are independent: they overlap).
// out: [T, nq, D] float32, or with a gate (common.cuh OutGate: qwen3_5's output gate, gate null where none) the
// gated rows in float32 or bf16 bits.
extern "C" __global__ void attention_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                            const int* __restrict__ items, const int* __restrict__ seq_info,
                                            void* __restrict__ out, int nq, int nkv, const float* __restrict__ gate,
                                            i64 g_st, i64 g_sh, int out_bf16) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  const OutGate og{gate, g_st, g_sh, out_bf16};
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
    const float gv = og.value(start + t, qh, d);  // in flight beside the parts' loads
    float sum = 0.0f, o = 0.0f;
#pragma unroll 8
    for (int p = p0; p < p0 + np; ++p) {
      const i64 pr = ((i64)p * nkv + kvh) * BLOCK_M + r;
      const float mp = part_ml[2 * pr];
      const float wgt = mp == NEG_INF ? 0.0f : expf(mp - mx);
      sum += part_ml[2 * pr + 1] * wgt;
      o += part_o[pr * D + d] * wgt;
    }
    og.store(out, start + t, qh, nq, D, d, o / sum, gv);
  }
}

// Microscaled pages -> bf16 pages: the tensor-core prefill's scratch (cupy_attention `DequantPages`), so that a
// long chunk's CTAs read keys and values by asynchronous copies instead of each decoding every tile again.
// Scratch page p holds source page src_pages[p], vectors (slot, KV head) in the pages' order; one thread per
// 8-element group of a key and of a value, decoded as tc_load_tile decodes them (the same bf16 bits).
// Grid-stride over npages * page_size * nkv * D / 8 groups.
#if HEAD_DIM % 8 == 0  // the general kernel takes any multiple of 4; the tensor-core one (this scratch's user) 16
extern "C" __global__ void __launch_bounds__(256)
kv_pages_bf16(const void* __restrict__ k_codes, const u8* __restrict__ k_scales, const void* __restrict__ v_codes,
              const u8* __restrict__ v_scales, const int* __restrict__ src_pages, int npages, int page_size,
              int nkv, u16* __restrict__ k_out, u16* __restrict__ v_out) {
  const i64 per_page = (i64)page_size * nkv * (D / 8), n = per_page * npages;
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const i64 p = i / per_page, r = i - p * per_page, v = r / (D / 8);
    const int c = (int)(r - v * (D / 8));
    const i64 src = (i64)src_pages[p] * page_size * nkv + v, dst = (p * page_size * nkv + v) * D + 8 * c;
    float x[8];
    kv_load8<KBITS>(k_codes, k_scales, src, D, 8 * c, x);
    *(uint4*)(k_out + dst) = pack_bf16x8(x);
    kv_load8<VBITS>(v_codes, v_scales, src, D, 8 * c, x);
    *(uint4*)(v_out + dst) = pack_bf16x8(x);
  }
}
#endif

#if PREFILL_TC
// ---- Tensor-core prefill (FlashAttention-2 style) over bf16 or microscaled pages -------------------------------
//
// Compile-time: TC_BLOCK_N (keys per tile: 32 or 64), TC_SPLIT (1: q and P each carried as two bf16 terms,
// hi + lo, so the scores and P @ V keep ~16 bits of q and P as the decode kernel's do; 0: one bf16 term each).
// A CTA of TC_WARPS = 4 or 8 warps owns BLOCK_M = 64 or 128 query rows of one work item (seq, row0, key range,
// part: the general kernel's items and partial layout, so attention_reduce merges split parts); warp w owns
// rows 16 w .. 16 w + 15 (in the wgmma build, warpgroup w / 4 rows 64 (w / 4) ..).
// Per key tile, with mma.sync m16n8k16 (bf16 in, float32 accumulate):
//   S [16 rows, TBN keys] = Q [16, D] @ K^T            Q from shared memory (ldmatrix), K as the B operand
//   online softmax on S in registers (exp2: q is staged times scale * log2(e))
//   O [16 rows, D]       += P [16, TBN] @ V             P straight from S's accumulator fragments
// Shared memory: Q (hi rows, then lo rows when TC_SPLIT) and TC_STAGES K and V tiles, rows of D bf16 padded by
// 16 bytes in this build (ldmatrix's 8 rows of a 16-byte column fall in 8 distinct bank groups). bf16 pages
// arrive by cp.async (zero-filled past the range); microscaled pages are decoded by the loading threads into
// bf16 (exact: an E4M3 / E2M3 / E2M1 element times a power-of-two scale has at most 4 significant bits). With
// one K and one V buffer (TC_STAGES 1) loads overlap the math as FlashAttention-2 orders them: V(t) is requested
// before S(t), K(t + 1) once every warp has read K(t); with a ring of TC_STAGES = 2 or 3 (K, V) pairs, tile
// t + TC_STAGES is requested once every warp is done with tile t.
// PREFILL_WG 1 (Hopper, built for sm_90a: define SM90A; head_dim 64 / 128 / 256) runs the same tiles, loads,
// barriers and softmax with warpgroup MMAs (wgmma.cuh): each 4 warps are one warpgroup of 64 rows, S and
// P @ V are wgmma m64 products (S from Q and K in shared memory, P @ V from P's fragments in registers and V read
// transposed), so no operand passes through ldmatrix; each product's group is waited for at once. Its Q, K and V
// sit in unpadded 128-byte swizzled tiles (wgmma.cuh), which 8 consecutive threads fill with a key's (or a query
// row's) 128 bytes in 8 distinct banks.
#include "mma.cuh"
#include "smem.cuh"
#ifndef PREFILL_WG
#define PREFILL_WG 0
#endif
#if PREFILL_WG
#include "wgmma.cuh"
#endif
#ifndef TC_BLOCK_N
#define TC_BLOCK_N 64
#endif
#ifndef TC_SPLIT
#define TC_SPLIT 1
#endif
#ifndef TC_STAGES
#define TC_STAGES 1  // (K, V) tile pairs in shared memory: 1 (a K and a V buffer), or 2 or 3 (a ring of pairs)
#endif
#ifndef TC_OVERLAP
#define TC_OVERLAP 0  // wgmma build, ring of 3: S(t + 1) issued before the softmax of tile t (not yet measured)
#endif
#ifndef TC_DIAG
#define TC_DIAG 0  // measurement only (bench/profile_step.py, a "/N" variant): wrong results when set
#endif
constexpr int TBN = TC_BLOCK_N;
template <bool B> struct TcFlag { static constexpr bool value = B; };
constexpr int TC_QTERMS = TC_SPLIT ? 2 : 1;                 // Q terms in shared memory (hi, lo)
constexpr int TC_NT = TBN / 8;                              // score n-tiles of a warp
constexpr int TC_DT = D / 8;                                // output n-tiles of a warp
constexpr int TC_CH = D / 8;                                // 16-byte chunks of a row
#if PREFILL_WG
static_assert(D == 64 || D == 128 || D == 256, "wgmma prefill: head_dim 64, 128 or 256");
constexpr int TC_QB = BLOCK_M * 2 * D;                      // bytes of one Q term (swizzled tile)
constexpr int TC_TILE = TBN * 2 * D;                        // bytes of a K or V tile (swizzled tile)
#else
constexpr int TC_RS = 2 * D + 16;                          // bytes per shared row (16-byte pad)
constexpr int TC_QB = BLOCK_M * TC_RS;
constexpr int TC_TILE = TBN * TC_RS;
#endif
static_assert(RPW == 16 && (NWARPS == 4 || NWARPS == 8), "tensor-core prefill: 4 or 8 warps of 16 rows");
static_assert(D % 16 == 0 && D <= 256, "tensor-core prefill: head_dim a multiple of 16, at most 256");
static_assert(TBN == 32 || TBN == 64, "tensor-core prefill: 32 or 64 keys a tile");
static_assert(TC_STAGES >= 1 && TC_STAGES <= 3, "tensor-core prefill: 1 to 3 (K, V) pairs");
static_assert(!TC_OVERLAP || (PREFILL_WG && TC_STAGES == 3 && !TC_DIAG), "overlap: the wgmma build, 3 pairs");

// Rows [0, TBN) of a K or V tile (keys k0 + n) into shared memory at `dst` (TC_RS-byte rows, or a swizzled tile
// in the wgmma build); keys at or past kend are zeros (P = 0 must not meet garbage). bf16: asynchronous copies
// (one commit group by the caller).
template <int BITS>
__device__ __forceinline__ void tc_load_tile(unsigned char* dst, const void* __restrict__ codes, const u8* __restrict__ scales,
                                             const int* __restrict__ bt, int page_size, int nkv, int kvh, int k0,
                                             int kend, int tid) {
  for (int i = tid; i < TBN * TC_CH; i += NTHREADS) {
    const int n = i / TC_CH, c = i - n * TC_CH;  // 8 consecutive threads: 128 bytes of a key
#if PREFILL_WG
    unsigned char* to = dst + wg_sw_chunk(n, c, TBN);
#else
    unsigned char* to = dst + n * TC_RS + 16 * c;
#endif
    const int j = k0 + n;
    const bool ok = j < kend;
    const i64 vi = ok ? ((i64)bt[j / page_size] * page_size + (j % page_size)) * nkv + kvh : 0;
    if constexpr (BITS == 16) {
      cp_async16(smem_u32(to), (const u16*)codes + vi * D + 8 * c, ok ? 16u : 0u);
    } else {
      uint4 w;
      w.x = w.y = w.z = w.w = 0u;
      if (ok) {
        float x[8];
        kv_load8<BITS>(codes, scales, vi, D, 8 * c, x);
        w = pack_bf16x8(x);
      }
      *(uint4*)to = w;
    }
  }
}

// q: [T, nq, D] float32; pages as paged_attention_fwd's; out / part_o / part_ml as there (BLOCK_M = 16 TC_WARPS).
// Grid (nwork, nkv), NTHREADS threads, dynamic shared memory TC_QTERMS * TC_QB + 2 * TC_STAGES * TC_TILE bytes
// (+ 1024 in the swizzled wgmma build)
// (decapybara/backend/cupy_attention.py `prefill_smem`).
extern "C" __global__ void __launch_bounds__(NTHREADS, NWARPS == 4 && TBN == 32 ? 2 : 1)
paged_prefill_attention_tc(const float* __restrict__ q, const void* __restrict__ k_codes,
                           const u8* __restrict__ k_scales, const void* __restrict__ v_codes,
                           const u8* __restrict__ v_scales, const int* __restrict__ block_tables,
                           const int* __restrict__ seq_info, const int* __restrict__ work, float* __restrict__ out,
                           float* __restrict__ part_o, float* __restrict__ part_ml, int nq, int nkv, int max_pages,
                           int page_size, float scale) {
#if PREFILL_WG  // swizzled tiles start 1024-byte aligned (1 KB more dynamic shared memory)
  DYN_SMEM_DECL(smem_dyn);
  unsigned char* const smem_raw = smem_dyn + ((1024u - (smem_u32(smem_dyn) & 1023u)) & 1023u);
#else
  DYN_SMEM_DECL(smem_raw);
#endif
  unsigned char* const k_p = smem_raw + TC_QTERMS * TC_QB;  // K of pair i at k_p + 2 i TC_TILE, V after it
  unsigned char* const v_p = k_p + TC_TILE;
  const u32 q_s = smem_u32(smem_raw), k_s = smem_u32(k_p), v_s = smem_u32(v_p);
  const int kvh = blockIdx.y, g = nq / nkv;
  const WorkItem it = work_item(work, seq_info, block_tables, max_pages, g);
  const int row0 = it.row0, kbeg = it.kbeg, kend = it.kend, part = it.part;
  const int start = it.start, nrows = it.nrows, context = it.context;
  const int* bt = it.bt;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  constexpr float LOG2E = 1.4426950408889634f;

#if TC_STAGES >= 2
  // the ring's first TC_STAGES (K, V) pairs, one commit group each
#pragma unroll
  for (int i = 0; i < TC_STAGES; ++i) {
    const int k0 = kbeg + i * TBN;
    if (k0 < kend) {
      tc_load_tile<KBITS>(k_p + 2 * i * TC_TILE, k_codes, k_scales, bt, page_size, nkv, kvh, k0, kend, tid);
      tc_load_tile<VBITS>(v_p + 2 * i * TC_TILE, v_codes, v_scales, bt, page_size, nkv, kvh, k0, kend, tid);
    }
    cp_commit();
  }
#else
  if (kbeg < kend) tc_load_tile<KBITS>(k_p, k_codes, k_scales, bt, page_size, nkv, kvh, kbeg, kend, tid);
  cp_commit();
#endif
  // Q rows (times scale * log2 e) as bf16 hi (and lo) terms; padding rows zeros.
  for (int i = tid; i < BLOCK_M * TC_CH; i += NTHREADS) {
    const int r = i / TC_CH, c = i - r * TC_CH;
#if PREFILL_WG
    const u32 q_at = wg_sw_chunk(r, c, BLOCK_M);
#else
    const u32 q_at = r * TC_RS + 16 * c;
#endif
    const int rho = row0 + r;
    float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (rho < nrows) {
      const int t = rho / g, qh = kvh * g + (rho - t * g);
      const float4* src = (const float4*)(q + ((i64)(start + t) * nq + qh) * D + 8 * c);
      const float4 a = src[0], b = src[1];
      const float sc = scale * LOG2E;
      x[0] = a.x * sc; x[1] = a.y * sc; x[2] = a.z * sc; x[3] = a.w * sc;
      x[4] = b.x * sc; x[5] = b.y * sc; x[6] = b.z * sc; x[7] = b.w * sc;
    }
    u32 hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) split2(x[2 * e], x[2 * e + 1], hi[e], lo[e]);
    uint4* to = (uint4*)(smem_raw + q_at);
    to->x = hi[0]; to->y = hi[1]; to->z = hi[2]; to->w = hi[3];
    if constexpr (TC_SPLIT) {
      uint4* tl = (uint4*)(smem_raw + TC_QB + q_at);
      tl->x = lo[0]; tl->y = lo[1]; tl->z = lo[2]; tl->w = lo[3];
    }
  }

  // this lane's two rows: ra = 16 warp + gid, rb = ra + 8 (positions; -1: padding, every key masked)
  int pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rho = row0 + 16 * warp + gid + 8 * h;
    pos[h] = rho < nrows ? context + rho / g : -1;
  }
  const int rho_first = row0 + 16 * warp;  // the warp's lowest position bounds where masking can start
  const int first_pos = rho_first < nrows ? context + rho_first / g : -1;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  float o[TC_DT][4];
#pragma unroll
  for (int i = 0; i < TC_DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

#if PREFILL_WG
  // S = Q K^T of the key tile at shared address kt: D / 16 wgmma steps a term, the first one overwriting S
  auto scores_issue = [&](float (&s)[TC_NT][4], const u32 kt) {  // committed as one group, not waited for
    float(&sf)[TBN / 2] = reinterpret_cast<float(&)[TBN / 2]>(s);
    // this warpgroup's 64 rows of the Q tile; K-major descriptors of Q and K
    const u32 qw = q_s + 8192u * (warp >> 2);
    auto dk = [](u32 base, int rows, int ks) { return wg_desc_k_sw(base, rows, ks); };
#if TC_OVERLAP
    wg_pin(sf);
#endif
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) wg_ss<TBN>(sf, dk(qw, BLOCK_M, ks), dk(kt, TBN, ks), ks);
#if TC_SPLIT
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) wg_ss<TBN>(sf, dk(qw + TC_QB, BLOCK_M, ks), dk(kt, TBN, ks), 1);
#endif
    wg_commit();
  };
  auto scores = [&](float (&s)[TC_NT][4], const u32 kt) {
    scores_issue(s, kt);
    wg_wait<0>();
  };
#else
  // ldmatrix lane addresses (byte offsets within a tile / the Q block)
  const u32 q_lane = (16 * warp + (lane & 15)) * TC_RS + (lane >> 4) * 16;
  const u32 k_lane = ((lane & 7) + ((lane >> 4) << 3)) * TC_RS + ((lane >> 3) & 1) * 16;
  const u32 v_lane = ((lane & 7) + (((lane >> 3) & 1) << 3)) * TC_RS + (lane >> 4) * 16;

  // S = Q K^T of the key tile at shared address kt (all warps' K rows ready)
  auto scores = [&](float (&s)[TC_NT][4], const u32 kt) {
#pragma unroll
    for (int i = 0; i < TC_NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      u32 qa[4];
      ldsm4(q_s + q_lane + 32 * ks, qa[0], qa[1], qa[2], qa[3]);
#if TC_SPLIT
      u32 ql[4];
      ldsm4(q_s + BLOCK_M * TC_RS + q_lane + 32 * ks, ql[0], ql[1], ql[2], ql[3]);
#endif
      u32 b[TC_NT / 2][4];
#pragma unroll
      for (int np = 0; np < TC_NT / 2; ++np)
        ldsm4(kt + 16 * np * TC_RS + k_lane + 32 * ks, b[np][0], b[np][1], b[np][2], b[np][3]);
#pragma unroll
      for (int np = 0; np < TC_NT / 2; ++np) {
        mma(s[2 * np], qa[0], qa[1], qa[2], qa[3], b[np][0], b[np][1]);
        mma(s[2 * np + 1], qa[0], qa[1], qa[2], qa[3], b[np][2], b[np][3]);
      }
#if TC_SPLIT  // the lo terms after every hi one: no MMA waits on the one just issued
#pragma unroll
      for (int np = 0; np < TC_NT / 2; ++np) {
        mma(s[2 * np], ql[0], ql[1], ql[2], ql[3], b[np][0], b[np][1]);
        mma(s[2 * np + 1], ql[0], ql[1], ql[2], ql[3], b[np][2], b[np][3]);
      }
#endif
    }
  };
#endif
  // masked online softmax of the tile at key k0: s becomes P; m, l and the output rows rescaled
  // (rescale: TcFlag<true> scales the output rows by each row's alpha here; TcFlag<false> leaves them and
  // returns the alphas in `alpha`, for a caller whose output rows are in a wgmma's flight)
  auto softmax_rows = [&](float (&s)[TC_NT][4], const int k0, float (&alpha_out)[2], auto rescale) {
    if (k0 + TBN > kend || k0 + TBN - 1 > first_pos) {  // some key may be invisible to some row of this warp
#pragma unroll
      for (int nt = 0; nt < TC_NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = k0 + 8 * nt + 2 * tig + (e & 1);
          if (j >= kend || j > pos[e >> 1]) s[nt][e] = NEG_INF;
        }
    }
    // rows h = 0 (ra) and 1 (rb); a row's TBN scores lie on the 4 lanes of its gid
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = NEG_INF;
#pragma unroll
      for (int nt = 0; nt < TC_NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
      const float mn = fmaxf(m[h], mx);
      float alpha = 1.f, sum = 0.f;
      if (mn != NEG_INF) {  // some key of this row is visible so far
        alpha = exp2f(m[h] - mn);
#pragma unroll
        for (int nt = 0; nt < TC_NT; ++nt) {
          s[nt][2 * h] = exp2f(s[nt][2 * h] - mn);
          s[nt][2 * h + 1] = exp2f(s[nt][2 * h + 1] - mn);
          sum += s[nt][2 * h] + s[nt][2 * h + 1];
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < TC_NT; ++nt) s[nt][2 * h] = s[nt][2 * h + 1] = 0.f;
      }
      l[h] = l[h] * alpha + sum;  // this lane's part of the row sum (the 4 lanes' parts add up at the end)
      m[h] = mn;
      if constexpr (decltype(rescale)::value) {
#pragma unroll
        for (int i = 0; i < TC_DT; ++i) {
          o[i][2 * h] *= alpha;
          o[i][2 * h + 1] *= alpha;
        }
      } else {
        alpha_out[h] = alpha;
      }
    }
  };
  auto softmax = [&](float (&s)[TC_NT][4], const int k0) {
    float unused[2];
    softmax_rows(s, k0, unused, TcFlag<true>{});
  };
  // O += P V of the value tile at shared address vt (all warps' V rows ready)
#if PREFILL_WG
  auto values_issue = [&](const float (&s)[TC_NT][4], const u32 vt) {  // committed as one group, not waited for
    u32 ph[TBN / 16][4], pl[TBN / 16][4];
#pragma unroll
    for (int kk = 0; kk < TBN / 16; ++kk) {
      split2(s[2 * kk][0], s[2 * kk][1], ph[kk][0], pl[kk][0]);
      split2(s[2 * kk][2], s[2 * kk][3], ph[kk][1], pl[kk][1]);
      split2(s[2 * kk + 1][0], s[2 * kk + 1][1], ph[kk][2], pl[kk][2]);
      split2(s[2 * kk + 1][2], s[2 * kk + 1][3], ph[kk][3], pl[kk][3]);
    }
    float(&of)[D / 2] = reinterpret_cast<float(&)[D / 2]>(o);
    auto dv = [](u32 base, int kk) { return wg_desc_mn_sw(base, TBN, kk); };
#if TC_OVERLAP  // the rescale of o and P's fragments stay before the fence (S(t + 1) is in flight)
    wg_pin(of);
    wg_pin(ph);
    wg_pin(pl);
#endif
    wg_fence();  // o was rescaled by the softmax
#pragma unroll
    for (int kk = 0; kk < TBN / 16; ++kk) wg_rs_t<D>(of, ph[kk], dv(vt, kk), 1);
#if TC_SPLIT
#pragma unroll
    for (int kk = 0; kk < TBN / 16; ++kk) wg_rs_t<D>(of, pl[kk], dv(vt, kk), 1);
#endif
    wg_commit();
  };
  auto values = [&](const float (&s)[TC_NT][4], const u32 vt) {
    values_issue(s, vt);
    wg_wait<0>();
  };
#else
  auto values = [&](const float (&s)[TC_NT][4], const u32 vt) {
#pragma unroll
    for (int kk = 0; kk < TBN / 16; ++kk) {
      u32 ph[4], pl[4];
      split2(s[2 * kk][0], s[2 * kk][1], ph[0], pl[0]);
      split2(s[2 * kk][2], s[2 * kk][3], ph[1], pl[1]);
      split2(s[2 * kk + 1][0], s[2 * kk + 1][1], ph[2], pl[2]);
      split2(s[2 * kk + 1][2], s[2 * kk + 1][3], ph[3], pl[3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {  // independent accumulators: the compiler interleaves
        u32 b[4];
        ldsm4t(vt + 16 * kk * TC_RS + v_lane + 32 * dp, b[0], b[1], b[2], b[3]);
        mma(o[2 * dp], ph[0], ph[1], ph[2], ph[3], b[0], b[1]);
        mma(o[2 * dp + 1], ph[0], ph[1], ph[2], ph[3], b[2], b[3]);
#if TC_SPLIT
        mma(o[2 * dp], pl[0], pl[1], pl[2], pl[3], b[0], b[1]);
        mma(o[2 * dp + 1], pl[0], pl[1], pl[2], pl[3], b[2], b[3]);
#endif
      }
    }
  };
#endif

  // every commit group but the newest (the two newest in a ring of 3) complete for every thread (and visible to
  // the wgmma proxy)
  auto landed = [&]() {
    cp_wait_groups<TC_STAGES == 1 ? 1 : TC_STAGES - 1>();
#if PREFILL_WG
    wg_fence_smem();
#endif
    __syncthreads();
  };
  auto tile_scores = [&](float (&s)[TC_NT][4], const u32 kt) {
    if (TC_DIAG & 2) {  // measurement: no score MMAs (nor value MMAs below)
#pragma unroll
      for (int i = 0; i < TC_NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.25f * i;
    } else {
      scores(s, kt);
    }
  };

#if PREFILL_WG && TC_OVERLAP
  // the ring of three pairs with FlashAttention-3's overlap inside a warpgroup: S(t + 1) and P(t) V(t) go out
  // together, the softmax of tile t + 1 runs while P(t) V(t) is on the tensor cores, and the output rows take tile
  // t + 1's alphas once it is done. Tile t + 1 must have landed when tile t starts: two tiles after its request.
  float s[TC_NT][4], sn[TC_NT][4];
  auto rescale_rows = [&](const float (&a)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < TC_DT; ++i) {
        o[i][2 * h] *= a[h];
        o[i][2 * h + 1] *= a[h];
      }
  };
  // tile t at key k0: cur holds P(t) and the output rows are rescaled for it; nxt takes S(t + 1), then P(t + 1)
  // (which the loop moves into cur).
  // Past the last tile, S(t + 1) comes from a slot of stale or unwritten keys that the softmax masks whole
  // (alpha 1, P 0): no branch around the wgmmas.
  auto step = [&](float (&cur)[TC_NT][4], float (&nxt)[TC_NT][4], const int k0, const int t) {
    const u32 slot = (t % 3) * 2 * TC_TILE, next = ((t + 1) % 3) * 2 * TC_TILE;
    cp_wait_groups<1>();  // tile t + 1's pair: every group but the newest complete
    wg_fence_smem();
    __syncthreads();
    scores_issue(nxt, k_s + next);
    values_issue(cur, v_s + slot);
    float a[2];
    wg_wait<1>();  // S(t + 1); P(t) V(t) may still run
    softmax_rows(nxt, k0 + TBN, a, TcFlag<false>{});
    wg_wait<0>();  // P(t) V(t)
    rescale_rows(a);
    __syncthreads();  // every warp is done with tile t's slot: it takes tile t + 3
    if (k0 + 3 * TBN < kend) {
      tc_load_tile<KBITS>(k_p + slot, k_codes, k_scales, bt, page_size, nkv, kvh, k0 + 3 * TBN, kend, tid);
      tc_load_tile<VBITS>(v_p + slot, v_codes, v_scales, bt, page_size, nkv, kvh, k0 + 3 * TBN, kend, tid);
    }
    cp_commit();
  };
  landed();  // tile 0's pair and Q's stores
  scores(s, k_s);
  softmax(s, kbeg);
  for (int k0 = kbeg, t = 0; k0 < kend; k0 += TBN, ++t) {
    step(s, sn, k0, t);
#pragma unroll
    for (int i = 0; i < TC_NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = sn[i][e];  // P(t + 1)
  }
#elif TC_STAGES >= 2
  // a ring of TC_STAGES (K, V) pairs: tile t + TC_STAGES is requested once every warp is done with tile t, so
  // each pair has TC_STAGES - 1 tiles' math to arrive in; two barriers a tile
  for (int k0 = kbeg, t = 0; k0 < kend; k0 += TBN, ++t) {
    const u32 slot = (TC_STAGES == 2 ? (t & 1) : t % TC_STAGES) * 2 * TC_TILE;
    landed();  // tile t's pair (and, on the first tile, Q's stores)
    float s[TC_NT][4];
    tile_scores(s, k_s + slot);
    softmax(s, k0);
    if (!(TC_DIAG & 2)) values(s, v_s + slot);
    __syncthreads();  // every warp is done with the slot: it takes tile t + TC_STAGES
    const int kn = k0 + TC_STAGES * TBN;
    if (!(TC_DIAG & 1) && kn < kend) {  // measurement: TC_DIAG bit 0 loads the first TC_STAGES tiles only
      tc_load_tile<KBITS>(k_p + slot, k_codes, k_scales, bt, page_size, nkv, kvh, kn, kend, tid);
      tc_load_tile<VBITS>(v_p + slot, v_codes, v_scales, bt, page_size, nkv, kvh, kn, kend, tid);
    }
    cp_commit();
  }
#else
  // one K and one V buffer: V(t) requested before S(t), K(t + 1) once every warp has read K(t)
  for (int k0 = kbeg; k0 < kend; k0 += TBN) {
    const bool load = !(TC_DIAG & 1) || k0 == kbeg;  // measurement: TC_DIAG bit 0 loads the first tiles only
    if (load) tc_load_tile<VBITS>(v_p, v_codes, v_scales, bt, page_size, nkv, kvh, k0, kend, tid);
    cp_commit();
    landed();  // K(t) (and, on the first tile, Q's stores)
    float s[TC_NT][4];
    tile_scores(s, k_s);
    __syncthreads();  // every warp has read K(t): its buffer takes K(t + 1)
    if (load && k0 + TBN < kend)
      tc_load_tile<KBITS>(k_p, k_codes, k_scales, bt, page_size, nkv, kvh, k0 + TBN, kend, tid);
    cp_commit();
    softmax(s, k0);
    landed();  // V(t) (K(t + 1) may still be in flight)
    if (!(TC_DIAG & 2)) values(s, v_s);
    __syncthreads();  // every warp has read V(t)
  }
#endif
  cp_wait_groups<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
    l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int lr = 16 * warp + gid + 8 * h, rho = row0 + lr;
    if (rho >= nrows) continue;
    if (part < 0) {
      const int t = rho / g, qh = kvh * g + (rho - t * g);
      float* dst = out + ((i64)(start + t) * nq + qh) * D + 2 * tig;
      const float inv = 1.0f / l[h];
#pragma unroll
      for (int i = 0; i < TC_DT; ++i)
        *(float2*)(dst + 8 * i) = make_float2(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
    } else {
      const i64 pr = ((i64)part * nkv + kvh) * BLOCK_M + lr;
      float* dst = part_o + pr * D + 2 * tig;
#pragma unroll
      for (int i = 0; i < TC_DT; ++i) *(float2*)(dst + 8 * i) = make_float2(o[i][2 * h], o[i][2 * h + 1]);
      if (tig == 0) {
        part_ml[2 * pr] = m[h] * 0.6931471805599453f;  // natural-log units, as attention_reduce expects
        part_ml[2 * pr + 1] = l[h];
      }
    }
  }
}
#endif  // PREFILL_TC

// Decode attention on tensor cores over bf16 or microscaled KV pages: one new token per sequence, the
// g <= BLOCK_M <= 8 query heads of one KV head per CTA, keys [key_begin, key_end) of one work item
// (decapybara/kernels/attn_prefill.cu's work and split-K partial layout, so its attention_reduce merges the parts;
// decapybara/backend/cupy_attention.py plans).
//
// Compile-time: HEAD_DIM (D: 64, 128 or 256), BLOCK_M (rows of a work tile: 4 or 8, the partial buffers'
// stride), DEC_WARPS (warps per CTA), DEC_STAGES (16-key tiles each warp has in flight), DEC_CHAINS (1 or 2
// accumulator chains for the scores of 8 keys: their D / 16 MMAs otherwise wait on each other).
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
//
// Microscaled pages (KBITS / VBITS 8, 6 or 4 defined: paged_decode_attention_mx, head_dim 128 or 256): the
// ring holds the tile's codes and E8M0 scale bytes as stored; each lane turns the codes it needs into bf16x2
// operand registers itself (mx_pairs.cuh: bit placement and one bf16x2 FMA by the block factor, exact),
// so no dequantised tile is written anywhere. The reduction order of an MMA is free, so
//   scores: lane (gr, t) takes keys gr and gr + 8, dims [t D/4, (t+1) D/4), 8 codes (two k-steps) at a time in
//           the pair order of the decoder; q is loaded in the same permutation (once, in registers);
//   P @ V:  lane (gr, t) takes keys 2t, 2t+1, 2t+8, 2t+9 (its P^T fragment, as above) and dims
//           [gr D/8, (gr+1) D/8): O^T row gr of tile i is dim gr D/8 + 2i, row gr + 8 is dim gr D/8 + 2i + 1;
//           a bf16x2 operand pairs two keys' codes of one dim (byte / nibble interleave, then the decoder).
// Each lane's dims of a key fall in one (V) or two (K, D = 256) 32-element scale blocks. The factors carry
// 2^-64 (mx_pairs.cuh), so q is staged times 2^64 and the output multiplied by 2^64. Range: scale codes up to
// 198 (E4M3) / 192 (E2M3, E2M1), blocks below 2^79 / 2^67 (a larger factor is inf); products below ~2^-62
// become bf16 subnormals (an absolute error of that size).
#include "common.cuh"
#include "mma.cuh"
#include "smem.cuh"

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
#ifndef DEC_CHAINS
#define DEC_CHAINS 2  // accumulator chains per 8 keys of the scores (1: one MMA dependency chain of D / 16)
#endif

constexpr int D = HEAD_DIM, NW = DEC_WARPS, NSTAGE = DEC_STAGES;
constexpr int KT = 16;                  // keys per tile
constexpr int ROW_B = 2 * D;            // bytes per key row
constexpr int TILE_B = 2 * KT * ROW_B;  // K rows then V rows of one tile
constexpr int KS = D / 16;              // k-steps of Q K^T = 16-row tiles of O^T
static_assert(D == 64 || D == 128 || D == 256, "decode attention: head_dim 64, 128 or 256");
static_assert(BLOCK_M == 4 || BLOCK_M == 8, "decode attention: at most 8 query heads per KV head");
static_assert(4 * NW * 8 * (D + 2) <= NW * NSTAGE * TILE_B, "the merge area must fit in the stage memory");

// Online softmax over one tile's scores sc (keys 2t, 2t+1, 8+2t, 9+2t of head gr, log2 units, -inf masked)
// -> p; running max m / sum l of this lane's head; acc (O^T, columns = heads 2t, 2t+1) rescaled.
__device__ __forceinline__ void softmax_tile(const float (&sc)[4], float& m, float& l, float (&acc)[KS][4],
                                             float (&p)[4], const int t) {
  float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
  mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
  const float mn = fmaxf(m, mx);  // finite: a tile's first key is in range
  const float alpha = exp2f(m - mn);
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
}

// Scores of one tile -> masked, then the softmax: s0 / s1 = S^T accumulators of keys 0-7 / 8-15 in two chains
// (rows r and r + 8 summed: the q and q-remainder parts). k0 = the tile's first key + 2t.
__device__ __forceinline__ void tile_probs(const float (&s0)[2][4], const float (&s1)[2][4], const int k0,
                                           const int kend, float& m, float& l, float (&acc)[KS][4], float (&p)[4],
                                           const int t) {
  float sc[4] = {(s0[0][0] + s0[0][2]) + (s0[1][0] + s0[1][2]), (s0[0][1] + s0[0][3]) + (s0[1][1] + s0[1][3]),
                 (s1[0][0] + s1[0][2]) + (s1[1][0] + s1[1][2]), (s1[0][1] + s1[0][3]) + (s1[1][1] + s1[1][3])};
  if (k0 + 9 >= kend) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (k0 + (e & 1) + 8 * (e >> 1) >= kend) sc[e] = NEG_INF;
  }
  softmax_tile(sc, m, l, acc, p, t);
}

// The CTA's work item (work row blockIdx.x: seq, row0, key range, part) and this warp's 16-key tiles of it:
// tile it = keys kbeg + (warp + it NW) KT + [0, KT).
struct WarpTiles {
  int kbeg, kend, part, start, warp, lane, page_size;
  const int* bt;  // the sequence's block table
  __device__ __forceinline__ WarpTiles(const int* work, const int* seq_info, const int* block_tables, int max_pages,
                                       int page_size_)
      : warp(threadIdx.x >> 5), lane(threadIdx.x & 31), page_size(page_size_) {
    const int* w = work + 5 * (i64)blockIdx.x;
    kbeg = w[2];
    kend = w[3];
    part = w[4];
    start = seq_info[3 * w[0]];
    bt = block_tables + (i64)w[0] * max_pages;
  }
  __device__ __forceinline__ int count() const {
    const int ntiles = kend > kbeg ? (kend - kbeg + KT - 1) / KT : 0;
    return ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;
  }
  // key lane % 16 of tile `it`; past the range kbeg (a valid address; the copy zero-fills) and ok = false
  __device__ __forceinline__ int key(int it, bool& ok) const {
    const int j = kbeg + (warp + it * NW) * KT + (lane & (KT - 1));
    ok = j < kend;
    return ok ? j : kbeg;
  }
  __device__ __forceinline__ int page(int it) const {
    bool ok;
    return bt[key(it, ok) / page_size];
  }
  // vector index (page, slot, KV head) of key lane % 16 of tile `it` on `page`
  __device__ __forceinline__ i64 vector(int it, int page, int nkv, int kvh, bool& ok) const {
    const int j = key(it, ok);
    return ((i64)page * page_size + j % page_size) * nkv + kvh;
  }
};

// The warp's tiles through its ring of NSTAGE stages: load(it, stage, page) issues tile it's copies (its page
// fetched a tile earlier, so that load's latency hides behind a tile's work), tile(it, stage) consumes it.
template <class Load, class Tile>
__device__ __forceinline__ void tile_ring(const WarpTiles& wt, Load load, Tile tile) {
  const int mine = wt.count();
#pragma unroll
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < mine) load(s, s, wt.page(s));
    cp_commit();
  }
  int page = NSTAGE - 1 < mine ? wt.page(NSTAGE - 1) : 0;
  for (int it = 0; it < mine; ++it) {
    if (it + NSTAGE - 1 < mine) load(it + NSTAGE - 1, (it + NSTAGE - 1) % NSTAGE, page);
    if (it + NSTAGE < mine) page = wt.page(it + NSTAGE);  // for the next iteration's copies
    cp_commit();
    cp_wait_groups<NSTAGE - 1>();
    __syncwarp();
    tile(it, it % NSTAGE);
    __syncwarp();  // every lane's reads of this stage are done before a later copy refills it
  }
  cp_wait_groups<0>();
}

// After every warp wrote its O^T (mo [NW][8 heads][D]) and (max, sum) (mml [NW][8][2]) and a block barrier:
// merge the warps' parts and write the final output (part < 0) or the split's partial, scaled by vmul.
__device__ __forceinline__ void merge_store(const float* mo, const float* mml, const int g, const int part,
                                            const int start, const int nq, const int nkv, const int kvh,
                                            void* __restrict__ out, const OutGate og, float* __restrict__ part_o,
                                            float* __restrict__ part_ml, const float vmul) {
  for (int idx = threadIdx.x; idx < g * D; idx += NW * 32) {
    const int h = idx / D, d = idx - h * D;
    const float gv = part < 0 ? og.value(start, kvh * g + h, d) : 0.0f;  // in flight beside the merge
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
      og.store(out, start, kvh * g + h, nq, D, d, o * vmul / sum, gv);
    } else {
      const i64 pr = ((i64)part * nkv + kvh) * BLOCK_M + h;
      part_o[pr * D + d] = o * vmul;
      if (d == 0) {
        part_ml[2 * pr] = mx * 0.6931471805599453f;  // natural-log units (-inf stays -inf)
        part_ml[2 * pr + 1] = sum;
      }
    }
  }
}

// After the ring: the warp's O^T and (max, sum) into the (now idle) stage memory, mo [NW][8 heads][D] and
// mml [NW][8][2], then the merge (merge_store). O^T row gr of tile i is dim d0 + di * i, row gr + 8 that + d8.
__device__ __forceinline__ void finish(unsigned char* smem, const float (&acc)[KS][4], const float m, float l,
                                       const int d0, const int di, const int d8, const int g, const int part,
                                       const int start, const int nq, const int nkv, const int kvh,
                                       void* __restrict__ out, const OutGate og, float* __restrict__ part_o,
                                       float* __restrict__ part_ml, const float vmul) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gr = lane >> 2, t = lane & 3;
  l += __shfl_xor_sync(FULL_MASK, l, 1);  // the head's sum over the four lanes of its row
  l += __shfl_xor_sync(FULL_MASK, l, 2);
  __syncthreads();
  float* mo = (float*)smem;
  float* mml = mo + NW * 8 * D;
#pragma unroll
  for (int i = 0; i < KS; ++i) {
    float* o0 = mo + ((warp * 8 + 2 * t) * D) + d0 + di * i;
    o0[0] = acc[i][0];
    o0[D] = acc[i][1];
    o0[d8] = acc[i][2];
    o0[D + d8] = acc[i][3];
  }
  if (t == 0) {
    mml[2 * (warp * 8 + gr)] = m;
    mml[2 * (warp * 8 + gr) + 1] = l;
  }
  __syncthreads();
  merge_store(mo, mml, g, part, start, nq, nkv, kvh, out, og, part_o, part_ml, vmul);
}

#if !(defined(KBITS) && defined(VBITS))  // bf16 pages
constexpr int CH = D / 8;               // 16-byte chunks per key row
constexpr int KPI = 32 / CH;            // key rows one warp-wide copy instruction covers
// q: [T, nq, D] float32 (row `start` of each sequence); k/v codes: bf16 bits [pages, page_size, nkv, D];
// out / part_o / part_ml as paged_attention_fwd (rows = heads of the KV head, row0 = 0); the final items' rows
// through the output gate (gate, g_st, g_sh, out_bf16: common.cuh OutGate; gate null: float32 out). Grid (nwork, nkv),
// NW * 32 threads, dynamic shared memory NW * NSTAGE * TILE_B bytes.
extern "C" __global__ void __launch_bounds__(NW * 32, 1)
    paged_decode_attention(const float* __restrict__ q, const u16* __restrict__ k_codes,
                           const u16* __restrict__ v_codes, const int* __restrict__ block_tables,
                           const int* __restrict__ seq_info, const int* __restrict__ work, void* __restrict__ out,
                           float* __restrict__ part_o, float* __restrict__ part_ml, int nq, int nkv, int max_pages,
                           int page_size, float scale, const float* __restrict__ gate, i64 g_st, i64 g_sh,
                           int out_bf16) {
  DYN_SMEM_DECL(smem);
  pdl_begin();  // overlapped launch (pdl.cuh)
  const WarpTiles wt(work, seq_info, block_tables, max_pages, page_size);
  const int kvh = blockIdx.y, g = nq / nkv, start = wt.start, kbeg = wt.kbeg, kend = wt.kend;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gr = lane >> 2, t = lane & 3;

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

  const u32 ring = smem_u32(smem) + (u32)(warp * NSTAGE * TILE_B);
  // Tile `it` (on `page`) of this warp -> stage `s`: lane l < KT finds key l's element offset, the copies take
  // it by shuffle.
  auto load_tile = [&](int it, int s, int page) {
    bool ok;
    const i64 off = wt.vector(it, page, nkv, kvh, ok) * D;
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

  tile_ring(wt, load_tile, [&](int it, int s) {
    const u32 kb = ring + (u32)(s * TILE_B) + (u32)(lk * ROW_B), vb = kb + KT * ROW_B;
    float s0[2][4] = {}, s1[2][4] = {};  // keys 0-7 / 8-15; even / odd k-steps: two accumulator chains each
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 b0, b1, b2, b3;
      ldsm4(kb + (u32)((((2 * ks + lc) ^ (lk & 7))) << 4), b0, b1, b2, b3);
      mma(s0[ks % DEC_CHAINS], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);
      mma(s1[ks % DEC_CHAINS], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b2, b3);
    }
    float p[4];  // of head gr for keys 2t, 2t+1, 8+2t, 9+2t of the tile
    tile_probs(s0, s1, kbeg + (warp + it * NW) * KT + 2 * t, kend, m, l, acc, p, t);
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
  });
  finish(smem, acc, m, l, gr, 16, 8, g, wt.part, start, nq, nkv, kvh, out, OutGate{gate, g_st, g_sh, out_bf16},
         part_o, part_ml, 1.0f);
}
#endif

#if defined(KBITS) && defined(VBITS)
// ---- microscaled pages ---------------------------------------------------------------------------------
#include "mx_pairs.cuh"

static_assert((KBITS == 8 || KBITS == 6 || KBITS == 4) && (VBITS == 8 || VBITS == 6 || VBITS == 4),
              "microscaled decode attention: 8, 6 or 4-bit keys and values");
static_assert(D == 128 || D == 256, "microscaled decode attention: head_dim 128 or 256");
namespace mxd {
constexpr int CBK = D * KBITS / 8, CBV = D * VBITS / 8;  // code bytes of one key / value vector
constexpr int SB = D / 32;                               // scale bytes of one vector
constexpr int STAGE_B = KT * (CBK + CBV + 2 * SB);       // K codes, V codes, K scales, V scales of a tile
constexpr int K_LB = CBK / 4;                            // bytes of a key row one lane reads (D / 4 dims)
constexpr int V_LB = CBV / 8;                            // bytes of a value row one lane reads (D / 8 dims)
constexpr int NG = D / 32;    // 8-code groups of a lane's key dims = 4-dim groups of its value dims
constexpr int KBLK = D / 128;  // scale blocks a lane's key dims span
static_assert(NSTAGE >= 2 && 4 * NW * 8 * (D + 2) <= NW * NSTAGE * STAGE_B,
              "two stages, and the merge area must fit in the stage memory");
// factor exponent offset of mx_factor16: E4M3 codes are placed as value * 2^-120, E2M1 / E2M3 as * 2^-126
constexpr int OFF_K = KBITS == 8 ? 120 : 126, OFF_V = VBITS == 8 ? 120 : 126;

// k-slot order of a decoder's 8-code group: slot p of its four pairs holds code perm(p) (mx_pairs.cuh)
__device__ __forceinline__ constexpr int perm(int bits, int p) {
  return bits == 8 ? ((p & 4) | ((p & 1) << 1) | ((p >> 1) & 1)) : (((p >> 2) << 1) | ((p & 1) << 2) | ((p >> 1) & 1));
}

// NB bytes of shared memory at addr (aligned to the largest of 16, 8, 4 dividing NB) -> words w
template <int NB>
__device__ __forceinline__ void lds_words(u32 addr, u32 (&w)[NB / 4]) {
  if constexpr (NB % 16 == 0) {
#pragma unroll
    for (int i = 0; i < NB / 16; ++i)
      asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(w[4 * i]), "=r"(w[4 * i + 1]), "=r"(w[4 * i + 2]), "=r"(w[4 * i + 3])
                   : "r"(addr + 16 * i));
  } else if constexpr (NB % 8 == 0) {
#pragma unroll
    for (int i = 0; i < NB / 8; ++i)
      asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(w[2 * i]), "=r"(w[2 * i + 1]) : "r"(addr + 8 * i));
  } else {
#pragma unroll
    for (int i = 0; i < NB / 4; ++i) asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w[i]) : "r"(addr + 4 * i));
  }
}
__device__ __forceinline__ u32 lds_u8(u32 addr) {
  u32 v;
  asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
// 3 bytes at byte offset `off` (a compile-time constant after unrolling) of w, in the low 24 bits
template <int N>
__device__ __forceinline__ u32 bytes3(const u32 (&w)[N], const int off) {
  const int i = off >> 2, sh = off & 3;
  return sh <= 1 ? w[i] >> (8 * sh) : __funnelshift_r(w[i], w[i + 1], 8 * sh);
}

// Key group u (8 codes, dims 8u..8u+7 of the lane's range) of one key row -> the B operands of k-steps 2u
// (a[0], a[1]) and 2u + 1 (a[2], a[3]); slot p holds code perm(p).
template <int BITS>
__device__ __forceinline__ void key_group(const u32 (&w)[K_LB / 4], const int u, const u32 f, u32 (&a)[4]) {
  if constexpr (BITS == 8) {
    e4m3_pairs(w[2 * u], f, a[0], a[1]);
    e4m3_pairs(w[2 * u + 1], f, a[2], a[3]);
  } else if constexpr (BITS == 4) {
    e2m1_pairs(w[u], f, a);
  } else {
    u32 g01, g23;
    e2m3_groups(bytes3(w, 6 * u), bytes3(w, 6 * u + 3), g01, g23);
    e2m3_pairs(g01, g23, f, a);
  }
}

// Value group j (dims 4j..4j+3 of the lane's range) of keys A and B -> a[r] = (A dim 4j+r, B dim 4j+r).
template <int BITS>
__device__ __forceinline__ void value_group(const u32 (&wa)[V_LB / 4], const u32 (&wb)[V_LB / 4], const int j,
                                            const u32 f, u32 (&a)[4]) {
  if constexpr (BITS == 8) {
    e4m3_pairs(__byte_perm(wa[j], wb[j], 0x5410), f, a[0], a[1]);  // bytes (A0, A1, B0, B1)
    e4m3_pairs(__byte_perm(wa[j], wb[j], 0x7632), f, a[2], a[3]);  // bytes (A2, A3, B2, B3)
  } else if constexpr (BITS == 4) {
    e2m1_pairs(__byte_perm(wa[j >> 1], wb[j >> 1], (j & 1) ? 0x7632 : 0x5410), f, a);  // nibbles A0-3, B0-3
  } else {
    u32 g01, g23;
    e2m3_groups(bytes3(wa, 3 * j), bytes3(wb, 3 * j), g01, g23);
    e2m3_pairs(g01, g23, f, a);
  }
}
}  // namespace mxd

__device__ __forceinline__ void cp_async_ca(u32 dst, const void* src, u32 bytes) {  // SB-byte copy, 0: zero-fill
  if constexpr (mxd::SB == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}

// As paged_decode_attention, over microscaled pages: codes u8 [pages, page_size, nkv, D * bits / 8], scales
// u8 [pages, page_size, nkv, D / 32] (common.cuh's KV vector layout). Dynamic shared memory
// NW * NSTAGE * STAGE_B bytes.
extern "C" __global__ void __launch_bounds__(NW * 32, 1)
    paged_decode_attention_mx(const float* __restrict__ q, const u8* __restrict__ k_codes,
                              const u8* __restrict__ k_scales, const u8* __restrict__ v_codes,
                              const u8* __restrict__ v_scales, const int* __restrict__ block_tables,
                              const int* __restrict__ seq_info, const int* __restrict__ work,
                              void* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
                              int nq, int nkv, int max_pages, int page_size, float scale,
                              const float* __restrict__ gate, i64 g_st, i64 g_sh, int out_bf16) {
  using namespace mxd;
  DYN_SMEM_DECL(smem);
  pdl_begin();  // overlapped launch (pdl.cuh)
  const WarpTiles wt(work, seq_info, block_tables, max_pages, page_size);
  const int kvh = blockIdx.y, g = nq / nkv, start = wt.start, kbeg = wt.kbeg, kend = wt.kend;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gr = lane >> 2, t = lane & 3;

  // Q operand in the key decoder's slot order: qa[2u + h] = {hi, lo of slots 4h, 4h+1; hi, lo of 4h+2, 4h+3}
  // of group u, dims t D/4 + 8u + perm(slot); scaled by scale * log2(e) * 2^64 (the key factors' 2^-64).
  u32 qa[KS][4];
  {
    const float* qr = q + ((i64)start * nq + kvh * g + min(gr, g - 1)) * D + t * (D / 4);
    const float sc = gr < g ? scale * 1.4426950408889634f * 0x1p64f : 0.0f;
#pragma unroll
    for (int u = 0; u < NG; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int p0 = 4 * h + 2 * c;
          split2(qr[8 * u + perm(KBITS, p0)] * sc, qr[8 * u + perm(KBITS, p0 + 1)] * sc, qa[2 * u + h][2 * c],
                 qa[2 * u + h][2 * c + 1]);
        }
  }

  const u32 ring = smem_u32(smem) + (u32)(warp * NSTAGE * STAGE_B);
  // Tile `it` (on `page`) of this warp -> stage `s`: lane l finds key l % 16's vector index; code rows are
  // copied in 16-byte pieces (the row's index by shuffle), scale rows by lanes 0-15 (keys) and 16-31 (values).
  auto load_tile = [&](int it, int s, int page) {
    bool ok;
    const i64 vi = wt.vector(it, page, nkv, kvh, ok);
    const u32 dst = ring + (u32)(s * STAGE_B);
    constexpr int CKK = CBK / 16, CKV = CBV / 16;
#pragma unroll
    for (int i = 0; i < KT * CKK / 32; ++i) {
      const int idx = 32 * i + lane, r = idx / CKK, c = idx - r * CKK;
      const i64 vr = __shfl_sync(FULL_MASK, vi, r);
      const u32 bytes = __shfl_sync(FULL_MASK, (int)ok, r) ? 16u : 0u;
      cp_async16(dst + (u32)(r * CBK + 16 * c), k_codes + vr * CBK + 16 * c, bytes);
    }
#pragma unroll
    for (int i = 0; i < KT * CKV / 32; ++i) {
      const int idx = 32 * i + lane, r = idx / CKV, c = idx - r * CKV;
      const i64 vr = __shfl_sync(FULL_MASK, vi, r);
      const u32 bytes = __shfl_sync(FULL_MASK, (int)ok, r) ? 16u : 0u;
      cp_async16(dst + (u32)(KT * CBK + r * CBV + 16 * c), v_codes + vr * CBV + 16 * c, bytes);
    }
    const u8* src = (lane < KT ? k_scales : v_scales) + vi * SB;
    cp_async_ca(dst + (u32)(KT * (CBK + CBV) + lane * SB), src, ok ? (u32)SB : 0u);
  };

  float acc[KS][4];
#pragma unroll
  for (int i = 0; i < KS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m = NEG_INF, l = 0.0f;

  tile_ring(wt, load_tile, [&](int it, int s) {
    const u32 st = ring + (u32)(s * STAGE_B);
    const u32 kcs = st, vcs = st + KT * CBK, kss = vcs + KT * CBV, vss = kss + KT * SB;

    float s0[2][4] = {}, s1[2][4] = {};  // keys gr / gr + 8 as MMA column gr; k-steps 2u / 2u + 1
    {
      u32 w0[K_LB / 4], w1[K_LB / 4], f0[KBLK], f1[KBLK];
      lds_words<K_LB>(kcs + (u32)(gr * CBK + t * K_LB), w0);
      lds_words<K_LB>(kcs + (u32)((gr + 8) * CBK + t * K_LB), w1);
#pragma unroll
      for (int b = 0; b < KBLK; ++b) {
        f0[b] = mx_factor16<OFF_K>(lds_u8(kss + (u32)(gr * SB + t * KBLK + b))) * 0x10001u;
        f1[b] = mx_factor16<OFF_K>(lds_u8(kss + (u32)((gr + 8) * SB + t * KBLK + b))) * 0x10001u;
      }
#pragma unroll
      for (int u = 0; u < NG; ++u) {
        u32 a[4], c[4];
        key_group<KBITS>(w0, u, f0[u / 4], a);
        key_group<KBITS>(w1, u, f1[u / 4], c);
        mma(s0[0], qa[2 * u][0], qa[2 * u][1], qa[2 * u][2], qa[2 * u][3], a[0], a[1]);
        mma(s1[0], qa[2 * u][0], qa[2 * u][1], qa[2 * u][2], qa[2 * u][3], c[0], c[1]);
        mma(s0[DEC_CHAINS - 1], qa[2 * u + 1][0], qa[2 * u + 1][1], qa[2 * u + 1][2], qa[2 * u + 1][3], a[2],
            a[3]);
        mma(s1[DEC_CHAINS - 1], qa[2 * u + 1][0], qa[2 * u + 1][1], qa[2 * u + 1][2], qa[2 * u + 1][3], c[2],
            c[3]);
      }
    }
    float p[4];  // of head gr for keys 2t, 2t+1, 8+2t, 9+2t of the tile
    tile_probs(s0, s1, kbeg + (warp + it * NW) * KT + 2 * t, kend, m, l, acc, p, t);
    u32 ph0, pl0, ph1, pl1;
    split2(p[0], p[1], ph0, pl0);
    split2(p[2], p[3], ph1, pl1);
    {
      const int vblk = gr * D / 256;  // the scale block of dims [gr D/8, (gr+1) D/8)
      const u32 f01 = mx_factor16<OFF_V>(lds_u8(vss + (u32)((2 * t) * SB + vblk))) |
                      mx_factor16<OFF_V>(lds_u8(vss + (u32)((2 * t + 1) * SB + vblk))) << 16;
      const u32 f89 = mx_factor16<OFF_V>(lds_u8(vss + (u32)((2 * t + 8) * SB + vblk))) |
                      mx_factor16<OFF_V>(lds_u8(vss + (u32)((2 * t + 9) * SB + vblk))) << 16;
      u32 wa[V_LB / 4], wb[V_LB / 4], wc[V_LB / 4], wd[V_LB / 4];
      lds_words<V_LB>(vcs + (u32)((2 * t) * CBV + gr * V_LB), wa);
      lds_words<V_LB>(vcs + (u32)((2 * t + 1) * CBV + gr * V_LB), wb);
      lds_words<V_LB>(vcs + (u32)((2 * t + 8) * CBV + gr * V_LB), wc);
      lds_words<V_LB>(vcs + (u32)((2 * t + 9) * CBV + gr * V_LB), wd);
#pragma unroll
      for (int j = 0; j < NG; ++j) {
        u32 x[4], y[4];  // dims 4j + r: keys (2t, 2t+1) / (2t+8, 2t+9)
        value_group<VBITS>(wa, wb, j, f01, x);
        value_group<VBITS>(wc, wd, j, f89, y);
        mma(acc[2 * j], x[0], x[1], y[0], y[1], ph0, ph1);
        mma(acc[2 * j], x[0], x[1], y[0], y[1], pl0, pl1);
        mma(acc[2 * j + 1], x[2], x[3], y[2], y[3], ph0, ph1);
        mma(acc[2 * j + 1], x[2], x[3], y[2], y[3], pl0, pl1);
      }
    }
  });
  finish(smem, acc, m, l, gr * (D / 8), 2, 1, g, wt.part, start, nq, nkv, kvh, out,
         OutGate{gate, g_st, g_sh, out_bf16}, part_o, part_ml, 0x1p64f);
}
#endif

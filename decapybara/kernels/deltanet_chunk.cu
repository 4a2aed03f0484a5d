// Chunked Gated DeltaNet prefill: the UT form of the numpy reference (NumpyBackend `gated_delta_chunk`) with its
// matrix products on bf16 tensor cores, every operand a hi + lo pair of bf16 terms (three MMAs a product: about
// 16 significant bits of each float32 operand; float32 sums). The bf16 backend's non-decode forwards take it
// (cupy_deltanet.CHUNKED); gdn_recurrent (deltanet_prefill.cu) stays the reference-precision path.
//
// Per chunk of at most CT = 64 tokens of a segment (chunks restart at every segment start, as the reference's do),
// value head h, with cum = cumsum(g) over the chunk, decay[i][j] = exp(cum_i - cum_j) (j <= i):
//   A      = strictly lower ((beta_i k_i . k_j) decay[i][j])          [CT, CT]
//   (U | W) = (I + A)^-1 (beta v | beta k exp(cum))                    [CT, DV] | [CT, DK]   (forward substitution)
//   P      = lower ((q_i . k_j) decay[i][j])                          [CT, CT]
//   V_new  = U - W S;  O = (q exp(cum)) S + P V_new;  S <- exp(cum_last) S + (k exp(cum_last - cum))^T V_new
// S [DK, DV] is the state at the chunk's start (float32 between chunks, as the reference stores it).
//
// gdn_chunk_prep (grid (chunks, HV), PREP_NT threads, float32 on CUDA cores, every chunk at once) computes the
// per-chunk operands and writes them as MMA B fragments, each 16-byte item {hi b0, hi b1, lo b0, lo b1} of a
// (n-tile, k-step, lane): W and q exp(cum) [n = token, k = key dim], k exp(cum_last - cum) [n = key dim,
// k = token], P [n = token, k = token] (pairs on or below the diagonal only); U as float32 C fragments of
// V_new^T (m = value column, n = token); and exp(cum_last).
// gdn_chunk_scan (grid (runs, HV, ceil(DV / 16 / SCAN_WARPS)), a warp per 16 value columns) walks a run's chunks
// in order. It keeps S^T for its columns in registers as C fragments (m = value column, n = key dim), which are
// also the A fragments of S^T's products over the key dims (two n-tiles a k-step, as attention kernels keep P),
// and likewise V_new^T: every product takes its A operand from registers and its B operand from the fragments
// above, which the CTA's warps share, staged in shared memory.
//
// Inputs: qn, kn [T, HK, DK] (normed q, k: gdn_qk_norm); v at y[:, 2 HK DK + h DV + col] (row stride C); g, beta
// [T, HV] (gdn_gates). chunks [NCH, 3] int32: first row, tokens (1..CT), snapshot index (-1: none; set on the last
// chunk of a segment with a snapshot); runs [R, 5] (cupy_deltanet.RunPlan) and run_chunks [R, 2] (first chunk,
// chunks). state [slots, HV, DK, DV] float32 (updated in place); out [T, HV, DV] float32; snap_rec
// [n_snap, HV, DK, DV].
#include "common.cuh"
#include "mma.cuh"
#include "smem.cuh"

#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif

constexpr int CT = 64;        // tokens a chunk (cupy_deltanet.CHUNK)
constexpr int KS = DK / 16;   // k-steps over the key dims
constexpr int NTK = DK / 8;   // n-tiles over the key dims
constexpr int MTV = DV / 16;  // m-tiles (a warp each) over the value columns
constexpr int NTC = CT / 8;   // n-tiles over a chunk's tokens
constexpr int KSC = CT / 16;  // k-steps over a chunk's tokens
constexpr int PREP_NT = 256;
#ifndef CHUNK_DIAG
#define CHUNK_DIAG 0  // measurement only (bench/gdn_prefill.py), results wrong: gdn_chunk_prep skips bit 0 the
#endif                // q k^T / k k^T products, bit 1 the forward substitution, bit 2 the fragment stores
constexpr int FRAGS = (CHUNK_DIAG & 4) ? 0 : 1;
static_assert(DK % 16 == 0 && DV % 16 == 0 && DK + DV <= PREP_NT, "head dims: multiples of 16, DK + DV <= 256");

// ---- shared memory of gdn_chunk_prep (cupy_deltanet.chunk_prep_smem_bytes mirrors it) -------------------------
constexpr int TLD = CT + 4;   // floats a row of q^T / k^T (key-dim rows, token columns): 16-byte rows
constexpr int ALD = CT + 4;   // floats a row of A / P
constexpr int ULD = DV + 4;   // floats a row of the U staging area (token rows)
constexpr int WLD = DK + 4;   // floats a row of the W staging area
constexpr int QK_FLOATS = 2 * DK * TLD, STAGE_FLOATS = CT * (ULD + WLD);
constexpr int REGION0 = QK_FLOATS > STAGE_FLOATS ? QK_FLOATS : STAGE_FLOATS;  // k^T, q^T; later U, W staging

// B fragment item (n-tile nt, k-step ks, lane) of a matrix M(n, k): b0 = (M(n, k), M(n, k + 1)), b1 = (M(n, k + 8),
// M(n, k + 9)) for n = 8 nt + lane / 4, k = 16 ks + 2 (lane % 4); hi terms in x, y, lo terms in z, w.
template <class F> __device__ __forceinline__ uint4 b_frag(const F& m, int nt, int ks, int lane) {
  const int n = 8 * nt + (lane >> 2), k = 16 * ks + 2 * (lane & 3);
  uint4 r;
  split2_cvt(m(n, k), m(n, k + 1), r.x, r.z);
  split2_cvt(m(n, k + 8), m(n, k + 9), r.y, r.w);
  return r;
}

extern "C" __global__ void __launch_bounds__(PREP_NT, 2)
gdn_chunk_prep(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ y,
               const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ chunks,
               uint4* __restrict__ wf, uint4* __restrict__ qf, uint4* __restrict__ kf, uint4* __restrict__ pf,
               float4* __restrict__ uf, float* __restrict__ gl, int HK, int HV, int C) {
  DYN_SMEM_DECL(smem_raw);
  float* const kT = (float*)smem_raw;  // [DK][TLD]: k^T (zeros past the chunk)
  float* const qT = kT + DK * TLD;     // [DK][TLD]: q^T
  float* const us = kT;                // after the solve: U [CT][ULD], then W [CT][WLD]
  float* const wsg = kT + CT * ULD;
  float* const A = kT + REGION0;       // [CT][ALD]: the strict lower part of the UT system, transposed (A^T)
  float* const P = A + CT * ALD;       // [CT][ALD]: the intra-chunk scores (entries above the diagonal unset)
  float* const cm = P + CT * ALD;      // [CT] cum
  float* const eg = cm + CT;           // [CT] exp(cum), 0 past the chunk
  float* const gd = eg + CT;           // [CT] exp(cum_last - cum), 0 past the chunk
  float* const bt = gd + CT;           // [CT] beta, 0 past the chunk
  const int ch = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int row0 = chunks[3 * ch], c = chunks[3 * ch + 1], hk = h / (HV / HK);
  const i64 item = (i64)ch * HV + h;

  {  // q, k rows by 16-byte loads, all in flight at once (lanes walk tokens), then stored transposed
    constexpr int PER = CT * DK / 4 / PREP_NT;  // float4 of each of q and k a thread
    static_assert(CT * DK / 4 % PREP_NT == 0, "whole float4 rounds");
    float4 kv[PER], qv[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int e = tid + u * PREP_NT, i = e % CT, d4 = e / CT;
      const i64 src = ((i64)(row0 + (i < c ? i : 0)) * HK + hk) * DK + 4 * d4;
      kv[u] = i < c ? __ldg((const float4*)(kn + src)) : make_float4(0.f, 0.f, 0.f, 0.f);
      qv[u] = i < c ? __ldg((const float4*)(qn + src)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int e = tid + u * PREP_NT, i = e % CT, d = 4 * (e / CT);
      kT[d * TLD + i] = kv[u].x;
      kT[(d + 1) * TLD + i] = kv[u].y;
      kT[(d + 2) * TLD + i] = kv[u].z;
      kT[(d + 3) * TLD + i] = kv[u].w;
      qT[d * TLD + i] = qv[u].x;
      qT[(d + 1) * TLD + i] = qv[u].y;
      qT[(d + 2) * TLD + i] = qv[u].z;
      qT[(d + 3) * TLD + i] = qv[u].w;
    }
  }
  if (tid < 32) {  // cum by a warp scan: lane l holds tokens l and l + 32
    float a = tid < c ? g[(i64)(row0 + tid) * HV + h] : 0.f;
    float b = tid + 32 < c ? g[(i64)(row0 + tid + 32) * HV + h] : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float xa = __shfl_up_sync(FULL_MASK, a, o), xb = __shfl_up_sync(FULL_MASK, b, o);
      if (tid >= o) {
        a += xa;
        b += xb;
      }
    }
    b += __shfl_sync(FULL_MASK, a, 31);
    const float last = __shfl_sync(FULL_MASK, c - 1 < 32 ? a : b, (c - 1) & 31);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = tid + 32 * half;
      const float cu = half ? b : a;
      const bool in = i < c;
      cm[i] = in ? cu : last;
      eg[i] = in ? expf(cu) : 0.f;
      gd[i] = in ? expf(last - cu) : 0.f;
      bt[i] = in ? beta[(i64)(row0 + i) * HV + h] : 0.f;
    }
    if (tid == 0) gl[item] = expf(last);
  }
  __syncthreads();

  // A and P by 4 x 4 tiles on or below the diagonal (136 of them): thread x < 136 takes tile (ti, tj), tj <= ti
  if (!(CHUNK_DIAG & 1) && tid < CT / 4 * (CT / 4 + 1) / 2) {
    int ti = (int)((sqrtf(8.f * tid + 1.f) - 1.f) * 0.5f);
    while ((ti + 1) * (ti + 2) / 2 <= tid) ++ti;
    while (ti * (ti + 1) / 2 > tid) --ti;
    const int tj = tid - ti * (ti + 1) / 2;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) kk[a][b] = qk[a][b] = 0.f;
#pragma unroll 4
    for (int d = 0; d < DK; ++d) {
      const float4 ki = *(const float4*)(kT + d * TLD + 4 * ti);
      const float4 qi = *(const float4*)(qT + d * TLD + 4 * ti);
      const float4 kj = *(const float4*)(kT + d * TLD + 4 * tj);
      const float iv[4] = {ki.x, ki.y, ki.z, ki.w}, qv[4] = {qi.x, qi.y, qi.z, qi.w}, jv[4] = {kj.x, kj.y, kj.z, kj.w};
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          kk[a][b] = fmaf(iv[a], jv[b], kk[a][b]);
          qk[a][b] = fmaf(qv[a], jv[b], qk[a][b]);
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int i = 4 * ti + a, j = 4 * tj + b;
        const float dec = j <= i ? expf(cm[i] - cm[j]) : 0.f;
        A[j * ALD + i] = j < i ? bt[i] * kk[a][b] * dec : 0.f;
        P[i * ALD + j] = qk[a][b] * dec;
      }
  }
  __syncthreads();

  // fragments of q exp(cum), k exp(cum_last - cum) and P (they read q^T and k^T before the staging reuses them)
  for (int x = tid; x < FRAGS * NTC * KS * 32; x += PREP_NT) {
    const int ks = (x >> 5) % KS, nt = (x >> 5) / KS;
    qf[item * (NTC * KS * 32) + x] = b_frag([&](int n, int k) { return qT[k * TLD + n] * eg[n]; }, nt, ks, x & 31);
  }
  for (int x = tid; x < FRAGS * NTK * KSC * 32; x += PREP_NT) {
    const int ks = (x >> 5) % KSC, nt = (x >> 5) / KSC;
    kf[item * (NTK * KSC * 32) + x] = b_frag([&](int n, int k) { return kT[n * TLD + k] * gd[k]; }, nt, ks, x & 31);
  }
  for (int x = tid; x < FRAGS * NTC * KSC * 32; x += PREP_NT) {
    const int ks = (x >> 5) % KSC, nt = (x >> 5) / KSC;
    if (ks <= nt / 2)
      pf[item * (NTC * KSC * 32) + x] =
          b_frag([&](int n, int k) { return k <= n ? P[n * ALD + k] : 0.f; }, nt, ks, x & 31);
  }

  // forward substitution, a column of (beta v | beta k exp(cum)) a thread, in registers
  const int col = tid;
  float s[CT];
  if (col < DV + DK) {
#pragma unroll
    for (int i = 0; i < CT; ++i) {
      if (col < DV) s[i] = i < c ? y[(i64)(row0 + i) * C + 2 * HK * DK + h * DV + col] * bt[i] : 0.f;
      else s[i] = kT[(col - DV) * TLD + i] * bt[i] * eg[i];
    }
  }
  __syncthreads();  // every read of q^T / k^T is done: the staging may overwrite them
  if (!(CHUNK_DIAG & 2) && col < DV + DK) {
#pragma unroll
    for (int j = 0; j < CT - 1; ++j) {  // s[j] is final: its terms leave every row below (independent updates)
      if (j + 1 >= c) break;
      const float sj = s[j];
#pragma unroll
      for (int i0 = (j + 1) & ~3; i0 < CT; i0 += 4) {
        const float4 a4 = *(const float4*)(A + j * ALD + i0);  // A[i0 .. i0 + 3][j]
        if (i0 > j) s[i0] = fmaf(-a4.x, sj, s[i0]);
        if (i0 + 1 > j) s[i0 + 1] = fmaf(-a4.y, sj, s[i0 + 1]);
        if (i0 + 2 > j) s[i0 + 2] = fmaf(-a4.z, sj, s[i0 + 2]);
        if (i0 + 3 > j) s[i0 + 3] = fmaf(-a4.w, sj, s[i0 + 3]);
      }
    }
  }
  if (col < DV + DK) {
#pragma unroll
    for (int i = 0; i < CT; ++i) {
      if (col < DV) us[i * ULD + col] = s[i];
      else wsg[i * WLD + col - DV] = s[i];
    }
  }
  __syncthreads();
  for (int x = tid; x < FRAGS * NTC * KS * 32; x += PREP_NT) {
    const int ks = (x >> 5) % KS, nt = (x >> 5) / KS;
    wf[item * (NTC * KS * 32) + x] = b_frag([&](int n, int k) { return wsg[n * WLD + k]; }, nt, ks, x & 31);
  }
  for (int x = tid; x < FRAGS * MTV * NTC * 32; x += PREP_NT) {  // U^T as C fragments: (m-tile, n-tile, lane)
    const int l = x & 31, nt = (x >> 5) % NTC, mt = (x >> 5) / NTC;
    const int i = 8 * nt + 2 * (l & 3), v = 16 * mt + (l >> 2);
    uf[item * (MTV * NTC * 32) + x] =
        make_float4(us[i * ULD + v], us[(i + 1) * ULD + v], us[i * ULD + v + 8], us[(i + 1) * ULD + v + 8]);
  }
}

// ---- the scan over a run's chunks ---------------------------------------------------------------------------
#ifndef SCAN_WARPS
#define SCAN_WARPS 4  // warps (16 value columns each) a CTA; cupy_deltanet passes the most of 4, 2, 1 dividing DV / 16
#endif

// the A fragments (hi, lo) of k-step s from C fragments f (m rows by n-tiles 2s, 2s + 1)
__device__ __forceinline__ void a_frag(const float (&f0)[4], const float (&f1)[4], u32 (&ah)[4], u32 (&al)[4]) {
  split2_cvt(f0[0], f0[1], ah[0], al[0]);
  split2_cvt(f0[2], f0[3], ah[1], al[1]);
  split2_cvt(f1[0], f1[1], ah[2], al[2]);
  split2_cvt(f1[2], f1[3], ah[3], al[3]);
}
// d[n] += A B[n] for the N accumulators whose `on[n]` is set, A = (hi, lo) pairs ah, al, B[n] the items {hi b0, hi b1,
// lo b0, lo b1}: hi hi, lo hi, hi lo, each term over every accumulator before the next (N independent MMAs in a
// row rather than three dependent ones)
template <int N>
__device__ __forceinline__ void mma3_rows(float (&d)[N][4], const u32 (&ah)[4], const u32 (&al)[4], const uint4 (&b)[N],
                                          const bool (&on)[N]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
    if (on[n]) mma(d[n], ah[0], ah[1], ah[2], ah[3], b[n].x, b[n].y);
#pragma unroll
  for (int n = 0; n < N; ++n)
    if (on[n]) mma(d[n], al[0], al[1], al[2], al[3], b[n].x, b[n].y);
#pragma unroll
  for (int n = 0; n < N; ++n)
    if (on[n]) mma(d[n], ah[0], ah[1], ah[2], ah[3], b[n].z, b[n].w);
}

#ifndef SCAN_WQ_BUFS
#define SCAN_WQ_BUFS 1  // chunks of W | q exp(cum) fragments staged at once (1 or 2; cupy_deltanet passes it)
#endif
static_assert(SCAN_WQ_BUFS == 1 || SCAN_WQ_BUFS == 2, "one or two W | q buffers");
// shared memory of gdn_chunk_scan, in 16-byte items (cupy_deltanet.chunk_scan_smem_bytes mirrors it): W and
// q exp(cum) fragments [SCAN_WQ_BUFS][2][WQ_ITEMS], then k exp(cum_last - cum) [K_ITEMS] and P [P_ITEMS], then U of
// each warp's m-tile [SCAN_WARPS][U_ITEMS]
constexpr int WQ_ITEMS = NTC * KS * 32, K_ITEMS = NTK * KSC * 32, P_ITEMS = NTC * KSC * 32, U_ITEMS = NTC * 32;
constexpr int SCAN_ITEMS = SCAN_WQ_BUFS * 2 * WQ_ITEMS + K_ITEMS + P_ITEMS + SCAN_WARPS * U_ITEMS;
static_assert(16 * SCAN_ITEMS <= 227 * 1024, "gdn_chunk_scan's shared memory");

// A CTA takes SCAN_WARPS m-tiles of one (run, value head); its warps share the chunk's B fragments, staged in
// shared memory by 16-byte asynchronous copies in two groups: W | q exp(cum) (products over the state), then
// k exp(cum_last - cum) | P | U (the rest). The second group of a chunk flies during its first phase; the first
// group flies during the chunk before (SCAN_WQ_BUFS 2: from the start of the chunk before; 1: from the end of
// its first phase).
extern "C" __global__ void __launch_bounds__(32 * SCAN_WARPS)
gdn_chunk_scan(const uint4* __restrict__ wf, const uint4* __restrict__ qf, const uint4* __restrict__ kf,
               const uint4* __restrict__ pf, const float4* __restrict__ uf, const float* __restrict__ gl,
               const int* __restrict__ chunks, const int* __restrict__ runs, const int* __restrict__ run_chunks,
               float* __restrict__ state, float* __restrict__ out, float* __restrict__ snap_rec, int HV) {
  DYN_SMEM_DECL(smem_raw);
  const u32 sm_wq = smem_u32(smem_raw), sm_k = sm_wq + 16 * SCAN_WQ_BUFS * 2 * WQ_ITEMS, sm_p = sm_k + 16 * K_ITEMS;
  const u32 sm_u = sm_p + 16 * P_ITEMS;
  const int r = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int mt0 = blockIdx.z * SCAN_WARPS, mt = mt0 + warp;
  const bool active = mt < MTV;
  const int slot = runs[5 * r + 2], ch0 = run_chunks[2 * r], nch = run_chunks[2 * r + 1];
  const int gq = lane >> 2, tq = lane & 3, col0 = 16 * mt;
  auto load_wq = [&](int ch, int buf) {
    const i64 item = (i64)ch * HV + h;
    const u32 dst = sm_wq + 16 * buf * 2 * WQ_ITEMS;
    for (int x = tid; x < 2 * WQ_ITEMS; x += 32 * SCAN_WARPS)
      cp_async16(dst + 16 * x, x < WQ_ITEMS ? wf + item * WQ_ITEMS + x : qf + item * WQ_ITEMS + x - WQ_ITEMS, 16);
  };
  auto load_kpu = [&](int ch) {
    const i64 item = (i64)ch * HV + h;
    for (int x = tid; x < K_ITEMS; x += 32 * SCAN_WARPS) cp_async16(sm_k + 16 * x, kf + item * K_ITEMS + x, 16);
    for (int x = tid; x < P_ITEMS; x += 32 * SCAN_WARPS)  // the items on or below the diagonal (prep writes no others)
      if ((x >> 5) % KSC <= (x >> 5) / KSC / 2) cp_async16(sm_p + 16 * x, pf + item * P_ITEMS + x, 16);
    for (int x = tid; x < SCAN_WARPS * U_ITEMS; x += 32 * SCAN_WARPS) {
      const int m = mt0 + x / U_ITEMS;
      if (m < MTV) cp_async16(sm_u + 16 * x, uf + (item * MTV + m) * U_ITEMS + x % U_ITEMS, 16);
    }
  };
  // S^T C fragments: S[nt][e] = S[key dim 8 nt + 2 tq + (e & 1)][value column col0 + gq + 8 (e >> 1)]
  auto s_at = [&](int nt, int e) { return (i64)(8 * nt + 2 * tq + (e & 1)) * DV + col0 + gq + 8 * (e >> 1); };
  float* const st = state + ((i64)slot * HV + h) * DK * DV;
  float S[NTK][4];
#pragma unroll
  for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) S[nt][e] = active ? st[s_at(nt, e)] : 0.f;

  // groups in commit order: WQ_0 [, WQ_1], then per chunk c: K_c, WQ_{c + SCAN_WQ_BUFS} (possibly empty)
  if (nch > 0) load_wq(ch0, 0);
  cp_commit();
  if (SCAN_WQ_BUFS == 2) {
    if (nch > 1) load_wq(ch0 + 1, 1);
    cp_commit();
  }
  for (int ci = 0; ci < nch; ++ci) {
    const int ch = ch0 + ci, row0 = chunks[3 * ch], c = chunks[3 * ch + 1], snap = chunks[3 * ch + 2];
    const u32 wq = sm_wq + 16 * (SCAN_WQ_BUFS == 2 ? ci & 1 : 0) * 2 * WQ_ITEMS;  // this chunk's W | q buffer
    load_kpu(ch);
    cp_commit();
    cp_wait_groups<SCAN_WQ_BUFS>();  // this chunk's W | q exp(cum) (after chunk 0: done at the last chunk's wait)
    __syncthreads();
    float vn[NTC][4], o[NTC][4];  // (W S)^T, then V_new^T; (q exp(cum) S)^T, then O^T
#pragma unroll
    for (int nt = 0; nt < NTC; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) vn[nt][e] = o[nt][e] = 0.f;
    bool on[NTC];
#pragma unroll
    for (int nt = 0; nt < NTC; ++nt) on[nt] = 8 * nt < c;
    if (active) {
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {  // (W S)^T, then (q exp(cum) S)^T
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          u32 ah[4], al[4];
          a_frag(S[2 * ks], S[2 * ks + 1], ah, al);
          uint4 b[NTC];
#pragma unroll
          for (int nt = 0; nt < NTC; ++nt)
            if (on[nt]) b[nt] = ld_shared_v4(wq + 16 * (pass * WQ_ITEMS + (nt * KS + ks) * 32 + lane));
          if (pass) mma3_rows(o, ah, al, b, on);
          else mma3_rows(vn, ah, al, b, on);
        }
      }
    }
    __syncthreads();  // every warp is done with this W | q buffer: the chunk SCAN_WQ_BUFS on may land there
    if (ci + SCAN_WQ_BUFS < nch) load_wq(ch + SCAN_WQ_BUFS, SCAN_WQ_BUFS == 2 ? ci & 1 : 0);
    cp_commit();
    cp_wait_groups<1>();  // this chunk's k exp(cum_last - cum) | P | U (and the next chunk's W | q)
    __syncthreads();
    if (active) {
      const u32 ui = sm_u + 16 * (warp * U_ITEMS + lane);
#pragma unroll
      for (int nt = 0; nt < NTC; ++nt) {
        if (8 * nt < c) {
          const uint4 u = ld_shared_v4(ui + 16 * 32 * nt);
          vn[nt][0] = __uint_as_float(u.x) - vn[nt][0];
          vn[nt][1] = __uint_as_float(u.y) - vn[nt][1];
          vn[nt][2] = __uint_as_float(u.z) - vn[nt][2];
          vn[nt][3] = __uint_as_float(u.w) - vn[nt][3];
        }
      }
      u32 vh[KSC][4], vl[KSC][4];
#pragma unroll
      for (int kj = 0; kj < KSC; ++kj) a_frag(vn[2 * kj], vn[2 * kj + 1], vh[kj], vl[kj]);
#pragma unroll
      for (int kj = 0; kj < KSC; ++kj) {  // P's k-step kj meets the token n-tiles 2 kj and after
        uint4 b[NTC];
        bool onp[NTC];
#pragma unroll
        for (int nt = 0; nt < NTC; ++nt) {
          onp[nt] = on[nt] && kj <= nt / 2;
          if (onp[nt]) b[nt] = ld_shared_v4(sm_p + 16 * ((nt * KSC + kj) * 32 + lane));
        }
        mma3_rows(o, vh[kj], vl[kj], b, onp);
      }
#pragma unroll
      for (int nt = 0; nt < NTC; ++nt) {
        if (on[nt]) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = 8 * nt + 2 * tq + (e & 1);
            if (i < c) out[((i64)(row0 + i) * HV + h) * DV + col0 + gq + 8 * (e >> 1)] = o[nt][e];
          }
        }
      }
      const float decay = __ldg(gl + (i64)ch * HV + h);
#pragma unroll
      for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[nt][e] *= decay;
      constexpr int NB = NTK < 8 ? NTK : 8;  // key-dim n-tiles a batch of MMAs
      static_assert(NTK % NB == 0, "key dims: at most 64 or a multiple of 64");
      bool all[NB];
#pragma unroll
      for (int n = 0; n < NB; ++n) all[n] = true;
#pragma unroll
      for (int kj = 0; kj < KSC; ++kj) {
        if (16 * kj < c) {
#pragma unroll
          for (int n0 = 0; n0 < NTK; n0 += NB) {
            uint4 b[NB];
#pragma unroll
            for (int n = 0; n < NB; ++n) b[n] = ld_shared_v4(sm_k + 16 * (((n0 + n) * KSC + kj) * 32 + lane));
            mma3_rows(*reinterpret_cast<float(*)[NB][4]>(&S[n0]), vh[kj], vl[kj], b, all);
          }
        }
      }
      if (snap >= 0) {
        float* const sr = snap_rec + ((i64)snap * HV + h) * DK * DV;
#pragma unroll
        for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) sr[s_at(nt, e)] = S[nt][e];
      }
    }
    __syncthreads();  // every warp is done with k | P | U: the next chunk's may land there
  }
  cp_wait_groups<0>();
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[s_at(nt, e)] = S[nt][e];
  }
}

// Gated DeltaNet core (NumpyBackend.deltanet_core): causal conv1d + SiLU with conv state, L2-normed q / k,
// g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), and the gated delta rule per token:
//   S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q        (S: [DK, DV] per value head)
//
// Compile-time: DK, DV (head dims), CONV_K (conv width), ACC (float or double: the recurrence's arithmetic).
// With ACC = double the state is rounded to float32 exactly where the numpy reference stores it (every
// `chunk` tokens of a segment and at each segment end), so the result matches the reference to float32
// rounding of the inputs. This is the per-token recurrent form (O(L) dependent steps per run and head, each
// DK * DV / threads work per thread); the bf16 backend's long prefill runs take the chunked form instead
// (deltanet_chunk.cu, cupy_deltanet.CHUNKED).
//
// Work is given as runs: maximal groups of consecutive segments of one sequence (same state slot, contiguous
// rows). runs [R, 5] int32 = first row, rows, state slot, first segment, number of segments; segs [S, 2] int32 =
// segment end (rows from the run start, exclusive), snapshot index (-1: none). Snapshots copy the state at
// the segment's end into snap_conv [n_snap, C, CONV_K - 1] / snap_rec [n_snap, HV, DK, DV].
// A decode forward (every run one row) takes gdn_decode + conv1d_state_update instead of the five kernels, or
// gdn_decode + gdn_decode_finish (the conv state and the gated RMS norm after the core) when the caller fuses
// the norm.
#include "common.cuh"
#include "smem.cuh"

#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif
#ifndef CONV_K
#define CONV_K 4
#endif
#ifndef ACC
#define ACC double
#endif

constexpr int KM1 = CONV_K - 1;
constexpr int KM1S = KM1 > 0 ? KM1 : 1;  // the conv windows' storage (a width-1 conv keeps no inputs)
constexpr int VCOLS = DV < 32 ? DV : 32;  // value columns per CTA
static_assert(DV % VCOLS == 0, "value head dim must be a multiple of 32 (or below 32)");

// ---- causal conv1d + SiLU ------------------------------------------------------------------------------
// x: [T, C] float32 (mixed q|k|v rows, row stride ldx >= C); w: [C, CONV_K]; conv_state: [slots, C, KM1];
// y: [T, C] (contiguous).
// x_ext(p) = row p of the run for p >= 0, conv state column KM1 + p for p < 0 (the inputs before the run).
__device__ __forceinline__ float conv_input(const float* __restrict__ x, const float* __restrict__ st, int row0,
                                            int p, i64 ldx, int c) {
  return p >= 0 ? x[(i64)(row0 + p) * ldx + c] : st[KM1 + p];
}

// Grid (ceil(C / 128), ceil(max run length / CONV_TOKENS), R), 128 threads: thread per (channel, CONV_TOKENS
// tokens of a run). y = silu(sum_j x_ext(i - KM1 + j) * w_j), accumulated in the reference's order with no
// fused multiply-add. Reads the conv state only; conv1d_state_update writes it afterwards.
constexpr int CONV_TOKENS = 16;
// NORM (conv1d_silu_gates' blocks of a q or k head: 128 threads, DK = 128 channels): also the head's normalised
// rows, gdn_qk_norm's bits: nout [T, HK, DK] at head h = (y / sqrt(sum y^2 + 1e-6)) * scale, the sum taken as
// gdn_qk_norm's lanes and warp_sum take it (scale 1 for k: an exact product, gdn_qk_norm's kr / dk).
template <bool NORM>
__device__ __forceinline__ void conv_silu_tokens(const float* __restrict__ x, const float* __restrict__ w,
                                                 const float* __restrict__ conv_state, const int* __restrict__ run,
                                                 float* __restrict__ y, int C, i64 ldx, int c, int i0,
                                                 float* __restrict__ nout = nullptr, int h = 0, int HK = 0,
                                                 float scale = 1.0f) {
  const int row0 = run[0], len = run[1], slot = run[2];
  if (c >= C || i0 >= len) return;  // NORM: the same for the whole block (every channel of a q / k head is < C)
  const float* st = conv_state + ((i64)slot * C + c) * KM1;
  float wc[CONV_K], win[KM1S];
#pragma unroll
  for (int j = 0; j < CONV_K; ++j) wc[j] = w[(i64)c * CONV_K + j];
#pragma unroll
  for (int j = 0; j < KM1; ++j) win[j] = conv_input(x, st, row0, i0 - KM1 + j, ldx, c);
  const int i1 = min(i0 + CONV_TOKENS, len);
  for (int i = i0; i < i1; ++i) {
    const float xi = x[(i64)(row0 + i) * ldx + c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < KM1; ++j) acc = __fadd_rn(acc, __fmul_rn(win[j], wc[j]));
    acc = __fadd_rn(acc, __fmul_rn(xi, wc[KM1]));
    const float yv = silu_f(acc);
    y[(i64)(row0 + i) * C + c] = yv;
    if constexpr (NORM) {
      __shared__ float ys[DK];
      __shared__ float den;
      ys[threadIdx.x] = yv;
      __syncthreads();
      if (threadIdx.x < 32) {
        float sq = 0.0f;
        for (int k = threadIdx.x; k < DK; k += 32) sq += ys[k] * ys[k];
        sq = warp_sum(sq);
        if (threadIdx.x == 0) den = sqrtf(sq + 1e-6f);
      }
      __syncthreads();
      nout[((i64)(row0 + i) * HK + h) * DK + threadIdx.x] = (yv / den) * scale;
      __syncthreads();  // ys and den are the next token's
    }
#pragma unroll
    for (int j = 0; j + 1 < KM1; ++j) win[j] = win[j + 1];
    if constexpr (KM1 > 0) win[KM1 - 1] = xi;
  }
}

extern "C" __global__ void conv1d_silu_runs(const float* __restrict__ x, const float* __restrict__ w,
                                            const float* __restrict__ conv_state, const int* __restrict__ runs,
                                            float* __restrict__ y, int C, i64 ldx) {
  conv_silu_tokens<false>(x, w, conv_state, runs + 5 * blockIdx.z, y, C, ldx, blockIdx.x * blockDim.x + threadIdx.x,
                          blockIdx.y * CONV_TOKENS);
}

// The conv state of channel c after each snapshotted segment of a run (into snap_conv) and after the run (into
// conv_state, in place: every value is read before the first write).
__device__ __forceinline__ void conv_state_update(const float* __restrict__ x, float* __restrict__ conv_state,
                                                  const int* __restrict__ run, const int* __restrict__ segs,
                                                  float* __restrict__ snap_conv, int C, i64 ldx, int c) {
  const int row0 = run[0], slot = run[2], seg0 = run[3], nseg = run[4];
  float* st = conv_state + ((i64)slot * C + c) * KM1;
  float old[KM1S], win[KM1S];
#pragma unroll
  for (int j = 0; j < KM1; ++j) old[j] = st[j];
  for (int s = seg0; s < seg0 + nseg; ++s) {
    const int end = segs[2 * s], snap = segs[2 * s + 1];
    if (snap < 0 && s + 1 < seg0 + nseg) continue;
#pragma unroll
    for (int j = 0; j < KM1; ++j) {
      const int p = end - KM1 + j;
      win[j] = p >= 0 ? x[(i64)(row0 + p) * ldx + c] : old[KM1 + p];
    }
    if (snap >= 0) {
#pragma unroll
      for (int j = 0; j < KM1; ++j) snap_conv[((i64)snap * C + c) * KM1 + j] = win[j];
    }
  }
  // win: the window at the last segment's end, which is the run's end
#pragma unroll
  for (int j = 0; j < KM1; ++j) st[j] = win[j];
}

// Grid (ceil(C / 128), R), 128 threads: conv_state_update for every channel of every run.
extern "C" __global__ void conv1d_state_update(const float* __restrict__ x, float* __restrict__ conv_state,
                                               const int* __restrict__ runs, const int* __restrict__ segs,
                                               float* __restrict__ snap_conv, int C, i64 ldx) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  conv_state_update(x, conv_state, runs + 5 * blockIdx.y, segs, snap_conv, C, ldx, c);
}

// ---- q / k normalisation and gates ----------------------------------------------------------------------
// One warp per (t, k-head): qn = q / sqrt(sum q^2 + 1e-6) * q_scale, kn = k / sqrt(sum k^2 + 1e-6), read from
// y [T, C] (q at column 0, k at column HK * DK). qn, kn: [T, HK, DK].
extern "C" __global__ void gdn_qk_norm(const float* __restrict__ y, float* __restrict__ qn, float* __restrict__ kn,
                                       int T, int HK, int C, float q_scale) {
  const i64 item = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (item >= (i64)T * HK) return;  // uniform per warp
  const i64 t = item / HK, h = item - t * HK;
  const float* qr = y + t * C + h * DK;
  const float* kr = qr + (i64)HK * DK;
  float sq = 0.0f, sk = 0.0f;
  for (int i = lane; i < DK; i += 32) {
    sq += qr[i] * qr[i];
    sk += kr[i] * kr[i];
  }
  const float dq = sqrtf(warp_sum(sq) + 1e-6f), dk = sqrtf(warp_sum(sk) + 1e-6f);
  for (int i = lane; i < DK; i += 32) {
    qn[item * DK + i] = (qr[i] / dq) * q_scale;
    kn[item * DK + i] = kr[i] / dk;
  }
}

// g = neg_A * softplus(a + dt_bias) (numpy's logaddexp(0, x) in float32), beta = sigmoid(b). a, b: [T, HV]
// rows `ld` floats apart (views of one fused product may interleave); g, beta: [T, HV]; neg_A, dt_bias: [HV].
__device__ __forceinline__ void gates_from(const float* __restrict__ a, const float* __restrict__ b,
                                           const float* __restrict__ neg_A, const float* __restrict__ dt_bias,
                                           float* __restrict__ g, float* __restrict__ beta, int T, int HV, i64 ld,
                                           i64 first, i64 stride) {
  const i64 n = (i64)T * HV;
  for (i64 i = first; i < n; i += stride) {
    const int h = (int)(i % HV);
    const i64 src = (i / HV) * ld + h;
    const float v = a[src] + dt_bias[h];
    float sp;
    if (v == 0.0f) sp = 0.693147180559945309f;
    else if (v > 0.0f) sp = v + log1pf(expf(-v));
    else sp = log1pf(expf(v));
    g[i] = neg_A[h] * sp;
    beta[i] = sigmoid_f(b[src]);
  }
}

extern "C" __global__ void gdn_gates(const float* __restrict__ a, const float* __restrict__ b,
                                     const float* __restrict__ neg_A, const float* __restrict__ dt_bias,
                                     float* __restrict__ g, float* __restrict__ beta, int T, int HV, i64 ld) {
  gates_from(a, b, neg_A, dt_bias, g, beta, T, HV, ld, (i64)blockIdx.x * blockDim.x + threadIdx.x,
             (i64)gridDim.x * blockDim.x);
}

// conv1d_silu_runs and gdn_gates in one launch, and with `norms` gdn_qk_norm too: grid (CB * TILES * R + GB), 128
// threads, CB = ceil(C / 128). Block b < CB * TILES * R is conv1d_silu_runs' block (b % CB, (b / CB) % TILES,
// b / (CB * TILES)); with `norms` (DK = 128: a block's channels are one head's) blocks b % CB < HK also write q
// head b % CB's normalised rows into qn, HK <= b % CB < 2 HK k head b % CB - HK's into kn. The GB blocks after
// them are gdn_gates' grid-stride loop. The same values as the separate launches.
extern "C" __global__ void conv1d_silu_gates(const float* __restrict__ x, const float* __restrict__ w,
                                             const float* __restrict__ conv_state, const int* __restrict__ runs,
                                             float* __restrict__ y, int C, i64 ldx, int tiles, int R,
                                             const float* __restrict__ a, const float* __restrict__ b,
                                             const float* __restrict__ neg_A, const float* __restrict__ dt_bias,
                                             float* __restrict__ g, float* __restrict__ beta, int T, int HV,
                                             i64 ld, int norms, float* __restrict__ qn, float* __restrict__ kn,
                                             int HK, float q_scale) {
  const int cblocks = (C + blockDim.x - 1) / blockDim.x;
  const i64 conv_blocks = (i64)cblocks * tiles * R;
  if ((i64)blockIdx.x >= conv_blocks) {
    gates_from(a, b, neg_A, dt_bias, g, beta, T, HV, ld, ((i64)blockIdx.x - conv_blocks) * blockDim.x + threadIdx.x,
               ((i64)gridDim.x - conv_blocks) * blockDim.x);
    return;
  }
  const int cb = (int)(blockIdx.x % cblocks);
  const i64 rest = blockIdx.x / cblocks;
  const int tile = (int)(rest % tiles), r = (int)(rest / tiles);
  const int c = cb * blockDim.x + threadIdx.x;
  if constexpr (DK == 128) {
    if (norms && cb < 2 * HK && blockDim.x == DK) {  // block-uniform
      conv_silu_tokens<true>(x, w, conv_state, runs + 5 * r, y, C, ldx, c, tile * CONV_TOKENS, cb < HK ? qn : kn,
                             cb < HK ? cb : cb - HK, HK, cb < HK ? q_scale : 1.0f);
      return;
    }
  }
  conv_silu_tokens<false>(x, w, conv_state, runs + 5 * r, y, C, ldx, c, tile * CONV_TOKENS);
}

// ---- the gated delta rule ----------------------------------------------------------------------------------
// Grid (R runs, HV, DV / VCOLS), VCOLS * KSPLIT threads. Column v of S evolves independently of the others given
// q, k, g, beta; KSPLIT adjacent lanes share a column, each holding ROWS = DK / KSPLIT of its rows in registers
// (ACC precision), and combine S^T k and S^T q partial sums with two shuffles. v: y[:, 2 * HK * DK + h * DV +
// col]; state: [slots, HV, DK, DV] float32; out: [T, HV, DV] float32. The inputs arrive in blocks of tokens
// (gdn_recurrent, below).
constexpr int KSPLIT = 4;
constexpr int ROWS = DK / KSPLIT;
constexpr int NT = VCOLS * KSPLIT;
constexpr int KPAD = ROWS + 1;             // padded stride per row slice: the KSPLIT lanes hit distinct banks
static_assert(DK % KSPLIT == 0 && NT % 32 == 0, "DK must split in 4; DV >= 8");

__device__ __forceinline__ ACC group_sum(ACC v) {  // over the KSPLIT = 4 adjacent lanes of a column
  v += __shfl_xor_sync(FULL_MASK, v, 1);
  v += __shfl_xor_sync(FULL_MASK, v, 2);
  return v;
}

// A product no compiler may fuse into a neighbouring add (the delta rule's arithmetic is spelled out: below).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// One token of the gated delta rule on this thread's rows of a state column: get(j) reads row j's state,
// put(j, v) takes its updated value; q_, k_ are the token's normed q / k at those rows (shared memory); returns
// the column's output S^T q after the update, summed over the KSPLIT lanes of the column. Every product and sum
// is an explicit fma or an unfusable product, so the compiler has no contraction to choose: the state in
// registers (delta_step) and in shared memory (delta_step_shared) give the same bits.
template <class Get, class Put>
__device__ __forceinline__ ACC delta_core(Get get, Put put, const float* q_, const float* k_, const ACC decay,
                                          const ACC bt, const ACC vt) {
  ACC ka = 0, kb = 0;  // S^T k, two chains
#pragma unroll
  for (int j = 0; j < ROWS; j += 2) {
    ka = fma(get(j), (ACC)k_[j], ka);
    if (j + 1 < ROWS) kb = fma(get(j + 1), (ACC)k_[j + 1], kb);
  }
  const ACC delta = mul_rn(fma(-decay, group_sum(ka + kb), vt), bt);
  ACC oa = 0, ob = 0;  // S^T q after the update
#pragma unroll
  for (int j = 0; j < ROWS; j += 2) {
    const ACC s0 = fma((ACC)k_[j], delta, mul_rn(get(j), decay));
    oa = fma(s0, (ACC)q_[j], oa);
    put(j, s0);
    if (j + 1 < ROWS) {
      const ACC s1 = fma((ACC)k_[j + 1], delta, mul_rn(get(j + 1), decay));
      ob = fma(s1, (ACC)q_[j + 1], ob);
      put(j + 1, s1);
    }
  }
  return group_sum(oa + ob);
}

// delta_core on the state in registers, updated in place.
__device__ __forceinline__ ACC delta_step(ACC (&S)[ROWS], const float* q_, const float* k_, const ACC decay,
                                         const ACC bt, const ACC vt) {
  return delta_core([&](int j) { return S[j]; }, [&](int j, ACC v) { S[j] = v; }, q_, k_, decay, bt, vt);
}

// delta_core on a state column slice in shared memory (sp[j * stride], ROWS rows) instead of registers: the
// updated values are not written back there but handed to put(j, value) (the decode stores them), so nothing of
// the state is held in registers across the step.
template <class Put>
__device__ __forceinline__ ACC delta_step_shared(const float* sp, int stride, const float* q_, const float* k_,
                                                 const ACC decay, const ACC bt, const ACC vt, Put put) {
  return delta_core([&](int j) { return (ACC)sp[j * stride]; }, put, q_, k_, decay, bt, vt);
}

// Inputs arrive in blocks of GDN_TOKENS tokens (q / k slices, v of this CTA's columns, g, beta) by cp.async
// into a double-buffered dynamic shared memory area (gdn_recurrent_smem bytes): the next block's copies are in
// flight while this one's tokens run, and there is no barrier between a block's tokens (each column's lanes
// read only what the block barrier published). The arithmetic per token is delta_step's, as before.
#ifndef GDN_TOKENS
#define GDN_TOKENS 16
#endif
constexpr int GT = GDN_TOKENS;
constexpr int SLICE = (ROWS + 3) / 4 * 4 + 4;  // floats per row slice of q / k in shared memory (16-byte aligned,
                                               // the KSPLIT slices of a token in distinct banks)
constexpr int TOKQ = KSPLIT * SLICE;           // floats of one token's q (or k)
constexpr int BLOCKF = GT * (2 * TOKQ + VCOLS + 2);  // floats of one buffer: q, k, v, g, beta
static_assert(NT % 32 == 0, "whole warps");

extern "C" __global__ void __launch_bounds__(NT)
gdn_recurrent(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ y,
              const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
              const int* __restrict__ runs, const int* __restrict__ segs, float* __restrict__ out,
              float* __restrict__ snap_rec, int HK, int HV, int C, int chunk) {
  DYN_SMEM_DECL(smem_raw);
  float* const area = (float*)smem_raw;  // [2][BLOCKF]: per buffer q [GT][TOKQ], k [GT][TOKQ], v [GT][VCOLS],
                                         // g [GT], beta [GT]
  const int* run = runs + 5 * blockIdx.x;
  const int row0 = run[0], len = run[1], slot = run[2], seg0 = run[3], nseg = run[4];
  const int h = blockIdx.y, tid = threadIdx.x, part = tid % KSPLIT;
  const int col0 = blockIdx.z * VCOLS, ccol = tid / KSPLIT, col = col0 + ccol;
  const int hk = h / (HV / HK);
  float* st = state + ((i64)slot * HV + h) * DK * DV + (i64)part * ROWS * DV + col;  // row part * ROWS
  ACC S[ROWS];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) S[j] = (ACC)st[(i64)j * DV];

  // tokens [b0, b0 + GT) of the run into buffer `buf` (4-byte copies, zero-filled past the run's end)
  auto stage = [&](int b0, int buf) {
    float* qb = area + buf * BLOCKF;
    float* kb = qb + GT * TOKQ;
    float* vb = kb + GT * TOKQ;
    float* gb = vb + GT * VCOLS;
    float* bb = gb + GT;
    for (int e = tid; e < GT * DK; e += NT) {
      const int t = e / DK, k = e - t * DK, i = b0 + t;
      const unsigned n = i < len ? 4u : 0u;
      const i64 src = ((i64)(row0 + (i < len ? i : 0)) * HK + hk) * DK + k;
      const int dst = t * TOKQ + (k / ROWS) * SLICE + k % ROWS;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(qb + dst)), "l"(qn + src), "r"(n));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(kb + dst)), "l"(kn + src), "r"(n));
    }
    for (int e = tid; e < GT * (VCOLS + 2); e += NT) {
      const int t = e / (VCOLS + 2), c = e - t * (VCOLS + 2), i = b0 + t;
      const unsigned n = i < len ? 4u : 0u;
      const i64 row = row0 + (i < len ? i : 0);
      const float* src = c < VCOLS ? y + row * C + 2 * HK * DK + h * DV + col0 + c
                                   : (c == VCOLS ? g : beta) + row * HV + h;
      float* dst = c < VCOLS ? vb + t * VCOLS + c : (c == VCOLS ? gb : bb) + t;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(n));
    }
    cp_commit();
  };
  if (len > 0) stage(0, 0);
  int seg = seg0, seg_start = 0, seg_end = segs[2 * seg];
  for (int b0 = 0, buf = 0; b0 < len; b0 += GT, buf ^= 1) {
    if (b0 + GT < len) {  // the next block's copies fly during this one (its buffer was read before the last barrier)
      stage(b0 + GT, buf ^ 1);
      cp_wait_groups<1>();
    } else {
      cp_wait_groups<0>();
    }
    __syncthreads();  // this block's inputs, from every thread's copies
    const float* qb = area + buf * BLOCKF;
    const float* kb = qb + GT * TOKQ;
    const float* vb = kb + GT * TOKQ;
    const float* gb = vb + GT * VCOLS;
    const float* bb = gb + GT;
    const int nt = min(GT, len - b0);
    for (int t = 0; t < nt; ++t) {
      const int i = b0 + t;
      const ACC decay = exp((ACC)gb[t]), bt = (ACC)bb[t], vt = (ACC)vb[t * VCOLS + ccol];
      const ACC o = delta_step(S, qb + t * TOKQ + part * SLICE, kb + t * TOKQ + part * SLICE, decay, bt, vt);
      if (part == 0) out[((i64)(row0 + i) * HV + h) * DV + col] = (float)o;
      const bool at_end = (i + 1 == seg_end);
      if (at_end || (i + 1 - seg_start) % chunk == 0) {  // the reference stores the state as float32 here
#pragma unroll
        for (int j = 0; j < ROWS; ++j) S[j] = (ACC)(float)S[j];
      }
      if (at_end) {
        const int snap = segs[2 * seg + 1];
        if (snap >= 0) {
          float* sr = snap_rec + ((i64)snap * HV + h) * DK * DV + (i64)part * ROWS * DV + col;
#pragma unroll
          for (int j = 0; j < ROWS; ++j) sr[(i64)j * DV] = (float)S[j];
        }
        seg_start = seg_end;
        if (++seg < seg0 + nseg) seg_end = segs[2 * seg];
      }
    }
    __syncthreads();  // every thread has read this buffer: the next stage may overwrite it
  }
#pragma unroll
  for (int j = 0; j < ROWS; ++j) st[(i64)j * DV] = (float)S[j];
}

// ---- one decode token per run ---------------------------------------------------------------------------
// conv1d_silu_runs + gdn_qk_norm + gdn_gates + gdn_recurrent for runs of exactly one row, in one launch and
// with the same arithmetic in the same order (so the same bits): grid (ceil(R / per_cta), HV, DV / DVC),
// DEC_NT threads (DVC value columns a CTA, KSPLIT threads a column). A CTA takes runs blockIdx.x * per_cta ..
// + per_cta - 1 (fewer at the end; per_cta <= DEC_MAXRUNS) one after another for its value head and columns.
// For each it computes the conv + SiLU of its key head's q and k channels (the DV / DVC CTAs of a value head
// and the HV / HK value heads of a key head repeat this small work; thread tid takes channels tid, tid +
// DEC_NT, ...), their L2 norms (one warp for q, one for k: gdn_qk_norm's lane-strided sum and butterfly), its
// value columns and its head's gates, then the recurrent step. Everything no kernel of this step writes goes
// out before the wait (pdl.cuh): the first run's recurrent state and conv state, the conv weights, A and dt (the
// model's own arrays: cupy_deltanet launches plainly otherwise). The conv state is only read here
// (gdn_decode_finish or conv1d_state_update writes it, after this kernel); each conv channel's terms over it are
// summed in the reference's order and the new input's term added last. While a run is computed, the next
// run's state, conv state and inputs are in flight, so a CTA's runs stream like one long copy. A run's DK x DVC
// state slice arrives by 16-byte cp.async copies (whole 128-byte lines a warp, no registers held while in
// flight) into dynamic shared memory, each thread then reading its ROWS values of a column from there (the
// parts KSPLIT apart in distinct banks); the next run's copies go out once every thread has read the current
// one's (after the first barrier of its work; with DEC_SMEM_S, into the other of two slices at its start).
// (Each thread loading its own values, 4-byte loads DV apart that touch KSPLIT lines a warp, was 1-7% slower from
// 4 sequences up at the 27B shape; the stores the other way round, through shared memory in 16-byte pieces, 5-8%
// slower than each thread's own: docs/perf.md.)
// DEC_MULTI builds take runs of any few rows (speculative verification: a token and its drafts; runs shorter than
// the reference's chunk, so no chunk store point falls inside one) in place of the three launches of other
// forwards (conv1d_silu_gates, gdn_recurrent, then gdn_finish or conv1d_state_update, which also runs after this
// build): a run's rows one after another on its state in registers, each row's conv windows the previous row's
// shifted by its inputs (conv1d_silu_runs' order), the next row's inputs in flight during a row's work; at each
// segment end the state is rounded to float32 (gdn_recurrent's store point) and copied to the segment's snapshot,
// at the run's end to the pool. One warp lists a CTA's runs of at least one row (a verification graph's throwaway
// runs of none are left out). The same bits as those launches (their conv, norms, gates and delta_step).
// x: mixed rows [T, C] (stride ldx); a, b: [T, HV] (stride ld_ab); R: runs; the rest as gdn_recurrent.
#ifndef DEC_VCOLS
#define DEC_VCOLS 64  // the gdn_decode launch passes its columns (cupy_deltanet.decode_vcols or FUSED_DECODE["vcols"])
#endif
#ifndef DEC_MAXRUNS
#define DEC_MAXRUNS 32  // cupy_deltanet.DECODE_MAX_RUNS: runs a CTA takes at most
#endif
constexpr int DVC = DV < DEC_VCOLS ? DV : DEC_VCOLS;
constexpr int DEC_NT = DVC * KSPLIT;
static_assert(DV % DVC == 0 && DEC_NT % 32 == 0, "value head dim must be a multiple of DEC_VCOLS (or below it)");
#ifndef GDN_MINB
#define GDN_MINB 1  // resident CTAs per SM the decode kernel is built for (__launch_bounds__): the launch passes
#endif              // cupy_deltanet.decode_ctas_per_sm (27B, float32 state, 32 columns: 4), or DECODE_SMEM_CTAS (5)
#ifndef DEC_MULTI
#define DEC_MULTI 0  // 1: runs of 0 to a few rows (speculative verification: a token and its drafts), each run's
#endif               // tokens one after another on the state held in registers (below)
#ifndef DEC_SMEM_S
#define DEC_SMEM_S 0  // 1: the delta step reads the state slice from shared memory (delta_step_shared), two slices
#endif                // double-buffered (the next run's copies go out at the start of the current run's work),
                      // so no state is held in registers: 96 at 5 CTAs an SM (cupy_deltanet.decode_smem_state)
constexpr int QK_J = (DK + 31) / 32;  // q (or k) channels per lane of the norm warps
constexpr int CH = (2 * DK + DEC_NT - 1) / DEC_NT;  // q then k channels i = tid + DEC_NT j of key head hk

// One run's loads into registers: before the wait its conv state over the run's channels (its recurrent state
// goes to shared memory), after it its new inputs (x at those channels, a, b).
struct DecodeRunIn {
  float cv[KM1S];        // conv state of the value channel
  float cq[CH][KM1S];    // conv state of the q / k channels
};
struct DecodeRunX {
  float xv, av, bv;      // x at the value channel, a and b at the head
  float xq[CH];          // x at the q / k channels
};
constexpr int SPART = ROWS * DVC + 8;  // floats of a part's rows in the shared state slice (+8: bank offset;
                                       // cupy_deltanet.decode_smem_bytes)

extern "C" __global__ void __launch_bounds__(DEC_NT, GDN_MINB)
gdn_decode(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ conv_state,
           const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ neg_A,
           const float* __restrict__ dt_bias, float* __restrict__ state, const int* __restrict__ runs,
           const int* __restrict__ segs, float* __restrict__ out, float* __restrict__ snap_rec, int HK, int HV,
           int C, i64 ldx, i64 ld_ab, float q_scale, int R, int per_cta) {
  static_assert(!(DEC_MULTI && DEC_SMEM_S), "runs of several rows keep their state in registers");
  static_assert(!DEC_MULTI || DEC_MAXRUNS <= 32, "one warp lists a CTA's runs");
  __shared__ float qs[KSPLIT * KPAD], ks[KSPLIT * KPAD];
  __shared__ float raw[2 * DK];
  // each of this CTA's runs: first row, state slot, rows, then its one segment's snapshot index (one-row build) or
  // its first segment (DEC_MULTI, whose runs of no rows are left out)
  __shared__ int meta[DEC_MAXRUNS][4];
  __shared__ int live_runs;
  extern __shared__ __align__(16) float sst[];  // KSPLIT * SPART floats (dynamic: cupy_deltanet.decode_smem_bytes):
                                                // a run's state slice, row part * ROWS + j, column c at
                                                // part * SPART + j * DVC + c; DEC_SMEM_S: two such slices,
                                                // run i's at (i & 1) * KSPLIT * SPART
  const int h = blockIdx.y, tid = threadIdx.x, part = tid % KSPLIT, lane = tid & 31, warp = tid >> 5;
  const int col = blockIdx.z * DVC + tid / KSPLIT;
  const int hk = h / (HV / HK);
  const int r0 = blockIdx.x * per_cta;
  int nr = min(per_cta, R - r0);
  constexpr int NWARP = DEC_NT / 32;
  if (DEC_MULTI) {
    if (warp == 0) {
      const int* run = runs + 5 * (r0 + lane);
      const bool live = lane < nr && run[1] > 0;
      const unsigned m = __ballot_sync(FULL_MASK, live);
      if (live) {
        int* mt = meta[__popc(m & ((1u << lane) - 1u))];
        mt[0] = run[0];
        mt[1] = run[2];
        mt[2] = run[1];
        mt[3] = run[3];
      }
      if (lane == 0) live_runs = __popc(m);
    }
  } else {
    for (int i = tid; i < nr; i += DEC_NT) {
      const int* run = runs + 5 * (r0 + i);
      meta[i][0] = run[0];
      meta[i][1] = run[2];
      meta[i][2] = 1;
      meta[i][3] = segs[2 * run[3] + 1];  // the run's one segment ends at its row: snapshot or -1
    }
  }
  // per CTA: the conv weights of its channels, A and dt of its head
  const int vc = 2 * HK * DK + h * DV + col;
  float wv[CONV_K], wq[CH][CONV_K];
  int cq_c[CH];
#pragma unroll
  for (int j = 0; j < CONV_K; ++j) wv[j] = w[(i64)vc * CONV_K + j];
#pragma unroll
  for (int jj = 0; jj < CH; ++jj) {
    const int i = tid + DEC_NT * jj;
    cq_c[jj] = i < DK ? hk * DK + i : HK * DK + hk * DK + i - DK;
#pragma unroll
    for (int j = 0; j < CONV_K; ++j) wq[jj][j] = i < 2 * DK ? w[(i64)cq_c[jj] * CONV_K + j] : 0.0f;
  }
  const float nA = neg_A[h], dtb = dt_bias[h];
  const i64 st_col = (i64)h * DK * DV + (i64)part * ROWS * DV + col;  // row part * ROWS of a slot's head h
  // The loads of run i (a slot's state is written only by this layer's kernel of earlier steps and host-ordered
  // resets / copies between steps, the conv state after this kernel: both may be read before the wait).
  auto fetch = [&](int i, DecodeRunIn& in) {
    const float* cs = conv_state + (i64)meta[i][1] * C * KM1;
#pragma unroll
    for (int j = 0; j < KM1; ++j) in.cv[j] = cs[(i64)vc * KM1 + j];
#pragma unroll
    for (int jj = 0; jj < CH; ++jj)
#pragma unroll
      for (int j = 0; j < KM1; ++j) in.cq[jj][j] = tid + DEC_NT * jj < 2 * DK ? cs[(i64)cq_c[jj] * KM1 + j] : 0.0f;
  };
  auto fetch_state = [&](int i) {  // run i's slice into sst (every thread done reading the slice before)
    const float* src = state + ((i64)meta[i][1] * HV + h) * DK * DV + blockIdx.z * DVC;
    float* dst = sst + (DEC_SMEM_S ? (i & 1) * KSPLIT * SPART : 0);  // DEC_SMEM_S: run i's buffer
    constexpr int Q = DVC / 4;  // 16-byte pieces of a row's DVC columns
    for (int q = tid; q < DK * Q; q += DEC_NT) {
      const int r = q / Q, c4 = q % Q;
      cp_async16(smem_u32(dst + (r / ROWS) * SPART + (r % ROWS) * DVC + 4 * c4), src + (i64)r * DV + 4 * c4, 16);
    }
    cp_commit();
  };
  auto fetch_x = [&](int row, DecodeRunX& in) {  // the products' outputs at `row`: after the wait only
    const float* xr = x + (i64)row * ldx;
    in.xv = xr[vc];
    in.av = a[(i64)row * ld_ab + h];
    in.bv = b[(i64)row * ld_ab + h];
#pragma unroll
    for (int jj = 0; jj < CH; ++jj) in.xq[jj] = tid + DEC_NT * jj < 2 * DK ? xr[cq_c[jj]] : 0.0f;
  };
  __syncthreads();  // meta
  if (DEC_MULTI) nr = live_runs;
  DecodeRunIn cur;
  DecodeRunX cx;
  if (nr > 0) {
    fetch(0, cur);
    fetch_state(0);
  }
  pdl_begin();  // overlapped launch (pdl.cuh)
  if (nr > 0) fetch_x(meta[0][0], cx);
  for (int i = 0; i < nr; ++i) {
    const int row0 = meta[i][0], slot = meta[i][1], len = DEC_MULTI ? meta[i][2] : 1;
    // the segment the run's token t is in: its end (rows from the run start) and snapshot index
    int seg = DEC_MULTI ? meta[i][3] : 0;
    int seg_end = DEC_MULTI ? segs[2 * seg] : 1, snap = DEC_MULTI ? segs[2 * seg + 1] : meta[i][3];
#if DEC_SMEM_S
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();  // run i's state slice; every thread done with run i - 1's (buffer (i + 1) & 1)
    if (i + 1 < nr) fetch_state(i + 1);
    const float* slice = sst + (i & 1) * KSPLIT * SPART + part * SPART + tid / KSPLIT;
#else
    ACC S[ROWS];
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();  // run i's state slice
#pragma unroll
    for (int j = 0; j < ROWS; ++j) S[j] = (ACC)sst[part * SPART + j * DVC + tid / KSPLIT];
#endif
    DecodeRunIn next;  // the next run's loads, in flight during this run's work
    if (i + 1 < nr) fetch(i + 1, next);
    float* st = state + (i64)slot * HV * DK * DV + st_col;
    for (int t = 0; t < len; ++t) {
      const int row = row0 + t;
      const float xv = cx.xv, av = cx.av, bv = cx.bv;
      DecodeRunX nx;  // the next token's inputs (this run's, else the next run's first), in flight meanwhile
      const bool more = t + 1 < len || i + 1 < nr;
      if (more) fetch_x(t + 1 < len ? row + 1 : meta[i + 1][0], nx);
      // conv1d_silu_runs at this row: acc = sum_j window_j * w_j over the KM1 inputs before it, then + x * w_last
      float v_head = 0.0f;
#pragma unroll
      for (int j = 0; j < KM1; ++j) v_head = __fadd_rn(v_head, __fmul_rn(cur.cv[j], wv[j]));
      const float vt_f = silu_f(__fadd_rn(v_head, __fmul_rn(xv, wv[KM1])));
      float ng, nb;  // gdn_gates
      {
        const float v = av + dtb;
        float sp;
        if (v == 0.0f) sp = 0.693147180559945309f;
        else if (v > 0.0f) sp = v + log1pf(expf(-v));
        else sp = log1pf(expf(v));
        ng = nA * sp;
        nb = sigmoid_f(bv);
      }
#pragma unroll
      for (int jj = 0; jj < CH; ++jj) {
        const int c = tid + DEC_NT * jj;
        if (c < 2 * DK) {
          float acc = 0.0f;
#pragma unroll
          for (int j = 0; j < KM1; ++j) acc = __fadd_rn(acc, __fmul_rn(cur.cq[jj][j], wq[jj][j]));
          raw[c] = silu_f(__fadd_rn(acc, __fmul_rn(cx.xq[jj], wq[jj][KM1])));
        }
      }
      if (DEC_MULTI && t + 1 < len) {  // the windows at the next row: this row's inputs shifted in
#pragma unroll
        for (int j = 0; j + 1 < KM1; ++j) {
          cur.cv[j] = cur.cv[j + 1];
#pragma unroll
          for (int jj = 0; jj < CH; ++jj) cur.cq[jj][j] = cur.cq[jj][j + 1];
        }
        if constexpr (KM1 > 0) {
          cur.cv[KM1 - 1] = xv;
#pragma unroll
          for (int jj = 0; jj < CH; ++jj) cur.cq[jj][KM1 - 1] = cx.xq[jj];
        }
      }
      __syncthreads();  // raw; every thread has read the previous token's qs / ks, and (not DEC_SMEM_S) this run's
                        // slice
      if (!DEC_SMEM_S && t == 0 && i + 1 < nr) fetch_state(i + 1);
      // gdn_qk_norm: lane-strided sums of squares, one warp each for q and k (the same warp if DEC_NT == 32)
#pragma unroll
      for (int qk = 0; qk < 2; ++qk) {
        if (warp == (NWARP > 1 ? qk : 0)) {
          float r[QK_J], s = 0.0f;
#pragma unroll
          for (int j = 0; j < QK_J; ++j) {
            const int k = lane + 32 * j;
            r[j] = k < DK ? raw[qk * DK + k] : 0.0f;
            if (k < DK) s += r[j] * r[j];
          }
          const float norm = sqrtf(warp_sum(s) + 1e-6f);
          float* dst = qk == 0 ? qs : ks;
#pragma unroll
          for (int j = 0; j < QK_J; ++j) {
            const int k = lane + 32 * j;
            if (k < DK) dst[(k / ROWS) * KPAD + k % ROWS] = qk == 0 ? (r[j] / norm) * q_scale : r[j] / norm;
          }
        }
      }
      __syncthreads();  // qs / ks; and the norm warps read raw before this
      // gdn_recurrent, one token
      const ACC decay = exp((ACC)ng), bt = (ACC)nb, vt = (ACC)vt_f;
      // a segment ends at the run's row: the state as float32 (the reference's store point) to its snapshot and,
      // at the run's end, to the pool
      const bool last = t + 1 == len, at_end = !DEC_MULTI || t + 1 == seg_end;
#if DEC_SMEM_S
      float* sr = snap_rec + ((i64)snap * HV + h) * DK * DV + (i64)part * ROWS * DV + col;
      const ACC o = delta_step_shared(slice, DVC, qs + part * KPAD, ks + part * KPAD, decay, bt, vt,
                                      [&](int j, ACC v) {
        st[(i64)j * DV] = (float)v;
        if (snap >= 0) sr[(i64)j * DV] = (float)v;
      });
      if (part == 0) out[((i64)row * HV + h) * DV + col] = (float)o;
#else
      const ACC o = delta_step(S, qs + part * KPAD, ks + part * KPAD, decay, bt, vt);
      if (part == 0) out[((i64)row * HV + h) * DV + col] = (float)o;
      if (at_end || last) {
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
          const float v = (float)S[j];
          if (last) st[(i64)j * DV] = v;
          if (at_end && snap >= 0)
            snap_rec[((i64)snap * HV + h) * DK * DV + (i64)part * ROWS * DV + col + (i64)j * DV] = v;
          if (DEC_MULTI) S[j] = (ACC)v;
        }
      }
      if (DEC_MULTI && at_end && !last) {
        ++seg;
        seg_end = segs[2 * seg];
        snap = segs[2 * seg + 1];
      }
#endif
      if (more) cx = nx;
    }
    if (i + 1 < nr) cur = next;
  }
}

// ---- a decode forward's last launch: conv state and the gated RMS norm ---------------------------------------
// gated_rms_norm_warp's row (decode_ops.cu) for n = DV, by one warp: out = x / sqrt(mean(x^2) + eps) *
// w * silu(z) with the same float operations in the same order, so the same bits: each lane sums x[i]^2 (fma)
// over its elements i = lane + 32 j in j order, then warp_sum's butterfly; the same output expression.
// (gated_rms_norm_warp's + 0 * 0 terms for j past the row are exact; its tail loop past 8 elements per lane
// continues the same j order.)
__device__ __forceinline__ void gated_norm_row(const float* __restrict__ x, const float* __restrict__ z,
                                               const float* __restrict__ w, void* __restrict__ out, i64 o,
                                               int out_bf16, float eps, int lane) {
  constexpr int NJ = (DV + 31) / 32;
  float xv[NJ], zv[NJ], wv[NJ];  // all loads first
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int i = lane + 32 * j;
    xv[j] = i < DV ? x[i] : 0.0f;
    zv[j] = i < DV ? z[i] : 0.0f;
    wv[j] = i < DV ? w[i] : 0.0f;
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) ss += xv[j] * xv[j];
  // __fadd_rn: with DV a compile-time power of two, `/ DV + eps` would become one fma (x * 2^-k + eps, rounded
  // once); gated_rms_norm_warp's runtime n keeps a division (x / 2^k = x * 2^-k exactly) and a rounded add
  const float denom = sqrtf(__fadd_rn(warp_sum(ss) / (float)DV, eps));
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if (lane + 32 * j < DV) store_out(out, out_bf16, o + lane + 32 * j, (xv[j] / denom) * wv[j] * silu_f(zv[j]));
}

// After gdn_decode (runs of one row), in place of conv1d_state_update: grid (NORM_BLOCKS + ceil(C / 128), R),
// 128 threads. Blocks b < NORM_BLOCKS = ceil(HV / 4) give each warp one value head h = 4 b + warp of the run's
// row: gated = gated_rms_norm(core, z, norm_w, eps) for that head (gated_norm_row: the bits gated_rms_norm_warp
// gives); blocks b >= NORM_BLOCKS are conv1d_state_update's, channel c = (b - NORM_BLOCKS) * 128 + thread. The
// stream orders this launch after gdn_decode, so every head's core output is complete here (a head's DV
// columns come from DV / DVC CTAs of gdn_decode). core, gated: [T, HV, DV]; z: head h of row t at
// z + t * ldz + h * DV (a column view of the fused qkv|z product, or contiguous); norm_w: [DV]; gated in bf16
// bits where out_bf16 (store_out: rows that only feed a skinny product), else float32.
extern "C" __global__ void gdn_decode_finish(const float* __restrict__ x, float* __restrict__ conv_state,
                                             const int* __restrict__ runs, const int* __restrict__ segs,
                                             float* __restrict__ snap_conv, int C, i64 ldx,
                                             const float* __restrict__ core, const float* __restrict__ z,
                                             const float* __restrict__ norm_w, void* __restrict__ gated, int HV,
                                             i64 ldz, float eps, int out_bf16) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  const int* run = runs + 5 * blockIdx.y;
  const int nwarp = blockDim.x >> 5, norm_blocks = (HV + nwarp - 1) / nwarp;
  if ((int)blockIdx.x >= norm_blocks) {
    const int c = (blockIdx.x - norm_blocks) * blockDim.x + threadIdx.x;
    if (c < C) conv_state_update(x, conv_state, run, segs, snap_conv, C, ldx, c);
    return;
  }
  const int h = blockIdx.x * nwarp + (threadIdx.x >> 5);
  if (h >= HV) return;  // whole warps leave together
  const i64 row = run[0], o = (row * HV + h) * DV;
  gated_norm_row(core + o, z + row * ldz + (i64)h * DV, norm_w, gated, o, out_bf16, eps, threadIdx.x & 31);
}

// After the recurrence of other forwards (gdn_recurrent, the chunked kernels), in place of conv1d_state_update
// and gated_rms_norm_warp: grid (NB + ceil(C / 128) * R), 128 threads. Blocks b < NB = ceil(T * HV / 4) give each
// warp one (row, value head) item i = 4 b + warp, row i / HV, head i % HV: gated = gated_rms_norm(core, z, norm_w,
// eps) (gated_norm_row, the bits of gated_rms_norm_warp); blocks b >= NB are conv1d_state_update's, channel block
// (b - NB) % ceil(C / 128) of run (b - NB) / ceil(C / 128). One launch where there were two. core, gated, z as
// gdn_decode_finish's (gated in bf16 bits where out_bf16).
extern "C" __global__ void gdn_finish(const float* __restrict__ x, float* __restrict__ conv_state,
                                      const int* __restrict__ runs, const int* __restrict__ segs,
                                      float* __restrict__ snap_conv, int C, i64 ldx, const float* __restrict__ core,
                                      const float* __restrict__ z, const float* __restrict__ norm_w,
                                      void* __restrict__ gated, int T, int HV, i64 ldz, float eps, int out_bf16) {
  const int nwarp = blockDim.x >> 5;
  const i64 items = (i64)T * HV, norm_blocks = (items + nwarp - 1) / nwarp;
  if ((i64)blockIdx.x >= norm_blocks) {
    const int cblocks = (C + blockDim.x - 1) / blockDim.x;
    const i64 b = (i64)blockIdx.x - norm_blocks;
    const i64 r = b / cblocks;
    const int c = (int)(b - r * cblocks) * blockDim.x + threadIdx.x;
    if (c < C) conv_state_update(x, conv_state, runs + 5 * r, segs, snap_conv, C, ldx, c);
    return;
  }
  const i64 item = (i64)blockIdx.x * nwarp + (threadIdx.x >> 5);
  if (item >= items) return;  // whole warps leave together
  const i64 row = item / HV;
  const int h = (int)(item - row * HV);
  gated_norm_row(core + item * DV, z + row * ldz + (i64)h * DV, norm_w, gated, item * DV, out_bf16, eps,
                 threadIdx.x & 31);
}

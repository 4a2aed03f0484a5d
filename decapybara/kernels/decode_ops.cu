// Per-token ops of the forward pass (float32 activations, float32 math):
// RMSNorm (+ fused residual add), gated RMSNorm, RoPE (cos/sin table or positions + inv_freq), an attention
// layer's per-head q / k RMSNorm + RoPE in one launch, SiLU gate, sigmoid (+ gate multiply), KV writes into
// pages (float32, bf16, MXFP8/6/4 quantised exactly as quant.quantize_kv), bf16 <-> float32 conversion, bf16
// embedding gather and block-format weight dequantisation.
//
// Row-wise kernels: "warp" variants give one warp per row (rows up to a few thousand elements), "block"
// variants one block per row. Every entry point is extern "C"; shapes are in the comments.
#include "common.cuh"

// ---- RMSNorm ----------------------------------------------------------------------------------------------
// h = x (+ res); out = h / sqrt(mean(h^2) + eps) * (offset + w); res_out = h when res is given.
// x, res, res_out: [rows, n] float32; w: [n] float32; out: [rows, n] float32, or bf16 bits (out_bf16: the
// float32 value rounded to nearest even, for rows that only feed products that round x to bf16 anyway).
// res / res_out may be null (plain norm).
__device__ __forceinline__ float load_h(const float* __restrict__ x, const float* __restrict__ res, i64 i) {
  return res ? __fadd_rn(x[i], res[i]) : x[i];
}

// Elements first + j * step (j < N) of a row, zero past n: h = x (+ res) and the raw weights w. Every load is
// issued before the arithmetic that uses it (an add right after each load waits on it, so the loads of a row
// would run one memory latency after another).
template <int N>
__device__ __forceinline__ void load_row(const float* __restrict__ x, const float* __restrict__ res,
                                         const float* __restrict__ w, i64 base, int n, int first, int step,
                                         float (&h)[N], float (&wv)[N]) {
  float r[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = first + j * step;
    h[j] = i < n ? x[base + i] : 0.0f;
    r[j] = res && i < n ? res[base + i] : 0.0f;
    wv[j] = i < n ? w[i] : 0.0f;
  }
  if (res) {
#pragma unroll
    for (int j = 0; j < N; ++j) h[j] = __fadd_rn(h[j], r[j]);
  }
}

#define RW_CACHE 8  // elements per lane a warp-per-row kernel keeps in registers (rows up to 256 in one pass)
extern "C" __global__ void rms_norm_warp(const float* __restrict__ x, const float* __restrict__ res,
                                         const float* __restrict__ w, void* __restrict__ out,
                                         float* __restrict__ res_out, int rows, int n, float eps,
                                         float offset, int out_bf16) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warps leave together
  const i64 base = (i64)row * n;
  float hv[RW_CACHE], wv[RW_CACHE];
  load_row<RW_CACHE>(x, res, w, base, n, lane, 32, hv, wv);
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < RW_CACHE; ++j) ss += hv[j] * hv[j];  // the order of the plain strided loop
  for (int i = lane + 32 * RW_CACHE; i < n; i += 32) {
    const float h = load_h(x, res, base + i);
    ss += h * h;
  }
  const float denom = sqrtf(warp_sum(ss) / (float)n + eps);
#pragma unroll
  for (int j = 0; j < RW_CACHE; ++j) {
    const int i = lane + 32 * j;
    if (i < n) {
      if (res_out) res_out[base + i] = hv[j];
      store_out(out, out_bf16, base + i, (hv[j] / denom) * (offset + wv[j]));
    }
  }
  for (int i = lane + 32 * RW_CACHE; i < n; i += 32) {
    const float h = load_h(x, res, base + i);
    if (res_out) res_out[base + i] = h;
    store_out(out, out_bf16, base + i, (h / denom) * (offset + w[i]));
  }
}

// One block per row; the first RN_CACHE elements of each thread (and their weights) stay in registers between
// the two passes.
#define RN_CACHE 16
extern "C" __global__ void rms_norm_block(const float* __restrict__ x, const float* __restrict__ res,
                                          const float* __restrict__ w, void* __restrict__ out,
                                          float* __restrict__ res_out, int rows, int n, float eps,
                                          float offset, int out_bf16) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  __shared__ float scratch[33];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const i64 base = (i64)row * n;
  const int step = blockDim.x, tail = threadIdx.x + RN_CACHE * step;
  float hv[RN_CACHE], wv[RN_CACHE];  // the weights are fetched with x, not after the reduction's barriers
  load_row<RN_CACHE>(x, res, w, base, n, threadIdx.x, step, hv, wv);
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < RN_CACHE; ++j) ss += hv[j] * hv[j];  // the order of the plain strided loop
  for (int i = tail; i < n; i += step) {
    const float h = load_h(x, res, base + i);
    ss += h * h;
  }
  const float denom = sqrtf(block_sum(ss, scratch) / (float)n + eps);
#pragma unroll
  for (int j = 0; j < RN_CACHE; ++j) {
    const int i = threadIdx.x + j * step;
    if (i < n) {
      if (res_out) res_out[base + i] = hv[j];
      store_out(out, out_bf16, base + i, (hv[j] / denom) * (offset + wv[j]));
    }
  }
  for (int i = tail; i < n; i += step) {
    const float h = load_h(x, res, base + i);
    if (res_out) res_out[base + i] = h;
    store_out(out, out_bf16, base + i, (h / denom) * (offset + w[i]));
  }
}

// out = x / sqrt(mean(x^2) + eps) * w * silu(z), one warp per row. x, z, out: [rows, n]; w: [n].
extern "C" __global__ void gated_rms_norm_warp(const float* __restrict__ x, const float* __restrict__ z,
                                               const float* __restrict__ w, float* __restrict__ out, int rows,
                                               int n, float eps, int zh, i64 ldz) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  // z row `row` starts at (row / zh) * ldz + (row % zh) * n: zh rows of n per token, tokens ldz apart
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const i64 base = (i64)row * n;
  const float* zr = z + (i64)(row / zh) * ldz + (i64)(row % zh) * n;
  float xv[RW_CACHE], zv[RW_CACHE], wv[RW_CACHE];  // all loads first (see load_row)
#pragma unroll
  for (int j = 0; j < RW_CACHE; ++j) {
    const int i = lane + 32 * j;
    xv[j] = i < n ? x[base + i] : 0.0f;
    zv[j] = i < n ? zr[i] : 0.0f;
    wv[j] = i < n ? w[i] : 0.0f;
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < RW_CACHE; ++j) ss += xv[j] * xv[j];
  for (int i = lane + 32 * RW_CACHE; i < n; i += 32) ss += x[base + i] * x[base + i];
  const float denom = sqrtf(warp_sum(ss) / (float)n + eps);
#pragma unroll
  for (int j = 0; j < RW_CACHE; ++j)
    if (lane + 32 * j < n) out[base + lane + 32 * j] = (xv[j] / denom) * wv[j] * silu_f(zv[j]);
  for (int i = lane + 32 * RW_CACHE; i < n; i += 32)
    out[base + i] = (x[base + i] / denom) * w[i] * silu_f(zr[i]);
}

// ---- RoPE (rotate-half on the first `rot` dims) -------------------------------------------------------
// x, out: [T, H, D] float32 (out may alias x); cos, sin: [T, rot / 2]. Thread per (t, h, j), j < D - rot / 2:
// j < rot / 2 rotates the pair (j, j + rot / 2); larger j copies dim j + rot / 2 (the unrotated tail).
extern "C" __global__ void rope_table(const float* x, const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t, float* out, int T, int H, int D,
                                      int rot) {
  const int half = rot >> 1, per = D - half;
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (i64)T * H * per) return;
  const int j = (int)(idx % per);
  const i64 th = idx / per;  // t * H + h
  const int t = (int)(th / H);
  const float* xr = x + th * D;
  float* orow = out + th * D;
  if (j < half) {
    const float c = cos_t[(i64)t * half + j], s = sin_t[(i64)t * half + j];
    const float x1 = xr[j], x2 = xr[j + half];
    orow[j] = x1 * c - x2 * s;
    orow[j + half] = x2 * c + x1 * s;
  } else {
    orow[j + half] = xr[j + half];
  }
}

// As rope_table with cos/sin computed in the kernel: angle = float(pos) * inv_freq[j] (float32, as
// RotaryTable.cos_sin), times the attention factor. positions: [T] int64; inv_freq: [rot / 2].
extern "C" __global__ void rope_pos(const float* x, const i64* __restrict__ positions,
                                    const float* __restrict__ inv_freq, float* out, int T, int H, int D, int rot,
                                    float attn_factor) {
  const int half = rot >> 1, per = D - half;
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (i64)T * H * per) return;
  const int j = (int)(idx % per);
  const i64 th = idx / per;
  const int t = (int)(th / H);
  const float* xr = x + th * D;
  float* orow = out + th * D;
  if (j < half) {
    const float ang = (float)positions[t] * inv_freq[j];
    float c = cosf(ang), s = sinf(ang);
    if (attn_factor != 1.0f) {
      c *= attn_factor;
      s *= attn_factor;
    }
    const float x1 = xr[j], x2 = xr[j + half];
    orow[j] = x1 * c - x2 * s;
    orow[j + half] = x2 * c + x1 * s;
  } else {
    orow[j + half] = xr[j + half];
  }
}

// ---- per-head RMSNorm then RoPE of an attention layer's q and k (one launch) ------------------------------
// q_out = rope_table(rms_norm_warp(q, wq)), k_out = rope_table(rms_norm_warp(k, wk)), bit for bit: the norm
// is rms_norm_warp's (load_row, per-lane sums over lane + 32 j in j order, warp_sum, the same expressions) and
// the rotation rope_table's (the same expressions on the normed floats).
// q: [T, Hq, D] with row (t, h) at q + t * q_st + h * q_sh (elements; unit stride along D: a column view of a
// fused [query | gate] product works), k: [T, Hk, D] alike; wq, wk: [D]; cos, sin: [T, rot / 2];
// q_out, k_out: C-contiguous [T, Hq, D], [T, Hk, D]. One warp per (t, h) row, the T * Hq q rows first; a
// warp's normed row waits in shared memory for the rotation (rows pair dims j and j + rot / 2 across lanes).
// Dynamic shared memory: D floats per warp of the block.
extern "C" __global__ void qk_norm_rope(const float* __restrict__ q, const float* __restrict__ k,
                                        const float* __restrict__ wq, const float* __restrict__ wk,
                                        const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                        float* __restrict__ q_out, float* __restrict__ k_out, i64 q_st, i64 q_sh,
                                        i64 k_st, i64 k_sh, int T, int Hq, int Hk, int D, int rot, float eps,
                                        float offset) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  DYN_SMEM_DECL(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const i64 qrows = (i64)T * Hq, row = (i64)blockIdx.x * (blockDim.x >> 5) + warp;
  if (row >= qrows + (i64)T * Hk) return;  // whole warps leave together
  const bool is_q = row < qrows;
  const i64 r = is_q ? row : row - qrows;  // t * H + h
  const int H = is_q ? Hq : Hk;
  const i64 t = r / H, h = r - t * H;
  const float* x = is_q ? q + t * q_st + h * q_sh : k + t * k_st + h * k_sh;
  const float* w = is_q ? wq : wk;
  float* y = (float*)smem + warp * D;  // this warp's normed row
  float hv[RW_CACHE], wv[RW_CACHE];
  load_row<RW_CACHE>(x, nullptr, w, 0, D, lane, 32, hv, wv);
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < RW_CACHE; ++j) ss += hv[j] * hv[j];  // rms_norm_warp's order
  for (int i = lane + 32 * RW_CACHE; i < D; i += 32) {
    const float v = x[i];
    ss += v * v;
  }
  const float denom = sqrtf(warp_sum(ss) / (float)D + eps);
#pragma unroll
  for (int j = 0; j < RW_CACHE; ++j) {
    const int i = lane + 32 * j;
    if (i < D) y[i] = (hv[j] / denom) * (offset + wv[j]);
  }
  for (int i = lane + 32 * RW_CACHE; i < D; i += 32) y[i] = (x[i] / denom) * (offset + w[i]);
  __syncwarp();
  const int half = rot >> 1;
  const float* cr = cos_t + t * half;
  const float* sr = sin_t + t * half;
  float* o = (is_q ? q_out : k_out) + r * D;
  for (int j = lane; j < half; j += 32) {  // rope_table's pair (j, j + half)
    const float c = cr[j], s = sr[j];
    const float x1 = y[j], x2 = y[j + half];
    o[j] = x1 * c - x2 * s;
    o[j + half] = x2 * c + x1 * s;
  }
  for (int i = rot + lane; i < D; i += 32) o[i] = y[i];  // the unrotated tail
}

// ---- elementwise -----------------------------------------------------------------------------------------
// out = silu(gate) * up; out = sigmoid(x); out = x * sigmoid(gate). All [n] float32.
extern "C" __global__ void silu_mul(const float* __restrict__ gate, const float* __restrict__ up,
                                    float* __restrict__ out, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    out[i] = silu_f(gate[i]) * up[i];
}

// out [rows, n] = silu(y[:, :n]) * y[:, n:] for y [rows, 2n]: the fused gate|up product's halves.
extern "C" __global__ void silu_mul_halves(const float* __restrict__ y, void* __restrict__ out, i64 rows, int n,
                                           int out_bf16) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < rows * n; i += (i64)gridDim.x * blockDim.x) {
    const i64 r = i / n, j = i - r * n;
    store_out(out, out_bf16, i, silu_f(y[r * 2 * n + j]) * y[r * 2 * n + n + j]);
  }
}

// silu_mul_halves for widths n that are multiples of 4 (prefill-sized rows): 4 consecutive columns a thread, one
// 16-byte load of each half and one 8- or 16-byte store, the same arithmetic per element. Grid (ceil(n / 1024),
// up to 65535 blocks over rows, striding), 256 threads.
extern "C" __global__ void silu_mul_halves4(const float* __restrict__ y, void* __restrict__ out, i64 rows, int n,
                                            int out_bf16) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  const int j = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
  if (j >= n) return;
  for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
    const float4 a = *(const float4*)(y + r * 2 * n + j), b = *(const float4*)(y + r * 2 * n + n + j);
    const float v0 = silu_f(a.x) * b.x, v1 = silu_f(a.y) * b.y, v2 = silu_f(a.z) * b.z, v3 = silu_f(a.w) * b.w;
    if (out_bf16) {
      uint2 w;
      w.x = (u32)f32_to_bf16(v0) | ((u32)f32_to_bf16(v1) << 16);
      w.y = (u32)f32_to_bf16(v2) | ((u32)f32_to_bf16(v3) << 16);
      *(uint2*)((u16*)out + r * n + j) = w;
    } else {
      *(float4*)((float*)out + r * n + j) = make_float4(v0, v1, v2, v3);
    }
  }
}

extern "C" __global__ void sigmoid_f32(const float* __restrict__ x, float* __restrict__ out, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    out[i] = sigmoid_f(x[i]);
}

extern "C" __global__ void sigmoid_mul(const float* __restrict__ x, const float* __restrict__ gate,
                                       float* __restrict__ out, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    out[i] = x[i] * sigmoid_f(gate[i]);
}

// out = x * sigmoid(gate) with strided gate rows, bit for bit sigmoid_f32 followed by a CuPy multiply (the same
// sigmoid_f, then mul_as_cupy; sigmoid_mul's plain multiply keeps subnormals). x, out: C-contiguous [T, H, D];
// gate element (t, h, j) at gate + t * g_st + h * g_sh + j (the gate half of a fused [query | gate] product).
// Grid-stride over elements.
extern "C" __global__ void sigmoid_mul_rows(const float* __restrict__ x, const float* __restrict__ gate,
                                            void* __restrict__ out, i64 g_st, i64 g_sh, int T, int H, int D,
                                            int out_bf16) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  const i64 n = (i64)T * H * D;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const i64 th = i / D, t = th / H;
    store_out(out, out_bf16, i, mul_as_cupy(x[i], sigmoid_f(gate[t * g_st + (th - t * H) * g_sh + (i - th * D)])));
  }
}

// float32 -> bf16 bits (round to nearest even) and back.
extern "C" __global__ void f32_to_bf16_bits(const float* __restrict__ x, u16* __restrict__ out, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void bf16_bits_to_f32(const u16* __restrict__ x, float* __restrict__ out, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    out[i] = bf16_to_f32(x[i]);
}

// out[t, :] = float(table[ids[t], :]); table: [V, H] bf16 bits, ids: [T] int64, out: [T, H] float32.
extern "C" __global__ void embed_bf16(const u16* __restrict__ table, const i64* __restrict__ ids,
                                      float* __restrict__ out, int T, int H) {
  const i64 n = (i64)T * H;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const i64 t = i / H;
    out[i] = bf16_to_f32(table[ids[t] * H + (i - t * H)]);
  }
}

// ---- KV writes ---------------------------------------------------------------------------------------------
// x: [T, H, D] float32 new keys (or values), vector (t, h) at x + t * x_st + h * x_sh (elements; unit stride
// along D: a column view of a fused q|k|v product works); slots: [T] int64 flat page slots (page * page_size +
// offset; negative = skip). Vector (slot, h) is index slot * H + h of the layer's [pages, page_size, H, ...]
// parts.
template <int BITS>
__device__ __forceinline__ void kv_write_plain(const float* __restrict__ x, const i64* __restrict__ slots,
                                               void* __restrict__ codes, i64 x_st, i64 x_sh, int T, int H,
                                               int D) {
  const i64 n = (i64)T * H * D;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const i64 th = i / D;
    const int d = (int)(i - th * D);
    const i64 t = th / H, h = th - t * H;
    const i64 slot = slots[t];
    if (slot < 0) continue;
    const i64 dst = (slot * H + h) * D + d;
    const float v = x[t * x_st + h * x_sh + d];
    if (BITS == 32) ((float*)codes)[dst] = v;
    else ((u16*)codes)[dst] = f32_to_bf16(v);
  }
}

extern "C" __global__ void kv_write_f32(const float* x, const i64* slots, void* codes, u8* scales, i64 x_st,
                                        i64 x_sh, int T, int H, int D) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  kv_write_plain<32>(x, slots, codes, x_st, x_sh, T, H, D);
}

extern "C" __global__ void kv_write_bf16(const float* x, const i64* slots, void* codes, u8* scales, i64 x_st,
                                         i64 x_sh, int T, int H, int D) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  kv_write_plain<16>(x, slots, codes, x_st, x_sh, T, H, D);
}

// One warp per (t, h, 32-block): lane l quantises element 32 * b + l (zero beyond D), the block's amax and
// NaN/inf flag come from warp reductions, and lanes gather the packed bytes with shuffles.
template <int BITS>
__device__ __forceinline__ void kv_write_mx(const float* __restrict__ x, const i64* __restrict__ slots,
                                            u8* __restrict__ codes, u8* __restrict__ scales, i64 x_st, i64 x_sh,
                                            int T, int H, int D) {
  typedef KVElem<BITS> E;
  const int nb = kv_scale_stride(D);
  const i64 item = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (item >= (i64)T * H * nb) return;  // uniform per warp
  const int b = (int)(item % nb);
  const i64 th = item / nb, t = th / H, h = th - t * H;
  const i64 slot = slots[t];
  if (slot < 0) return;
  const int d = b * 32 + lane;
  const float v = d < D ? x[t * x_st + h * x_sh + d] : 0.0f;
  const bool bad = __any_sync(FULL_MASK, is_nonfinite(v));
  const float amax = warp_max(fabsf(v));
  const u32 sc = e8m0_select(amax, bad, MxElem<E::EB, E::MB>::EMAX);
  // x / 2^(sc - 127) is exact; a NaN scale zeroes the block's elements (blocks.divide_by_scale).
  const float q = bad ? 0.0f : v * pow2i(127 - (int)sc);
  const u32 code = mx_encode<E::EB, E::MB>(q);
  const i64 vi = slot * H + h;
  u8* row = codes + vi * kv_code_stride(BITS, D);
  if (BITS == 8) {
    row[d] = (u8)code;
  } else if (BITS == 4) {
    const u32 hi = __shfl_down_sync(FULL_MASK, code, 1);
    if ((lane & 1) == 0) row[b * 16 + (lane >> 1)] = (u8)(code | (hi << 4));
  } else {
    const u32 c1 = __shfl_down_sync(FULL_MASK, code, 1);
    const u32 c2 = __shfl_down_sync(FULL_MASK, code, 2);
    const u32 c3 = __shfl_down_sync(FULL_MASK, code, 3);
    if ((lane & 3) == 0) {
      const u32 w = code | (c1 << 6) | (c2 << 12) | (c3 << 18);
      u8* g = row + b * 24 + (lane >> 2) * 3;
      g[0] = (u8)(w & 0xffu);
      g[1] = (u8)((w >> 8) & 0xffu);
      g[2] = (u8)(w >> 16);
    }
  }
  if (lane == 0) scales[vi * nb + b] = (u8)sc;
}

extern "C" __global__ void kv_write_mx8(const float* x, const i64* slots, u8* codes, u8* scales, i64 x_st,
                                        i64 x_sh, int T, int H, int D) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  kv_write_mx<8>(x, slots, codes, scales, x_st, x_sh, T, H, D);
}
extern "C" __global__ void kv_write_mx6(const float* x, const i64* slots, u8* codes, u8* scales, i64 x_st,
                                        i64 x_sh, int T, int H, int D) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  kv_write_mx<6>(x, slots, codes, scales, x_st, x_sh, T, H, D);
}
extern "C" __global__ void kv_write_mx4(const float* x, const i64* slots, u8* codes, u8* scales, i64 x_st,
                                        i64 x_sh, int T, int H, int D) {
  pdl_begin();  // overlapped launch (pdl.cuh)
  kv_write_mx<4>(x, slots, codes, scales, x_st, x_sh, T, H, D);
}

// ---- weight dequantisation (QuantTensor -> float32 / bf16 rows) ------------------------------------------
// codes: [R, Kp * bits / 8] uint8; scales: [R, Kp / BLOCK] uint8 (E8M0, or E4M3 with a float32 tensor scale
// for NVFP4); out: [R, K]. MX: x = elem * 2^(s - 127) (exact); NVFP4: x = fl32(elem * e4m3(s)) * ts.
template <int EB, int MB, int BLOCK, bool NV, bool BF16_OUT>
__device__ __forceinline__ void dequant_rows(const u8* __restrict__ codes, const u8* __restrict__ scales,
                                             float ts, void* __restrict__ out, i64 R, int K) {
  constexpr int BITS = 1 + EB + MB;
  const int kp = (K + BLOCK - 1) / BLOCK * BLOCK, nb = kp / BLOCK, cb = kp * BITS / 8;
  const i64 n = R * K;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const i64 r = i / K;
    const int k = (int)(i - r * K);
    const float e = mx_decode<EB, MB>(load_code<BITS>(codes + r * cb, k));
    const u32 s = scales[r * nb + k / BLOCK];
    const float v = NV ? (e * mx_decode<4, 3>(s)) * ts : e * e8m0_value(s);
    if (BF16_OUT) ((u16*)out)[i] = f32_to_bf16(v);
    else ((float*)out)[i] = v;
  }
}

#define DEQUANT_ENTRY(NAME, EB, MB, BLOCK, NV)                                                           \
  extern "C" __global__ void dequant_##NAME##_f32(const u8* c, const u8* s, float ts, void* o, i64 R,     \
                                                  int K) {                                                \
    dequant_rows<EB, MB, BLOCK, NV, false>(c, s, ts, o, R, K);                                            \
  }                                                                                                       \
  extern "C" __global__ void dequant_##NAME##_bf16(const u8* c, const u8* s, float ts, void* o, i64 R,    \
                                                   int K) {                                               \
    dequant_rows<EB, MB, BLOCK, NV, true>(c, s, ts, o, R, K);                                             \
  }

DEQUANT_ENTRY(mxfp8, 4, 3, 32, false)
DEQUANT_ENTRY(mxfp8_e5m2, 5, 2, 32, false)
DEQUANT_ENTRY(mxfp6, 2, 3, 32, false)
DEQUANT_ENTRY(mxfp6_e3m2, 3, 2, 32, false)
DEQUANT_ENTRY(mxfp4, 2, 1, 32, false)
DEQUANT_ENTRY(nvfp4, 2, 1, 16, true)

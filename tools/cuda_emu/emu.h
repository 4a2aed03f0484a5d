// Host emulation of the CUDA execution model for testing kernels on a CPU (fibers per thread, one block at a time).
#pragma once
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <initializer_list>
#include <vector>
using std::fabs;
using std::min;
using std::max;
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) int2 { int x, y; };
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }
namespace emu {
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
struct Fiber;
extern Fiber* cur;
extern Dim3 g_block_idx, g_block_dim, g_grid_dim;
extern unsigned char* dyn_smem;
extern long dyn_smem_bytes;  // the launch's dynamic shared memory size
const Dim3& tid();
int lane();
void sync_block();
void sync_warp();
unsigned long long* warp_buf();
void sync_warpgroup();
unsigned long long* warpgroup_buf();  // 256 words: 2 a thread of the warpgroup
bool lane_alive(int l);
void yield();  // let the other threads (of every resident block) run before this one goes on
void reg_shared(void* p, size_t bytes);  // a static __shared__ variable (once is enough; again is a no-op)
}
#define threadIdx (emu::tid())
#define blockIdx (emu::g_block_idx)
#define blockDim (emu::g_block_dim)
#define gridDim (emu::g_grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
// static __shared__ arrays: static variables, each registered as its declaration is passed (ptx_lower.py
// `register_static_shared`), so that emu.cpp can swap their bytes between resident blocks (each its own)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define DYN_SMEM_DECL(name) unsigned char* name = emu::dyn_smem
inline void __syncthreads() { emu::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::sync_warp(); }
inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __expf(float x) { return expf(x); }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }  // the default mode: nearest even
// the low / high 32 bits of the 64-bit hi:lo shifted by (shift & 31), as CUDA's funnel shifts (wrap mode)
inline unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int shift) {
  return (unsigned int)((((unsigned long long)hi << 32) | lo) >> (shift & 31)); }
inline unsigned int __funnelshift_l(unsigned int lo, unsigned int hi, unsigned int shift) {
  return (unsigned int)(((((unsigned long long)hi << 32) | lo) << (shift & 31)) >> 32); }
template <class T> T emu_shfl(T v, int src) {
  unsigned long long* buf = emu::warp_buf();
  int l = emu::lane();
  unsigned long long bits = 0; memcpy(&bits, &v, sizeof(T)); buf[l] = bits;
  emu::sync_warp();
  T r; unsigned long long b2 = buf[src & 31]; memcpy(&r, &b2, sizeof(T));
  if (!emu::lane_alive(src & 31)) { fprintf(stderr, "EMU: shuffle from exited lane %d\n", src & 31); abort(); }
  emu::sync_warp();
  return r;
}
template <class T> T __shfl_sync(unsigned, T v, int src, int = 32) { return emu_shfl(v, src); }
template <class T> T __shfl_xor_sync(unsigned, T v, int m, int = 32) { return emu_shfl(v, emu::lane() ^ m); }
template <class T> T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
  int s = emu::lane() + (int)d; return emu_shfl(v, s < 32 ? s : emu::lane()); }
template <class T> T __shfl_up_sync(unsigned, T v, unsigned d, int = 32) {
  int s = emu::lane() - (int)d; return emu_shfl(v, s >= 0 ? s : emu::lane()); }
inline int __any_sync(unsigned, int p) {
  unsigned long long* buf = emu::warp_buf(); int l = emu::lane(); buf[l] = p ? 1 : 0; emu::sync_warp();
  int r = 0; for (int i = 0; i < 32; i++) if (emu::lane_alive(i) && buf[i]) r = 1; emu::sync_warp(); return r; }
inline int __all_sync(unsigned, int p) { return !__any_sync(0xffffffffu, !p); }
inline unsigned __ballot_sync(unsigned, int p) {
  unsigned long long* buf = emu::warp_buf(); int l = emu::lane(); buf[l] = p ? 1 : 0; emu::sync_warp();
  unsigned r = 0; for (int i = 0; i < 32; i++) if (emu::lane_alive(i) && buf[i]) r |= 1u << i; emu::sync_warp(); return r; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
// redux.sync: the warp's maximum / minimum of an unsigned value (every lane gets it)
inline unsigned emu_redux(unsigned v, bool max) {
  unsigned long long* buf = emu::warp_buf(); int l = emu::lane(); buf[l] = v; emu::sync_warp();
  unsigned r = max ? 0u : 0xFFFFFFFFu;
  for (int i = 0; i < 32; i++)
    if (emu::lane_alive(i)) r = max ? (r > (unsigned)buf[i] ? r : (unsigned)buf[i]) : (r < (unsigned)buf[i] ? r : (unsigned)buf[i]);
  emu::sync_warp(); return r; }
inline unsigned __reduce_max_sync(unsigned, unsigned v) { return emu_redux(v, true); }
inline unsigned __reduce_min_sync(unsigned, unsigned v) { return emu_redux(v, false); }
// __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of the 8-byte value y:x (no sign mode)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; i++) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
// CUDA intrinsics the kernels use beyond the above. Blocks run one at a time and their threads cooperatively,
// so atomics are plain read-modify-writes and fences are no-ops.
template <class T> T __ldg(const T* p) { return *p; }
inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
inline float atomicAdd(float* p, float v) { float o = *p; *p = o + v; return o; }
inline unsigned atomicXor(unsigned* p, unsigned v) { unsigned o = *p; *p = o ^ v; return o; }
inline unsigned atomicExch(unsigned* p, unsigned v) { unsigned o = *p; *p = v; return o; }
template <class T> T atomicMin(T* p, T v) { T o = *p; if (v < o) *p = v; return o; }
template <class T> T atomicMax(T* p, T v) { T o = *p; if (v > o) *p = v; return o; }
inline double __longlong_as_double(long long u) { double d; memcpy(&d, &u, 8); return d; }
inline long long __double_as_longlong(double d) { long long u; memcpy(&u, &d, 8); return u; }
inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
inline double __dsub_rn(double a, double b) { volatile double r = a - b; return r; }
inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
inline double __ddiv_rn(double a, double b) { volatile double r = a / b; return r; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline void __threadfence() {}
// A count of calls, not time (only differences mean anything); each call yields, so that a loop that spins on
// another block's progress with a clock64 timeout lets that block run (emu_launch's `resident` blocks).
inline long long clock64() { static long long t = 0; emu::yield(); return ++t; }
inline void __nanosleep(unsigned) { emu::yield(); }
inline unsigned __vminu2(unsigned a, unsigned b) {
  unsigned lo = std::min(a & 0xffffu, b & 0xffffu), hi = std::min(a >> 16, b >> 16);
  return lo | (hi << 16);
}

// Inline PTX, lowered by ptx_lower.py to these calls (operands in the asm statement's order, outputs first).
namespace emu_ptx {
typedef unsigned int u32;
typedef unsigned short u16;
template <class... A> inline void nop(A...) {}  // launch control, cp.async groups (copies complete at once)
[[noreturn]] inline void unsupported(const char* insn) {
  fprintf(stderr, "EMU: inline PTX '%s' has no emulation (tools/cuda_emu/emu.h)\n", insn);
  abort();
}
inline float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }
inline u16 f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN (quiet)
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
  return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline void ld_v4(u32& x, u32& y, u32& z, u32& w, const void* p) {
  const u32* q = (const u32*)p; x = q[0]; y = q[1]; z = q[2]; w = q[3];
}
inline void st_v4(void* p, u32 x, u32 y, u32 z, u32 w) { u32* q = (u32*)p; q[0] = x; q[1] = y; q[2] = z; q[3] = w; }
inline void ld_f32(float& v, const float* p) { v = *(const volatile float*)p; }
inline void atom_add_s32(int& r, int* p, int v) { r = atomicAdd(p, v); }  // blocks run one at a time
inline void ld_u32(unsigned& v, const unsigned* p) { v = *(const volatile unsigned*)p; }
inline void red_add_u32(unsigned* p, unsigned v) { *p += v; }  // threads run one at a time: no other writer meanwhile
inline void cvt_f32_f16(float& f, u16 h) { _Float16 x; memcpy(&x, &h, 2); f = (float)x; }
inline void cvt_rn_f16_f32(u16& h, float f) { _Float16 x = (_Float16)f; memcpy(&h, &x, 2); }
inline void cvt_rn_bf16_f32(u16& h, float f) { h = f32_to_bf16(f); }
inline void cvt_rn_bf16x2_f32(u32& r, float hi, float lo) { r = (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16); }
// Exact here (the kernels multiply bf16 values whose float product is exact and add -0): one rounding to bf16.
inline void fma_rn_bf16x2(u32& d, u32 a, u32 b, u32 c) {
  u16 r[2];
  for (int i = 0; i < 2; i++)
    r[i] = f32_to_bf16(std::fma(bf16_to_f32((u16)(a >> 16 * i)), bf16_to_f32((u16)(b >> 16 * i)),
                                bf16_to_f32((u16)(c >> 16 * i))));
  d = (u32)r[0] | ((u32)r[1] << 16);
}
inline void mul_rn_ftz_f32(float& d, float a, float b) {
  auto ftz = [](float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.f, v) : v; };
  d = ftz(ftz(a) * ftz(b));
}
// The 64 bits of every lane of the warp (all lanes take part, as .aligned PTX requires).
inline void warp_gather(unsigned long long v, unsigned long long (&all)[32]) {
  unsigned long long* buf = emu::warp_buf();
  buf[emu::lane()] = v;
  emu::sync_warp();
  for (int l = 0; l < 32; l++) {
    if (!emu::lane_alive(l)) { fprintf(stderr, "EMU: warp collective (mma / ldmatrix) with exited lane %d\n", l); abort(); }
    all[l] = buf[l];
  }
  emu::sync_warp();
}
// mma.sync m16n8k16, row-major A (16 x 16 bf16), column-major B (16 x 8 bf16), float32 C = D. Lane (g, t) =
// (lane / 4, lane % 4) holds a0 = A[g][2t, 2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..],
// b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g] (low half first) and d = D[g][2t], D[g][2t+1], D[g+8][2t],
// D[g+8][2t+1]. Sums in k order in float32 (the products of bf16 values are exact).
inline void mma_m16n8k16_bf16(float& d0, float& d1, float& d2, float& d3, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                              u32 b1) {
  unsigned long long A01[32], A23[32], B01[32];
  warp_gather(a0 | ((unsigned long long)a1 << 32), A01);
  warp_gather(a2 | ((unsigned long long)a3 << 32), A23);
  warp_gather(b0 | ((unsigned long long)b1 << 32), B01);
  auto a_at = [&](int r, int k) {  // A[r][k]
    const int src = 4 * (r % 8) + (k % 8) / 2, reg = (r >= 8) + 2 * (k >= 8);
    const unsigned long long v = reg < 2 ? A01[src] : A23[src];
    return bf16_to_f32((u16)(v >> (32 * (reg & 1) + 16 * (k & 1))));
  };
  auto b_at = [&](int k, int n) {  // B[k][n]
    const unsigned long long v = B01[4 * n + (k % 8) / 2];
    return bf16_to_f32((u16)(v >> (32 * (k >= 8) + 16 * (k & 1))));
  };
  const int g = emu::lane() / 4, t = emu::lane() % 4;
  float* d[4] = {&d0, &d1, &d2, &d3};
  for (int q = 0; q < 4; q++) {
    const int r = g + 8 * (q >> 1), n = 2 * t + (q & 1);
    float s = *d[q];
    for (int k = 0; k < 16; k++) s += a_at(r, k) * b_at(k, n);
    *d[q] = s;
  }
}
// Shared-memory addresses (32-bit, as __cvta_generic_to_shared gives them): offsets into the launch's dynamic
// shared memory, or, bit 31 set, window (bits 23-30) and offset (bits 0-22) of a static __shared__ array
// (emulated as a static variable: static_smem_windows, below).
inline std::vector<unsigned char*>& static_smem_windows();
inline unsigned char* smem_at(u32 a) {
  if (!(a >> 31)) return emu::dyn_smem + a;
  const std::vector<unsigned char*>& w = static_smem_windows();
  if (((a >> 23) & 0xFFu) >= w.size()) { fprintf(stderr, "EMU: shared address %#x in no window\n", a); abort(); }
  return w[(a >> 23) & 0xFFu] + (a & 0x7FFFFFu);
}
inline void ld_shared_v4(u32& x, u32& y, u32& z, u32& w, u32 a) { ld_v4(x, y, z, w, smem_at(a)); }
inline void ld_shared_v2(u32& x, u32& y, u32 a) { memcpy(&x, smem_at(a), 4); memcpy(&y, smem_at(a) + 4, 4); }
inline void ld_shared_u32(u32& v, u32 a) { memcpy(&v, smem_at(a), 4); }
inline void ld_shared_u8(u32& v, u32 a) { v = *smem_at(a); }
// cp.async of the template's size (16 for .cg): src_bytes copied, the rest zero-filled, at once.
inline void cp_async(const char* tmpl, u32 dst, const void* src, u32 src_bytes) {
  const char* c = tmpl;
  for (int commas = 0; *c && commas < 2; c++) commas += *c == ',';
  const int size = atoi(c);
  if (size != 4 && size != 8 && size != 16) unsupported(tmpl);
  const u32 n = src_bytes < (u32)size ? src_bytes : (u32)size;
  memcpy(smem_at(dst), src, n);
  memset(smem_at(dst) + n, 0, size - n);
}
// ldmatrix m8n8 x4 (b16): lane l gives the address of row l % 8 of matrix l / 8; lane (g, t) receives of
// matrix j the elements (g, 2t), (g, 2t+1), or transposed (2t, g), (2t+1, g).
inline void ldmatrix_x4_impl(u32& r0, u32& r1, u32& r2, u32& r3, u32 a, bool trans) {
  unsigned long long rows[32];
  warp_gather(a, rows);
  const int g = emu::lane() / 4, t = emu::lane() % 4;
  u32* r[4] = {&r0, &r1, &r2, &r3};
  auto at = [&](int j, int row, int col) { u16 v; memcpy(&v, smem_at((u32)rows[8 * j + row]) + 2 * col, 2); return v; };
  for (int j = 0; j < 4; j++)
    *r[j] = trans ? (u32)at(j, 2 * t, g) | ((u32)at(j, 2 * t + 1, g) << 16)
                  : (u32)at(j, g, 2 * t) | ((u32)at(j, g, 2 * t + 1) << 16);
}
inline void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 a) { ldmatrix_x4_impl(r0, r1, r2, r3, a, false); }
inline void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, u32 a) { ldmatrix_x4_impl(r0, r1, r2, r3, a, true); }
// wgmma.mma_async m64nNk16 bf16 -> f32 (decapybara/kernels/wgmma.cuh), run at issue: the kernels leave its operands
// alone until wgmma.wait_group, so the asynchronous read gives the same values. `tmpl` is the asm text (N, and A from
// registers or a descriptor); `d` the thread's N / 2 accumulators; `in` the inputs: A's descriptor or its 4
// registers (mma.sync m16n8k16 A fragments), B's descriptor, scale-d (0: D = A B), in that order. A descriptor:
// start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), swizzle
// (62-63: 0 none, 1 128-byte). Element addresses follow the canonical layouts: K-major (A; B unless transposed)
// (row, k) at start + (row / 8) SBO + (k / 8) LBO + 16 (row % 8) + 2 (k % 8), or swizzled start + (row / 8) SBO +
// 128 (row % 8) + 2 k; MN-major (B transposed) (k, n) at start + (k / 8) LBO + (n / 8) SBO + 16 (k % 8) + 2 (n % 8),
// or swizzled start + (n / 64) LBO + (k / 8) SBO + 128 (k % 8) + 2 (n % 64); a swizzled address has its bits 4-6
// XORed with bits 7-9. Sums in k order in float32 onto the accumulator (the products of bf16 values are exact).
inline u32 wg_addr(unsigned long long desc, int row, int k, bool mn_major) {
  const u32 start = (u32)(desc & 0x3FFFu) << 4, lbo = (u32)((desc >> 16) & 0x3FFFu) << 4;
  const u32 sbo = (u32)((desc >> 32) & 0x3FFFu) << 4, swz = (u32)(desc >> 62);
  if (swz != 0 && swz != 1) unsupported("wgmma descriptor swizzle other than none / 128-byte");
  u32 a;
  if (!mn_major) a = swz ? start + (row / 8) * sbo + 128 * (row % 8) + 2 * k
                         : start + (row / 8) * sbo + (k / 8) * lbo + 16 * (row % 8) + 2 * (k % 8);
  else a = swz ? start + (row / 64) * lbo + (k / 8) * sbo + 128 * (k % 8) + 2 * (row % 64)
               : start + (k / 8) * lbo + (row / 8) * sbo + 16 * (k % 8) + 2 * (row % 8);
  return swz ? a ^ (((a >> 7) & 7u) << 4) : a;
}
inline float wg_bf16_at(u32 a) { u16 v; memcpy(&v, smem_at(a), 2); return bf16_to_f32(v); }
inline void wgmma(const char* tmpl, std::initializer_list<float*> d, std::initializer_list<unsigned long long> in) {
  const char* shape = strstr(tmpl, "m64n");
  if (!shape || !strstr(tmpl, ".f32.bf16.bf16")) unsupported(tmpl);
  const int n = atoi(shape + 4), lane = emu::lane(), w = (int)(threadIdx.x / 32) % 4;
  if ((int)d.size() != n / 2) unsupported(tmpl);
  const bool a_regs = in.size() == 6;  // 4 A registers, B's descriptor, scale-d (else A's descriptor, B's, scale-d)
  // the immediates after "p, ": scale-a, scale-b[, trans-a], trans-b
  const char* imm = strstr(strstr(tmpl, "wgmma.mma_async"), ", p, ");
  int vals[4] = {0, 0, 0, 0}, nv = 0;
  for (const char* c = imm ? imm + 5 : ""; *c && nv < 4; c++)
    if (*c >= '0' && *c <= '9') vals[nv++] = *c - '0';
  const bool trans_b = nv ? vals[nv - 1] != 0 : false;
  if ((a_regs ? nv != 3 : nv != 4) || vals[0] != 1 || vals[1] != 1 || (!a_regs && vals[2] != 0)) unsupported(tmpl);
  const unsigned long long* v = in.begin();
  const unsigned long long b_desc = a_regs ? v[4] : v[1];
  const int accumulate = (int)(a_regs ? v[5] : v[2]);
  u32 areg[4][32 * 4];  // a_regs: every thread's 4 A registers, by warp of the warpgroup and lane
  if (a_regs) {
    unsigned long long* buf = emu::warpgroup_buf();
    const int t = 32 * w + lane;
    buf[2 * t] = v[0] | (v[1] << 32);
    buf[2 * t + 1] = v[2] | (v[3] << 32);
    emu::sync_warpgroup();
    for (int i = 0; i < 128; i++)
      for (int r = 0; r < 4; r++) areg[r][i] = (u32)(buf[2 * i + r / 2] >> (32 * (r % 2)));
    emu::sync_warpgroup();
  }
  auto a_at = [&](int m, int k) {  // A[m][k], m in the warpgroup's 64 rows
    if (!a_regs) return wg_bf16_at(wg_addr(v[0], m, k, false));
    const int src = 32 * (m / 16) + 4 * (m % 8) + (k % 8) / 2, reg = (m % 16 >= 8) + 2 * (k >= 8);
    return bf16_to_f32((u16)(areg[reg][src] >> (16 * (k & 1))));
  };
  const int g = lane / 4, t = lane % 4;
  int q = 0;
  for (float* acc : d) {
    const int i = q / 4, e = q % 4, m = 16 * w + g + 8 * (e >> 1), col = 8 * i + 2 * t + (e & 1);
    float s = accumulate ? *acc : 0.f;
    for (int k = 0; k < 16; k++)
      s += a_at(m, k) * wg_bf16_at(trans_b ? wg_addr(b_desc, col, k, true) : wg_addr(b_desc, col, k, false));
    *acc = s;
    q++;
  }
}
// float -> E4M3 (bias 7, max 448, no infinities), round to nearest even, saturated to +-448; NaN -> 0x7F.
inline unsigned e4m3_satfinite(float f) {
  const unsigned sign = std::signbit(f) ? 0x80u : 0u;
  if (std::isnan(f)) return 0x7Fu;
  const double a = std::fabs((double)f);
  unsigned best = 0;
  double best_err = a;  // code 0 (zero)
  for (unsigned c = 1; c <= 0x7E; c++) {
    const unsigned e = c >> 3, m = c & 7u;
    const double v = e ? std::ldexp(1.0 + m / 8.0, (int)e - 7) : std::ldexp(m / 8.0, -6);
    const double err = std::fabs(v - a);
    if (err < best_err || (err == best_err && (c & 1u) == 0)) { best = c; best_err = err; }
  }
  return sign | best;
}
inline void cvt_rn_satfinite_e4m3x2_f32(u16& d, float hi, float lo) {
  d = (u16)(e4m3_satfinite(lo) | (e4m3_satfinite(hi) << 8));
}
}  // namespace emu_ptx
// Windows of 8 MB, each starting 4 MB below the first address seen in it, over the static __shared__ arrays.
inline std::vector<unsigned char*>& emu_ptx::static_smem_windows() {
  static std::vector<unsigned char*> w;
  return w;
}
inline unsigned long long __cvta_generic_to_shared(const void* p) {
  unsigned char* const c = (unsigned char*)p;
  const long long off = c - emu::dyn_smem;
  if (emu::dyn_smem && off >= 0 && off <= emu::dyn_smem_bytes) return (unsigned long long)off;
  std::vector<unsigned char*>& w = emu_ptx::static_smem_windows();
  for (size_t i = 0; i < w.size(); i++)
    if (c >= w[i] && c - w[i] < (1LL << 23)) return 0x80000000ull | (i << 23) | (unsigned long long)(c - w[i]);
  if (w.size() == 256) { fprintf(stderr, "EMU: too many static shared-memory windows\n"); abort(); }
  w.push_back(c - (1LL << 22));
  return 0x80000000ull | ((w.size() - 1) << 23) | (1ull << 22);
}

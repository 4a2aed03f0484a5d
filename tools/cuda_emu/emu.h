// Host emulation of the CUDA execution model for testing kernels on a CPU (fibers per thread, one block at a time).
#pragma once
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
using std::fabs;
using std::min;
using std::max;
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
namespace emu {
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
struct Fiber;
extern Fiber* cur;
extern Dim3 g_block_idx, g_block_dim, g_grid_dim;
extern unsigned char* dyn_smem;
const Dim3& tid();
int lane();
void sync_block();
void sync_warp();
unsigned long long* warp_buf();
bool lane_alive(int l);
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
#define __shared__ static
#define __align__(n) alignas(n)
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
// __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of the 8-byte value y:x (no sign mode)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; i++) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}

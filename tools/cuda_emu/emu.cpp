#include "emu.h"
#include <ucontext.h>
#include <vector>
#include <ffi.h>
// Fiber switches. glibc's swapcontext / getcontext save and restore the signal mask, a system call at every switch
// (every barrier and warp collective of every emulated thread): on x86-64 a switch is instead emu_switch below,
// which saves the callee-saved registers, MXCSR and the x87 control word on the old stack and resumes the other;
// elsewhere ucontext stays.
#if defined(__x86_64__)
#define EMU_FAST_SWITCH 1
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch, .-emu_switch
)");
#else
#define EMU_FAST_SWITCH 0
#endif
namespace emu {
struct Fiber { ucontext_t ctx; void* sp; Dim3 t; int lane, warp, state, kind; };  // state 0 run 1 wait 2 done; kind 0
                                                                                  // block 1 warp 2 warpgroup (wgmma)
Fiber* cur = nullptr;
Dim3 g_block_idx, g_block_dim, g_grid_dim;
unsigned char* dyn_smem = nullptr;
long dyn_smem_bytes = 0;
static ucontext_t sched_ctx;
static void* sched_sp = nullptr;
static std::vector<Fiber> fibers;
static std::vector<char> stacks;
static std::vector<unsigned long long> wbuf, wgbuf;
static const size_t STACK = 256 * 1024;
static ffi_cif* g_cif; static void* g_fn; static void** g_vals;
const Dim3& tid() { return cur->t; }
int lane() { return cur->lane; }
unsigned long long* warp_buf() { return &wbuf[cur->warp * 32]; }
unsigned long long* warpgroup_buf() { return &wgbuf[(cur->warp / 4) * 256]; }
bool lane_alive(int l) { size_t i = cur->warp * 32 + l; return i < fibers.size() && fibers[i].state != 2; }
static void to_scheduler() {
#if EMU_FAST_SWITCH
  emu_switch(&cur->sp, sched_sp);
#else
  swapcontext(&cur->ctx, &sched_ctx);
#endif
}
static void wait(int kind) { cur->state = 1; cur->kind = kind; to_scheduler(); }
void sync_block() { wait(0); }
void sync_warp() { wait(1); }
void sync_warpgroup() { wait(2); }
// A fiber's whole life: the kernel for its thread, then back to the scheduler for good (never resumed after).
static void entry() { ffi_arg ret; ffi_call(g_cif, FFI_FN(g_fn), &ret, g_vals); cur->state = 2; to_scheduler(); }
static void start_fiber(Fiber& f, char* stack) {
  f.state = 0;
#if EMU_FAST_SWITCH
  // The stack's top as emu_switch leaves one: the control words, six zeroed registers, then entry as the return
  // address at a 16-byte boundary (so that entry starts with the stack alignment of a call) and a null above it.
  unsigned* top = (unsigned*)(((uintptr_t)(stack + STACK) & ~(uintptr_t)15) - 16);
  void** frame = (void**)top - 7;  // [control words][r15 r14 r13 r12 rbx rbp][return address] [null]
  unsigned csr, cw = 0;
  asm volatile("stmxcsr %0" : "=m"(csr));
  asm volatile("fnstcw %0" : "=m"(cw));
  ((unsigned*)frame)[0] = csr; ((unsigned*)frame)[1] = cw & 0xFFFF;
  for (int r = 1; r <= 6; r++) frame[r] = nullptr;
  ((void**)top)[0] = (void*)&entry;  // at top: 16-byte aligned; the slot above it (the fake caller's) is null
  ((void**)top)[1] = nullptr;
  f.sp = frame;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = stack; f.ctx.uc_stack.ss_size = STACK; f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, entry, 0);
#endif
}
static void resume(Fiber& f) {
  cur = &f;
#if EMU_FAST_SWITCH
  emu_switch(&sched_sp, f.sp);
#else
  swapcontext(&sched_ctx, &f.ctx);
#endif
}
static void run_block(int n) {
  for (int i = 0; i < n; i++) start_fiber(fibers[i], &stacks[i * STACK]);
  for (;;) {
    for (int i = 0; i < n; i++) if (fibers[i].state == 0) resume(fibers[i]);
    bool all_done = true; for (int i = 0; i < n; i++) if (fibers[i].state != 2) all_done = false;
    if (all_done) return;
    bool released = false;
    int nw = (n + 31) / 32;
    for (int w = 0; w < nw; w++) {
      bool any = false, all = true;
      for (int i = w * 32; i < std::min(n, w * 32 + 32); i++) {
        if (fibers[i].state == 2) continue;
        any = true; if (!(fibers[i].state == 1 && fibers[i].kind == 1)) all = false;
      }
      if (any && all) { released = true; for (int i = w * 32; i < std::min(n, w * 32 + 32); i++) if (fibers[i].state == 1) fibers[i].state = 0; }
    }
    for (int w = 0; w < (n + 127) / 128; w++) {  // warpgroups: every live thread of the 4 warps at the collective
      bool any = false, all = true;
      for (int i = w * 128; i < std::min(n, w * 128 + 128); i++) {
        if (fibers[i].state == 2) continue;
        any = true; if (!(fibers[i].state == 1 && fibers[i].kind == 2)) all = false;
      }
      if (any && all) { released = true; for (int i = w * 128; i < std::min(n, w * 128 + 128); i++) if (fibers[i].state == 1) fibers[i].state = 0; }
    }
    if (released) continue;
    bool all_block = true;
    for (int i = 0; i < n; i++) if (fibers[i].state == 1 && fibers[i].kind != 0) all_block = false;
    if (all_block) { for (int i = 0; i < n; i++) if (fibers[i].state == 1) fibers[i].state = 0; continue; }
    fprintf(stderr, "EMU DEADLOCK in block (%u,%u,%u): divergent barrier/shuffle\n", g_block_idx.x, g_block_idx.y, g_block_idx.z);
    for (int i = 0; i < n; i++) fprintf(stderr, " t%d s%d k%d", i, fibers[i].state, fibers[i].kind);
    fprintf(stderr, "\n"); abort();
  }
}
}  // namespace emu
extern "C" int emu_launch(void* fn, int nargs, const int* types, void** vals, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, long smem) {
  using namespace emu;
  std::vector<ffi_type*> at(nargs);
  for (int i = 0; i < nargs; i++) at[i] = types[i] == 0 ? &ffi_type_pointer : types[i] == 1 ? &ffi_type_sint32 :
      types[i] == 2 ? &ffi_type_sint64 : types[i] == 3 ? &ffi_type_float : &ffi_type_double;
  ffi_cif cif;
  if (ffi_prep_cif(&cif, FFI_DEFAULT_ABI, nargs, &ffi_type_void, at.data()) != FFI_OK) return -1;
  g_cif = &cif; g_fn = fn; g_vals = vals;
  int n = bx * by * bz;
  fibers.assign(n, Fiber());
  if (stacks.size() < (size_t)n * STACK) stacks.resize((size_t)n * STACK);
  wbuf.assign(((n + 31) / 32) * 32, 0);
  wgbuf.assign(((n + 127) / 128) * 256, 0);
  std::vector<unsigned char> smem_buf(smem > 0 ? smem + 64 : 64);
  unsigned char* aligned = (unsigned char*)(((uintptr_t)smem_buf.data() + 15) & ~(uintptr_t)15);
  // poison dynamic shared memory
  memset(smem_buf.data(), 0xFF, smem_buf.size());
  dyn_smem = aligned;
  dyn_smem_bytes = smem > 0 ? smem : 0;
  g_grid_dim.x = gx; g_grid_dim.y = gy; g_grid_dim.z = gz; g_block_dim.x = bx; g_block_dim.y = by; g_block_dim.z = bz;
  for (unsigned z = 0; z < gz; z++) for (unsigned y = 0; y < gy; y++) for (unsigned x = 0; x < gx; x++) {
    g_block_idx.x = x; g_block_idx.y = y; g_block_idx.z = z;
    for (int i = 0; i < n; i++) {
      Fiber& f = fibers[i];
      f.t.x = i % bx; f.t.y = (i / bx) % by; f.t.z = i / (bx * by); f.lane = i % 32; f.warp = i / 32;
    }
    run_block(n);
  }
  return 0;
}

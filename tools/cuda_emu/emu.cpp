#include "emu.h"
#include <sys/mman.h>
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
struct Fiber { ucontext_t ctx; void* sp; Dim3 t; int lane, warp, state, kind, slot; };  // state 0 run 1 wait 2 done;
                                                                                        // kind 0 block 1 warp 2
                                                                                        // warpgroup (wgmma)
Fiber* cur = nullptr;
Dim3 g_block_idx, g_block_dim, g_grid_dim;
unsigned char* dyn_smem = nullptr;
long dyn_smem_bytes = 0;
static ucontext_t sched_ctx;
static void* sched_sp = nullptr;
static std::vector<Fiber> fibers;
// The fibers' stacks, STACK bytes each: anonymous memory mapped as needed, so pages no fiber touches cost nothing
// (a launch of many resident blocks maps hundreds of MB of stack)
static char* stacks = nullptr;
static size_t stacks_bytes = 0;
static std::vector<unsigned long long> wbuf, wgbuf;
static const size_t STACK = 256 * 1024;
static ffi_cif* g_cif; static void* g_fn; static void** g_vals;
// Resident blocks: slot k runs block slot_block[k] (its fibers [k * g_pad, k * g_pad + g_n)) on its own dynamic
// and static shared memory; one slot unless the launch asks for more (emu_launch's `resident`).
static int g_n = 0, g_pad = 0, cur_slot = -1;
static std::vector<Dim3> slot_block;
static std::vector<unsigned char*> slot_smem;
// The module's static __shared__ variables, as their declarations register them (reg_shared): with more than one
// slot, slot_static[k][i] keeps slot k's bytes of variable i while another slot's threads run, swapped in as its
// threads resume; a variable registered mid-launch starts every slot from the bytes it has then.
struct Region { unsigned char* p; size_t n; };
static std::vector<Region> regions;
static std::vector<std::vector<std::vector<unsigned char>>> slot_static;
void reg_shared(void* p, size_t bytes) {
  for (const Region& r : regions) if (r.p == p) return;
  regions.push_back({(unsigned char*)p, bytes});
  for (auto& copies : slot_static) copies.emplace_back((unsigned char*)p, (unsigned char*)p + bytes);
}
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
void yield() { to_scheduler(); }  // stays runnable: the scheduler resumes it after the others have run
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
  if (f.slot != cur_slot) {
    if (!slot_static.empty())
      for (size_t i = 0; i < regions.size(); i++) {
        if (cur_slot >= 0) memcpy(slot_static[cur_slot][i].data(), regions[i].p, regions[i].n);
        memcpy(regions[i].p, slot_static[f.slot][i].data(), regions[i].n);
      }
    cur_slot = f.slot; g_block_idx = slot_block[f.slot]; dyn_smem = slot_smem[f.slot];
  }
  cur = &f;
#if EMU_FAST_SWITCH
  emu_switch(&sched_sp, f.sp);
#else
  swapcontext(&sched_ctx, &f.ctx);
#endif
}
// Fibers [b, e) in groups of `size` (from b): a group whose live threads all wait at a collective of `kind` is
// made runnable. Whether any was.
static bool release_groups(int b, int e, int size, int kind) {
  bool released = false;
  for (int w = b; w < e; w += size) {
    bool any = false, all = true;
    for (int i = w; i < std::min(e, w + size); i++) {
      if (fibers[i].state == 2) continue;
      any = true; if (!(fibers[i].state == 1 && fibers[i].kind == kind)) all = false;
    }
    if (any && all) { released = true; for (int i = w; i < std::min(e, w + size); i++) if (fibers[i].state == 1) fibers[i].state = 0; }
  }
  return released;
}
// The threads of slot k's block go on while any can: each runnable one runs until it waits, yields or ends; then
// the warps (kind 1) and warpgroups (kind 2) whose live threads all wait at a collective go on, and the block's
// barrier (kind 0) once no thread runs and every waiting one waits there. Returns 1 if any thread of the block was
// made runnable, 0 if none could be, 2 if the block has ended.
static int release(int k) {
  const int b = k * g_pad, e = b + g_n;
  bool all_done = true, running = false;
  for (int i = b; i < e; i++) { all_done &= fibers[i].state == 2; running |= fibers[i].state == 0; }
  if (all_done) return 2;
  // warps and warpgroups (every live thread of the 4 warps) all of whose live threads wait at their collective go
  // on, runnable threads elsewhere in the block or not
  const bool released = release_groups(b, e, 32, 1) | release_groups(b, e, 128, 2);
  if (released || running) return 1;
  bool all_block = true;
  for (int i = b; i < e; i++) if (fibers[i].state == 1 && fibers[i].kind != 0) all_block = false;
  if (all_block) { for (int i = b; i < e; i++) if (fibers[i].state == 1) fibers[i].state = 0; return 1; }
  return 0;
}
static void deadlock(int k) {
  const Dim3 bi = slot_block[k];
  fprintf(stderr, "EMU DEADLOCK in block (%u,%u,%u): divergent barrier/shuffle\n", bi.x, bi.y, bi.z);
  for (int i = k * g_pad; i < k * g_pad + g_n; i++) fprintf(stderr, " t%d s%d k%d", i - k * g_pad, fibers[i].state, fibers[i].kind);
  fprintf(stderr, "\n"); abort();
}
// Slot k's block starts: its threads' fibers from their entries.
static void start_block(int k, Dim3 bi) {
  slot_block[k] = bi;
  if (cur_slot == k) g_block_idx = bi;
  for (int j = 0; j < g_n; j++) {
    Fiber& f = fibers[k * g_pad + j];
    f.t.x = j % g_block_dim.x; f.t.y = (j / g_block_dim.x) % g_block_dim.y; f.t.z = j / (g_block_dim.x * g_block_dim.y);
    f.lane = j % 32; f.warp = (k * g_pad + j) / 32; f.slot = k;
    start_fiber(f, &stacks[(size_t)(k * g_pad + j) * STACK]);
  }
}
// Every block of the grid, `slots` at a time side by side (the next block of the grid, x fastest, taking a slot
// as its block ends): with one slot, one block at a time as before.
static void run_grid(int slots) {
  const unsigned total = g_grid_dim.x * g_grid_dim.y * g_grid_dim.z;
  auto block_of = [](unsigned i) { Dim3 d; d.x = i % g_grid_dim.x; d.y = (i / g_grid_dim.x) % g_grid_dim.y; d.z = i / (g_grid_dim.x * g_grid_dim.y); return d; };
  unsigned next = 0;
  std::vector<int> live(slots, 0);
  for (int k = 0; k < slots && next < total; k++) { start_block(k, block_of(next++)); live[k] = 1; }
  for (;;) {
    for (int k = 0; k < slots; k++)
      if (live[k]) for (int i = k * g_pad; i < k * g_pad + g_n; i++) if (fibers[i].state == 0) resume(fibers[i]);
    bool any_live = false, progress = false;
    for (int k = 0; k < slots; k++) {
      if (!live[k]) continue;
      int r = release(k);
      if (r == 2) {
        live[k] = 0;
        if (next < total) { start_block(k, block_of(next++)); live[k] = 1; r = 1; }
      }
      any_live |= live[k] != 0;
      progress |= r == 1;
    }
    if (!any_live) return;
    if (!progress) for (int k = 0; k < slots; k++) if (live[k]) deadlock(k);
  }
}
}  // namespace emu
// `resident`: blocks run side by side (1: one at a time), so that blocks that wait on one another (a persistent
// kernel's counters, spun on with a yield: clock64) can; each slot has dynamic shared memory of its own.
extern "C" int emu_launch(void* fn, int nargs, const int* types, void** vals, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, long smem, int resident) {
  using namespace emu;
  std::vector<ffi_type*> at(nargs);
  for (int i = 0; i < nargs; i++) at[i] = types[i] == 0 ? &ffi_type_pointer : types[i] == 1 ? &ffi_type_sint32 :
      types[i] == 2 ? &ffi_type_sint64 : types[i] == 3 ? &ffi_type_float : &ffi_type_double;
  ffi_cif cif;
  if (ffi_prep_cif(&cif, FFI_DEFAULT_ABI, nargs, &ffi_type_void, at.data()) != FFI_OK) return -1;
  g_cif = &cif; g_fn = fn; g_vals = vals;
  const unsigned total = gx * gy * gz;
  const int slots = (int)std::max(1u, std::min((unsigned)std::max(resident, 1), total));
  g_n = bx * by * bz;
  g_pad = slots == 1 ? g_n : (g_n + 127) / 128 * 128;  // each slot's warps and warpgroups whole
  const int nf = slots * g_pad;
  fibers.assign(nf, Fiber());
  for (Fiber& f : fibers) f.state = 2;  // a slot's padding: threads that have ended
  if (stacks_bytes < (size_t)nf * STACK) {  // no fiber of an earlier launch is alive: its stack may go
    if (stacks) munmap(stacks, stacks_bytes);
    stacks_bytes = (size_t)nf * STACK;
    void* m = mmap(nullptr, stacks_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) { fprintf(stderr, "EMU: cannot map %zu bytes of fiber stacks\n", stacks_bytes); abort(); }
    stacks = (char*)m;
  }
  wbuf.assign(((nf + 31) / 32) * 32, 0);
  wgbuf.assign(((nf + 127) / 128) * 256, 0);
  const size_t per = (size_t)(smem > 0 ? smem + 64 : 64);
  std::vector<unsigned char> smem_buf(per * slots);
  // poison dynamic shared memory
  memset(smem_buf.data(), 0xFF, smem_buf.size());
  slot_block.assign(slots, Dim3());
  slot_smem.assign(slots, nullptr);
  for (int k = 0; k < slots; k++) slot_smem[k] = (unsigned char*)(((uintptr_t)(smem_buf.data() + k * per) + 15) & ~(uintptr_t)15);
  dyn_smem = slot_smem[0];
  dyn_smem_bytes = smem > 0 ? smem : 0;
  cur_slot = -1;
  slot_static.clear();
  if (slots > 1) {  // each slot starts from the bytes the variables have now
    slot_static.resize(slots);
    for (auto& copies : slot_static)
      for (const Region& r : regions) copies.emplace_back(r.p, r.p + r.n);
  }
  g_grid_dim.x = gx; g_grid_dim.y = gy; g_grid_dim.z = gz; g_block_dim.x = bx; g_block_dim.y = by; g_block_dim.z = bz;
  run_grid(slots);
  return 0;
}

"""The host CUDA emulator (tools/cuda_emu): inline PTX lowered to emulator calls, headers inlined, and the skinny
GEMM's GPU tests run on it end to end (where g++ and libffi are installed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tools" / "cuda_emu"
sys.path.insert(0, str(EMU))
from ptx_lower import inline_includes, lower_asm, lower_dynamic_shared, register_static_shared


def test_lowering_keeps_operand_order_outputs_first():
    src = '''void f() {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(f(b, c)));
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p + 4));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
}'''
    out = lower_asm(src)
    assert "asm" not in out
    assert "emu_ptx::mma_m16n8k16_bf16(d[0], d[1], d[2], d[3], a0, a1, a2, a3, b.x, f(b, c));" in out
    assert "emu_ptx::ld_f32(v, p + 4);" in out
    assert "emu_ptx::cvt_rn_bf16x2_f32(r, hi, lo);" in out


def test_copies_whose_size_is_a_literal_take_the_instruction_text():
    out = lower_asm('asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(n));')
    assert out == 'emu_ptx::cp_async("cp.async.ca.shared.global [%0], [%1], 8, %2;", dst, src, n);'


def test_unknown_instruction_aborts_when_reached_and_operandless_ones_lower():
    out = lower_asm('asm volatile("griddepcontrol.wait;" ::: "memory");\nasm("prefetch.global.L1 [%0];" :: "l"(p));')
    assert 'emu_ptx::nop();' in out
    assert 'emu_ptx::unsupported("prefetch.global.L1");' in out


def test_dynamic_shared_memory_becomes_the_launch_buffer():
    out = lower_dynamic_shared("    extern __shared__ int sh[];  // counts\n    extern __shared__ __align__(16) unsigned char buf[];")
    assert "int* sh = (int*)emu::dyn_smem;" in out
    assert "unsigned char* buf = (unsigned char*)emu::dyn_smem;" in out


def test_static_shared_declarations_register_each_name():
    """Function-scope `__shared__` declarations get one emu::reg_shared a name (so that resident blocks each have
    their bytes); file-scope ones, comments, strings and `extern` (dynamic) ones are left alone."""
    src = ('__shared__ int filescope[4];\n'
           'template <int N> __device__ void f() {\n'
           '    __shared__ __align__(16) u16 xs[A ? 8 : B * C];\n'
           '    __shared__ float nden[NF], sqp[W * NF];  // { brace\n'
           '    // __shared__ int commented;\n'
           '    const char* s = "{ __shared__ int q; ";\n'
           '    extern __shared__ __align__(16) u16 dyn[];\n'
           '    __shared__ int last_flag;\n'
           '}\n')
    out = register_static_shared(src)
    assert out.count("emu::reg_shared") == 4
    for name in ("xs", "nden", "sqp", "last_flag"):
        assert f"emu::reg_shared(&{name}, sizeof({name}));" in out
    assert out.startswith("__shared__ int filescope[4];\ntemplate")
    assert "// __shared__ int commented;\n" in out and 'int q; ";\n' in out


def test_headers_inlined_once_without_pragma(tmp_path):
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("#pragma once\nint b;\n")
    out = inline_includes('#include "a.cuh"\n#include "b.cuh"\n#include <cstdio>\nint c;\n', [str(tmp_path)])
    assert out.count("int b;") == 1 and out.count("int a;") == 1 and "#include <cstdio>" in out
    assert "pragma once" not in out


def test_every_kernel_file_lowers_to_known_handlers_or_named_aborts():
    for cu in sorted((ROOT / "decapybara" / "kernels").glob("*.cu")):
        out = lower_asm(inline_includes(cu.read_text(), [str(ROOT / "decapybara" / "kernels")]))
        assert "asm(" not in out.replace(" ", "") and "asmvolatile(" not in out.replace(" ", ""), cu.name


def _emulator_toolchain() -> bool:
    if shutil.which("g++") is None:
        return False
    probe = subprocess.run(["g++", "-x", "c++", "-E", "-"], input="#include <ffi.h>\n", capture_output=True,
                           text=True, check=False)
    return probe.returncode == 0


@dataclass(frozen=True)
class EmuRun:
    """One `pytest -m gpu files -k cases` through the emulator plugin, in a process of its own."""

    files: tuple[str, ...]
    cases: str
    strided: bool = True  # CUDA_EMU_STRIDED: blocks' threads stepped in strides (the faster schedule)
    timeout: int = 1200
    device: str = "h200"  # CUDA_EMU_DEVICE: the GPU the fake CuPy reports (fake_cupy.DEVICE_PROFILES)

    def run(self, live: set, stopping: threading.Event) -> tuple[int, str, str]:
        """(exit status, stdout, stderr); the process is in `live` while it runs (so that it can be killed), and
        killed at once where `stopping` is set."""
        env = {**os.environ, "PYTHONPATH": str(EMU), "OMP_NUM_THREADS": "1", "CUDA_EMU_DEVICE": self.device,
               **({"CUDA_EMU_STRIDED": "1"} if self.strided else {})}
        t0 = time.monotonic()
        proc = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "pytest", "-q", "-p", "emu_plugin", "-p",
                                 "no:cacheprovider", "-m", "gpu", *self.files, "-k", self.cases], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        lowest_autogroup(proc.pid)
        live.add(proc)
        if stopping.is_set():  # stopped while this process started: `Runs.stop` may not have seen it in `live`
            kill(proc)
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            kill(proc)
            out, err = proc.communicate()
            err += f"\ntimed out after {self.timeout} s"
        finally:
            live.discard(proc)
        print(f"emulator run {self.files} -k {self.cases[:60]!r}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
        return proc.returncode, out, err


def lowest_autogroup(pid: int) -> None:
    """Where the kernel groups processes by session for its scheduler (autogroups), a process' nice value counts
    only against its own session's: the run's session (`start_new_session`) is set to the lowest priority too, so
    that the suite's Ray processes, in sessions of their own, keep the CPU they ask for."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("19")
    except OSError:
        pass


def kill(proc: subprocess.Popen) -> None:
    """Kill a run's whole session (its kernel builds too)."""
    try:
        os.killpg(proc.pid, 9)
    except OSError:
        proc.kill()


PREFILL_EMU_CASES = ("(prefill_attention_tensor_cores and (4/4-heads6-tile0-1-8-2-0 or 4/4-heads6-tile0-0-8-2-0 or "
                     "4/4-heads6-tile0-1-8-3-0 or 4/4-heads6-tile0-1-8-3-1 or 16/16-heads2-tile0-1-8-3-1)) "
                     "or (prefill_attention_dequant_pages and 4/4) or (mixed_step_decode_rows and 16/16) "
                     "or shared_operands or register_a_transposed_b")
SNAPSHOT_CASES = ("(deltanet_core_matches_reference and dims0 and double) or "
                  "(fused_is_bit_identical and dims0-double-64-None) or (fused_is_bit_identical and dims0-double-64-3) "
                  "or (fused_is_bit_identical and dims0-float-32-2-True) "
                  "or (deltanet_chunked_matches_reference and dims0) or chunk_table_splits "
                  "or (prefill_fused_launches and dims1) or decode_plan_fills_one_wave "
                  "or (multi_row_runs and (dims0-float-None-None or dims0-double-16-3))")
MOE_EMU_CASES = ("(shared_expert_matches and bf16-1 and not 12) or (moe_matches and 1024-256-mxfp4-True-1 and not 12)"
                 " or (nan_and_infinite and 16-5) or (one_expert_more and mxfp4-12)"
                 " or (gate_up_in_one_launch and 1024-256-bf16-1 and not 12)"
                 " or (combine_with_residual and (slot-9000-1-9 or apart-2048-12-9))"
                 " or (normed_rows and (True-mxfp4-slot-3 or False-bf16-apart-8 or True-bf16-apart-9))"
                 " or (moe_blocks and mxfp4) or (kernels_of_few_rows and mxfp4-12)")
PIECEWISE = ("tests/gpu/test_piecewise.py", "tests/gpu/test_blas.py")

# Every emulator run, longest first (a fresh clone's minutes on the 2-core CI machine, kernel builds included), so
# that the runs, started side by side at collection (`start_early`) or as soon as the first of these tests asks,
# finish together.
RUNS: dict[str, EmuRun] = {
    "prefill": EmuRun(("tests/gpu/test_kernels_core.py", "tests/gpu/test_wgmma.py"), PREFILL_EMU_CASES),
    "piecewise_engine": EmuRun(("tests/gpu/test_engine_graphs.py",), "piecewise_tails_with_packed"),
    "piecewise_dense": EmuRun(PIECEWISE, "(eager_logits and mxfp4 and (qwen3_5_text or qwen3])) or kept or arena "
                                         "or outside or failed or captured or unbound or handle"),
    "moe": EmuRun(("tests/gpu/test_kernels_extra.py", "tests/gpu/test_fused_norm.py"), MOE_EMU_CASES),
    "decode_graphs": EmuRun(("tests/gpu/test_cuda_graph.py", "tests/gpu/test_engine_graphs.py",
                             "tests/gpu/test_cupy_model.py"),
                            "decode_graph_equals_eager or runs_prefill_eagerly or attention_splits "
                            "or moe_decode_graphs or fp32_moe or server_backend_with_packed "
                            "or (mtp_graph_equals_eager and None-None) or (one_pass_gives and 16/16) "
                            "or (several_drafts and paged_decode_attention]) or (near_its_table and None-None) "
                            "or prompt_logprobs_match or (conv_widths and 1])"),
    "piecewise_moe_slot": EmuRun(PIECEWISE, "eager_logits and mxfp4-qwen3_5_moe_text/slot]"),
    "piecewise_moe": EmuRun(PIECEWISE, "eager_logits and mxfp4-qwen3_5_moe_text]"),
    "bf16_prefill": EmuRun(("tests/gpu/test_dense_prefill.py",),
                           "dense_values_are or (change_no_logit and mxfp4-qwen3_5) or setting_is_checked"),
    "decode_attention": EmuRun(("tests/gpu/test_kernels_core.py", "tests/gpu/test_attention_fusions.py"),
                               "(test_decode_attention_microscaled_pages and 6/6-heads1-shape1) "
                               "or (gated_decode and contexts2) or backend_gates"),
    "small": EmuRun(("tests/gpu/test_gemv_small.py", "tests/gpu/test_chain_reads.py"),
                    "(small and not (unaligned and (8-8 or 4-2)) and not (normed and 4-2- and not 40-5128)) "
                    "or chain_reads"),
    "skinny": EmuRun(("tests/gpu/test_kernels_extra.py",),
                     "mx_linear_k_tail or bf16_x_staging_edges or early_refill_keeps_the_bytes_small "
                     "or one_row_blocks_of_their_own_width_keep_the_bytes_small or one_row_build_only "
                     "or (many_row_kernels_keep_the_bytes_small and mxfp4)", strided=False),
    "sampler": EmuRun(("tests/gpu/test_kernels_extra.py",), "cuda_sample or philox or guesses or canonical_orders"),
    "snapshots": EmuRun(("tests/gpu/test_kernels_core.py",), SNAPSHOT_CASES),
    "launch_caches": EmuRun(("tests/gpu/test_launch_cache.py",), "launch or tune or kernel or layout or dequantisation"),
    "product_chain": EmuRun(("tests/gpu/test_product_chain.py", "tests/gpu/test_chain_tails.py"), "chain"),
    "other_gpu": EmuRun(("tests/gpu/test_engine_graphs.py", "tests/gpu/test_dense_prefill.py"),
                        "server_backend_with_packed or dense_values_are", device="l40s"),
}


def uses_runs(*names: str):
    """Marks a test as reading these RUNS (the `emulator` fixture starts the selected tests' runs only)."""
    def mark(fn):
        fn.emu_runs = names
        return fn
    return mark


def emulator_jobs() -> int:
    """Emulator processes side by side: one a CPU this process may use (the runs are single-threaded), at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


class Runs:
    """The emulator runs named, `emulator_jobs()` at a time in RUNS' order, each process at the lowest CPU priority
    (nice 19: started beside the rest of the suite, they take only the CPU time it leaves idle). `result(name)`
    waits for one; `stop()` drops the runs not started and kills the running ones."""

    def __init__(self, names: set[str]) -> None:
        self.pool, self.live, self.stopping = ThreadPoolExecutor(max_workers=emulator_jobs()), set(), threading.Event()
        self.futures = {n: self.pool.submit(run.run, self.live, self.stopping) for n, run in RUNS.items() if n in names}

    def result(self, name: str) -> str:
        code, out, err = self.futures[name].result()
        assert code == 0, f"{name}: " + out[-3000:] + err[-2000:]
        return out

    def stop(self) -> None:
        self.stopping.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(self.live):
            kill(proc)
        self.pool.shutdown(wait=True)


EARLY: Runs | None = None  # the runs `start_early` started for this session (conftest.py)


def wanted_runs(items: list) -> set[str]:
    """The RUNS that `items`' tests of this module read (none where the toolchain is missing: they skip)."""
    if not _emulator_toolchain():
        return set()
    return {n for item in items if getattr(item, "module", None) is sys.modules[__name__]
            for n in getattr(getattr(item, "function", None), "emu_runs", ())}


def start_early(items: list) -> bool:
    """At collection (conftest.py, not in pytest-xdist workers): start the runs `items` will read, so that they
    run beside the rest of the suite, whose tests the caller puts before this module's. False where none."""
    global EARLY
    names = wanted_runs(items)
    if names and EARLY is None:
        EARLY = Runs(names)
    return bool(names)


def stop_early() -> None:
    global EARLY
    if EARLY is not None:
        EARLY.stop()
        EARLY = None


@pytest.fixture(scope="module")
def emulator(request):
    """name -> that run's stdout, asserting it exited 0: the runs `start_early` started, else those of every
    selected test of this module, started at once. A test waits for its own run. At the module's end (or an
    interrupted session's) runs not started are dropped and running ones killed. (Under pytest-xdist each worker
    given one of these tests would start every selected run: run this file in one process.)"""
    runs = EARLY if EARLY is not None else Runs(wanted_runs(request.session.items))
    yield runs.result
    if runs is EARLY:
        stop_early()
    else:
        runs.stop()


def passed(out: str) -> int:
    """The count of pytest's "N passed" in `out` (0 where none)."""
    m = re.search(r"\b(\d+) passed\b", out)
    return int(m.group(1)) if m else 0


needs_toolchain = pytest.mark.skipif(not _emulator_toolchain(), reason="the emulator needs g++ and libffi headers")


@needs_toolchain
@uses_runs("skinny")
def test_skinny_gemm_gpu_tests_pass_on_the_emulator(emulator):
    """The mx_gemv kernels (tensor-core MMAs, bf16x2 decode, split-K reduction, x fragments by shared-window
    addresses of static and dynamic shared memory) against the numpy reference: the K-tail GPU tests of every
    weight format, and the bf16 x staging (byte permutes, bf16x2 FMAs by 2^64) against float32 x of the same
    values, zeros, subnormals and overflow included; the early refill (TUNE `early`) against the plain loop, and
    the 4- and 8-n-tile kernels' staging rows, stages and block widths (TUNE `many_*`) against each other, and the
    one-row products' own block width (TUNE `row1_warps`) against the plain one's, byte for byte (bf16 and MXFP4;
    `many_*` and `row1_warps` MXFP4), and where one-row products take that width (`row1_fill`, `row1_vs_plain`): through the
    emulator plugin in a separate process."""
    out = emulator("skinny")
    assert passed(out) == 16, out[-3000:]


@needs_toolchain
@uses_runs("product_chain")
def test_product_chain_gpu_tests_pass_on_the_emulator(emulator):
    """A decode layer's run of one-row products (out and down with the residual and next norm fused, gate|up with
    SwiGLU, the next input product), recorded and run as one persistent launch (mx_gemv.cu MX_CHAIN) on blocks side
    by side, writes what the launches write byte for byte, twice (its counters zeroed): MXFP4 and NVFP4 on the
    one-row kernels, MXFP4 and bf16 at 2-5 rows on the plain ones, stream-K and K-split tile grids, with and
    without the L2 prefetch before its waits; and decode graphs of a tiny hybrid model over MXFP4 weights whose
    layer tails run as chains (decapybara/backend/chain_tails.py, one and three rows): the chained tails of a graph
    write the eager tails' bytes, and chained decode graphs the launched graphs' logits, KV pages and states (a tail
    of two builds a chain for each), a chain's timeout flag turning chains off, a tail with an op the recording does not keep staying launched:
    through the emulator plugin in a separate process."""
    out = emulator("product_chain")
    assert passed(out) == 14, out[-3000:]


@needs_toolchain
@uses_runs("decode_graphs")
def test_decode_graphs_pass_on_the_emulator(emulator):
    """Decode steps as CUDA graphs (the emulator's captures record launches and the numpy work on device arrays,
    fake_cupy `DevArray`, and replay both): replays equal eager steps in logits, KV pages and DeltaNet states over
    float32, bf16 and 6/4-bit pages (the tensor-core decode attention with empty key splits), prefill steps run
    eagerly, the attention's split counts, MoE models' graphs (bf16 and MXFP4 experts) capture and the fp32 mode's
    do not, the server's backend with MXFP4 weights generates the eager tokens through graphs, and the MTP head's
    pass and its KV-only pass through graphs of their own give the eager pass's guesses and KV pages, and a
    verification graph's attention in one launch gives its two launches' bytes, graphs of several drafts a sequence
    equal the eager forward, prompt logprobs on the device equal the numpy engine's, and a width-1 DeltaNet conv (no
    conv state: the kernels' windows of `KM1S`) gives the numpy logits and greedy tokens: cases of their GPU tests,
    through the emulator plugin in a separate process."""
    out = emulator("decode_graphs")
    assert passed(out) == 15, out[-3000:]


@uses_runs("other_gpu")
def test_a_gpu_before_hopper_with_less_shared_memory_serves_on_the_emulator(emulator):
    """On what an L40S reports (sm_89, 99 KB of shared memory a block, 142 SMs): plain launches where Hopper's
    overlap, no sm_90a builds, every kernel's shared memory fitted to the device (the fake CuPy refuses more, as
    cudaFuncSetAttribute does), the products planned for its SMs; the server's backend with MXFP4 weights still
    generates the eager tokens through graphs, and the bf16 prefill path its logits. (The decode attention's launch
    shapes fitted to such a device: `test_decode_attention_tensor_cores` with CUDA_EMU_DEVICE=l40s, ~25-40 s a
    head_dim-256 case here, so not in CI.)"""
    out = emulator("other_gpu")
    assert passed(out) == 4, out[-3000:]


@needs_toolchain
@uses_runs("decode_attention")
def test_microscaled_decode_attention_gpu_test_passes_on_the_emulator(emulator):
    """The tensor-core decode attention over 6/6-bit pages (codes unpacked with funnel shifts, MMAs, the split-K
    reduce) against numpy: one case of its GPU test; and the output gate in its final items and attention_reduce
    against the attention then sigmoid_mul_rows, byte for byte (bf16 and 6/4-bit pages, float32 and bf16 out),
    and the backend's choice of the two: through the emulator plugin in a separate process."""
    out = emulator("decode_attention")
    assert passed(out) == 16, out[-3000:]


@needs_toolchain
@uses_runs("snapshots")
def test_deltanet_snapshots_pass_on_the_emulator(emulator):
    """The DeltaNet core's state snapshots (copied layer by layer into pinned host slabs by asynchronous copies,
    `cupy_deltanet._to_slab`) against the numpy reference's, and the fused decode's against the unfused kernels'
    byte for byte (one and three runs a CTA; the delta step on the state in registers and in shared memory); the
    chunked prefill kernels (tensor-core MMAs on hi/lo fragments, cp.async staging) against the reference and
    gdn_recurrent, and their chunk table: five cases of their GPU tests; and other forwards' fused conv / gates /
    q-k norm and conv state / gated norm launches against the separate ones, byte for byte, through the emulator
    plugin; the fused decode's launch plan (columns and runs a CTA by batch size, `decode_vcols` /
    `decode_runs_per_cta`, `decode_smem_state`); and its multi-row build (runs of up to four rows, a verification
    graph's plan) against the general path's launches, byte for byte."""
    out = emulator("snapshots")
    assert passed(out) == 15, out[-3000:]


@needs_toolchain
@uses_runs("prefill")
def test_prefill_attention_builds_pass_on_the_emulator(emulator):
    """The tensor-core prefill attention with 8-warp CTAs against numpy: its warpgroup-MMA build (two
    warpgroups, swizzled tiles; emu.h runs wgmma from the descriptors) with rings of two and three (K, V) pairs
    and the overlapped loop, its mma.sync build with a ring of two, over 4/4-bit and bf16 pages; 4/4-bit pages
    decoded into bf16 scratch pages first; a mixed step's decode rows through the decode kernel beside the chunks;
    and the wgmma building blocks' probes: cases of their GPU tests, through the emulator plugin."""
    out = emulator("prefill")
    assert passed(out) == 23, out[-3000:]


@needs_toolchain
@uses_runs("launch_caches")
def test_launch_caches_pass_on_the_emulator(emulator):
    """What eager launches keep between calls (launch recipes on the weights, the large products' dequantisation,
    TUNE's resolved tunings, kernel handles, the NULL argument) is reused while TUNE and the weight's arrays stay
    and rebuilt when they change, never copied with a weight, the products right throughout: its GPU test file,
    through the emulator plugin."""
    out = emulator("launch_caches")
    assert passed(out) == 8, out[-3000:]


@needs_toolchain
@uses_runs("bf16_prefill")
def test_bf16_prefill_weights_pass_on_the_emulator(emulator):
    """Prefill weights in bf16 (`prefill_weights=bf16`): the kept values are the dequantisation's bits, large
    products read them and give the same bytes, and a hybrid model's logits with them are the packed-only
    model's, byte for byte: cases of its GPU test file, through the emulator plugin."""
    out = emulator("bf16_prefill")
    assert passed(out) == 5, out[-3000:]


@needs_toolchain
@uses_runs("piecewise_dense", "piecewise_moe", "piecewise_moe_slot", "piecewise_engine")
def test_piecewise_graphs_pass_on_the_emulator(emulator):
    """Eager steps' layer tails as CUDA graphs (the emulator records a capture's launches, device copies and
    `blas` GEMMs and replays them): a forward with tails against the eager one over captures, replays and mixed
    steps (MoE models' layers too, the shared expert apart and in the stacks), cuBLAS products inside captured
    tails (bf16 values kept, buckets past DENSE_ROWS), the arena, a failed capture's eager fallback, cuBLAS handles
    bound before a capture, and the engine's greedy tokens with tails against the same engine without them (the
    device sampler included): cases of their GPU tests, through the emulator plugin, in four processes."""
    names = ("piecewise_dense", "piecewise_moe", "piecewise_moe_slot", "piecewise_engine")
    counts = {name: passed(emulator(name)) for name in names}
    assert counts == {"piecewise_dense": 11, "piecewise_moe": 1, "piecewise_moe_slot": 1, "piecewise_engine": 1}, \
        counts


@needs_toolchain
@uses_runs("sampler")
def test_device_sampler_passes_on_the_emulator(emulator):
    """decapybara/kernels/sample.cu against the numpy reference: random rows and logits at vocabularies of 7 to
    248,320 (the fallback's block-wide scan where a draw lies past the certified prefix), ties, masks, bf16 logits,
    the greedy short path, top-k rows that sort few tiles, buffers kept between calls of other shapes and threads,
    the fallback's canonical orders of several rows by two 1-D sorts and its scan over spans, each tile's first
    tokens by the warps' merges,
    Philox draws bit for bit, the MTP head's guesses against numpy's argmax and softmax maximum, and the sampling
    parameters' bounds."""
    out = emulator("sampler")
    assert passed(out) == 28, out[-3000:]


@needs_toolchain
@uses_runs("moe")
def test_moe_kernels_pass_on_the_emulator(emulator):
    """The device MoE against the numpy reference: routing and dispatch in one launch with the hit experts'
    group list, grouped products split over K, the shared expert added in the combine (a bf16 router and gate
    stacked), the experts' gate and up in one grouped SwiGLU launch and the shared expert as one expert more of
    the stacks, routing of NaN and infinite logits, the combine with the residual add and the next norm (a row
    past the kernel's cached columns, and twelve rows), the block over a fused norm's rows (the routing kernel's
    copy of their sums of squares, the grouped SwiGLU launch's division, MXFP4 models' decode against the numpy
    emulation of that rounding), grouped launches on the one-n-tile kernels at twelve rows, through the emulator
    plugin."""
    out = emulator("moe")
    assert passed(out) == 14, out[-3000:]


@needs_toolchain
@uses_runs("small")
def test_small_products_pass_on_the_emulator(emulator):
    """decapybara/kernels/gemv_small.cu (bf16 products of few weight rows: 16-row tiles on tensor cores, K split over a
    block's warps, weights loaded before the overlapped launch's wait, x unaligned or not, 17-32 rows of x in
    launches of 16) against numpy and the skinny GEMM, its limits, a fused norm's rows (the denominators in the
    skinny kernels' order): the GPU test
    file through the emulator plugin, most of its other block builds left to the GPU run (each build is a module
    the emulator compiles); and bench/chain_bound.cu's reads (every row of every product once, each launch kind
    and layout) and the persistent launch's waits (its blocks side by side: `fake_cupy.RESIDENT`)."""
    out = emulator("small")
    assert passed(out) == 142, out[-3000:]

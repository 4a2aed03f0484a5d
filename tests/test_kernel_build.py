"""decapybara/kernels/__init__.py's nvcc cache: processes that need the same cubin at once compile it once.

A fake `nvcc` (a shell script under a temporary CUDA_PATH) counts its compiles and takes a moment over each,
so that the builders overlap; no CUDA toolkit or device is needed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kernels_nvcc() -> str | None:
    """The CUDA toolkit's nvcc as the kernel loader finds it, or None."""
    sys.path.insert(0, str(ROOT))
    from decapybara import kernels
    return kernels._find_nvcc()

FAKE_NVCC = textwrap.dedent("""\
    #!/bin/sh
    if [ "$1" = "--version" ]; then echo "fake nvcc 0.0"; exit 0; fi
    out=""
    while [ $# -gt 0 ]; do
      if [ "$1" = "-o" ]; then out="$2"; shift; fi
      shift
    done
    echo compile >> "$FAKE_NVCC_LOG"
    echo + >> "$FAKE_NVCC_LOG.running"
    sleep "${FAKE_NVCC_SECONDS:-0.5}"
    echo - >> "$FAKE_NVCC_LOG.running"
    printf 'cubin' > "$out"
    """)

BUILD = textwrap.dedent("""\
    import sys
    from decapybara import kernels
    print(kernels._build_cubin("probe", ("--std=c++17", "-arch=sm_90", "-DVARIANT=" + sys.argv[1])))
    """)


def _env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    return {**os.environ, "CUDA_PATH": str(tmp_path / "cuda"), "DECAPYBARA_KERNEL_CACHE": str(tmp_path / "cache"),
            "FAKE_NVCC_LOG": str(tmp_path / "compiles.log"), "PYTHONPATH": str(ROOT)}


def _builders(env: dict[str, str], variants: list[str]) -> list[str]:
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, v], env=env, stdout=subprocess.PIPE, text=True)
             for v in variants]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return outs


def test_concurrent_builders_compile_a_cubin_once(tmp_path):
    env = _env(tmp_path)
    paths = _builders(env, ["1"] * 5)
    assert len(set(paths)) == 1 and Path(paths[0]).read_text() == "cubin"
    assert (tmp_path / "compiles.log").read_text().count("compile") == 1
    # a later builder finds the cubin; another variant is its own build
    assert _builders(env, ["1", "2"])[0] == paths[0]
    assert (tmp_path / "compiles.log").read_text().count("compile") == 2


def most_at_once(log: Path) -> int:
    """The most fake nvcc processes that ran at once, from their start (+) and end (-) lines in order."""
    running = most = 0
    for line in log.read_text().split():
        running += 1 if line == "+" else -1
        most = max(most, running)
    return most


@pytest.mark.parametrize("jobs", [1, 2])
def test_nvcc_processes_at_once_are_bounded(jobs, tmp_path):
    """DECAPYBARA_NVCC_JOBS bounds the nvcc processes of all the builders sharing a cache: six builders of six
    variants compile six cubins, at most `jobs` at a time (and that many do overlap: each compile takes 1.5 s, so
    that builders starting up to that far apart meet)."""
    env = {**_env(tmp_path), "DECAPYBARA_NVCC_JOBS": str(jobs), "FAKE_NVCC_SECONDS": "1.5"}
    paths = _builders(env, [str(v) for v in range(6)])
    assert len(set(paths)) == 6
    assert (tmp_path / "compiles.log").read_text().count("compile") == 6
    assert most_at_once(tmp_path / "compiles.log.running") == jobs


def test_line_info_is_its_own_build(tmp_path, monkeypatch):
    """$DECAPYBARA_KERNEL_LINEINFO adds -lineinfo to the nvcc options (nothing else changes), and a cubin built
    with it is cached apart from the one without."""
    from decapybara import kernels
    env = _env(tmp_path)
    for key in ("CUDA_PATH", "DECAPYBARA_KERNEL_CACHE", "FAKE_NVCC_LOG"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.delenv("DECAPYBARA_KERNEL_LINEINFO", raising=False)
    plain = kernels.nvcc_options("90", (("X", 1),))
    assert "-lineinfo" not in plain
    monkeypatch.setenv("DECAPYBARA_KERNEL_LINEINFO", "1")
    lined = kernels.nvcc_options("90", (("X", 1),))
    assert [o for o in lined if o != "-lineinfo"] == list(plain) and lined.count("-lineinfo") == 1
    monkeypatch.setenv("DECAPYBARA_KERNEL_LINEINFO", "")
    assert kernels.nvcc_options("90", (("X", 1),)) == plain
    paths = {kernels._build_cubin("probe", opts) for opts in (plain, lined, plain)}
    assert len(paths) == 2 and (tmp_path / "compiles.log").read_text().count("compile") == 2


def test_sm90a_builds_target_sm90a_only_on_hopper():
    """A build whose defines set SM90A targets sm_90a on Hopper; others, and other devices, their plain arch."""
    from decapybara import kernels
    assert "-arch=sm_90a" in kernels.nvcc_options("90", (("SM90A", 1),))
    assert "-arch=sm_90" in kernels.nvcc_options("90", (("SM90A", 0),))
    assert "-arch=sm_100" in kernels.nvcc_options("100", (("SM90A", 1),))
    assert kernels.needs_sm90a((("X", 1), ("SM90A", 1))) and not kernels.needs_sm90a((("X", 1),))


PREFILL_WG_BUILDS = [  # the wgmma prefill attention's builds: 27B (head_dim 256) and head_dim 128 shapes, ring of 2
    (("HEAD_DIM", 256), ("TC_BLOCK_N", 32), ("KBITS", 16), ("VBITS", 16), ("TC_STAGES", 2)),
    (("HEAD_DIM", 128), ("TC_BLOCK_N", 64), ("KBITS", 6), ("VBITS", 4), ("TC_STAGES", 2)),
    (("HEAD_DIM", 256), ("TC_BLOCK_N", 32), ("KBITS", 16), ("VBITS", 16), ("TC_STAGES", 3), ("TC_OVERLAP", 1)),
]


@pytest.mark.skipif(kernels_nvcc() is None, reason="needs the CUDA toolkit's nvcc")
@pytest.mark.parametrize("shape", PREFILL_WG_BUILDS, ids=["d256", "d128-6/4", "d256-overlap"])
def test_wgmma_prefill_builds_need_no_compiler_fences(shape, tmp_path):
    """ptxas inserts warpgroup fences or waits itself (C7519, C7517) or serialises wgmmas (C7520, C7514, C7515)
    where registers that a wgmma reads or accumulates are touched in its way; the prefill attention's wgmma builds
    (decapybara/kernels/wgmma.cuh's register rules), the overlapped loop among them, must need none of it."""
    from decapybara import kernels
    defines = (*shape, ("ROWS_PER_WARP", 16), ("PREFILL_TC", 1), ("TC_SPLIT", 1), ("PREFILL_WG", 1), ("SM90A", 1),
               ("TC_WARPS", 8))
    cmd = [kernels_nvcc(), *kernels.nvcc_options("90", defines), "-Xptxas", "-v", "-cubin",
           "-o", str(tmp_path / "a.cubin"), str(ROOT / "decapybara" / "kernels" / "attn_prefill.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not any(f"C75{n}" in res.stderr for n in (14, 15, 17, 19, 20)), res.stderr[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    assert spills and not any(int(n) for n in spills), res.stderr[-2000:]


@pytest.mark.skipif(kernels_nvcc() is None, reason="needs the CUDA toolkit's nvcc")
@pytest.mark.parametrize("head_dim,kv_bits", [(20, 16), (36, 4), (256, 6)])
def test_attention_file_builds_for_every_head_dim_it_promises(head_dim, kv_bits, tmp_path):
    """decapybara/kernels/attn_prefill.cu's general kernel and reduce take head_dim any multiple of 4 (KV pages of any
    format): the file builds there too, the tensor-core prefill's scratch decoder (head_dim a multiple of 8)
    left out where it does not apply."""
    from decapybara import kernels
    defines = (("HEAD_DIM", head_dim), ("KBITS", kv_bits), ("VBITS", kv_bits), ("ROWS_PER_WARP", 4))
    cmd = [kernels_nvcc(), *kernels.nvcc_options("90", defines), "-cubin", "-o", str(tmp_path / "a.cubin"),
           str(ROOT / "decapybara" / "kernels" / "attn_prefill.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.skipif(kernels_nvcc() is None, reason="needs the CUDA toolkit's nvcc")
@pytest.mark.parametrize("arch", ["80", "89"])
def test_activation_quantiser_builds_before_and_after_the_hardware_e4m3_conversion(arch, tmp_path):
    """decapybara/kernels/act_quant.cu converts to E4M3 with cvt.rn.satfinite.e4m3x2 from sm_89 on, and rounds in
    software before (Ampere, where ptxas rejects the conversion): it builds for both. That the two give the
    reference's bytes is tests/gpu/test_kernels_extra.py's `test_act_quant_bytes_equal_reference` (`soft`)."""
    from decapybara import kernels
    cmd = [kernels_nvcc(), *kernels.nvcc_options(arch, ()), "-cubin", "-o", str(tmp_path / "a.cubin"),
           str(ROOT / "decapybara" / "kernels" / "act_quant.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]

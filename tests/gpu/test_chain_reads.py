"""bench/chain_bound.cu (the reads bench/chain_bound.py times): every launch kind and layout reads each row of each
product once (the xor of what its blocks read against the buffers'), shared memory rows ahead and tails of fewer
than four rows included; the persistent launch's waits hold every block until all are done with the product before,
and its counters are zeroed after it. On the host emulator the persistent launches run with all their blocks
resident (`fake_cupy.RESIDENT`), as the bench runs them on the GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("chain_bound", ROOT / "bench" / "chain_bound.py")
chain_bound = sys.modules.setdefault("chain_bound", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(chain_bound)
EMULATED = "fake_cupy" in sys.modules
# (buffer key, bytes): rows 3, 5, 1, 8, 2, 13, 5 (the last a second read of the second buffer); a short last row
SIZES = [("a", 3 * 4096), ("b", 5 * 4096 - 16), ("c", 4096), ("d", 8 * 4096), ("e", 2 * 4096), ("f", 13 * 4096),
         ("b", 5 * 4096 - 16)]


@pytest.fixture(scope="module")
def chain():
    return chain_bound.Chain(cp, SIZES, sms=2)


@pytest.fixture
def resident(monkeypatch):
    """On the host emulator: `blocks` blocks of a launch run side by side (a GPU keeps a persistent grid resident)."""
    def set_to(blocks: int) -> None:
        if EMULATED:
            monkeypatch.setattr(sys.modules["fake_cupy"], "RESIDENT", blocks)
    return set_to


@pytest.mark.parametrize("spec", ["launch:c:1:0", "launch:c:2:3", "launch:i:3:2:8", "launch:i:1:20", "spare:c:2:3",
                                  "spare:i:3:0", "read:c:3:1", "read:i:1:5:3", "persist:c:1:0", "persist:c:2:3:5",
                                  "persist:i:4:2", "persist:c:3:16"])
def test_every_row_read_once(chain, resident, spec):
    """Grids of 2-8 blocks over products of 1-13 rows: blocks with no rows, shares shorter than `ahead`, the
    four-row loop's tail, the stand-in arithmetic (`work`); the persistent launch's waits held (`check`)."""
    v = chain_bound.Variant.parse(spec)
    if not v.launched:
        resident(2 * v.bps)
    assert chain.check(v) == []
    assert chain.check(v) == []  # again: the counters were zeroed for the next launch


@pytest.mark.parametrize("bps", [1, 2, 3, 8])
def test_launch_blocks_fill_their_sms(chain, bps):
    """A `launch` variant's blocks take an SM's shared memory between them (at least their rows ahead), so that no
    block of the next kernel fits beside them; a `spare` one's, their rows ahead alone."""
    attrs = cp.cuda.Device().attributes
    per_sm, reserved = attrs["MaxSharedMemoryPerMultiprocessor"], 1024
    smem = chain.smem(chain_bound.Variant.parse(f"launch:c:{bps}:1"))
    assert smem % 128 == 0 and bps * (smem + reserved) <= per_sm < (bps + 1) * (smem + reserved)
    assert smem <= attrs["MaxSharedMemoryPerBlockOptin"]
    assert chain.smem(chain_bound.Variant.parse(f"spare:c:{bps}:5")) == 5 * 4096
    assert chain.smem(chain_bound.Variant.parse(f"launch:c:{bps}:50")) == max(50 * 4096, smem)
    if not EMULATED:
        assert chain.resident(chain_bound.Variant.parse(f"launch:c:{bps}:1")) == bps


def test_a_changed_buffer_is_reported(chain):
    """The check can fail: a word of one buffer changed after its xor was taken shows in each product reading it."""
    buf = chain.bufs["b"]
    old = int(cp.asnumpy(buf[7]))
    buf[7] = np.uint32(old ^ 0x10)
    try:
        bad = chain.check(chain_bound.Variant.parse("read:c:2:1"))
    finally:
        buf[7] = np.uint32(old)
    assert [b.split(" (")[0] for b in bad] == ["product 1", "product 6"]
    assert chain.check(chain_bound.Variant.parse("read:c:2:1")) == []


def test_a_block_going_on_early_is_reported(chain, resident):
    """The waits' check can fail: without them (`read`), a block goes on to a product while others still read the
    one before, and the counts it saw say so (on the emulator always: its first block runs ahead of the second)."""
    resident(4)
    seen = []
    for kind in ("read", "persist"):
        chain.check(chain_bound.Variant.parse(f"{kind}:c:2:1"))
        seen.append(cp.asnumpy(chain.seen)[1:].tolist())
    assert seen[1] == [4] * (len(SIZES) - 1)
    if EMULATED:
        assert min(seen[0]) < 4


@pytest.mark.skipif(EMULATED, reason="a wait's timeout is ~2^32 clock64 calls on the emulator")
def test_persistent_waits_need_every_block():
    """A wait holds a block until every block of the grid is done with the product before: with more blocks than
    the device keeps resident (40 an SM), blocks of the first wave wait for blocks that cannot start, the wait
    times out and says so (the waits after it then return at once, so the launch ends). Without the waits the same
    grid reads every row once."""
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    c = chain_bound.Chain(cp, [("x", 4096 * sms * 40), ("y", 4096 * 8)], sms=sms)
    assert c.check(chain_bound.Variant.parse("read:c:40:0")) == []
    assert c.check(chain_bound.Variant.parse("persist:c:40:0")) == ["a wait timed out (blocks not all resident)"]
    assert c.check(chain_bound.Variant.parse("persist:c:2:0")) == []


@pytest.mark.skipif(EMULATED, reason="the emulator has no event timing and cannot run the persistent waits")
def test_measure_times_each_checked_variant(chain):
    """The bench's flow on a small chain: every variant checked, captured and timed (launches overlapped in a
    graph), one that cannot keep its blocks resident reported and left out."""
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    c = chain_bound.Chain(cp, SIZES, sms=sms)
    specs = ["launch:i:8:0", "spare:c:2:3", "persist:c:2:3:8", "read:i:8:0", "persist:c:9:0"]
    times, wrong = chain_bound.measure(c, [chain_bound.Variant.parse(s) for s in specs], rounds=3)
    assert list(times) == specs[:4] and all(len(ts) == 3 and min(ts) > 0 for ts in times.values())
    assert list(wrong) == ["persist:c:9:0"] and wrong["persist:c:9:0"][0].startswith("skipped: ")  # 9 x 256 threads: past an SM's 2,048

"""bench/chain_bound.cu (the reads bench/chain_bound.py times): every launch kind and layout reads each row of each
product once (the xor of what its blocks read against the buffers'), shared memory rows ahead and tails of fewer
than four rows included; the persistent launch's waits hold every block until all are done with the product before,
and its counters are zeroed after it. On the host emulator, whose blocks run one at a time, the persistent kind
runs without its waits (`read`) only."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
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


@pytest.mark.parametrize("spec", ["launch:c:1:0", "launch:c:2:3", "launch:i:3:2:8", "launch:i:1:20", "read:c:3:1",
                                  "read:i:1:5:3", "persist:c:1:0", "persist:c:2:3:5", "persist:i:4:2",
                                  "persist:c:3:16"])
def test_every_row_read_once(chain, spec):
    """Grids of 2-8 blocks over products of 1-13 rows: blocks with no rows, shares shorter than `ahead`, the
    four-row loop's tail, the stand-in arithmetic (`work`)."""
    v = chain_bound.Variant.parse(spec)
    if EMULATED and v.kind == "persist":
        v = replace(v, kind="read")
    assert chain.check(v) == []
    assert chain.check(v) == []  # again: the counters were zeroed for the next launch


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


@pytest.mark.skipif(EMULATED, reason="the emulator runs one block at a time: a cross-block wait cannot return")
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
    specs = ["launch:c:2:3", "persist:c:2:3:8", "read:i:8:0", "persist:c:9:0"]
    times, wrong = chain_bound.measure(c, [chain_bound.Variant.parse(s) for s in specs], rounds=3)
    assert list(times) == specs[:3] and all(len(ts) == 3 and min(ts) > 0 for ts in times.values())
    assert list(wrong) == ["persist:c:9:0"] and wrong["persist:c:9:0"][0].startswith("skipped: ")  # 2,048 threads an SM

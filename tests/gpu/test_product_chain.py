"""decapybara/backend/product_chain.py and mx_gemv.cu's MX_CHAIN kernels: a decode layer's run of one-row products
(out with the residual and the next norm fused, gate|up with SwiGLU over it, down likewise, the next layer's input
product over its norm), recorded (`pdl.recording()`) and run as one persistent launch, writes every output the
launches write, byte for byte (outputs poisoned after recording, so an unwritten element fails), at one row on the
one-row kernels and at 2-5 rows on the plain ones, stream-K and K-split tile grids; again, and in a CUDA graph,
since the chain zeroes its counters; a grid larger than the device keeps resident times out and says
so. On the host emulator the chain's blocks run side by side (`fake_cupy.RESIDENT`)."""

from __future__ import annotations

import sys
import zlib

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_kernels_extra import assert_bytes_equal, random_weight

from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend import pdl
from decapybara.backend.cuda_graph import capture_graph
from decapybara.backend.product_chain import ProductChain

pytestmark = pytest.mark.gpu
EMULATED = "fake_cupy" in sys.modules
H, I, K_IN, Q = 512, 512, 256, 320  # hidden, MLP width, the out product's K, the next input product's N
# TUNE per case: the one-row kernels in their own build for every product (`_1r` / `_1rs`), or the plain ones
ONE_ROW = {"row1_fill": 0, "small_bytes": 0, "small_n": 0}
PLAIN = {"row1": 0, "small_bytes": 0, "small_n": 0}
SPLIT = {**PLAIN, "ksplit": 2}  # tile grids split over K (virtual blocks along y), not stream-K
# (format, TUNE, rows of x): one row on the one-row kernels, 2-5 rows (one n-tile) on the plain ones
CASES = [("mxfp4", ONE_ROW, 1), ("nvfp4", ONE_ROW, 1), ("mxfp4", PLAIN, 5), ("bf16", PLAIN, 3), ("mxfp4", SPLIT, 2)]
IDS = [f"{f}-{'row1' if t is ONE_ROW else 'split' if t is SPLIT else 'plain'}-{m}" for f, t, m in CASES]


def weights(fmt: str) -> dict:
    rng = np.random.default_rng(zlib.crc32(f"chain-{fmt}".encode()))
    shapes = {"out": (H, K_IN), "gate_up": (2 * I, H), "down": (H, I), "qkv": (Q, H)}
    return {k: ex.pack_weight(random_weight(rng, fmt, s)[0]) for k, s in shapes.items()}


def layer(ws: dict, x, res, g1, g2) -> list:
    """The run of products between two token mixers, as a decode step launches them: its outputs."""
    normed, h = ex.mx_linear_add_norm(x, ws["out"], None, res, g1, 1e-6, 1.0)
    a = ex.mx_swiglu(normed, ws["gate_up"], out_dtype=np.uint16)
    normed2, h2 = ex.mx_linear_add_norm(a, ws["down"], None, h, g2, 1e-6, 1.0)
    q = ex.mx_linear(normed2, ws["qkv"])
    return [h, normed.xg, normed.sq, a, h2, normed2.xg, normed2.sq, q]


def inputs(seed: int, m: int = 1) -> tuple:
    rng = np.random.default_rng(seed)
    x = cp.asarray(rng.standard_normal((m, K_IN)).astype(np.float32))
    res = cp.asarray(rng.standard_normal((m, H)).astype(np.float32))
    g1, g2 = (cp.asarray(rng.standard_normal(H).astype(np.float32) * 0.1) for _ in range(2))
    return x, res, g1, g2


def poison(outs: list) -> None:
    for o in outs:
        o[...] = np.array(0x7FC0DEAD if o.dtype == np.float32 else 0xFFFF, np.uint32).astype(
            np.uint32 if o.dtype == np.float32 else np.uint16).view(o.dtype)


@pytest.fixture
def resident(monkeypatch):
    """The chain's grid: 3 blocks, side by side on the emulator."""
    if EMULATED:
        monkeypatch.setattr(sys.modules["fake_cupy"], "RESIDENT", 3)
    return 3


def recorded_layer(fmt: str, seed: int, m: int = 1) -> tuple[list, list, list]:
    """(the layer's outputs as launched, on the host; the outputs of its recorded launches; those launches)."""
    ws = weights(fmt)
    args = inputs(seed, m)
    ref = [cp.asnumpy(o) for o in layer(ws, *args)]
    with pdl.recording() as launches:
        outs = layer(ws, *args)
    return ref, outs, launches


def assert_outputs(outs: list, ref: list, name: str) -> None:
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert_bytes_equal(o, r, f"{name} output {i}")


@pytest.mark.parametrize("fmt,tune,m", CASES, ids=IDS)
def test_chain_writes_what_the_launches_write(fmt, tune, m, resident, monkeypatch):
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **tune})
    ref, outs, launches = recorded_layer(fmt, 1, m)
    assert len(launches) == 4
    suffixes = {kernels.kernel_origin(launch.kernel)[1].rpartition("_")[2] for launch in launches}
    assert suffixes == ({"1r", "1rs"} if tune is ONE_ROW else {"1", "1s"})
    assert any(launch.grid[1] > 1 for launch in launches) == (tune is SPLIT)  # K split over a tile grid's y
    chain = ProductChain(launches, blocks=resident)
    for _ in range(2):  # the second run: the counters the first one zeroed
        poison(outs)
        chain()
        assert_outputs(outs, ref, fmt)
    assert not chain.timed_out()


@pytest.mark.parametrize("prefetch", [0, 16])
def test_chain_prefetch_leaves_the_bytes(prefetch, resident, monkeypatch):
    """Blocks asking the L2 for none or 16 chunks of the next product's weights before each wait (MX_CHAIN_PF)
    write the same bytes (a prefetch reads nothing into the block)."""
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **ONE_ROW})
    ref, outs, launches = recorded_layer("mxfp4", 4)
    chain = ProductChain(launches, blocks=resident, prefetch=prefetch)
    poison(outs)
    chain()
    assert_outputs(outs, ref, f"prefetch {prefetch}")


@pytest.mark.skipif(EMULATED, reason="graphs and the device's own residency: the GPU's")
def test_chain_in_a_graph_and_on_every_resident_block(monkeypatch):
    """On the device's whole resident grid (the default), captured in a CUDA graph, replayed twice."""
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **ONE_ROW})
    ref, outs, launches = recorded_layer("mxfp4", 2)
    chain = ProductChain(launches)
    # the one-row build's launch bounds promise two blocks an SM, and the driver's occupancy says so
    assert chain.resident() >= 2 and chain.blocks == chain.resident() * ex.sm_count()
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    graph, _ = capture_graph(chain, stream, pool)
    for _ in range(2):
        poison(outs)
        cp.cuda.runtime.deviceSynchronize()  # the poison (current stream) before the replay (a stream of its own)
        graph.launch(stream)
        stream.synchronize()
        assert_outputs(outs, ref, "graph")
    assert not chain.timed_out()


@pytest.mark.skipif(EMULATED, reason="a wait's timeout is ~2^32 clock64 calls on the emulator")
def test_a_grid_past_the_resident_blocks_times_out(monkeypatch):
    """A block waits only where it has work in a product after the first. With half as many blocks again as the
    device keeps resident, and a second product with at least that many virtual blocks, every resident block
    waits for blocks that cannot start: the wait gives up and says so, and the launch ends (every later wait
    returns at once). (With small products most blocks have no work in them, run through and leave room; and the
    planner fits a product's blocks to one wave of the resident ones, so the second is a tile grid split four ways
    over K: 192 tiles x 4 on the H200, past its 1.5 x 396.)"""
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **PLAIN, "ksplit": 4})
    rng = np.random.default_rng(9)
    w1 = ex.pack_weight(random_weight(rng, "mxfp4", (4096, 256))[0])
    w2 = ex.pack_weight(random_weight(rng, "mxfp4", (24576, 4096))[0])
    x = cp.asarray(rng.standard_normal((1, 256)).astype(np.float32))
    with pdl.recording() as launches:
        ex.mx_linear(ex.mx_linear(x, w1), w2)
    resident = ProductChain(launches).blocks
    blocks = resident + resident // 2
    second = int(np.prod(launches[1].grid))
    assert second >= blocks, f"the second product's {second} virtual blocks leave some of {blocks} without work"
    chain = ProductChain(launches, blocks=blocks)
    chain()
    assert chain.timed_out()
    assert not cp.asnumpy(chain.done).any() and int(cp.asnumpy(chain.err)[1]) == 0  # ready for the next launch
    chain.clear()
    assert not chain.timed_out()

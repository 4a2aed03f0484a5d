"""decapybara/backend/chain_tails.py on a tiny hybrid model (DeltaNet + gated attention) over MXFP4 weights on the
server's bf16 backend, at one row (the one-row kernels) and three (the plain one-n-tile kernels):
- its layer tails captured in a graph as chains, replayed over new inputs written into the capture's input
  buffers, write what `QwenModel.block_tail` writes eagerly, byte for byte. The chains are built in the capture's
  warm-up and pointed at the capture's arrays after it (`commit`): a chain left on the warm-up's arrays would
  leave the graph's outputs stale;
- decode graphs with chains (`DecodeGraphRunner(chains=True)`) write the launched graphs' logits, KV pages and
  DeltaNet states byte for byte, step after step, at buckets 1 and 4;
- a tail whose products take two builds runs a chain for each run of one build;
- a chain's timeout flag, copied to the host at the end of a replay, turns chains off: the graphs with chains
  are captured again without them;
- a tail with an op that `pdl.recording()` does not keep (here a device copy between the products) fails the
  warm-up's byte check and stays launched.
On the host emulator the chains' blocks run side by side (`fake_cupy.RESIDENT`)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_cuda_graph import restore, snapshot

from decapybara.backend import chain_tails
from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.cuda_factory import cuda_backend
from decapybara.backend.cuda_graph import DecodeGraphRunner, capture_graph
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import FULL_ATTENTION
from decapybara.model.qwen import Projection, QwenModel
from decapybara.testing import prefilled_sequences, quantized_matrices, tiny_checkpoint

pytestmark = pytest.mark.gpu
EMULATED = "fake_cupy" in sys.modules
PAGE, PAGES, SLOTS = 8, 40, 6


@pytest.fixture
def resident(monkeypatch):
    """On the emulator: chains of 3 blocks, side by side."""
    if EMULATED:
        monkeypatch.setattr(sys.modules["fake_cupy"], "RESIDENT", 3)
        monkeypatch.setitem(chain_tails.CHAIN, "blocks", 3)


def packed_model() -> QwenModel:
    """The tiny qwen3_5 checkpoint with every matrix in MXFP4, on the server's backend (bf16, packed weights)."""
    cfg, tensors = tiny_checkpoint("qwen3_5_text")
    tensors = quantized_matrices(tensors, "mxfp4")
    return QwenModel.from_tensors(cfg, cuda_backend("bf16"), tensors)


def host_bytes(a) -> np.ndarray:
    return np.ascontiguousarray(cp.asnumpy(a)).view(np.uint8)


def out_weight(model: QwenModel, i: int):
    """Layer i's token mixer output projection."""
    attn = model.cfg.layer_types[i] == FULL_ATTENTION
    return model.w[f"model.layers.{i}." + ("self_attn.o_proj.weight" if attn else "linear_attn.out_proj.weight")]


def tail_bytes(outs) -> list[np.ndarray]:
    """A tail's (inputs, h) as host bytes."""
    return [host_bytes(a) for a in (*outs[0], outs[1])]


@pytest.mark.parametrize("rows", [1, 3])
def test_chained_tails_in_a_graph_write_the_eager_tails_bytes(resident, rows):
    model = packed_model()
    layers = range(model.cfg.num_hidden_layers - 1)  # the last layer's tail is launched, not chained
    rng = np.random.default_rng(rows)
    xs = {i: cp.zeros((rows, out_weight(model, i).shape[1]), cp.float32) for i in layers}  # the mixers' outputs
    h = cp.zeros((rows, model.cfg.hidden_size), cp.float32)
    tails = chain_tails.ChainTails()

    def fill() -> None:
        for a in (*xs.values(), h):
            a[...] = cp.asarray(rng.standard_normal(a.shape).astype(np.float32))

    def chained() -> list:
        run = tails.start(model, h)
        return [run.tail(i, Projection(xs[i], out_weight(model, i), None), h) for i in layers]

    fill()
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    # A chain's waits give up where another process's kernels hold the GPU meanwhile (the suite's test processes
    # share it), and its tail then stays launched, as designed: such an attempt, and only such, is tried again.
    for attempt in range(3):
        graph, outs = capture_graph(chained, stream, pool)
        tails.commit()
        if not (tails.stats["launched"] and tails.timed_out()) or attempt == 2:
            break
        tails = chain_tails.ChainTails()
    # (the message names why a tail stayed launched: its build's error, a chain's timeout, else where the warm-up's
    # bytes differed)
    why = {k: tails.stats[k] for k in ("chains", "launched", "recut", "errors", "differs")}
    why |= {"timed out": tails.timed_out(), "attempts": attempt + 1}
    assert tails.stats["chains"] >= len(layers) and not tails.stats["launched"] and not tails.stats["recut"], str(why)
    assert tails.stats["retargeted"] == tails.stats["chains"] and not tails.pending, tails.stats
    for replay in range(2):
        fill()
        cp.cuda.runtime.deviceSynchronize()
        graph.launch(stream)
        stream.synchronize()
        for i, got in zip(layers, outs, strict=True):
            want = tail_bytes(model.block_tail(i, Projection(xs[i], out_weight(model, i), None), h))
            assert all(np.array_equal(a, b) for a, b in zip(tail_bytes(got), want, strict=True)), \
                f"replay {replay}, layer {i}: the chained tail's outputs differ from the eager tail's"
    assert not tails.timed_out()


def run_both(model: QwenModel, rows: int, steps: int = 3, after_step=None) -> dict[bool, DecodeGraphRunner]:
    """Decode steps of `rows` sequences through a launched and a chained graph runner from the same state: equal
    logits, KV pages and states, byte for byte, every step (`after_step(step, runners)` after each)."""
    kv, states = model.new_kv_cache(PAGES, PAGE), model.new_state_pool(SLOTS)
    runners = {c: DecodeGraphRunner(model, max_pages=8, pad_page=PAGES - 1, pad_slot=SLOTS - 1, chains=c)
               for c in (False, True)}
    seqs = prefilled_sequences(model, kv, states, (5, 11, 20)[:rows], seed=1)
    for step in range(steps):
        batch = ForwardBatch.build([([s[0][-1]], len(s[0]) - 1, s[2], s[1]) for s in seqs], PAGE, logits="last")
        before = snapshot(kv, states, [s[1] for s in seqs])
        got = {}
        for chained, runner in runners.items():
            restore(kv, states, before)
            logits = np.ascontiguousarray(cp.asnumpy(runner.forward(batch, kv, states).logits))
            pages, st = snapshot(kv, states, [s[1] for s in seqs])
            got[chained] = (logits, {k: host_bytes(a) for k, a in pages.arrays.items()},
                            [host_bytes(a) for s in st.values() for a in (*s.conv, *s.recurrent)])
            assert runner.stats["graph_steps"] == step + 1, runner.stats
        (la, ka, sa), (lb, kb, sb) = got[False], got[True]
        assert np.array_equal(la.view(np.uint8), lb.view(np.uint8)), f"step {step}: logits differ"
        assert ka.keys() == kb.keys() and all(np.array_equal(ka[k], kb[k]) for k in ka), f"step {step}: KV pages"
        assert all(np.array_equal(a, b) for a, b in zip(sa, sb, strict=True)), f"step {step}: DeltaNet states"
        for j, s in enumerate(seqs):  # the chained step's pages and states stand: the next token
            s[0].append(int(np.argmax(lb[j])))
        if after_step is not None:
            after_step(step, runners)
    return runners


@pytest.mark.parametrize("rows", [1, 3])
def test_chained_decode_graphs_write_the_launched_graphs_bytes(resident, rows):
    model = packed_model()
    runners = run_both(model, rows)
    stats = runners[True].chain_stats()
    layers = model.cfg.num_hidden_layers
    # every tail but the last chained: out, gate|up, down and the next layer's input products (two for DeltaNet)
    assert stats["launched_tails"] == 0 and stats["recut_tails"] == 0, stats
    assert stats["chains"] >= layers - 1 and stats["chained_products"] >= 4 * (layers - 1), stats
    sts = [st.chains for st in runners[True]._graphs.values()]
    assert sts and all(c.stats["retargeted"] == c.stats["chains"] and not c.pending for c in sts), \
        [c.stats for c in sts]
    assert not any(c.timed_out() for c in sts)
    assert runners[False].chain_stats()["chains"] == 0


def test_tails_of_two_builds_run_a_chain_for_each_run(resident, monkeypatch):
    """Where a tail's one-row products take two builds (as under the 27B's shipped tuning, `row1_fills`), each run
    of one build is a chain of its own: here gate|up and down (N 256, K 128) on the one-row build, out, qkv|z, b|a
    and the attention's q|k|v on the plain one, so a DeltaNet layer's tail cuts into out | gate|up, down |
    qkv|z, b|a and the tail before the attention layer into out | gate|up, down | q|k|v: five chains of two
    products; the graphs still write the launched graphs' bytes."""
    monkeypatch.setattr(ex, "row1_fills", lambda w, row1, plain: w.N == 256 or w.K == 128)
    runners = run_both(packed_model(), 1, steps=2)
    stats = runners[True].chain_stats()
    assert stats == {"chains": 5, "chained_products": 10, "launched_tails": 0, "recut_tails": 0}, stats


def test_a_timed_out_chain_turns_chains_off(resident):
    """A chain's timeout flag set (as a wait that gave up sets it) reaches the host at the end of the next replay;
    the step after finds it, drops the graphs with chains and captures them again without chains, whose bytes are
    still the launched graphs'."""
    model = packed_model()

    def time_out(step, runners):
        if step == 0:
            (st,) = runners[True]._graphs.values()
            st.chains.err[0] = 1
            cp.cuda.runtime.deviceSynchronize()

    runners = run_both(model, 1, steps=4, after_step=time_out)
    chained = runners[True]
    assert chained.stats["chain_timeouts"] == 1 and not chained.chains, chained.stats
    assert chained.chain_stats()["chains"] == 0 and chained.stats["captures"] == 2, chained.stats
    assert all(st.chains is None for st in chained._graphs.values())


def test_a_tail_with_an_unrecorded_op_stays_launched(resident, monkeypatch):
    model = packed_model()
    swiglu = model.backend.swiglu
    # the MLP's activation copied on the device: under recording the copy runs at once, before the products
    monkeypatch.setattr(model.backend, "swiglu", lambda *a, **kw: swiglu(*a, **kw).copy())
    rng = np.random.default_rng(5)
    h = cp.asarray(rng.standard_normal((1, model.cfg.hidden_size)).astype(np.float32))
    tails = chain_tails.ChainTails()
    run = tails.start(model, h)
    for i in range(model.cfg.num_hidden_layers - 1):
        x = cp.asarray(rng.standard_normal((1, out_weight(model, i).shape[1])).astype(np.float32))
        got = tail_bytes(run.tail(i, Projection(x, out_weight(model, i), None), h))
        want = tail_bytes(model.block_tail(i, Projection(x, out_weight(model, i), None), h))
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), f"layer {i}"
        assert tails.sites[i] is None, f"layer {i}: chained"
    assert tails.stats["launched"] == list(range(model.cfg.num_hidden_layers - 1)) and tails.stats["chains"] == 0
    # each says where its chained run's bytes differed: the activation's copy read the poison (NaN)
    assert sorted(tails.stats["differs"]) == tails.stats["launched"], tails.stats["differs"]
    assert all("elements differ" in why for why in tails.stats["differs"].values()), tails.stats["differs"]

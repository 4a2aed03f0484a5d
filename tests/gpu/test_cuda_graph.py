"""CUDA-graph decode (decapybara/backend/cuda_graph.py) against eager execution (on the GPU; on the host emulator,
whose captures record launches and the numpy work on device arrays, all but the memory pools' accounting).

The generic capture replays with new inputs written into its static buffers and allocates nothing; the
model-level runner replays decode steps of a tiny hybrid model (DeltaNet + gated attention) whose logits,
KV pages and DeltaNet states equal the eager `QwenModel.forward` from the same starting state, across
changing contexts, bucket padding and reordered state slots.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.attn_plan import DECODE
from decapybara.backend.base import HybridState
from decapybara.backend.cuda_graph import DecodeGraphRunner, capture_graph
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig
from decapybara.model.quant import quantize
from decapybara.model.qwen import QwenModel
from decapybara.model.weights import random_tensors
from decapybara.testing import TINY_HF_CONFIGS, prefilled_sequences

pytestmark = pytest.mark.gpu


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"shape {got.shape} vs {ref.shape}"
    assert not np.isnan(got).any(), f"NaN in output ({int(np.isnan(got).sum())} of {got.size})"
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.mark.skipif("fake_cupy" in sys.modules, reason="the emulator's memory pools keep no accounts")
def test_capture_graph_replays_new_inputs_without_allocating():
    rng = np.random.default_rng(0)
    w = ex.pack_weight(quantize(rng.standard_normal((512, 256)).astype(np.float32), "mxfp4"))
    x = cp.asarray(rng.standard_normal((12, 256)).astype(np.float32))  # static input buffer

    def step():
        return ex.mx_linear(x, w) * 2.0 + 1.0

    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    graph, out = capture_graph(step, stream, pool)
    default_pool = cp.get_default_memory_pool()
    for i in range(4):
        x[...] = cp.asarray(rng.standard_normal((12, 256)).astype(np.float32))
        cp.cuda.get_current_stream().synchronize()
        used = (default_pool.used_bytes(), pool.used_bytes(), pool.total_bytes())
        graph.launch(stream)
        stream.synchronize()
        assert (default_pool.used_bytes(), pool.used_bytes(), pool.total_bytes()) == used, f"replay {i} allocated"
        ref = cp.asnumpy(step())
        assert np.array_equal(cp.asnumpy(out), ref), f"replay {i}: max diff {np.abs(cp.asnumpy(out) - ref).max()}"


SPIN_WRITE = r"""
extern "C" __global__ void spin_write(float* x, int n, float v, long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = v;
}
"""


@pytest.mark.skipif("fake_cupy" in sys.modules, reason="the emulator's streams order nothing")
def test_capture_graph_warms_up_after_the_callers_stream():
    """The warm-up reads what the caller's stream wrote before the capture, though the capture's stream is a
    non-blocking one (which the legacy default stream does not order): here a write queued behind tens of ms of
    spinning."""
    spin_write = cp.RawKernel(SPIN_WRITE, "spin_write")
    x = cp.zeros(256, cp.float32)
    cp.cuda.runtime.deviceSynchronize()
    # 2^26 cycles (~35-60 ms at the SM's clock) on the caller's stream, then the write
    spin_write((1,), (128,), (x, np.int32(x.size), np.float32(3.0), np.int64(1 << 26)))
    seen = []
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    capture_graph(lambda: seen.append(x.copy()) or seen[-1], stream, pool)
    stream.synchronize()
    assert np.all(cp.asnumpy(seen[0]) == 3.0), "the warm-up ran before the caller's write"


@pytest.mark.skipif("fake_cupy" in sys.modules, reason="the emulator's streams order nothing")
def test_a_warm_up_that_raises_leaves_nothing_running():
    """A warm-up that fails after queuing work has that work finished when `capture_graph` raises: the caller then
    frees and reuses its buffers on its own stream, which is not ordered after the capture's."""
    spin_write = cp.RawKernel(SPIN_WRITE, "spin_write")
    x = cp.zeros(256, cp.float32)
    cp.cuda.runtime.deviceSynchronize()

    def fails():
        spin_write((1,), (128,), (x, np.int32(x.size), np.float32(5.0), np.int64(1 << 26)))
        raise MemoryError("a warm-up's allocation failed")

    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with pytest.raises(MemoryError):
        capture_graph(fails, stream, pool)
    assert stream.done, "the failed warm-up's kernel was still running"
    assert np.all(cp.asnumpy(x) == 5.0)


def tiny_model(seed=3, **overrides):
    cfg = ModelConfig.from_hf({**TINY_HF_CONFIGS["qwen3_5_text"], **overrides})
    backend = CupyBackend("fp32")
    return QwenModel.from_tensors(cfg, backend, random_tensors(cfg, seed=seed, std=0.2), include_mtp=False)


def snapshot(kv, states, slots):
    """Host copies of every KV page but the last (the pad page, written by padding rows) and of `slots`."""
    return kv.export_pages(np.arange(kv.num_pages - 1)), {s: states.get(s) for s in slots}


def restore(kv, states, snap):
    kv.import_pages(np.arange(kv.num_pages - 1), snap[0])
    for s, st in snap[1].items():
        states.set(s, st)


def compare_state(kv, states, ref, name):
    pages, st = snapshot(kv, states, list(ref[1]))
    for key, a in ref[0].arrays.items():
        assert rel_err(pages.arrays[key], a) <= 1e-4, f"{name}: KV {key}"
    for s, hs in ref[1].items():
        for j, (c, r) in enumerate(zip(hs.conv, hs.recurrent)):
            assert rel_err(st[s].conv[j], c) <= 1e-4, f"{name}: conv state slot {s} layer {j}"
            assert rel_err(st[s].recurrent[j], r) <= 1e-4, f"{name}: recurrent state slot {s} layer {j}"


@pytest.mark.parametrize("heads,kv_mode", [(None, None), ((8, 2, 64), "16/16"), ((8, 2, 128), "6/4")])
def test_decode_graph_equals_eager(monkeypatch, heads, kv_mode):
    """Graph replays equal eager steps; with bf16 pages (head_dim 64) or 6/4-bit pages (head_dim 128) both run
    the tensor-core decode attention (decapybara/kernels/attn_decode.cu), whose graph work items include empty key
    ranges (splits > keys)."""
    from decapybara.backend import cupy_attention as ca
    launched = []
    get = ca.get_kernel
    monkeypatch.setattr(ca, "get_kernel", lambda m, f, d=(): launched.append(f) or get(m, f, d))
    over = {} if heads is None else dict(zip(("num_attention_heads", "num_key_value_heads", "head_dim"), heads))
    if heads is not None:  # 4 key splits over ~10-30 keys: later splits are empty
        monkeypatch.setattr(DecodeGraphRunner, "_splits", lambda self, batch, kv: 4)
    model = tiny_model(**over)
    page, num_pages = 8, 40
    kv, states = model.new_kv_cache(num_pages, page, kv_mode), model.new_state_pool(6)
    runner = DecodeGraphRunner(model, max_pages=8, pad_page=num_pages - 1, pad_slot=5)
    seqs = prefilled_sequences(model, kv, states, (5, 11, 20), seed=1)  # [tokens, slot, pages]
    plan = [[0, 1, 2], [0, 1, 2], [2, 0], [1, 2, 0], [1], [0, 1, 2]]  # bucket 4 (padded), 2, 4, 1, 4
    for step, order in enumerate(plan):
        active = [seqs[i] for i in order]
        batch = ForwardBatch.build([([s[0][-1]], len(s[0]) - 1, s[2], s[1]) for s in active], page, logits="last")
        batch.normed_rows = step % 2 == 0  # every row's final-normed state too (speculation's MTP input)
        before = snapshot(kv, states, [s[1] for s in seqs])
        eager_out = model.forward(batch, kv, states)
        eager = cp.asnumpy(eager_out.logits)
        after = snapshot(kv, states, [s[1] for s in seqs])
        restore(kv, states, before)
        out = runner.forward(batch, kv, states)
        graph = cp.asnumpy(out.logits)
        assert runner.stats["graph_steps"] == step + 1, f"step {step} ran eagerly: {runner.stats}"
        err = rel_err(graph, eager)
        assert err <= 1e-4, f"step {step} (order {order}): logits rel err {err:.2e}"
        if batch.normed_rows:
            err = rel_err(cp.asnumpy(out.normed), cp.asnumpy(eager_out.normed))
            assert err <= 1e-4, f"step {step}: normed rows rel err {err:.2e}"
        else:
            assert out.normed is None and eager_out.normed is None
        compare_state(kv, states, after, f"step {step}")
        for j, s in enumerate(active):
            s[0].append(int(np.argmax(eager[j])))
    assert runner.stats["captures"] == len({runner._bucket(len(o)) for o in plan}), runner.stats
    kernel = {"16/16": "paged_decode_attention", "6/4": "paged_decode_attention_mx"}.get(kv_mode)
    assert kernel is None or kernel in launched, sorted(set(launched))
    assert kernel is not None or not any(f.startswith("paged_decode") for f in launched), sorted(set(launched))


def poison_pad(kv, states, pad_page, pad_slot):
    """NaN into the pad page (bf16 pages: NaN bits) and the pad slot: what padding and throwaway rows leave there
    may be anything, and no real row may read it."""
    page = np.asarray([pad_page], np.int64)
    data = kv.export_pages(page)
    for a in data.arrays.values():
        a[...] = np.nan if np.issubdtype(a.dtype, np.floating) else (0x7FC0 if a.dtype == np.uint16 else 0xFF)
    kv.import_pages(page, data)
    if states is not None:
        st = states.get(pad_slot)
        for a in (*st.conv, *st.recurrent):
            a[...] = np.nan
        states.set(pad_slot, st)


def compare_snapshot(got, ref, name):
    for j, (c, r) in enumerate(zip(got.conv, ref.conv)):
        assert rel_err(cp.asnumpy(c), r) <= 1e-4, f"{name}: conv layer {j}"
    for j, (c, r) in enumerate(zip(got.recurrent, ref.recurrent)):
        assert rel_err(cp.asnumpy(c), r) <= 1e-4, f"{name}: rec layer {j}"


def verification_setup(monkeypatch, heads, kv_mode, kernel):
    """(the kernels launched, a tiny hybrid model of `heads` (query heads, KV heads, head_dim; None: the tiny
    config's), its KV cache of 40 pages of 16 and 6 state slots, a graph runner of 12-page tables, pad page 39 and
    pad slot 5) for the verification tests; on the decode kernel's pages 4 key splits, some of them empty."""
    from decapybara.backend import cupy_attention as ca
    launched = []
    get = ca.get_kernel
    monkeypatch.setattr(ca, "get_kernel", lambda m, f, d=(): launched.append(f) or get(m, f, d))
    over = {} if heads is None else dict(zip(("num_attention_heads", "num_key_value_heads", "head_dim"), heads))
    if kernel.startswith("paged_decode"):  # its rule splits no range this short: 4 splits (some of them empty)
        monkeypatch.setattr(DecodeGraphRunner, "_splits", lambda self, batch, kv, rows=None: 4)
    model = tiny_model(**over)
    kv, states = model.new_kv_cache(40, 16, kv_mode), model.new_state_pool(6)
    return launched, model, kv, states, DecodeGraphRunner(model, max_pages=12, pad_page=39, pad_slot=5)


def eager_then_graph(model, runner, kv, states, batch, seqs, pad):
    """`batch` run eagerly, then (from the same state, NaN on the pad page and slot `pad`) through `runner`:
    (the runner's output, the eager output, its logits and snapshots on the host side, the state it left)."""
    before = snapshot(kv, states, [s[1] for s in seqs])
    eager_out = model.forward(batch, kv, states)
    eager_logits = cp.asnumpy(eager_out.logits)
    cp.cuda.get_current_stream().synchronize()  # device-kept snapshots: pinned copies still in flight
    eager_snaps = dict(eager_out.snapshots)
    after = snapshot(kv, states, [s[1] for s in seqs])
    restore(kv, states, before)
    poison_pad(kv, states, *pad)
    return runner.forward(batch, kv, states), eager_out, eager_logits, eager_snaps, after


def compare_verification(out, eager_out, eager_logits, eager_snaps, after, kv, states, batch, device, name):
    """A verification replay's logits, normed rows, KV pages, states and snapshots (device views exactly where
    `device` names them) against the eager forward's."""
    err = rel_err(cp.asnumpy(out.logits), eager_logits)
    assert err <= 1e-4, f"{name}: logits rel err {err:.2e}"
    if batch.normed_rows:
        err = rel_err(cp.asnumpy(out.normed), cp.asnumpy(eager_out.normed))
        assert err <= 1e-4, f"{name}: normed rows rel err {err:.2e}"
    compare_state(kv, states, after, name)
    assert sorted(out.snapshots) == sorted(eager_snaps), name
    for key, ref in eager_snaps.items():
        got = out.snapshots[key]
        for a in (got.recurrent[0], ref.recurrent[0]):  # graph and eager alike: rollback points on the device
            on_device = type(a) is not np.ndarray  # (the emulator's device arrays subclass it)
            assert on_device == (key in device), f"{name} {key}"
        compare_snapshot(got, HybridState([cp.asnumpy(c) for c in ref.conv],
                                          [cp.asnumpy(r) for r in ref.recurrent]), f"{name} {key}")


@pytest.mark.parametrize("heads,kv_mode,kernel,one_pass", [
    (None, None, "paged_attention_fwd", 1), ((8, 2, 64), "16/16", "paged_decode_attention", 1),
    ((8, 2, 64), "16/16", "paged_decode_attention", 0), ((8, 2, 128), "6/4", "paged_decode_attention_mx", 1),
    ((18, 2, 64), "16/16", "paged_prefill_attention_tc", 1)])
def test_verify_graph_equals_eager(monkeypatch, heads, kv_mode, kernel, one_pass):
    """Verification steps (some sequences add a draft as a second row, others one token) replay graphs of two
    rows a sequence whose logits and normed rows (in the batch's order), KV pages, DeltaNet states and
    snapshots (a draft's rollback point after its real token, as device views or host copies; a sequence's end)
    equal the eager forward's from the same state; the throwaway rows of one-token sequences touch only the pad
    page and slot, which hold NaN before every replay, and no real row reads them: block tables end at each
    sequence's last token, so a one-token sequence at a page's end (step 0: 32 tokens, pages of 16) has its
    throwaway row's key on the pad page. Contexts up to ~150 keys: split keys. bf16 and 6/4-bit pages run the
    decode kernel in the graphs, once over both tokens a sequence (`one_pass`) or twice (a pass a token), or,
    past 8 query heads a KV head, the tensor-core prefill kernel; float32 pages the general one."""
    monkeypatch.setitem(DECODE, "verify_one_pass", one_pass)
    launched, model, kv, states, runner = verification_setup(monkeypatch, heads, kv_mode, kernel)
    page, num_pages = 16, 40
    seqs = prefilled_sequences(model, kv, states, (5, 31, 140), seed=6, pages_each=12)
    rng = np.random.default_rng(9)
    # (order, which draft, snapshot kinds): "dev" the rollback point as device views, "host" as a host copy, "end"
    # a snapshot at the sequence's end too
    plan = [([0, 1, 2], {0: "dev", 2: "host"}), ([2, 0, 1], {2: "dev+end", 1: "dev"}), ([1, 2], {}),
            ([1], {1: "host+end"}), ([0, 1, 2], {0: "dev", 1: "dev", 2: "dev"}), ([2, 0], {0: ""})]
    verify = 0
    for step, (order, drafts) in enumerate(plan):
        active = [seqs[i] for i in order]
        entries, snaps, device = [], [], set()
        for j, i in enumerate(order):
            s = seqs[i]
            new = [s[0][-1]] + ([int(rng.integers(0, 512))] if i in drafts else [])
            total = len(s[0]) - 1 + len(new)
            entries.append((new, len(s[0]) - 1, s[2][:-(-total // page)], s[1]))  # pages up to its last token
            if step == 0 and i == 1:
                assert len(new) == 1 and total % page == 0  # its throwaway row's key: on the pad page
            kind = drafts.get(i, "")
            points = ({total - 1} if kind else set()) | ({total} if "end" in kind else set())
            snaps.append(tuple(sorted(points)))
            if "dev" in kind:
                device.add((j, total - 1))
        batch = ForwardBatch.build(entries, page, logits="all", snapshot_at=snaps)
        batch.device_snapshots = frozenset(device)
        batch.normed_rows = step % 2 == 0
        out, *ref = eager_then_graph(model, runner, kv, states, batch, seqs, (num_pages - 1, 5))
        eager = ref[1]
        assert runner.stats["graph_steps"] == step + 1, f"step {step} ran eagerly: {runner.stats}"
        verify += bool(drafts)
        assert runner.stats["verify_steps"] == verify
        compare_verification(out, *ref, kv, states, batch, device, f"step {step} (order {order})")
        r = 0
        for s, b in zip(active, batch.seqs):  # the real token's greedy successor (drafts are thrown away)
            s[0].append(int(np.argmax(eager[r])))
            r += b.length
    keys = set(runner._graphs)
    assert {k[2] for k in keys} == {1, 2} and runner.stats["captures"] == len(keys), (keys, runner.stats)
    assert runner.checkpoint_bytes() > 0
    assert kernel in launched, sorted(set(launched))
    verifying = [st for st in runner._graphs.values() if st.rows == 2]
    if kernel == "paged_prefill_attention_tc":  # CTAs of 4 warps: 64 query rows, of which a sequence's two tokens 2g
        assert {st.block_m for st in verifying} == {64}
        assert not any(f.startswith("paged_decode") for f in launched), sorted(set(launched))
    decode = kernel.startswith("paged_decode")
    assert all((st.attn_plan.rows is not None) == (decode and not one_pass) for st in verifying)
    assert all((st.token_tables is not None) == (decode and bool(one_pass)) for st in verifying)
    assert max(k[1] for k in keys if k[2] == 2) > 1, keys  # split keys


@pytest.mark.parametrize("heads,kv_mode,kernel", [
    (None, None, "paged_attention_fwd"), ((8, 2, 64), "16/16", "paged_decode_attention"),
    ((8, 2, 128), "6/4", "paged_decode_attention_mx"), ((18, 2, 64), "16/16", "paged_prefill_attention_tc")])
def test_several_drafts_verify_graph_equals_eager(monkeypatch, heads, kv_mode, kernel):
    """Verification steps of up to seven drafts a sequence replay graphs of R = 1 + the most drafts rows a
    sequence (sequences of fewer tokens: throwaway rows on the pad page and slot, NaN before every replay); their
    logits and normed rows, KV pages, DeltaNet states and snapshots equal the eager forward's from the same state:
    the rollback points after each row but the last (checkpoint i (R - 1) + d of sequence i's d-th row, up to the
    last of the 12), as device views or host copies, some skipped, and the sequence's end. The hybrid model's
    checkpoints (one a row of the largest bucket, 12) bound the drafts a batch of n sequences takes (`max_drafts`:
    n x drafts <= 12, the bucket's padding sequences keeping none); a batch over them runs eagerly with the same
    results. The decode kernel's pages take the
    tokens in one launch (DECODE "verify_one_pass"; two launches take two rows only), the prefill kernel's CTAs of
    64 query rows (9 heads a KV head: a sequence's 8 rows in two tiles), float32 pages the general kernel."""
    from decapybara.backend.cuda_graph import MAX_ROWS
    launched, model, kv, states, runner = verification_setup(monkeypatch, heads, kv_mode, kernel)
    page, num_pages = 16, 40
    assert [runner.max_drafts(n, kv) for n in (1, 2, 3, 4, 5, 7, 12, 13)] == [7, 6, 4, 3, 2, 1, 1, 0]
    seqs = prefilled_sequences(model, kv, states, (5, 31, 120), seed=6, pages_each=12)
    rng = np.random.default_rng(11)
    # (order, {sequence: (drafts, {rollback point d, after row d: "dev" (device views) / "host"}, a snapshot at
    # its end too)}, graph rows or 0 for an eager step)
    plan = [([0, 1, 2], {0: (3, {0: "dev", 1: "host", 2: "dev"}, False), 2: (1, {0: "dev"}, True)}, 4),
            ([2, 0], {2: (6, {d: "dev" for d in range(6)}, True), 0: (2, {1: "host"}, False)}, 7),
            ([1], {1: (7, {1: "host", 4: "dev", 6: "dev"}, False)}, 8),
            ([0, 1, 2], {1: (2, {0: "dev", 1: "dev"}, False)}, 3),
            ([0, 2, 1], {1: (4, {0: "dev", 3: "host"}, True), 2: (2, {1: "dev"}, False)}, 5),  # checkpoint 11
            ([0, 1, 2], {0: (5, {0: "dev", 4: "dev"}, False)}, 0),  # 5 drafts beside 2 sequences: eagerly
            ([1, 2], {}, 1),
            ([2, 1, 0], {0: (3, {2: "dev"}, True), 1: (1, {}, False), 2: (3, {0: "host"}, False)}, 4)]
    graphs = eager = 0
    for step, (order, drafts, rows) in enumerate(plan):
        active = [seqs[i] for i in order]
        entries, snaps, device = [], [], set()
        for j, i in enumerate(order):
            s = seqs[i]
            k, points, end = drafts.get(i, (0, {}, False))
            new = [s[0][-1]] + [int(t) for t in rng.integers(0, 512, k)]
            p0 = len(s[0]) - 1
            total = p0 + len(new)
            entries.append((new, p0, s[2][:-(-total // page)], s[1]))  # pages up to its last token
            snaps.append(tuple(sorted({p0 + d + 1 for d in points} | ({total} if end else set()))))
            device |= {(j, p0 + d + 1) for d, how in points.items() if how == "dev"}
        batch = ForwardBatch.build(entries, page, logits="all", snapshot_at=snaps)
        batch.device_snapshots = frozenset(device)
        batch.normed_rows = step % 2 == 0
        why = runner.ineligible(batch, kv)
        assert (why is None) == (rows > 0), f"step {step}: {why}"
        assert rows or "max_drafts" in why
        out, *ref = eager_then_graph(model, runner, kv, states, batch, seqs, (num_pages - 1, 5))
        eager_logits = ref[1]
        graphs, eager = graphs + bool(rows), eager + (not rows)
        assert (runner.stats["graph_steps"], runner.stats["eager_steps"]) == (graphs, eager), f"step {step}"
        compare_verification(out, *ref, kv, states, batch, device, f"step {step} (order {order})")
        r = 0
        for s, b in zip(active, batch.seqs):  # the real token's greedy successor (drafts are thrown away)
            s[0].append(int(np.argmax(eager_logits[r])))
            r += b.length
    keys = set(runner._graphs)
    assert {k[2] for k in keys} == {rows for *_, rows in plan if rows} and MAX_ROWS == 8, keys
    assert runner.checkpoint_bytes() > 0
    assert kernel in launched, sorted(set(launched))
    verifying = [st for st in runner._graphs.values() if st.rows > 1]
    if kernel == "paged_prefill_attention_tc":  # CTAs of 4 warps: 64 query rows; 8 rows of 9 heads take two
        assert {st.block_m for st in verifying} == {64} and max(st.tiles for st in verifying) == 2
        assert not any(f.startswith("paged_decode") for f in launched), sorted(set(launched))
    assert all((st.token_tables is not None) == kernel.startswith("paged_decode") for st in verifying)
    # a verification graph of the bucket that failed to capture: fewer drafts than its rows (none past two rows)
    runner.stats["failures"][(4, 4, 4)] = "CUDARuntimeError: out of memory"
    assert [runner.max_drafts(n, kv) for n in (1, 2, 3, 4)] == [7, 6, 2, 2]
    runner.stats["failures"][(4, 4, 2)] = "CUDARuntimeError: out of memory"
    assert [runner.max_drafts(n, kv) for n in (1, 3, 5)] == [7, 0, 2]
    runner.stats["failures"].clear()
    # two decode-kernel launches a token (verify_one_pass 0) take two rows a sequence only
    monkeypatch.setitem(DECODE, "verify_one_pass", 0)
    assert [runner.max_drafts(n, kv) for n in (1, 3)] == ([1, 1] if kernel.startswith("paged_decode") else [7, 4])


@pytest.mark.parametrize("heads,kv_mode", [(None, None), ((8, 2, 64), "16/16")])
def test_a_sequence_near_its_table_end_keeps_the_verification_graph(heads, kv_mode):
    """A sequence that verifies nothing within a few tokens of its graph table's end (max_pages x page_size) beside
    one verifying six drafts: its throwaway rows need no page of its own (their keys go to the pad page, they
    attend to its keys only), so the step replays the graph of seven rows a sequence, equal to the eager forward."""
    over = {} if heads is None else dict(zip(("num_attention_heads", "num_key_value_heads", "head_dim"), heads))
    model = tiny_model(**over)
    page, num_pages = 16, 40
    kv, states = model.new_kv_cache(num_pages, page, kv_mode), model.new_state_pool(6)
    runner = DecodeGraphRunner(model, max_pages=4, pad_page=num_pages - 1, pad_slot=5)  # 64 tokens a sequence
    seqs = prefilled_sequences(model, kv, states, (59, 9), seed=2, pages_each=4)  # the first: 60 of 64 tokens
    rng = np.random.default_rng(1)
    entries = []
    for s, k in zip(seqs, (0, 6)):
        new = [s[0][-1]] + [int(t) for t in rng.integers(0, 512, k)]
        p0 = len(s[0]) - 1
        entries.append((new, p0, s[2][:-(-(p0 + len(new)) // page)], s[1]))
    p0 = len(seqs[1][0]) - 1
    batch = ForwardBatch.build(entries, page, logits="all", snapshot_at=[(), tuple(range(p0 + 1, p0 + 7))])
    batch.device_snapshots = frozenset((1, q) for q in batch.seqs[1].snapshot_at)
    assert batch.seqs[0].total + 7 > 4 * page and runner.ineligible(batch, kv) is None
    out, *ref = eager_then_graph(model, runner, kv, states, batch, seqs, (num_pages - 1, 5))
    assert runner.stats["graph_steps"] == 1 and set(runner._graphs) == {(2, runner._splits(batch, kv), 7)}
    compare_verification(out, *ref, kv, states, batch, batch.device_snapshots, "near the table's end")


@pytest.mark.parametrize("kv_mode,head_dim", [("16/16", 64), ("6/4", 128)])
def test_verify_one_pass_gives_the_two_passes_bits(monkeypatch, kv_mode, head_dim):
    """A verification graph's attention in one decode-kernel launch over (sequence, token) one-token sequences
    computes what its two launches, a token each, compute: the same work items a token (keys to its own; the
    split count forced equal), the same partials and reduce, so the logits, the KV pages and the DeltaNet states
    come out byte for byte; over three steps of changing order and drafts, one-token sequences' throwaway rows
    included (NaN on the pad page and slot before every replay)."""
    monkeypatch.setattr(DecodeGraphRunner, "_splits", lambda self, batch, kv, rows=None: 4)
    model = tiny_model(num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim)
    page, num_pages = 16, 40
    kv, states = model.new_kv_cache(num_pages, page, kv_mode), model.new_state_pool(6)
    seqs = prefilled_sequences(model, kv, states, (9, 47, 120), seed=2, pages_each=12)
    runners = {}
    for one in (1, 0):
        monkeypatch.setitem(DECODE, "verify_one_pass", one)
        runners[one] = DecodeGraphRunner(model, max_pages=12, pad_page=num_pages - 1, pad_slot=5)
    rng = np.random.default_rng(5)
    for step, (order, drafted) in enumerate([([0, 1, 2], {0, 2}), ([2, 1], {1}), ([1, 0, 2], {0, 1, 2})]):
        entries = []
        for i in order:
            s = seqs[i]
            new = [s[0][-1]] + ([int(rng.integers(0, 512))] if i in drafted else [])
            entries.append((new, len(s[0]) - 1, s[2][:-(-(len(s[0]) - 1 + len(new)) // page)], s[1]))
        batch = ForwardBatch.build(entries, page, logits="all")
        before = snapshot(kv, states, [s[1] for s in seqs])
        outs = {}
        for one in (1, 0):
            monkeypatch.setitem(DECODE, "verify_one_pass", one)
            restore(kv, states, before)
            poison_pad(kv, states, num_pages - 1, 5)
            outs[one] = (cp.asnumpy(runners[one].forward(batch, kv, states).logits),
                         snapshot(kv, states, [s[1] for s in seqs]))
            assert runners[one].stats["verify_steps"] == step + 1, runners[one].stats
        assert np.array_equal(outs[1][0], outs[0][0]), f"step {step}: logits differ"
        (pages1, st1), (pages0, st0) = outs[1][1], outs[0][1]
        for key, a in pages0.arrays.items():
            assert np.array_equal(pages1.arrays[key], a, equal_nan=True), f"step {step}: KV {key}"
        for slot, hs in st0.items():
            for a, b in zip((*st1[slot].conv, *st1[slot].recurrent), (*hs.conv, *hs.recurrent)):
                assert np.array_equal(a, b), f"step {step}: state slot {slot}"
        for s, b in zip([seqs[i] for i in order], batch.seqs):
            s[0].append(int(np.argmax(outs[1][0][b.start])))
    assert all(st.token_tables is not None for st in runners[1]._graphs.values())
    assert all(st.token_tables is None and st.attn_plan.rows is not None for st in runners[0]._graphs.values())


@pytest.mark.parametrize("heads,kv_mode,vocab", [(None, None, 0), ((8, 2, 64), "16/16", 0), ((8, 2, 128), "6/4", 200)])
def test_mtp_graph_equals_eager(heads, kv_mode, vocab):
    """The MTP head's pass replays graphs of R pair rows a sequence, R the most pairs a sequence has, at least two
    (a decode's one, an accepted draft's two, up to eight after seven accepted drafts): its guesses and
    probabilities at each sequence's last pair and the head's KV pages equal the eager `mtp_forward`'s, with NaN
    in the pad page before every replay and block tables ending at the last pair (a one-pair sequence at a page's
    end: its throwaway row's key on the pad page); a sequence of more than eight pairs (after a prompt chunk) runs
    eagerly. The head's KV-only pass (`mtp_kv`) writes the same KV pages, eagerly
    and through its own graphs (`DecodeGraphRunner.mtp_kv`). With a draft vocabulary (`draft_vocab` 200: ids below
    208, and ids 300 and 511) the graph's guesses are the eager head's over the same ids."""
    over = {} if heads is None else dict(zip(("num_attention_heads", "num_key_value_heads", "head_dim"), heads))
    cfg = ModelConfig.from_hf({**TINY_HF_CONFIGS["qwen3_5_text"], "mtp_num_hidden_layers": 1, **over})
    model = QwenModel.from_tensors(cfg, CupyBackend("fp32"), random_tensors(cfg, seed=8, std=0.2))
    page, num_pages = 8, 40
    kv, states = model.new_kv_cache(num_pages, page, kv_mode), model.new_state_pool(6)
    head = model.draft_head(vocab, extra=(300, 511))  # (vocab 0: the whole head, no extra ids)
    runner = DecodeGraphRunner(model, max_pages=8, pad_page=num_pages - 1, pad_slot=5, draft_head=head)
    seqs = prefilled_sequences(model, kv, states, (7, 14, 22), seed=3)  # step 0: sequence 0's one pair ends a page
    rng = np.random.default_rng(4)
    steps = [([0, 1, 2], (1, 2, 1)), ([2, 0], (2, 2)), ([1], (1,)), ([0, 1, 2], (2, 1, 2)), ([1, 2], (5, 3)),
             ([0], (8,))]
    for step, (order, pairs) in enumerate(steps):
        entries = []
        for i, k in zip(order, pairs):
            s = seqs[i]
            p0 = len(s[0]) - 1
            entries.append((list(rng.integers(0, 512, k)), p0, s[2][:-(-(p0 + k) // page)], None))
            if step == 0 and i == 0:
                assert k == 1 and (p0 + k) % page == 0
            s[0].extend(int(t) for t in rng.integers(0, 512, k))
        batch = ForwardBatch.build(entries, page, logits="none")
        batch.logits_rows = np.asarray([b.end - 1 for b in batch.seqs], np.int64)
        hidden = cp.asarray(rng.standard_normal((batch.num_tokens, cfg.hidden_size)).astype(np.float32))
        before = snapshot(kv, states, [])
        ref_logits, ref_own = model.mtp_forward(batch, hidden, kv, own=True, head=head)
        assert ref_logits.shape[1] == (210 if vocab else cfg.vocab_size)
        ref_guess, ref_prob = (cp.asnumpy(a) for a in model.draft_guesses(ref_logits, head))
        ref_own = cp.asnumpy(ref_own)
        after = snapshot(kv, states, [])
        restore(kv, states, before)
        model.mtp_kv(batch, hidden, kv)  # the KV-only pass (a step whose next drafts are withheld): the same KV
        compare_state(kv, states, after, f"step {step}, the head's KV-only pass")
        restore(kv, states, before)
        poison_pad(kv, None, num_pages - 1, None)
        # the head's own normed states at the last pairs come back with `own` (what a chained guess pairs with)
        got = runner.mtp(batch, hidden, kv, own=step % 2 == 1)
        assert len(got) == 2 + step % 2
        guess, prob = cp.asnumpy(got[0]), cp.asnumpy(got[1])
        assert runner.stats["mtp_steps"] == step + 1, runner.stats
        assert np.array_equal(guess, ref_guess), f"step {step}: guesses {guess} vs {ref_guess}"
        assert rel_err(prob, ref_prob) <= 1e-4, f"step {step}: probabilities"
        if step % 2:
            own = cp.asnumpy(got[2])
            assert own.shape == ref_own.shape and rel_err(own, ref_own) <= 1e-4, f"step {step}: the head's states"
        compare_state(kv, states, after, f"step {step}")
        restore(kv, states, before)
        poison_pad(kv, None, num_pages - 1, None)
        assert runner.mtp_kv(batch, hidden, kv)  # the KV-only pass through its own graph
        assert runner.stats["mtp_kv_steps"] == step + 1, runner.stats
        compare_state(kv, states, after, f"step {step}, the KV-only graph")
    # on the decode kernel's pages both tokens' attention is one launch (DECODE "verify_one_pass")
    assert all((st.token_tables is not None) == (heads is not None) for st in runner._graphs.values())
    assert {k[3] for k in runner._graphs} == {2, 5, 8}, set(runner._graphs)  # rows a sequence
    long = ForwardBatch.build([(list(range(9)), len(seqs[0][0]) - 1, seqs[0][2], None)], page, logits="none")
    assert runner.mtp(long, cp.zeros((9, cfg.hidden_size), cp.float32), kv) is None
    assert not runner.mtp_kv(long, cp.zeros((9, cfg.hidden_size), cp.float32), kv)
    assert runner.stats["mtp_eager"] == 2 and not runner.stats["failures"]


def test_decode_graph_runs_prefill_eagerly():
    model = tiny_model(seed=4)
    kv, states = model.new_kv_cache(16, 8), model.new_state_pool(3)
    states.reset(0)
    runner = DecodeGraphRunner(model, max_pages=4, pad_page=15, pad_slot=2)
    batch = ForwardBatch.build([(list(range(9)), 0, np.arange(4, dtype=np.int32), 0)], 8, logits="last")
    assert runner.ineligible(batch) is not None
    before = snapshot(kv, states, [0])
    ref = cp.asnumpy(model.forward(batch, kv, states).logits)
    restore(kv, states, before)
    got = cp.asnumpy(runner.forward(batch, kv, states).logits)
    assert runner.stats["eager_steps"] == 1 and runner.stats["graph_steps"] == 0
    assert np.array_equal(got, ref)


def test_decode_attention_splits_on_this_device():
    """The graph runner and the eager decode plans split keys by attn_plan.decode_splits with this device's SM
    count and the CTAs an SM holds (`decode_per_sm`: by shared memory, 1 for bf16 pages of head_dim 256 at 4
    warps x 3 stages, 3 for 6/4-bit pages on an H100 / H200), at 27B attention shapes (24 query heads over 4 KV
    heads of 256: one tile of rows a sequence, 4 CTAs a split). The rule's own counts: tests/test_attn_plan.py."""
    from types import SimpleNamespace

    from decapybara.backend import attn_plan as ap
    from decapybara.backend import cupy_attention as ca

    def decode_seq(total):  # a decode row ending at `total` keys
        return SimpleNamespace(total=total, context=total - 1, length=1)

    model = tiny_model(num_attention_heads=24, num_key_value_heads=4, head_dim=256)
    kv = model.new_kv_cache(8, 16, "16/16")
    runner = DecodeGraphRunner(model, max_pages=4, pad_page=7, pad_slot=3)
    shape = runner._decode_launch(kv)
    assert shape is not None
    if ca.smem_per_sm() == 228 * 1024:  # H100 / H200
        assert ca.decode_per_sm(256, (16, 16), (4, 3)) == 1 and ca.decode_per_sm(256, (6, 4), (4, 3)) == 3
        # over 6/4-bit pages one sequence's graphs take 64 splits at 32k (graph_split_cap), two sequences 32
        kv64 = model.new_kv_cache(8, 16, "6/4")
        assert [runner._splits(SimpleNamespace(seqs=[decode_seq(32769)] * b), kv64)
                for b in (1, 2)] == [64, 32]
    sms, per_sm = ca.sm_count(), ca.decode_per_sm(256, (16, 16), shape)
    for b, keys in ((1, 1025), (3, 1025), (12, 32769), (5, 20000)):
        batch = SimpleNamespace(seqs=[decode_seq(keys)] * b)
        per_split = 4 * runner._bucket(b)
        assert runner._splits(batch, kv) == ap.decode_splits(per_split, keys, sms, pow2=True,
                                                             cap=ap.graph_split_cap(per_split, sms, per_sm),
                                                             per_sm=per_sm), (b, keys)
        # a verification graph's one launch holds both tokens' CTAs: twice a split's
        verify = SimpleNamespace(seqs=[SimpleNamespace(total=keys, context=keys - 2, length=2)] * b)
        assert runner._splits(verify, kv) == ap.decode_splits(2 * per_split, keys, sms, pow2=True,
                                                              cap=ap.graph_split_cap(2 * per_split, sms, per_sm),
                                                              per_sm=per_sm), (b, keys)
        table = np.zeros(ap.cdiv(keys, 16), np.int32)  # pages of 16 keys
        plan = ca.plan_attention(ForwardBatch.build([([0], keys - 1, table, None)] * b, 16), 24, 4, 256,
                                 kv_bits=(16, 16))
        splits = ap.decode_splits(4 * b, keys, sms, cap=ap.cdiv(ap.DECODE_WAVES * sms, 4 * b), per_sm=per_sm)
        chunk = ap.cdiv(ap.cdiv(keys, splits), ap.BLOCK_N) * ap.BLOCK_N  # whole 32-key tiles a split
        work = cp.asnumpy(plan.work)
        assert plan.decode == shape and np.bincount(work[:, 0]).tolist() == [ap.cdiv(keys, chunk)] * b, (b, keys)


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_moe_decode_graphs_capture(experts):
    """An MoE hybrid's decode steps replay as graphs: bf16 expert stacks (the bf16 backend) and packed MXFP4
    experts (the packed backend) both take the device `moe` (no host synchronisation); graph logits equal the
    eager step's within float32 summation order (a bucket's padded rows change the products' launch plans) and
    give the same greedy tokens."""
    from decapybara.backend.cuda_factory import cuda_backend

    hf = TINY_HF_CONFIGS["qwen3_5_moe_text"]
    cfg = ModelConfig.from_hf({**hf, "shared_expert_intermediate_size": hf["moe_intermediate_size"]})  # as the 35B's
    tensors = dict(random_tensors(cfg, seed=5, std=0.2))
    if experts == "mxfp4":
        tensors = {k: quantize(v, "mxfp4") if ".experts." in k else v for k, v in tensors.items()}
    backend = CupyBackend("bf16") if experts == "bf16" else cuda_backend("bf16")
    model = QwenModel.from_tensors(cfg, backend, tensors, include_mtp=False)
    stacks = [model.w[f"model.layers.0.mlp.experts.{p}"] for p in ("gate_proj", "up_proj", "down_proj")]
    assert backend.moe_captures(*stacks)
    fused = model.fused_moe
    assert sorted(fused) == [f"model.layers.{i}.mlp" for i in range(cfg.num_hidden_layers) if cfg.layer_is_moe(i)]
    # router|shared gate and the experts' gate|up stacked; the shared expert (bf16 as the bf16 experts; not as
    # the MXFP4 ones) as their expert E
    assert all(f.router_gate is not None and f.gate_up is not None for f in fused.values())
    assert all(f.shared_slot == (experts == "bf16") for f in fused.values())
    page, num_pages = 8, 40
    kv, states = model.new_kv_cache(num_pages, page), model.new_state_pool(6)
    runner = DecodeGraphRunner(model, max_pages=8, pad_page=num_pages - 1, pad_slot=5)
    seqs = prefilled_sequences(model, kv, states, (5, 11, 20), seed=2)
    for step, order in enumerate([[0, 1, 2], [0, 1, 2], [2, 0], [1]]):
        active = [seqs[i] for i in order]
        batch = ForwardBatch.build([([s[0][-1]], len(s[0]) - 1, s[2], s[1]) for s in active], page, logits="last")
        before = snapshot(kv, states, [s[1] for s in seqs])
        eager = cp.asnumpy(model.forward(batch, kv, states).logits)
        restore(kv, states, before)
        graph = cp.asnumpy(runner.forward(batch, kv, states).logits)
        assert runner.stats["graph_steps"] == step + 1, f"step {step} ran eagerly: {runner.stats}"
        assert rel_err(graph, eager) <= 2e-3, f"{experts} step {step}: rel err {rel_err(graph, eager):.2e}"
        assert (graph.argmax(-1) == eager.argmax(-1)).all(), f"{experts} step {step}: greedy tokens"
        for j, s in enumerate(active):
            s[0].append(int(np.argmax(eager[j])))


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_moe_verification_graphs_capture(experts):
    """An MoE hybrid's verification steps (drafts as second rows beside one-token decodes) replay graphs too:
    bf16 and packed MXFP4 experts over twice the bucket's rows; logits equal the eager step's within float32
    summation order, the same greedy tokens, the rollback points within the same tolerance."""
    from decapybara.backend.cuda_factory import cuda_backend

    hf = TINY_HF_CONFIGS["qwen3_5_moe_text"]
    cfg = ModelConfig.from_hf({**hf, "shared_expert_intermediate_size": hf["moe_intermediate_size"]})
    tensors = dict(random_tensors(cfg, seed=5, std=0.2))
    if experts == "mxfp4":
        tensors = {k: quantize(v, "mxfp4") if ".experts." in k else v for k, v in tensors.items()}
    backend = CupyBackend("bf16") if experts == "bf16" else cuda_backend("bf16")
    model = QwenModel.from_tensors(cfg, backend, tensors, include_mtp=False)
    page, num_pages = 8, 40
    kv, states = model.new_kv_cache(num_pages, page), model.new_state_pool(6)
    runner = DecodeGraphRunner(model, max_pages=8, pad_page=num_pages - 1, pad_slot=5)
    seqs = prefilled_sequences(model, kv, states, (5, 11, 20), seed=2)
    rng = np.random.default_rng(3)
    for step, (order, drafts) in enumerate([([0, 1, 2], {0, 2}), ([2, 0], {2}), ([1], {1})]):
        entries, snaps = [], []
        for i in order:
            s = seqs[i]
            new = [s[0][-1]] + ([int(rng.integers(0, 512))] if i in drafts else [])
            entries.append((new, len(s[0]) - 1, s[2], s[1]))
            snaps.append((len(s[0]),) if i in drafts else ())  # the rollback point after the real token
        batch = ForwardBatch.build(entries, page, logits="all", snapshot_at=snaps)
        batch.device_snapshots = frozenset((j, p[0]) for j, p in enumerate(snaps) if p)
        before = snapshot(kv, states, [s[1] for s in seqs])
        eager_out = model.forward(batch, kv, states)
        eager = cp.asnumpy(eager_out.logits)
        restore(kv, states, before)
        out = runner.forward(batch, kv, states)
        graph = cp.asnumpy(out.logits)
        assert runner.stats["verify_steps"] == step + 1, f"step {step} ran eagerly: {runner.stats}"
        assert rel_err(graph, eager) <= 2e-3, f"{experts} step {step}: rel err {rel_err(graph, eager):.2e}"
        assert (graph.argmax(-1) == eager.argmax(-1)).all(), f"{experts} step {step}: greedy tokens"
        for key, ref in eager_out.snapshots.items():
            got = out.snapshots[key]
            assert rel_err(cp.asnumpy(got.recurrent[-1]), cp.asnumpy(ref.recurrent[-1])) <= 2e-3, (step, key)
        r = 0
        for i, b in zip(order, batch.seqs):
            seqs[i][0].append(int(np.argmax(eager[r])))
            r += b.length
    assert not runner.stats["failures"], runner.stats["failures"]


def test_fp32_moe_does_not_capture():
    """The fp32 mode's float32 experts read their routing on the host: `moe_captures` says so."""
    cfg = ModelConfig.from_hf(TINY_HF_CONFIGS["qwen3_5_moe_text"])
    model = QwenModel.from_tensors(cfg, CupyBackend("fp32"), random_tensors(cfg, seed=5, std=0.2), include_mtp=False)
    stacks = [model.w[f"model.layers.0.mlp.experts.{p}"] for p in ("gate_proj", "up_proj", "down_proj")]
    assert not model.backend.moe_captures(*stacks)

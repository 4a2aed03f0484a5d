"""Programmatic dependent launch (decapybara/backend/pdl.py), GPU only.

A product launched through `pdl.launch` may start before the kernel that writes its x has finished; it must
wait for that kernel before reading x. The output poisoning of the GPU tests (`cupy_ops.POISON`) is off
here: its fill kernels, launched plainly before each kernel's launch, would keep every kernel from
overlapping the one that feeds it. The tests count the overlapped launches they make. Chains of norm -> product -> norm -> ... where each product reads what
the kernel just before it wrote give byte-identical results with and without the overlap, eager and
replayed as a CUDA graph, on fresh inputs each time: a read of x before the wait would see the previous
replay's values. Decode steps of a tiny hybrid model (products, norms, KV writes, decode attention over
bf16 and 6/4-bit pages, the DeltaNet decode kernels) give the same logits, KV pages and states, byte for
byte, with and without the overlap, eager and as graphs.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend import pdl
from decapybara.backend.cuda_graph import DecodeGraphRunner, capture_graph
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig
from decapybara.model.quant import quantize
from decapybara.model.qwen import QwenModel
from decapybara.model.weights import random_tensors
from decapybara.testing import TINY_HF_CONFIGS, prefilled_sequences

pytestmark = pytest.mark.gpu
PAGE, KV_PAGES = 8, 40  # the tiny models' KV cache: keys a page, pages (the last one pads graph rows)


@pytest.fixture(autouse=True)
def overlapping(monkeypatch):
    """No poisoning fills between kernels; a list that counts the overlapped launches (cuLaunchKernelEx)."""
    monkeypatch.setattr(ops, "POISON", False)
    monkeypatch.setitem(pdl.MODE, "pdl", "1")
    calls, real = [], pdl._launch_ex()
    if real is not None:
        monkeypatch.setattr(pdl, "_launch_ex", lambda: (lambda *a: calls.append(1) or real(*a)))
    return calls


def packed(rng, fmt, n, k, scale=0.05):
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    if fmt == "bf16":
        from decapybara.model.quant.elements import bf16_encode

        return ex.PackedWeight("bf16", (n, k), cp.asarray(bf16_encode(w)), persistent=True)
    p = ex.pack_weight(quantize(w, fmt))
    p.persistent = True  # uploaded before the products that read it, as a model weight
    return p


def hybrid_model(head_dim, kv_mode, seed, lengths, prefill_seed, family="qwen3_5_text"):
    """(model, kv, states, seqs): a tiny hybrid model of `family` (8 query heads over 2 KV heads of `head_dim`;
    the MoE family with a shared expert of the routed experts' width, as the 35B-A3B's, so that it runs in the
    stacks) over bf16 weights, KV_PAGES pages of PAGE keys in `kv_mode`, 5 state slots, and sequences of `lengths`
    prompt tokens prefilled ([tokens, slot, pages] each)."""
    hf = TINY_HF_CONFIGS[family]
    if "moe_intermediate_size" in hf:
        hf = {**hf, "shared_expert_intermediate_size": hf["moe_intermediate_size"]}
    cfg = ModelConfig.from_hf({**hf, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": head_dim})
    model = QwenModel.from_tensors(cfg, CupyBackend("bf16"), random_tensors(cfg, seed=seed, std=0.2),
                                   include_mtp=False)
    kv, states = model.new_kv_cache(KV_PAGES, PAGE, kv_mode), model.new_state_pool(5)
    return model, kv, states, prefilled_sequences(model, kv, states, lengths, seed=prefill_seed)


def graph_runner(model):
    return DecodeGraphRunner(model, max_pages=8, pad_page=KV_PAGES - 1, pad_slot=4)


def decode_batch(seqs):
    """One decode step of `seqs`: each one's last token on top of the rest."""
    return ForwardBatch.build([([s[0][-1]], len(s[0]) - 1, s[2], s[1]) for s in seqs], PAGE, logits="last")


def assert_same_results(results, pairs, step):
    """results[name] = (logits bytes, cache bytes, logits): each pair's logits and caches byte for byte."""
    for a, b in pairs:
        assert results[a][0] == results[b][0], f"step {step}: {a} and {b} logits differ"
        assert results[a][1] == results[b][1], f"step {step}: {a} and {b} KV pages / states differ"


def compare_steps(seqs, kv, states, names, run, pairs, steps):
    """`steps` decode steps of `seqs`, each run once per name from the same KV pages and states (`run(name, step,
    batch)` -> logits on the device); each of `pairs` gives the same logits, pages and states byte for byte
    (`assert_same_results`), and every sequence takes the first name's greedy token."""
    slots = [s[1] for s in seqs]
    for step in range(steps):
        batch = decode_batch(seqs)
        restore = cache_restorer(kv, states, slots)
        results = {}
        for name in names:
            restore()
            logits = cp.asnumpy(run(name, step, batch))
            results[name] = (logits.tobytes(), cache_bytes(kv, states, slots), logits)
        assert_same_results(results, pairs, step)
        for s, row in zip(seqs, results[names[0]][2]):
            s[0].append(int(np.argmax(row)))


def cache_restorer(kv, states, slots):
    """A function that puts every KV page but the padding one (the last), and the slots' states, back as they
    are now."""
    pages, saved = kv.export_pages(np.arange(kv.num_pages - 1)), {s: states.get(s) for s in slots}

    def restore():
        kv.import_pages(np.arange(kv.num_pages - 1), pages)
        for s, st in saved.items():
            states.set(s, st)
    return restore


@pytest.fixture
def forks(monkeypatch):
    """The side-stream forks of CupyBackend.linear_pair, counted (one entry each)."""
    from decapybara.backend import cupy_backend as cb

    calls, side = [], cb._side_stream
    monkeypatch.setattr(cb, "_side_stream", lambda d: calls.append(d) or side(d))
    return calls


def cache_bytes(kv, states, slots):
    """Bytes of every KV page but the padding one (the last), and of the slots' conv and recurrent states."""
    pages = kv.export_pages(np.arange(kv.num_pages - 1))
    return [np.asarray(a).tobytes() for a in pages.arrays.values()] + [
        np.asarray(x).tobytes() for s in slots for st in [states.get(s)] for x in (*st.conv, *st.recurrent)]


def assert_same_bytes(got, ref, name):
    got, ref = cp.asnumpy(got), cp.asnumpy(ref)
    assert got.shape == ref.shape, f"{name}: {got.shape} vs {ref.shape}"
    diff = np.argwhere(got.view(np.uint32) != ref.view(np.uint32))
    assert not diff.size, f"{name}: {len(diff)} of {got.size} differ, first at {tuple(diff[0])}"


def test_pdl_modes(monkeypatch):
    """With MODE "1" (the default, $DECAPYBARA_PDL) while a graph is captured; with always everywhere; never with 0."""
    cc = int(cp.cuda.Device().compute_capability)
    func = kernels.get_kernel("mx_gemv", "mx_gemm_bf16_1", ex.gemm_defines(ex.tune_for("bf16"), "bf16"))
    assert pdl._function_handle(func) is not None, "no CUfunction handle on the CuPy kernel"
    assert not pdl.enabled()  # the default (1), not capturing
    monkeypatch.setitem(pdl.MODE, "pdl", "1")
    assert not pdl.enabled()  # not capturing
    monkeypatch.setitem(pdl.MODE, "pdl", "always")
    assert pdl.enabled() == (cc >= 90)
    monkeypatch.setitem(pdl.MODE, "pdl", "0")
    assert not pdl.enabled()
    monkeypatch.setitem(pdl.MODE, "pdl", "1")
    seen = []
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    capture_graph(lambda: seen.append(pdl.enabled()) or cp.zeros(4), stream, pool)
    assert seen == [False, cc >= 90]  # the warm-up call, then the captured one


def _chain(x, norm_w, weights, gate_up, down):
    """norm -> product repeated (each product reads what the norm just wrote), then an MLP."""
    h = x
    for w in weights:
        h = ex.mx_linear(ops.rms_norm(h, norm_w, 1e-6, 1.0), w)
    return ex.mx_linear(ops.silu_mul_halves(ex.mx_linear(ops.rms_norm(h, norm_w, 1e-6, 1.0), gate_up)), down)


@pytest.mark.parametrize("fmt,m", [("mxfp4", 1), ("mxfp4", 12), ("bf16", 1), ("mxfp8", 4)])
def test_overlapped_launches_compute_the_same_chain(fmt, m, monkeypatch, overlapping):
    rng = np.random.default_rng(7)
    d, inter = 2048, 3072
    weights = [packed(rng, fmt, d, d, 0.03) for _ in range(6)]
    gate_up, down = packed(rng, fmt, 2 * inter, d, 0.03), packed(rng, fmt, d, inter, 0.03)
    norm_w = cp.asarray(rng.uniform(-0.2, 0.2, d).astype(np.float32))
    x = cp.asarray(rng.standard_normal((m, d)).astype(np.float32))  # the graph's static input

    def run(overlap):
        monkeypatch.setitem(pdl.MODE, "pdl", "always" if overlap else "0")
        return _chain(x, norm_w, weights, gate_up, down)

    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    monkeypatch.setitem(pdl.MODE, "pdl", "1")
    graph, out = capture_graph(lambda: _chain(x, norm_w, weights, gate_up, down), stream, pool)
    captured = len(overlapping)
    assert captured >= 2 * len(weights) + 4, f"{captured} overlapped launches in the capture"
    for i in range(5):
        x[...] = cp.asarray(rng.standard_normal((m, d)).astype(np.float32) * (1 + i))
        cp.cuda.get_current_stream().synchronize()
        plain = run(False)
        assert_same_bytes(run(True), plain, f"eager, input {i}")
        graph.launch(stream)
        stream.synchronize()
        assert_same_bytes(out, plain, f"graph replay, input {i}")
    assert len(overlapping) > captured, "the eager runs made no overlapped launch"


@pytest.mark.parametrize("fmt,m", [("mxfp4", 1), ("mxfp4", 12), ("nvfp4", 1), ("mxfp8", 4)])
def test_products_asking_the_l2_before_their_wait_compute_the_same_chain(fmt, m, monkeypatch, overlapping):
    """TUNE `pdl_prefetch` (MX_PDL_PF): an overlapped product's blocks ask the L2 for their next chunks before they
    wait for the kernel before. A cache hint: the chain of norms and products replayed as a graph with it gives
    the bytes of the plain launches without it, on fresh inputs."""
    rng = np.random.default_rng(11)
    d, inter = 2048, 3072
    weights = [packed(rng, fmt, d, d, 0.03) for _ in range(3)]
    gate_up, down = packed(rng, fmt, 2 * inter, d, 0.03), packed(rng, fmt, d, inter, 0.03)
    norm_w = cp.asarray(rng.uniform(-0.2, 0.2, d).astype(np.float32))
    x = cp.asarray(rng.standard_normal((m, d)).astype(np.float32))
    monkeypatch.setitem(ex.TUNE, "pdl_prefetch", 0)
    assert not any(k == "MX_PDL_PF" for k, _ in ex.gemm_defines(ex.tune_for(fmt), fmt))
    monkeypatch.setitem(ex.TUNE, "pdl_prefetch", 4)
    assert ("MX_PDL_PF", 4) in ex.gemm_defines(ex.tune_for(fmt), fmt)
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    graph, out = capture_graph(lambda: _chain(x, norm_w, weights, gate_up, down), stream, pool)
    assert len(overlapping) >= len(weights) + 3, f"{len(overlapping)} overlapped launches in the capture"
    for i in range(3):
        x[...] = cp.asarray(rng.standard_normal((m, d)).astype(np.float32) * (1 + i))
        cp.cuda.get_current_stream().synchronize()
        monkeypatch.setitem(ex.TUNE, "pdl_prefetch", 0)
        monkeypatch.setitem(pdl.MODE, "pdl", "0")
        plain = _chain(x, norm_w, weights, gate_up, down)
        monkeypatch.setitem(pdl.MODE, "pdl", "1")
        monkeypatch.setitem(ex.TUNE, "pdl_prefetch", 4)
        cp.cuda.get_current_stream().synchronize()
        graph.launch(stream)
        stream.synchronize()
        assert_same_bytes(out, plain, f"graph replay, input {i}")


def test_products_asking_the_l2_before_their_wait_keep_model_steps(monkeypatch, overlapping):
    """TUNE `pdl_prefetch` changes no byte of decode steps of the tiny qwen3_5 checkpoint with MXFP4 matrices on the
    server's backend, as graphs captured with overlapped launches: 8 chunks against none (logits, KV pages and
    states)."""
    from decapybara.backend.cuda_factory import cuda_backend
    from decapybara.testing import quantized_matrices, tiny_checkpoint

    cfg, tensors = tiny_checkpoint("qwen3_5_text")
    tensors = quantized_matrices(tensors, "mxfp4")
    model = QwenModel.from_tensors(cfg, cuda_backend("bf16"), tensors)
    kv, states = model.new_kv_cache(KV_PAGES, PAGE, "16/16"), model.new_state_pool(5)
    seqs = prefilled_sequences(model, kv, states, (6, 13, 21), seed=2)
    chunks = {"off": 0, "on": 8}
    runners = {name: graph_runner(model) for name in chunks}

    def run(name, step, batch):
        monkeypatch.setitem(ex.TUNE, "pdl_prefetch", chunks[name])
        return runners[name].forward(batch, kv, states).logits

    compare_steps(seqs, kv, states, list(chunks), run, (("off", "on"),), 3)
    assert all(r.stats["graph_steps"] == 3 and not r.stats["failures"] for r in runners.values()), \
        [r.stats for r in runners.values()]
    assert len(overlapping) > 20, f"{len(overlapping)} overlapped launches"


@pytest.mark.parametrize("kv_mode,head_dim,family", [("16/16", 64, "qwen3_5_text"), ("6/4", 128, "qwen3_5_text"),
                                                     ("16/16", 64, "qwen3_5_moe_text")])
def test_model_steps_are_identical_with_and_without_overlap(kv_mode, head_dim, family, monkeypatch, overlapping):
    model, kv, states, seqs = hybrid_model(head_dim, kv_mode, 5, (6, 13, 21), 2, family)
    assert family != "qwen3_5_moe_text" or model.fused_moe, "the MoE layers should run from their stacks"
    runners = {flag: graph_runner(model) for flag in ("0", "1")}  # graphs captured with and without overlap

    def run(name, step, batch):
        kind, flag = name.split()
        monkeypatch.setitem(pdl.MODE, "pdl", {"1": "always"}.get(flag, flag) if kind == "eager" else flag)
        fwd = model.forward if kind == "eager" else runners[flag].forward
        return fwd(batch, kv, states).logits

    compare_steps(seqs, kv, states, ["eager 0", "eager 1", "graph 0", "graph 1"], run,
                  (("eager 0", "eager 1"), ("graph 0", "graph 1")), 4)
    assert all(r.stats["graph_steps"] == 4 for r in runners.values()), [r.stats for r in runners.values()]
    assert len(overlapping) > 80, f"{len(overlapping)} overlapped launches"


def test_model_steps_are_identical_with_side_stream_pairs(monkeypatch, overlapping, forks):
    """CupyBackend.linear_pair (a DeltaNet layer's qkv|z and b|a products, the second on a side stream that forks
    and joins around it) gives the bytes of the two products one after the other: logits, KV pages and states
    of decode steps of a tiny hybrid model, eager and as graphs captured with overlapped launches (the side
    product overlapped or launched plainly)."""
    from decapybara.backend import cupy_backend as cb

    model, kv, states, seqs = hybrid_model(64, "16/16", 7, (5, 11, 19), 3)
    assert model.fused_dn, "the tiny hybrid model's DeltaNet products should be fused pairs"
    variants = {"eager serial": {"side_stream": False}, "eager side": {"side_stream": True},
                "graph serial": {"side_stream": False}, "graph side": {"side_stream": True, "side_pdl": True},
                "graph side plain": {"side_stream": True, "side_pdl": False}}
    runners = {name: graph_runner(model) for name in variants if name.startswith("graph")}

    def run(name, step, batch):
        setting = variants[name]
        monkeypatch.setitem(cb.PAIRS, "side_stream", setting["side_stream"])
        monkeypatch.setitem(cb.PAIRS, "side_pdl", setting.get("side_pdl", True))
        n = len(forks)
        fwd = model.forward if name.startswith("eager") else runners[name].forward
        logits = fwd(batch, kv, states).logits
        if name.startswith("eager") or step == 0:  # a graph forks while it is captured (step 0)
            assert (len(forks) > n) == setting["side_stream"], (name, step, len(forks) - n)
        return logits

    compare_steps(seqs, kv, states, list(variants), run, (("eager serial", "eager side"), ("graph serial", "graph side"),
                                                          ("graph serial", "graph side plain")), 3)
    assert all(r.stats["graph_steps"] == 3 and not r.stats["failures"] for r in runners.values()), \
        [r.stats for r in runners.values()]
    assert len(overlapping) > 80, f"{len(overlapping)} overlapped launches"


@pytest.mark.parametrize("rows", [1, 5, 12, 80])
def test_linear_pair_matches_two_linears(rows, monkeypatch, forks):
    """linear_pair over the normed rows a fused output projection leaves (NormedRows up to 8 rows, bf16 bits
    at 12, float32 past 64): two bf16 matrices that read them as they are, and a float32 one beside a bf16 one
    (which materialises NormedRows on its own stream), the same bytes as two `linear` calls on one stream;
    forked up to 64 rows (the skinny kernels), not past (cuBLAS) nor beside a product that takes cuBLAS (a
    float32 matrix that is a transposed view)."""
    from decapybara.backend import cupy_backend as cb
    from decapybara.model.quant.elements import bf16_encode

    rng = np.random.default_rng(rows)
    be = CupyBackend("bf16")
    k = 256
    w_out = cp.asarray(bf16_encode((rng.standard_normal((k, 192)) * 0.05).astype(np.float32)))
    w_a = cp.asarray(bf16_encode((rng.standard_normal((320, k)) * 0.05).astype(np.float32)))
    w_b = cp.asarray(bf16_encode((rng.standard_normal((24, k)) * 0.05).astype(np.float32)))
    w_f = cp.asarray((rng.standard_normal((40, k)) * 0.05).astype(np.float32))
    w_t = cp.asarray((rng.standard_normal((k, 40)) * 0.05).astype(np.float32)).T  # cp.matmul: cuBLAS
    x = cp.asarray(rng.standard_normal((rows, 192)).astype(np.float32))
    res = cp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    nw = cp.asarray((rng.standard_normal(k) * 0.1 + 1).astype(np.float32))
    normed, _ = be.linear_add_rms_norm(x, w_out, None, res, nw, 1e-6, 0.0)
    assert isinstance(normed, ex.NormedRows) == (rows <= ex.FUSED_ROWS), type(normed)
    for wa, wb in ((w_a, w_b), (w_f, w_b), (w_b, w_f), (w_b, w_t)):
        monkeypatch.setitem(cb.PAIRS, "side_stream", False)
        ref = be.linear_pair(normed, wa, wb)
        monkeypatch.setitem(cb.PAIRS, "side_stream", True)
        n = len(forks)
        got = be.linear_pair(normed, wa, wb)
        assert (len(forks) > n) == (rows <= cb.SKINNY_ROWS and wb is not w_t), (rows, wa.dtype, wb.dtype)
        for g, r, name in zip(got, ref, ("first", "second")):
            assert_same_bytes(g, r, f"{name} product, {rows} rows, {wa.dtype} / {wb.dtype}")

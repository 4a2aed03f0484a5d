"""The whole model on the CUDA backend against the numpy reference, on the four tiny families (GPU only).

fp32 mode computes the reference function: logits within 1e-4 relative (max-norm) and greedy generation
through the engine token-identical. bf16 mode is checked against a numpy emulation of its rounding (bf16
weights, bf16 GEMM operands, bf16 KV pages) and, loosely, against the float32 reference.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from decapybara.backend.base import HybridState
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.backend.kv_codec import f32_to_bf16_bits
from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request
from decapybara.model import quant
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import with_yarn
from decapybara.model.qwen import QwenModel
from decapybara.testing import FAMILIES, tiny_checkpoint

pytestmark = pytest.mark.gpu
PROMPT = np.random.default_rng(1234).integers(0, 512, 40)


def build(family: str, backend) -> QwenModel:
    cfg, tensors = tiny_checkpoint(family)
    return QwenModel.from_tensors(cfg, backend, tensors)


def bf16_round(a: np.ndarray) -> np.ndarray:
    return (f32_to_bf16_bits(a).astype(np.uint32) << 16).view(np.float32)


class NumpyBF16(NumpyBackend):
    """The numpy reference with the bf16 backend's rounding: bf16 matrices, bf16 GEMM operands, bf16 KV."""

    def prepare_weight(self, name, value):
        w = super().prepare_weight(name, value)
        return bf16_round(w) if (w.ndim >= 2 and not name.endswith("conv1d.weight")) else w

    def linear(self, x, weight, bias=None):
        return super().linear(bf16_round(x), weight, bias)

    def new_kv_cache(self, cfg, num_pages, page_size, kv_mode=None):
        return super().new_kv_cache(cfg, num_pages, page_size, kv_mode or "16/16")


def forward_chunks(model: QwenModel, ids: np.ndarray, chunk: int, kv_mode=None) -> np.ndarray:
    """Logits of every row of `ids` run in chunks of `chunk` tokens (host float32 [len(ids), vocab])."""
    kv = model.new_kv_cache(16, 8, kv_mode)
    states = model.new_state_pool(2) if model.cfg.linear_layers else None
    if states is not None:
        states.reset(1)
    out = []
    table = np.arange(15, -1, -1)  # pages in reverse order: block tables really indirect
    for s in range(0, len(ids), chunk):
        b = ForwardBatch.build([(ids[s:s + chunk], s, table, 1)], 8, logits="all")
        out.append(model.backend.to_host(model.forward(b, kv, states).logits))
    return np.concatenate(out)


def rel_err(got: np.ndarray, ref: np.ndarray, name: str) -> float:
    assert got.shape == ref.shape, f"{name}: shape {got.shape} vs {ref.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN at {np.argwhere(np.isnan(got))[0]}"
    err = np.abs(got.astype(np.float64) - ref)
    rel = float(err.max() / np.abs(ref).max())
    i = np.unravel_index(int(err.argmax()), err.shape)
    print(f"{name}: max rel err {rel:.3e} at {i} (got {got[i]:.6g}, ref {ref[i]:.6g})")
    return rel


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [40, 7, 1])
def test_fp32_logits_match_numpy(family, chunk):
    """Both float32 implementations against the exact function (the numpy model in float64): the CUDA one
    within 1e-4, or, where float32 rounding of the hybrid recurrence itself reaches that (~1e-4), no
    further from exact than 1.5x the float32 reference is."""
    exact = forward_chunks(build(family, NumpyBackend(np.float64)), PROMPT, chunk)
    ref = forward_chunks(build(family, NumpyBackend()), PROMPT, chunk)
    got = forward_chunks(build(family, CupyBackend("fp32")), PROMPT, chunk)
    ref_err = rel_err(ref, exact, f"{family} numpy fp32 chunk {chunk}")
    assert rel_err(got, ref, f"{family} fp32 vs numpy fp32 chunk {chunk}") <= 3e-4
    assert rel_err(got, exact, f"{family} fp32 chunk {chunk}") <= max(1e-4, 1.5 * ref_err)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("kv_mode", ["16/16", "8/8", "6/4", "4/4"])
def test_fp32_logits_with_kv_modes_match_numpy(family, kv_mode):
    """The same quantised KV bytes on both sides, so only float rounding separates the logits."""
    ref = forward_chunks(build(family, NumpyBackend()), PROMPT, 13, kv_mode)
    got = forward_chunks(build(family, CupyBackend("fp32")), PROMPT, 13, kv_mode)
    assert rel_err(got, ref, f"{family} kv {kv_mode}") <= 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_generation_identical_through_engine(family):
    """Three prompts batched through the engine (chunked prefill, decode, paged KV, DeltaNet slots)."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 23, 41)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    cfg = EngineConfig(page_size=8, num_pages=96, max_batch_tokens=32, max_slots=4, loop_guard="off")
    ref = Engine(build(family, NumpyBackend()), cfg).generate(prompts, params)
    got = Engine(build(family, CupyBackend("fp32")), cfg).generate(prompts, params)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert len(b) == 64, f"reference produced {len(b)} tokens"
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"{family} prompt {i}: first difference at token {first}: {a[first:first + 4]} vs {b[first:first + 4]}"


@pytest.mark.parametrize("width", [1, 2])
def test_fp32_conv_widths_match_numpy(width):
    """A DeltaNet causal conv narrower than the default 4 (`linear_conv_kernel_dim` 1: no conv state at all):
    the kernels built for that width give the numpy logits in chunks of 7 and 1 tokens, and greedy tokens through
    the engine (its decode graphs) equal the numpy engine's."""
    from decapybara.model.config import ModelConfig
    from decapybara.testing import canonical_tensors, make_hf_model

    hf = make_hf_model("qwen3_5_text", seed=7, overrides={"linear_conv_kernel_dim": width})
    cfg, tensors = ModelConfig.from_hf(hf.config.to_dict()), canonical_tensors(hf)
    assert cfg.linear_conv_kernel_dim == width

    def model(backend):
        return QwenModel.from_tensors(cfg, backend, tensors)

    for chunk in (7, 1):
        ref = forward_chunks(model(NumpyBackend()), PROMPT, chunk)
        got = forward_chunks(model(CupyBackend("fp32")), PROMPT, chunk)
        assert rel_err(got, ref, f"width {width} chunk {chunk}") <= 3e-4
    prompts = [PROMPT[:5].tolist(), PROMPT[:23].tolist()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ecfg = EngineConfig(page_size=8, num_pages=64, max_batch_tokens=32, max_slots=4, loop_guard="off")
    assert Engine(model(CupyBackend("fp32")), ecfg).generate(prompts, params) == \
        Engine(model(NumpyBackend()), ecfg).generate(prompts, params)


def test_fp32_prompt_logprobs_match_numpy_through_engine():
    """Prompt logprobs (`SamplingParams.prompt_logprobs`) on the device: a prompt in chunks beside another
    request, each token's logprob and its three best alternatives (`Backend.token_logprobs`: the log-softmax and a
    partition where the logits are) equal the numpy engine's within float32 rounding."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 512, n).tolist() for n in (45, 17)]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3), SamplingParams(temperature=0, max_tokens=5)]
    cfg = EngineConfig(page_size=8, num_pages=96, max_batch_tokens=16, max_slots=4, loop_guard="off")
    got = {}
    for name, backend in (("numpy", NumpyBackend()), ("cupy", CupyBackend("fp32"))):
        e = Engine(build("qwen3_5_text", backend), cfg)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            e.add_request(Request(tuple(p), sp, f"r{i}"))
        while e.has_work():
            for ev in e.step():
                if ev.prompt_logprobs is not None:
                    got[name] = ev.prompt_logprobs
    ref, dev = got["numpy"], got["cupy"]
    assert len(dev) == len(ref) == 44
    assert max(abs(a[0] - b[0]) for a, b in zip(dev, ref)) < 1e-4
    for a, b in zip(dev, ref):
        assert len(a[1]) == len(b[1]) == 3
        assert all(abs(x[1] - y[1]) < 1e-4 for x, y in zip(a[1], b[1]))
        gaps = np.diff([v for _, v in b[1]])
        if np.all(gaps < -1e-3):  # no near-tie: the same ids
            assert [t for t, _ in a[1]] == [t for t, _ in b[1]]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_fp32_yarn_logits_and_greedy_graphs_match_numpy(family):
    """A model served past its trained context (`with_yarn`, x4): the host's rotary tables feed every backend,
    so the CUDA model's logits and its greedy tokens through the engine's decode graphs are the numpy
    reference's, as without YaRN."""
    cfg, tensors = tiny_checkpoint(family)
    ext = with_yarn(cfg, 4 * cfg.max_position_embeddings)
    assert ext.rope.kind == "yarn"
    ref = forward_chunks(QwenModel.from_tensors(ext, NumpyBackend(), tensors), PROMPT, 7)
    got = forward_chunks(QwenModel.from_tensors(ext, CupyBackend("fp32"), tensors), PROMPT, 7)
    assert rel_err(got, ref, f"{family} yarn") <= 3e-4
    prompts = [np.random.default_rng(11).integers(0, 512, n).tolist() for n in (9, 30)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ecfg = EngineConfig(page_size=8, num_pages=4 * cfg.max_position_embeddings // 8 + 2, max_batch_tokens=32,
                        max_slots=4, loop_guard="off")  # a pool that holds the whole extended context
    want = Engine(QwenModel.from_tensors(ext, NumpyBackend(), tensors), ecfg).generate(prompts, params)
    engine = Engine(QwenModel.from_tensors(ext, CupyBackend("fp32"), tensors), ecfg)
    assert engine.generate(prompts, params) == want and engine.max_model_len == 4 * cfg.max_position_embeddings


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_close(family):
    """Against the bf16 emulation: every row within 1e-2 relative (MoE: 90 % of rows -- a near-tie in the
    router may pick another expert on one side). Against float32 only a sanity bound: these random tiny
    models amplify bf16 rounding (hybrid layers up to ~15 %, MoE routing flips)."""
    emul = forward_chunks(build(family, NumpyBF16()), PROMPT, 40)
    got = forward_chunks(build(family, CupyBackend("bf16")), PROMPT, 40)
    ref32 = forward_chunks(build(family, NumpyBackend()), PROMPT, 40)
    rel_err(got, ref32, f"{family} bf16 vs fp32 reference")
    top1 = float(np.mean(got.argmax(-1) == ref32.argmax(-1)))
    print(f"{family} bf16: top-1 agreement with fp32 {top1:.3f}")
    assert top1 >= 0.6
    rel_err(got, emul, f"{family} bf16 vs bf16 emulation")
    rows = np.abs(got - emul).max(-1) / np.abs(emul).max()
    good = float(np.mean(rows <= 1e-2))
    print(f"{family} bf16: {good:.3f} of rows within 1e-2 of the emulation; worst rows {np.sort(rows)[-3:]}")
    assert good >= (0.9 if "moe" in family else 1.0)


def fused_and_unfused(family: str, backend, bias: bool, monkeypatch) -> tuple[QwenModel, QwenModel]:
    """The model with q|k|v stacked (one product per attention layer) and without (three products)."""
    from test_fused_products import with_attention_biases

    cfg, tensors = tiny_checkpoint(family)
    if bias:
        cfg, tensors = with_attention_biases(cfg, tensors)
    fused = QwenModel.from_tensors(cfg, backend(), tensors)
    with monkeypatch.context() as m:
        m.setattr(QwenModel, "_fuse_attention_inputs", lambda self: {})
        plain = QwenModel.from_tensors(cfg, backend(), tensors)
    assert len(fused.fused_qkv) == len(cfg.attention_layers) and not plain.fused_qkv
    return fused, plain


@pytest.mark.parametrize("kv_mode", [None, "16/16", "6/4"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])  # without / with the output gate
def test_fp32_fused_qkv_is_bit_identical(family, bias, kv_mode, monkeypatch):
    """fp32: k and v as strided column views of the fused product (qk_norm_rope, the KV write of float32 / bf16
    / microscaled pages read them in place) give the three products' logits bit for bit, prefill chunks and
    decode (every product here has at most 64 rows: gemv_f32, one column each, whatever the matrix's height)."""
    fused, plain = fused_and_unfused(family, lambda: CupyBackend("fp32"), bias, monkeypatch)
    for chunk in (13, 1):
        got = forward_chunks(fused, PROMPT[:27], chunk, kv_mode)
        ref = forward_chunks(plain, PROMPT[:27], chunk, kv_mode)
        assert not np.isnan(got).any()
        np.testing.assert_array_equal(got, ref, err_msg=f"{family} bias={bias} kv {kv_mode} chunk {chunk}")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_bf16_fused_qkv_matches_unfused(family, monkeypatch):
    """bf16: the fused product's launch plan may split K differently (float32 sums in another order), so the
    logits agree to rounding (these tiny models amplify bf16 rounding: the bf16 tests' 1e-2), not bits."""
    fused, plain = fused_and_unfused(family, lambda: CupyBackend("bf16"), False, monkeypatch)
    got, ref = forward_chunks(fused, PROMPT, 13), forward_chunks(plain, PROMPT, 13)
    assert rel_err(got, ref.astype(np.float64), f"{family} bf16 fused q|k|v vs unfused") <= 1e-2
    assert float(np.mean(got.argmax(-1) == ref.argmax(-1))) >= 0.95


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe_text"])
def test_quantised_weights_dequantise_on_device(family):
    """QuantTensor weights (MXFP8 / MXFP6 / MXFP4 / NVFP4) prepared by the backend give the numpy logits."""
    cfg, tensors = tiny_checkpoint(family)
    fmts = ["mxfp8", "mxfp6", "mxfp4", "nvfp4"]
    q = {name: (quant.quantize(w, fmts[i % 4]) if w.ndim >= 2 and not name.endswith("conv1d.weight") else w)
         for i, (name, w) in enumerate(sorted(tensors.items()))}
    ref = forward_chunks(QwenModel.from_tensors(cfg, NumpyBackend(), q), PROMPT, 40)
    got = forward_chunks(QwenModel.from_tensors(cfg, CupyBackend("fp32"), q), PROMPT, 40)
    assert rel_err(got, ref, f"{family} quantised weights") <= 1e-4


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_pause_resume_moves_pages_and_state_exactly(family):
    """Export a sequence's pages + state, import them elsewhere (other pages, other slot): identical decode."""
    model = build(family, CupyBackend("fp32"))
    hybrid = bool(model.cfg.linear_layers)
    kv = model.new_kv_cache(16, 8)
    states = model.new_state_pool(3) if hybrid else None
    if hybrid:
        states.reset(0)
    table = np.arange(0, 8)
    model.forward(ForwardBatch.build([(PROMPT[:30], 0, table, 0)], 8), kv, states)
    pages = kv.export_pages(table[:4])
    state = states.get(0) if hybrid else None
    moved = np.arange(8, 16)
    kv.import_pages(moved[:4], pages)
    if hybrid:
        states.set(2, state)
    a = model.forward(ForwardBatch.build([(PROMPT[30:34], 30, table, 0)], 8, logits="all"), kv, states).logits
    b = model.forward(ForwardBatch.build([(PROMPT[30:34], 30, moved, 2)], 8, logits="all"), kv, states).logits
    assert rel_err(cp.asnumpy(b), cp.asnumpy(a).astype(np.float64), f"{family} resumed") <= 1e-6


def test_state_pool_copies_slots_and_device_states_in_one_launch(monkeypatch):
    """`copy` and `set` from device arrays (a verification graph's rollback point) run copy_segments once: every
    layer's conv and recurrent state lands in the slot exactly, the other slots untouched; odd-sized arrays
    (4-byte words) and 16-byte ones alike."""
    from decapybara.backend import cupy_kv

    calls = []
    get = cupy_kv.get_kernel
    monkeypatch.setattr(cupy_kv, "get_kernel", lambda m, f, d=(): calls.append(f) or get(m, f, d))
    model = build("qwen3_5_text", CupyBackend("fp32"))
    states = model.new_state_pool(4)
    rng = np.random.default_rng(11)
    for d in (states.conv, states.rec):
        for a in d.values():
            a[...] = cp.asarray(rng.standard_normal(a.shape).astype(np.float32))
    before = {s: states.get(s) for s in range(4)}
    states.copy(1, 3)
    assert calls == ["copy_segments"]
    src = HybridState([cp.asarray(rng.standard_normal(c.shape).astype(np.float32)) for c in before[0].conv],
                      [cp.asarray(rng.standard_normal(r.shape).astype(np.float32)) for r in before[0].recurrent])
    states.set(0, src)
    assert calls == ["copy_segments"] * 2
    after = {s: states.get(s) for s in range(4)}
    for j in range(len(states.layers)):
        assert np.array_equal(after[3].conv[j], before[1].conv[j]) and np.array_equal(after[3].recurrent[j],
                                                                                      before[1].recurrent[j])
        assert np.array_equal(after[0].conv[j], cp.asnumpy(src.conv[j]))
        assert np.array_equal(after[0].recurrent[j], cp.asnumpy(src.recurrent[j]))
        for s in (1, 2):
            assert np.array_equal(after[s].recurrent[j], before[s].recurrent[j])
    odd = [cp.asarray(rng.standard_normal(n).astype(np.float32)) for n in (1, 5, 4099)]
    dst = [cp.zeros_like(a) for a in odd]
    cupy_kv.copy_many(list(zip(odd, dst)))
    assert all(np.array_equal(cp.asnumpy(a), cp.asnumpy(b)) for a, b in zip(odd, dst))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("kv_mode", [None, "6/4"])
def test_prefix_pages_through_the_tiers_and_a_restart_keep_greedy_tokens(family, kv_mode, tmp_path):
    """On the CUDA backend (decode graphs on): a system prompt's pages evicted from a small pool to the RAM / disk
    tiers come back on its next use, and after a graceful stop's save (`save_cached_pages`) an engine over the
    same disk adopts and restores them; both give the greedy tokens of a CUDA engine without any prefix cache."""
    from decapybara.engine.sequence import Request
    from decapybara.kv.disk_tier import DiskTierStore
    from decapybara.kv.ram_tier import RamTierStore
    from decapybara.kv.stores import TierStores
    from decapybara.kv.tiers import KVTiers

    url = f"file://{tmp_path}/kv"
    model = build(family, CupyBackend("fp32"))

    def engine_over(num_pages: int, ram_bytes: int) -> tuple[Engine, TierStores]:
        engine = Engine(model, EngineConfig(page_size=8, num_pages=num_pages, kv_mode=kv_mode, loop_guard="off",
                                            snapshot_interval=8, max_slots=4))
        stores = TierStores(KVTiers(RamTierStore(ram_bytes), DiskTierStore(url, 64 << 20)), engine.blocks.salt)
        engine.bundle_store = stores
        engine.set_page_store(stores)
        return engine, stores

    def run(engine: Engine, rid: str, tokens: list[int], params: SamplingParams) -> list[int]:
        engine.add_request(Request(tuple(tokens), params, rid))
        out: list[int] = []
        while engine.has_work():
            for ev in engine.step():
                out += ev.token_ids
        return out

    rng = np.random.default_rng(21)
    system = rng.integers(0, 512, 40).tolist()  # five pages
    second = system + rng.integers(0, 512, 9).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine, stores = engine_over(num_pages=14, ram_bytes=1 << 20)
    want = Engine(model, EngineConfig(page_size=8, num_pages=64, kv_mode=kv_mode, loop_guard="off",
                                      enable_prefix_cache=False, max_model_len=engine.max_model_len)).generate(
        [second], greedy)[0]
    run(engine, "a", system + [1, 2, 3], short)
    for i in range(3):  # other traffic pushes the system prompt's pages out of the pool
        run(engine, f"x{i}", rng.integers(0, 512, 60).tolist(), short)
    assert engine.stats.offloaded_pages >= 5
    before = engine.stats.computed_prompt_tokens
    assert run(engine, "b", second, greedy) == want
    assert engine.stats.restored_pages >= 5 and engine.stats.computed_prompt_tokens - before == len(second) - 40
    assert engine.save_cached_pages() >= 5
    engine, stores = engine_over(num_pages=14, ram_bytes=1 << 20)  # a restart: fresh RAM, the same disk
    assert stores.adopt_pages() >= 5
    assert run(engine, "c", second, greedy) == want  # the save held b's own pages too: at most its last token left
    assert engine.stats.restored_pages >= 5 and engine.stats.computed_prompt_tokens <= len(second) - 40

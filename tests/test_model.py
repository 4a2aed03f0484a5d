"""The numpy model against HF transformers, through the real path: HF folder -> builder -> .mcapy -> load.

Norm: max |ours - hf| / max |hf| over all logits of a 40-token prompt (fp32), required <= 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.builder.build import build
from decapybara.errors import ConfigError
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig, named_config, param_count
from decapybara.model.load import load_model
from decapybara.model.qwen import QwenModel
from decapybara.model.weights import expected_tensors, random_tensors
from decapybara.testing import (
    FAMILIES,
    TINY_HF_CONFIGS,
    canonical_tensors,
    make_hf_model,
    save_hf_checkpoint,
    tiny_qwen,
)

PROMPT = np.random.default_rng(1234).integers(0, 512, 40)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    family = request.param
    hf = make_hf_model(family, seed=7)
    d = tmp_path_factory.mktemp(family)
    save_hf_checkpoint(hf, d / "hf")
    build(str(d / "hf"), str(d / "m.mcapy"), weights="fp32")
    return family, hf, load_model(str(d / "m.mcapy"))


def forward_chunks(model, ids, chunk):
    cfg = model.cfg
    kv = model.new_kv_cache(16, 8)
    states = model.new_state_pool(1) if cfg.linear_layers else None
    if states is not None:
        states.reset(0)
    out = []
    for s in range(0, len(ids), chunk):
        b = ForwardBatch.build([(ids[s:s + chunk], s, np.arange(16), 0)], 8, logits="all")
        out.append(model.forward(b, kv, states).logits)
    return np.concatenate(out)


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_logits_match_transformers(pair):
    family, hf, loaded = pair
    with torch.no_grad():
        ref = hf(torch.tensor(PROMPT)[None]).logits[0].numpy()
    ours = forward_chunks(loaded.model, PROMPT, 40)
    assert rel_err(ours, ref) <= 1e-4, family


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_chunked_prefill_equals_one_chunk(pair, chunk):
    """fp32: chunking changes only float rounding (GEMV vs GEMM sums, recurrent vs chunked DeltaNet), which
    the hybrid layers amplify to ~1e-4 relative; in float64 the chunkings agree to ~1e-13 (exact)."""
    family, hf, loaded = pair
    one = forward_chunks(loaded.model, PROMPT, 40)
    assert rel_err(forward_chunks(loaded.model, PROMPT, chunk), one) <= 3e-4
    exact = QwenModel.from_tensors(loaded.config, NumpyBackend(np.float64), canonical_tensors(hf))
    ref64 = forward_chunks(exact, PROMPT, 40)
    assert rel_err(forward_chunks(exact, PROMPT, chunk), ref64) <= 1e-11


def test_greedy_64_tokens_identical(pair):
    family, hf, loaded = pair
    prompt = PROMPT[:12]
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt)[None], max_new_tokens=64, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    model = loaded.model
    kv = model.new_kv_cache(16, 8)
    states = model.new_state_pool(1) if model.cfg.linear_layers else None
    if states is not None:
        states.reset(0)
    ids, ctx, out = list(prompt), 0, []
    for _ in range(64):
        b = ForwardBatch.build([(ids[ctx:], ctx, np.arange(16), 0)], 8)
        ctx = len(ids)
        tok = int(np.argmax(model.forward(b, kv, states).logits[-1]))
        out.append(tok)
        ids.append(tok)
    assert out == ref, family


def test_loaded_tokenizer_and_config(pair):
    _, hf, loaded = pair
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size <= loaded.config.vocab_size
    assert loaded.config.num_hidden_layers == hf.config.num_hidden_layers


@pytest.mark.parametrize("act", ["silu", "swish", "gelu", "relu"])
def test_config_refuses_an_activation_its_mlps_do_not_compute(act):
    """transformers builds every MLP and expert of these families with `ACT2FN[hidden_act]`; ours compute
    silu(gate) * up, so a config.json naming another activation is a `ConfigError`, not a silently other model."""
    hf = {**TINY_HF_CONFIGS["qwen3_5_moe_text"], "hidden_act": act}
    if act in ("silu", "swish"):  # the same function in transformers' table
        assert ModelConfig.from_hf(hf) == ModelConfig.from_hf(TINY_HF_CONFIGS["qwen3_5_moe_text"])
    else:
        with pytest.raises(ConfigError, match=f"hidden_act '{act}'"):
            ModelConfig.from_hf(hf)


def test_width_one_conv_matches_transformers():
    """A DeltaNet whose causal conv has width 1 (`linear_conv_kernel_dim` 1: no conv state to carry) prefills in
    chunks of several tokens and decodes as transformers computes it."""
    model, hf = tiny_qwen("qwen3_5_text", seed=7, overrides={"linear_conv_kernel_dim": 1, "num_hidden_layers": 2,
                                                              "layer_types": ["linear_attention", "full_attention"]})
    ids = PROMPT[:13]
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    for chunk in (5, 1):
        assert rel_err(forward_chunks(model, ids, chunk), ref) <= 1e-4, chunk


def test_named_27b_config_shapes():
    cfg = named_config("qwen3.8-27b")
    assert cfg.num_hidden_layers == 64 and len(cfg.attention_layers) == 16 and len(cfg.linear_layers) == 48
    assert cfg.attention_layers[:2] == (3, 7) and cfg.rotary_dim == 64
    assert 26e9 < param_count(cfg) < 29e9  # ~27B incl. embeddings, head and the MTP layer
    shapes = expected_tensors(cfg)
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 48 * 128, 5120)
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 24 * 256, 5120)


def test_random_weights_are_seeded_and_lazy():
    cfg = named_config("qwen3.8-27b")
    names = ["model.layers.0.input_layernorm.weight", "model.layers.3.self_attn.k_proj.weight"]
    gen = random_tensors(cfg, seed=3, names=names)  # any subset alone: the 27B model is never materialised
    first = dict(gen)
    assert list(first) == names and first[names[1]].shape == (4 * 256, 5120)
    assert first[names[1]].dtype == np.float32 and 0.015 < float(first[names[1]].std()) < 0.025
    again = dict(random_tensors(cfg, seed=3, names=names[1:]))
    assert np.array_equal(first[names[1]], again[names[1]])
    other = dict(random_tensors(cfg, seed=4, names=names[1:]))
    assert not np.array_equal(first[names[1]], other[names[1]])


def test_forward_tails_hook(pair):
    """`forward(..., tails=)`: a run from `tails.start(model, h)` stands in for `block_tail` at every layer (in
    order, with the mixer's output and the residual stream; it gives the next layer's input products, none after
    the last) and `finish` gives the residual stream at the end; a
    run that delegates to `block_tail` gives the plain forward's logits exactly; `start` returning None leaves
    the plain path."""
    model = pair[2].model
    calls = []

    class Run:
        def tail(self, i, out, h):
            calls.append(i)
            inputs, h = model.block_tail(i, out, h)
            if i + 1 == model.cfg.num_hidden_layers:
                assert inputs is None
            else:  # the next layer's input products: 2-D, one row a token
                assert inputs and all(a.ndim == 2 and a.shape[0] == len(PROMPT) for a in inputs)
            return inputs, h

        def finish(self, h):
            calls.append("finish")
            return h

    class Tails:
        def __init__(self, on):
            self.on = on

        def start(self, m, h):
            assert m is model and h.shape == (len(PROMPT), m.cfg.hidden_size)
            return Run() if self.on else None

    ref = model.forward(ForwardBatch.build([(PROMPT, 0, np.arange(16), 0)], 8, logits="all"), *pools(model)).logits
    for on in (True, False):
        calls.clear()
        b = ForwardBatch.build([(PROMPT, 0, np.arange(16), 0)], 8, logits="all")
        got = model.forward(b, *pools(model), tails=Tails(on)).logits
        np.testing.assert_array_equal(got, ref)
        assert calls == ([*range(model.cfg.num_hidden_layers), "finish"] if on else [])


def pools(model):
    kv = model.new_kv_cache(16, 8)
    states = model.new_state_pool(1) if model.cfg.linear_layers else None
    if states is not None:
        states.reset(0)
    return kv, states


def test_a_failed_forward_waits_for_its_snapshot_copies(pair, monkeypatch):
    """A forward that raises after a DeltaNet layer took a snapshot synchronises its backend before the error leaves
    it: on a GPU the snapshots' device-to-host copies are in flight into pinned buffers that go back to the pool
    with the failed forward (the next user of such a buffer would see the late copy land in it)."""
    model = pair[2].model
    if not model.cfg.linear_layers:
        pytest.skip("no DeltaNet layers: no snapshots")
    syncs = []
    monkeypatch.setattr(model.backend, "synchronize", lambda: syncs.append("sync"), raising=False)

    class Run:
        def tail(self, i, out, h):
            if i + 1 == model.cfg.num_hidden_layers:
                raise RuntimeError("a layer failed")
            return model.block_tail(i, out, h)

        def finish(self, h):
            return h

    class Tails:
        def start(self, m, h):
            return Run()

    for snaps, want in (([(20,)], ["sync"]), (None, [])):
        syncs.clear()
        b = ForwardBatch.build([(PROMPT, 0, np.arange(16), 0)], 8, logits="all", snapshot_at=snaps)
        with pytest.raises(RuntimeError, match="a layer failed"):
            model.forward(b, *pools(model), tails=Tails())
        assert syncs == want

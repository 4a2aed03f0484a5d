"""Fused products (`Backend.concat_rows`) in the model, on the CPU.

The CUDA backend stacks gate|up, qkv|z, b|a and an attention layer's q|k|v at load and `QwenModel` slices
column views of the fused products; only the GPU tests ran that path. Here a numpy backend that fuses
(`np.concatenate` + row-range views) runs it: the logits equal the unfused model's (the column order of every
split is right), the model's weights become views of the stacked matrices, and a backend that declines (None)
leaves the model as it was. One BLAS call over a stacked matrix may round a column differently from the call
over its part alone (OpenBLAS sgemm picks edge kernels by the matrix's size), so the bit-for-bit comparisons
use `PartwiseFusingBackend`, whose product of a stacked matrix is the products of its parts side by side: every
op after the product then sees exactly the unfused values, as the strided column views the GPU path passes.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.model.batch import ForwardBatch
from decapybara.model.qwen import QwenModel
from decapybara.model.weights import expected_tensors
from decapybara.testing import tiny_checkpoint


class FusingNumpyBackend(NumpyBackend):
    """NumpyBackend with `concat_rows` as CupyBackend does it for plain arrays."""

    def concat_rows(self, weights):
        if any(w.ndim != 2 or w.dtype != weights[0].dtype or w.shape[1] != weights[0].shape[1] for w in weights):
            return None
        fused = np.concatenate(weights, axis=0)
        bounds = np.cumsum([0] + [w.shape[0] for w in weights])
        return fused, [fused[a:b] for a, b in itertools.pairwise(bounds)]


class PartwiseFusingBackend(FusingNumpyBackend):
    """FusingNumpyBackend whose product with a stacked matrix is the products with its parts, side by side in
    one [T, sum N_i] array (bit for bit the unfused products; see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}

    def concat_rows(self, weights):
        got = super().concat_rows(weights)
        if got is not None:
            self.parts[id(got[0])] = got  # holds the stacked matrix, so its id stays its own
        return got

    def linear(self, x, weight, bias=None):
        got = self.parts.get(id(weight))
        if got is None or got[0] is not weight:
            return super().linear(x, weight, bias)
        y = np.concatenate([x @ part.T for part in got[1]], axis=1)
        return y + bias if bias is not None else y


def logits_of(model: QwenModel, chunks: list[int]) -> list[np.ndarray]:
    """Logits of every row, the prompt fed in `chunks` (prefill chunks, then decode steps)."""
    ids = np.random.default_rng(5).integers(0, model.cfg.vocab_size, sum(chunks))
    kv = model.new_kv_cache(16, 8)
    states = model.new_state_pool(1) if model.cfg.linear_layers else None
    out, lo = [], 0
    for n in chunks:
        batch = ForwardBatch.build([(ids[lo:lo + n], lo, np.arange(16, dtype=np.int32), 0)], 8, logits="all")
        out.append(np.asarray(model.forward(batch, kv, states).logits))
        lo += n
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text", "qwen3_5_moe_text"])
def test_fused_products_give_the_unfused_logits(family):
    cfg, tensors = tiny_checkpoint(family)
    plain = QwenModel.from_tensors(cfg, NumpyBackend(), tensors)
    fused = QwenModel.from_tensors(cfg, FusingNumpyBackend(), tensors)
    assert not plain.fused_mlp and not plain.fused_dn and not plain.fused_qkv
    assert fused.fused_mlp and len(fused.fused_dn) == len(cfg.linear_layers)
    assert len(fused.fused_qkv) == len(cfg.attention_layers)
    for m, stacked in fused.fused_mlp.items():
        gate, up = fused.w[f"{m}.gate_proj.weight"], fused.w[f"{m}.up_proj.weight"]
        assert np.shares_memory(gate, stacked) and np.shares_memory(up, stacked)
        np.testing.assert_array_equal(stacked, np.concatenate([tensors[f"{m}.gate_proj.weight"],
                                                               tensors[f"{m}.up_proj.weight"]]))
    for la, (qkvz, ba) in fused.fused_dn.items():
        assert np.shares_memory(fused.w[f"{la}.in_proj_z.weight"], qkvz)
        assert np.shares_memory(fused.w[f"{la}.in_proj_a.weight"], ba)
        np.testing.assert_array_equal(fused.w[f"{la}.in_proj_a.weight"], tensors[f"{la}.in_proj_a.weight"])
    chunks = [9, 4, 1, 1]
    for got, ref in zip(logits_of(fused, chunks), logits_of(plain, chunks)):
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()  # float32 rounding of stacked BLAS calls


def with_attention_biases(cfg, tensors, seed=3):
    """(cfg with attention_bias, tensors + seeded q / k / v / o biases)."""
    cfg = dataclasses.replace(cfg, attention_bias=True)
    rng = np.random.default_rng(seed)
    tensors = dict(tensors)
    for name, shape in expected_tensors(cfg).items():
        if name.endswith("_proj.bias"):
            tensors[name] = (rng.standard_normal(shape) * 0.3).astype(np.float32)
    return cfg, tensors


def greedy(model: QwenModel, prompt: np.ndarray, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens after `prompt` (one prefill, then `steps` decode forwards) and every forward's logits."""
    kv = model.new_kv_cache(16, 8)
    states = model.new_state_pool(1) if model.cfg.linear_layers else None
    table = np.arange(16, dtype=np.int32)
    new, ctx, tokens, logits = list(prompt), 0, [], []
    for _ in range(steps + 1):
        batch = ForwardBatch.build([(np.asarray(new), ctx, table, 0)], 8, logits="all")
        out = np.asarray(model.forward(batch, kv, states).logits)
        logits.append(out)
        ctx += len(new)
        new = [int(np.argmax(out[-1]))]
        tokens.append(new[0])
    return tokens, logits


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])  # without / with the output gate ([query | gate])
def test_fused_qkv_is_bit_identical(family, bias):
    """q|k|v as one product (q, k, v column views of it: k through qk_norm_rope, v straight into the KV write)
    gives the unfused model's logits bit for bit, prefill and decode, and the same greedy tokens; with biases
    they are stacked as well."""
    cfg, tensors = tiny_checkpoint(family)
    if bias:
        cfg, tensors = with_attention_biases(cfg, tensors)
    assert cfg.attn_output_gate == (family == "qwen3_5_text")
    plain = QwenModel.from_tensors(cfg, NumpyBackend(), tensors)
    fused = QwenModel.from_tensors(cfg, PartwiseFusingBackend(), tensors)
    assert not plain.fused_qkv and len(fused.fused_qkv) == len(cfg.attention_layers)
    for i in cfg.attention_layers:
        a = f"model.layers.{i}.self_attn"
        stacked, stacked_bias = fused.fused_qkv[a]
        names = [f"{a}.{n}_proj" for n in "qkv"]
        np.testing.assert_array_equal(stacked, np.concatenate([tensors[f"{n}.weight"] for n in names]))
        assert all(np.shares_memory(fused.w[f"{n}.weight"], stacked) for n in names)
        if bias:
            np.testing.assert_array_equal(stacked_bias, np.concatenate([tensors[f"{n}.bias"] for n in names]))
            assert all(np.shares_memory(fused.w[f"{n}.bias"], stacked_bias) for n in names)
        else:
            assert stacked_bias is None
    chunks = [9, 4, 1, 1]
    for got, ref in zip(logits_of(fused, chunks), logits_of(plain, chunks), strict=True):
        np.testing.assert_array_equal(got, ref)
    prompt = np.random.default_rng(8).integers(0, cfg.vocab_size, 7)
    (tok_f, log_f), (tok_p, log_p) = greedy(fused, prompt, 6), greedy(plain, prompt, 6)
    assert tok_f == tok_p
    for got, ref in zip(log_f, log_p, strict=True):
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_fused_qkv_single_product_matches(family, bias):
    """The same with the stacked matrix in one BLAS call: logits to float rounding, the same greedy tokens."""
    cfg, tensors = tiny_checkpoint(family)
    if bias:
        cfg, tensors = with_attention_biases(cfg, tensors)
    plain = QwenModel.from_tensors(cfg, NumpyBackend(), tensors)
    fused = QwenModel.from_tensors(cfg, FusingNumpyBackend(), tensors)
    prompt = np.random.default_rng(8).integers(0, cfg.vocab_size, 9)
    (tok_f, log_f), (tok_p, log_p) = greedy(fused, prompt, 6), greedy(plain, prompt, 6)
    assert tok_f == tok_p
    for got, ref in zip(log_f, log_p, strict=True):
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_fused_qkv_needs_biases_on_all_three_or_none():
    """A layer with a q bias but no k / v bias keeps its three products (the other layers still fuse)."""
    cfg, tensors = tiny_checkpoint("qwen3")
    a = f"model.layers.{cfg.attention_layers[0]}.self_attn"
    model = QwenModel.__new__(QwenModel)
    model.cfg, model.backend = cfg, FusingNumpyBackend()
    model.w = dict(tensors)
    model.w[f"{a}.q_proj.bias"] = np.ones(tensors[f"{a}.q_proj.weight"].shape[0], np.float32)
    fused = model._fuse_attention_inputs()
    assert a not in fused and len(fused) == len(cfg.attention_layers) - 1
    assert model.w[f"{a}.k_proj.weight"] is tensors[f"{a}.k_proj.weight"]


class Deferred:
    """Normed rows a backend hands back from `linear_add_rms_norm` in a deferred form: only `shape` and the
    backend's `linear` may touch them (anything else raises), as `NormedRows` on the GPU."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.shape = rows, rows.shape


class DeferringBackend(FusingNumpyBackend):
    """Fuses the output projections with the residual add and the next norm the way CupyBackend does (normed
    rows deferred to the next products), computing the plain values; counts the fused calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = 0

    def linear_add_rms_norm(self, x, weight, bias, residual, norm_weight, eps, offset):
        self.fused += 1
        normed, h = super().linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps, offset)
        return Deferred(normed), h

    def linear(self, x, weight, bias=None):
        return super().linear(x.rows if isinstance(x, Deferred) else x, weight, bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text"])
def test_output_projections_fuse_into_the_next_norm(family, bias):
    """Every block's output projection runs with the residual add and the next norm (`linear_add_rms_norm`)
    where that norm's rows go only to products: the post-attention norm before a dense MLP (not before a MoE
    block, whose router takes the rows) and the next layer's input norm after a dense MLP's down projection
    (a MoE block's output is no single product). The normed rows reach nothing but `linear`, and the logits
    are the unfused model's, bit for bit."""
    cfg, tensors = tiny_checkpoint(family)
    if bias:
        cfg, tensors = with_attention_biases(cfg, tensors)
    plain = QwenModel.from_tensors(cfg, FusingNumpyBackend(), tensors)
    backend = DeferringBackend()
    fused = QwenModel.from_tensors(cfg, backend, tensors)
    chunks = [9, 1, 1]
    for got, ref in zip(logits_of(fused, chunks), logits_of(plain, chunks)):
        np.testing.assert_array_equal(got, ref)
    dense = [not cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)]
    assert backend.fused == len(chunks) * (sum(dense) + sum(dense[:-1]))
    assert backend.fused > 0 or "moe" in family

"""The attention layer's optional fusions (`Backend.qk_norm_rope`, `Backend.sigmoid_gate`) on the CPU.

Their default implementations are the unfused ops bit for bit (q as the strided query columns of a fused
[query | gate] product included), `QwenModel` calls each once per attention layer, and its numpy logits equal,
bit for bit, those of the layer as written before the fusions (four norm / RoPE calls, `o * sigmoid(gate)`
over the gate reshaped to [T, nq * d]). The CUDA kernels are checked in tests/gpu/test_attention_fusions.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_fused_products import logits_of

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import FULL_ATTENTION
from decapybara.model.qwen import QwenModel
from decapybara.model.rope import RotaryTable, default_inv_freq
from decapybara.testing import tiny_checkpoint


def unfused_inputs(self: QwenModel, i: int, x: Any) -> list[Any]:
    """`QwenModel.layer_inputs`, but an attention layer's "inputs" are its normed rows (`unfused_attention` runs
    its products)."""
    return [x] if self.cfg.layer_types[i] == FULL_ATTENTION else LAYER_INPUTS(self, i, x)


LAYER_INPUTS = QwenModel.layer_inputs


def unfused_attention(self: QwenModel, p: str, layer: Any, inputs: list[Any], batch: ForwardBatch, kv: Any,
                      cos: Any, sin: Any) -> Any:
    """QwenModel._attention (with its input products) as it was before the fusions, op for op; inputs = [x]
    (`unfused_inputs`)."""
    (x,) = inputs
    cfg, ops, w = self.cfg, self.backend, self.w
    t, d = x.shape[0], cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    a = f"{p}.self_attn"
    q = ops.linear(x, w[f"{a}.q_proj.weight"], w.get(f"{a}.q_proj.bias"))
    if cfg.attn_output_gate:
        qg = q.reshape(t, nq, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, nq * d)
    else:
        q, gate = q.reshape(t, nq, d), None
    k = ops.linear(x, w[f"{a}.k_proj.weight"], w.get(f"{a}.k_proj.bias")).reshape(t, nkv, d)
    v = ops.linear(x, w[f"{a}.v_proj.weight"], w.get(f"{a}.v_proj.bias")).reshape(t, nkv, d)
    q = ops.rms_norm(q, w[f"{a}.q_norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
    k = ops.rms_norm(k, w[f"{a}.k_norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
    q = ops.rope(q, cos, sin, cfg.rotary_dim)
    k = ops.rope(k, cos, sin, cfg.rotary_dim)
    o = ops.paged_attention(kv, layer, q, k, v, batch, self.scale).reshape(t, nq * d)
    if gate is not None:
        o = o * ops.sigmoid(gate)
    return ops.linear(o, w[f"{a}.o_proj.weight"], w.get(f"{a}.o_proj.bias"))


class CountingBackend(NumpyBackend):
    """NumpyBackend counting calls of the two fusions."""

    def __init__(self) -> None:
        super().__init__(np.float32)
        self.calls = {"qk_norm_rope": 0, "sigmoid_gate": 0}

    def qk_norm_rope(self, *args: Any) -> tuple[Any, Any]:
        self.calls["qk_norm_rope"] += 1
        return super().qk_norm_rope(*args)

    def sigmoid_gate(self, o: Any, gate: Any, to_product: Any = None) -> Any:
        self.calls["sigmoid_gate"] += 1
        return super().sigmoid_gate(o, gate, to_product)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_model_logits_equal_the_unfused_layer(family, monkeypatch):
    cfg, tensors = tiny_checkpoint(family)
    backend = CountingBackend()
    model = QwenModel.from_tensors(cfg, backend, tensors)
    chunks = [7, 1, 1]
    fused = logits_of(model, chunks)
    layers = len(cfg.attention_layers) * len(chunks)
    assert backend.calls == {"qk_norm_rope": layers, "sigmoid_gate": layers if cfg.attn_output_gate else 0}
    monkeypatch.setattr(QwenModel, "_attention", unfused_attention)
    monkeypatch.setattr(QwenModel, "layer_inputs", unfused_inputs)
    for got, ref in zip(fused, logits_of(model, chunks), strict=True):
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("gated", [False, True])
def test_default_fusions_are_the_unfused_ops(dtype, gated):
    be = NumpyBackend(dtype)
    rng = np.random.default_rng(11)
    t, nq, nkv, d, rot = 5, 6, 2, 32, 16
    prod = (rng.standard_normal((t, nq * d * (2 if gated else 1))) * 3).astype(dtype)  # the q product
    qg = prod.reshape(t, nq, -1)
    q, gate = (qg[..., :d], qg[..., d:]) if gated else (qg, None)
    k = (rng.standard_normal((t, nkv, d)) * 3).astype(dtype)
    wq, wk = (rng.standard_normal(d) * 0.2).astype(dtype), (rng.standard_normal(d) * 0.2).astype(dtype)
    cos, sin = RotaryTable(default_inv_freq(1e7, rot), 1.0).cos_sin(rng.integers(0, 10**5, t))
    cos, sin = cos.astype(dtype), sin.astype(dtype)
    fq, fk = be.qk_norm_rope(q, k, wq, wk, 1e-6, 1.0, cos, sin, rot)
    np.testing.assert_array_equal(fq, be.rope(be.rms_norm(q, wq, 1e-6, 1.0), cos, sin, rot))
    np.testing.assert_array_equal(fk, be.rope(be.rms_norm(k, wk, 1e-6, 1.0), cos, sin, rot))
    if gated:
        o = rng.standard_normal((t, nq, d)).astype(dtype)
        ref = o.reshape(t, nq * d) * be.sigmoid(gate.reshape(t, nq * d))  # the layer's old form
        np.testing.assert_array_equal(be.sigmoid_gate(o, gate).reshape(t, nq * d), ref)

"""Fused products (`Backend.concat_rows`) in the model, on the CPU.

The CUDA backend stacks gate|up, qkv|z and b|a at load and `QwenModel` slices column views of the fused
products; only the GPU tests ran that path. Here a numpy backend that fuses (`np.concatenate` + row-range
views) runs it: the logits equal the unfused model's (the column order of every split is right), the model's
weights become views of the stacked matrices, and a backend that declines (None) leaves the model as it was.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.model.batch import ForwardBatch
from decapybara.model.qwen import QwenModel
from decapybara.testing import tiny_checkpoint


class FusingNumpyBackend(NumpyBackend):
    """NumpyBackend with `concat_rows` as CupyBackend does it for plain arrays."""

    def concat_rows(self, weights):
        if any(w.ndim != 2 or w.dtype != weights[0].dtype or w.shape[1] != weights[0].shape[1] for w in weights):
            return None
        fused = np.concatenate(weights, axis=0)
        bounds = np.cumsum([0] + [w.shape[0] for w in weights])
        return fused, [fused[a:b] for a, b in itertools.pairwise(bounds)]


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
    assert not plain.fused_mlp and not plain.fused_dn
    assert fused.fused_mlp and len(fused.fused_dn) == len(cfg.linear_layers)
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

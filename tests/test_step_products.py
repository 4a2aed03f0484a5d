"""bench/step_products.py: a decode step's dense products as the model fuses them, by shape and count."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.model.config import named_config
from decapybara.testing import tiny_qwen

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("step_products", ROOT / "bench" / "step_products.py")
step_products = sys.modules.setdefault("step_products", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(step_products)


def test_named_models_products():
    """The 27B's six products (the list bench/gemv_sweep.py timed by hand until it read this) and the 35B-A3B's
    four dense ones (its experts are grouped launches), in order, with their counts a step."""
    assert list(step_products.step_products(named_config("qwen3.8-27b")).items()) == [
        ("gate|up", ((34816, 5120), 64)), ("down", ((5120, 17408), 64)), ("qkv|z", ((16384, 5120), 48)),
        ("out", ((5120, 6144), 64)), ("q|k|v", ((14336, 5120), 16)), ("lm_head", ((248320, 5120), 1))]
    assert list(step_products.step_products(named_config("qwen3.8-35b-a3b")).items()) == [
        ("qkv|z", ((12288, 2048), 30)), ("out", ((2048, 4096), 40)), ("q|k|v", ((9216, 2048), 10)),
        ("lm_head", ((248320, 2048), 1))]


class FusingBackend(NumpyBackend):
    """The numpy backend with the fusion a GPU backend does: matrices stacked along rows, row-range views back."""

    def concat_rows(self, weights):
        fused = np.concatenate(weights, axis=0)
        ends = np.cumsum([w.shape[0] for w in weights])
        return fused, [fused[e - w.shape[0]:e] for e, w in zip(ends, weights, strict=True)]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_products_match_the_model_s_fused_weights(family):
    """A tiny model built on a backend that fuses: its stacked q|k|v, qkv|z and gate|up matrices and its unfused
    output projections (main layers, not the MTP head's) have the shapes and counts the list gives."""
    model, _ = tiny_qwen(family, backend=FusingBackend())
    main = lambda prefix: prefix.startswith("model.layers.")
    seen: Counter = Counter()
    seen.update(("q|k|v", v[0].shape) for k, v in model.fused_qkv.items() if main(k))
    seen.update(("qkv|z", v[0].shape) for k, v in model.fused_dn.items() if main(k))
    seen.update(("gate|up", v.shape) for k, v in model.fused_mlp.items() if main(k))
    for name, w in model.w.items():
        if main(name) and name.endswith((".o_proj.weight", ".out_proj.weight", "mlp.down_proj.weight")):
            seen["down" if "down" in name else "out", w.shape] += 1
    head = model.w.get("lm_head.weight", model.w["model.embed_tokens.weight"])
    seen["lm_head", head.shape] += 1
    want = Counter({(name.split(" ")[0], shape): count for name, (shape, count) in  # a role at two shapes:
                    step_products.step_products(model.cfg).items()})              # "out", "out 64x128"
    assert seen == want
    assert len(want) >= 4  # at least q|k|v, out, gate|up, down (and lm_head)

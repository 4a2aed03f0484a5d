"""bench/chain_bound.py's pure parts: a decode step's product chain in the step's order, and its variants."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from decapybara.model.config import named_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("chain_bound", ROOT / "bench" / "chain_bound.py")
chain_bound = sys.modules.setdefault("chain_bound", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(chain_bound)
from step_products import step_products  # bench/step_products.py


def test_27b_chain_runs_each_layers_products_in_step_order():
    """Per layer its input product (qkv|z in the 48 DeltaNet layers, q|k|v in the 16 attention ones), out, gate|up,
    down; lm_head last; as many of each as `step_products` counts, at MXFP4's bytes (codes + E8M0 scales)."""
    cfg = named_config("qwen3.8-27b")
    chain = chain_bound.step_chain(cfg)
    assert len(chain) == 64 * 4 + 1 and chain[-1][:2] == ("lm_head", -1)
    for i, kind in enumerate(cfg.layer_types):
        roles = [role for role, layer, _ in chain if layer == i]
        assert roles == ["qkv|z" if kind == "linear_attention" else "q|k|v", "out", "gate|up", "down"]
    products = step_products(cfg)
    assert Counter(role for role, _, _ in chain) == {role: count for role, (_, count) in products.items()}
    n, k = products["gate|up"][0]
    assert chain[2] == ("gate|up", 0, n * k // 2 + n * k // 32) == ("gate|up", 0, 94_699_520)
    total = sum(b for _, _, b in chain)
    assert total == sum(count * chain_bound.mxfp4_bytes(*shape) for shape, count in products.values())
    assert 13.5e9 < total < 14.5e9


def test_moe_chain_leaves_the_experts_out():
    """The 35B-A3B's layers run their input product and out as dense launches; its experts are grouped launches."""
    chain = chain_bound.step_chain(named_config("qwen3.8-35b-a3b"))
    assert {role for role, _, _ in chain} == {"qkv|z", "q|k|v", "out", "lm_head"}
    assert len(chain) == 40 * 2 + 1


def test_variants_parse_and_refuse_bad_specs():
    v = chain_bound.Variant.parse("persist:c:2:24")
    assert (v.kind, v.layout, v.bps, v.ahead, v.name, v.launched) == ("persist", 0, 2, 24, "persist:c:2:24", False)
    assert chain_bound.Variant.parse("spare:c:2:3").launched and chain_bound.Variant.parse("launch:c:2:3").launched
    assert chain_bound.Variant.parse(" launch:i:8:0").layout == 1
    w = chain_bound.Variant.parse("launch:c:2:0:64")
    assert (w.work, w.name, v.work) == (64, "launch:c:2:0:64", 0)
    for bad in ("persist:c:2", "spin:c:2:0", "read:x:2:0", "read:c:0:0", "read:c:1:-1", "read:c:1:0:1:2", "read:c:1:a"):
        with pytest.raises(ValueError):
            chain_bound.Variant.parse(bad)
    assert [chain_bound.Variant.parse(s).name for s in chain_bound.DEFAULT_VARIANTS.split(",")] == \
        chain_bound.DEFAULT_VARIANTS.split(",")
    assert chain_bound.rows_of(1) == 1 and chain_bound.rows_of(4096) == 1 and chain_bound.rows_of(4097) == 2

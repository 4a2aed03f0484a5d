"""What eager launches keep between calls (GPU only): a product's launch recipe on its weight
(`cupy_ops_extra._launch_of`, `PackedWeight.launches`; past DENSE_ROWS rows its bf16 dequantisation), TUNE's
resolved tunings (`tune_for`), kernel handles (`kernels.get_kernel`) and the NULL argument (`cupy_ops.null`).
Each is reused while nothing it derives from changed, and rebuilt when TUNE changes by any route (item set,
replacement by a plain dict, monkeypatch's undo), so that the products computed after a change are those of the
new tuning, against numpy.
"""

from __future__ import annotations

import copy
import pickle
import zlib

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_kernels_extra import assert_close, bf16_round, host, random_weight

from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra as ex

pytestmark = pytest.mark.gpu


def _product(w, x, w_ref, name):
    got = host(ex.mx_linear(cp.asarray(x), w))
    assert_close(got, bf16_round(x).astype(np.float64) @ w_ref.T, 1e-4, name)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_launch_recipes_follow_tune(fmt, monkeypatch):
    """One recipe a (weight, rows) while TUNE stays; a changed TUNE (set item, plain-dict replacement, undo)
    gives the new tuning's recipe, and the products stay right throughout."""
    rng = np.random.default_rng(zlib.crc32(f"recipe-{fmt}".encode()))
    wq, w_ref = random_weight(rng, fmt, (704, 1536))
    w = ex.pack_weight(wq)
    x = rng.standard_normal((3, 1536)).astype(np.float32)
    _product(w, x, w_ref, f"{fmt} first")
    first = ex._launch_of(w, 3, 3, None, False)
    assert ex._launch_of(w, 3, 3, None, False) is first, "the recipe was rebuilt with nothing changed"
    assert ex._launch_of(w, 5, 5, None, False) is not first, "another row count shares a recipe"
    assert first.warps == ex.tune_for(fmt)["warps"]
    version = ex.TUNE.version
    monkeypatch.setitem(ex.TUNE, "warps", 4)  # a TuneDict change
    assert ex.TUNE.version != version
    changed = ex._launch_of(w, 3, 3, None, False)
    assert changed is not first and changed.warps == 4 and changed.block == (128,)
    _product(w, x, w_ref, f"{fmt} warps 4")
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, "warps": 8, "policy": "stream"})  # a plain dict: nothing cached
    assert ex.tune_state() is None
    plain = ex._launch_of(w, 3, 3, None, False)
    assert plain.warps == 8 and ex._launch_of(w, 3, 3, None, False) is not plain
    _product(w, x, w_ref, f"{fmt} plain-dict TUNE, stream-K")
    monkeypatch.undo()  # back to the TuneDict, one version on (the undone setitem)
    again = ex._launch_of(w, 3, 3, None, False)
    assert again is not first and (again.warps, again.plan) == (first.warps, first.plan)
    _product(w, x, w_ref, f"{fmt} after undo")


def test_tune_for_is_cached_by_version():
    """tune_for(fmt) returns the same resolved dict while TUNE stays, a new one (with the new value) after a
    change; an explicit tuning is resolved afresh."""
    a = ex.tune_for("mxfp4")
    assert ex.tune_for("mxfp4") is a and ex.tune_for("bf16") is not a
    old = ex.TUNE["acc"]
    try:
        ex.TUNE["acc"] = old + 1
        b = ex.tune_for("mxfp4")
        assert b is not a and b["acc"] == old + 1
    finally:
        ex.TUNE["acc"] = old
    assert ex.tune_for("mxfp4")["acc"] == old
    assert ex.tune_for("mxfp4", {**ex.TUNE, "acc": 7})["acc"] == 7


def test_kernel_handles_and_null_are_reused():
    """A kernel asked twice is one handle (defines as a tuple or a list alike); NULL is one zero-size array a
    device, at device address 0."""
    k = kernels.get_kernel("decode_ops", "rms_norm_warp")
    assert kernels.get_kernel("decode_ops", "rms_norm_warp") is k
    d = (("MX_ONLY", -1),)
    assert kernels.get_kernel("mx_gemv", "mx_dequant_rows", d) is kernels.get_kernel("mx_gemv", "mx_dequant_rows",
                                                                                     list(d))
    n = ops.null()
    assert ops.null() is n and n.size == 0
    assert getattr(n.data, "ptr", 0) == 0  # (the host emulator's arrays have no device address)


def test_layout_checks_follow_the_arrays():
    """A weight's layout check is remembered for the arrays it passed with: codes swapped for ones of the wrong
    shape fail again."""
    rng = np.random.default_rng(5)
    wq, _ = random_weight(rng, "mxfp4", (64, 512))
    w = ex.pack_weight(wq)
    x = cp.asarray(rng.standard_normal((1, 512)).astype(np.float32))
    ex.mx_linear(x, w)
    w.codes = w.codes[:, :-16].copy()
    with pytest.raises(AssertionError, match="codes"):
        ex.mx_linear(x, w)


def test_copies_start_without_cached_launches():
    """copy, deepcopy, pickle and dataclasses.replace of a weight keep its fields and start with no cached launch
    (the original's recipes hold its own arrays); a new TuneDict never meets another's cache entries."""
    import dataclasses

    rng = np.random.default_rng(9)
    wq, w_ref = random_weight(rng, "mxfp4", (64, 512))
    w = ex.pack_weight(wq)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    _product(w, x, w_ref, "original")
    assert w.launches
    for clone in (copy.copy(w), copy.deepcopy(w), pickle.loads(pickle.dumps(w)), dataclasses.replace(w)):
        assert clone.launches == {} and clone.launches is not w.launches
        assert (clone.fmt, clone.shape, clone.tiled, clone.e2m1_split, clone.persistent) == \
            (w.fmt, w.shape, w.tiled, w.e2m1_split, w.persistent)
        _product(clone, x, w_ref, "copy")
    versions = {ex.TUNE.version}
    for _ in range(5):
        fresh = type(ex.TUNE)(ex.TUNE)
        assert fresh.version not in versions
        versions.add(fresh.version)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_large_products_keep_their_dequantisation(fmt, monkeypatch):
    """Past DENSE_ROWS rows a product dequantises its weight to bf16 for cuBLAS from a recipe kept on the weight
    (no kernel lookup after the first; NVFP4 through one tensor-scale-1 twin); new codes rebuild it, and the
    products match numpy before and after."""
    rng = np.random.default_rng(zlib.crc32(f"large-{fmt}".encode()))
    wq, w_ref = random_weight(rng, fmt, (320, 512))
    w = ex.pack_weight(wq)
    m = ex.DENSE_ROWS + 36
    x = rng.standard_normal((m, 512)).astype(np.float32)
    _product(w, x, w_ref, f"{fmt} first")
    looked_up = []
    monkeypatch.setattr(ex, "get_kernel", lambda *a, real=ex.get_kernel: looked_up.append(a[1]) or real(*a))
    _product(w, x, w_ref, f"{fmt} again")
    assert "mx_dequant_bf16" not in looked_up, looked_up
    if fmt == "nvfp4":
        assert ex._unscaled(w) is ex._unscaled(w) and ex._unscaled(w).tensor_scale == 1.0
        assert ex._unscaled(w).launches, "the twin keeps no recipe"
    wq2, w_ref2 = random_weight(rng, fmt, (320, 512))
    w2 = ex.pack_weight(wq2)
    w.codes, w.scales, w.tensor_scale = w2.codes, w2.scales, w2.tensor_scale
    _product(w, x, w_ref2, f"{fmt} new codes")
    assert "mx_dequant_bf16" in looked_up

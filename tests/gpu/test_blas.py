"""cuBLAS GEMMs a CUDA graph captures (`decapybara/backend/blas.py`; GPU only).

A stream's own handle (bound before a capture) lets `gemm_bf16` sit in a graph: the replay computes the product of
the inputs in the buffers at replay time, alpha as captured; a stream first met during a capture refuses the call
(`CaptureError`) and the capture ends cleanly; each stream keeps one handle and its workspace.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_kernels_core import assert_close, rand

from decapybara.backend import blas, piecewise
from decapybara.backend import cupy_ops as ops
from decapybara.backend.cuda_graph import capture_graph
from decapybara.backend.kv_codec import f32_to_bf16_bits

pytestmark = pytest.mark.gpu


def bf16_product(xb: np.ndarray, wb: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    f = lambda b: (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return alpha * f(xb) @ f(wb).T


@pytest.mark.parametrize("t,n,k", [(40, 96, 128), (130, 520, 264)])
def test_a_captured_gemm_replays_on_new_inputs(t, n, k):
    rng = np.random.default_rng(t * n + k)
    x = cp.zeros((t, k), cp.uint16)
    w = cp.asarray(f32_to_bf16_bits(rand(rng, n, k, scale=k ** -0.5)))
    stream = cp.cuda.Stream(non_blocking=True)
    blas.bind(stream)
    out = cp.zeros((t, n), cp.float32)

    def fn():
        y = ops.gemm_bf16(x, w, alpha=0.5)
        cp.cuda.runtime.memcpyAsync(ops.dev_ptr(out), ops.dev_ptr(y), out.nbytes, 3, cp.cuda.get_current_stream().ptr)
        return y

    graph, held = capture_graph(fn, stream, piecewise._Arena(), warmup=0)  # held: the graph's output buffer
    for _ in range(2):  # fresh inputs in the captured buffer, replayed twice
        xb = f32_to_bf16_bits(rand(rng, t, k))
        x[...] = cp.asarray(xb)
        cp.cuda.Device().synchronize()
        out.fill(np.nan)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        ref = bf16_product(xb, cp.asnumpy(w), 0.5)
        assert_close(out, ref, 1e-5, f"captured gemm {t}x{n}x{k}")
        assert_close(held, ref, 1e-5, f"captured gemm {t}x{n}x{k}: its own output")


def test_an_unbound_stream_refuses_during_a_capture():
    stream = cp.cuda.Stream(non_blocking=True)
    x, w = cp.zeros((40, 64), cp.uint16), cp.zeros((32, 64), cp.uint16)
    with pytest.raises(blas.CaptureError):
        capture_graph(lambda: ops.gemm_bf16(x, w), stream, piecewise._Arena(), warmup=0)
    blas.bind(stream)  # outside the capture: bound now, and the product runs on it
    with stream:
        y = ops.gemm_bf16(x, w)
    stream.synchronize()
    assert float(cp.abs(y).max()) == 0.0


def test_one_handle_a_stream():
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    ha, hb = blas.bind(a), blas.bind(b)
    assert ha == blas.bind(a) and hb == blas.bind(b)
    if a.ptr != b.ptr:  # the host emulator's streams share the current stream's id
        assert ha != hb
    key = (cp.cuda.runtime.getDevice(), int(a.ptr))
    assert blas._HANDLES[key].workspace.nbytes == blas.WORKSPACE

"""Persistent chains of skinny products: a run of one-n-tile products, each one's x the output of the one before,
as one launch of resident blocks (decapybara/kernels/mx_gemv.cu `mx_chain_<fmt>`, MX_CHAIN; its header says how
the blocks wait on one another).

    with pdl.recording() as launches:       # the products' calls launch nothing; their launches are kept
        normed, h = ex.mx_linear_add_norm(x, w_out, None, residual, g, eps, offset)
        a = ex.mx_swiglu(normed, w_gate_up, out_dtype=np.uint16)
        ...
    chain = ProductChain(launches)          # items on the device, the chain kernel, its grid
    chain()                                 # every product, in order, into the outputs the calls returned

Each item is a recorded launch as its own wrapper made it: its arguments, its plan's grid (dealt round-robin to
the chain's blocks as virtual blocks), so its sums come out as the launch's would, byte for byte. The launches must
all be one-n-tile kernels (`_1`, `_1s`, `_1r`, `_1rs`: up to FUSED_ROWS rows, dense) of one kernel module (one
file and defines) and one block width, with no dynamic shared memory. The chain keeps the recorded arguments, so
the buffers they name live as long as it does, but not their split-K tile counters (the recording stream's): it
has its own. It runs on the current stream, overlapped with the kernel before it as the products are
(`pdl.launch`), and a CUDA graph may capture it like any launch.

Every block of the chain's grid must be resident at once (its blocks wait on one another): by default the grid is
what the device keeps resident of it when nothing else runs. Kernels that run beside it (other streams, graph
branches, other processes) could take SMs it counts on; its waits then time out after ~2 s, the launch ends
with wrong outputs, and `timed_out()` says so.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import cupy as cp
import numpy as np

from decapybara import kernels
from decapybara.backend import cupy_ops, pdl

KINDS = {"1": 0, "1s": 1, "1r": 2, "1rs": 3}  # kernel suffix -> the chain's item kind (mx_gemv.cu ChainItem)

# mx_gemv.cu `Args`, field by field in its order (the `MX_KERNEL` parameters'): "p" a pointer, else the scalar type
ARGS = (("W", "p"), ("S", "p"), ("post", "f32"), ("bias", "p"), ("x", "p"), ("x_kind", "i32"), ("ldx", "i64"),
        ("gather", "p"), ("y", "p"), ("y_kind", "i32"), ("ldy", "i64"), ("partial", "p"), ("counters", "p"),
        ("M", "i32"), ("N", "i32"), ("K", "i32"), ("Kp", "i32"), ("w_row", "i64"), ("s_row", "i64"),
        ("w_gstride", "i64"), ("s_gstride", "i64"), ("g_off", "p"), ("g_cnt", "p"), ("mtiles", "i32"),
        ("cps", "i32"), ("x_vec", "i32"), ("stream", "i32"), ("res", "p"), ("sq", "p"), ("xg", "p"), ("gw", "p"),
        ("gw_off", "f32"), ("nsq", "p"), ("nsq_tiles", "i32"), ("n_eps", "f32"), ("xg_kind", "i32"), ("g_ids", "p"))
_CTYPES = {"p": ctypes.c_uint64, "f32": ctypes.c_float, "i32": ctypes.c_int32, "i64": ctypes.c_int64}


class ArgsC(ctypes.Structure):
    """mx_gemv.cu `Args` (the C layout: pointers and 64-bit fields 8-byte aligned)."""
    _fields_ = [(name, _CTYPES[t]) for name, t in ARGS]


class ItemC(ctypes.Structure):
    """mx_gemv.cu `ChainItem`."""
    _fields_ = [("a", ArgsC), ("kind", ctypes.c_int32), ("gx", ctypes.c_uint32), ("gy", ctypes.c_uint32),
                ("gz", ctypes.c_uint32)]


def _value(arg: Any, kind: str) -> Any:
    if kind == "p":
        if arg is None or arg.size == 0:  # None, or `cupy_ops.null()`'s empty array: a null pointer, as a launch passes
            return 0
        assert not isinstance(arg, np.generic), f"a scalar where a pointer belongs: {arg!r}"
        return cupy_ops.dev_ptr(arg)
    assert isinstance(arg, np.generic), f"a {kind} argument must be a numpy scalar, got {type(arg).__name__}"
    return arg.item()


def item_of(launch: pdl.Launch) -> tuple[ItemC, str, str, tuple]:
    """(the chain item, kernel file, format, defines) of one recorded skinny-product launch."""
    origin = kernels.kernel_origin(launch.kernel)
    assert origin is not None, "a recorded kernel that get_kernel did not give"
    name, func, defines = origin
    head, _, suffix = func.rpartition("_")
    assert head.startswith("mx_gemm_") and suffix in KINDS, f"{func}: not a one-n-tile skinny product"
    assert launch.shared_mem == 0, f"{func}: dynamic shared memory ({launch.shared_mem} B)"
    assert len(launch.args) == len(ARGS), f"{func}: {len(launch.args)} arguments, Args has {len(ARGS)}"
    grid = (*launch.grid, 1, 1)[:3]
    item = ItemC(ArgsC(*(_value(a, t) for a, (_, t) in zip(launch.args, ARGS, strict=True))), KINDS[suffix], *grid)
    return item, name, head[len("mx_gemm_"):], tuple(defines)


class ProductChain:
    """Recorded skinny products (`pdl.recording()`) as one persistent launch; see the module docstring.

    `blocks`: the chain's grid (default: as many blocks as the device keeps resident, which every block's waits
    need). `prefetch`: chunks of weights past its register stages a block asks of the L2 before it waits for the
    item before (MX_CHAIN_PF; default the kernel's). `__call__` enqueues it on the current stream; `timed_out()`
    (a host sync) says whether a wait gave up."""

    def __init__(self, launches: Sequence[pdl.Launch], blocks: int | None = None, prefetch: int | None = None):
        assert launches, "an empty chain"
        items = [item_of(launch) for launch in launches]
        files = {(name, fmt, defines) for _, name, fmt, defines in items}
        assert len(files) == 1, f"products of more than one kernel module: {sorted(map(str, files))}"
        widths = {launch.block for launch in launches}
        assert len(widths) == 1, f"products of more than one block width: {widths}"
        self.block = (*next(iter(widths)), 1, 1)[:3]
        name, fmt, defines = next(iter(files))
        mask = sum(1 << kind for kind in {item.kind for item, *_ in items})
        chain_defines = (("MX_CHAIN", mask), *((("MX_CHAIN_PF", prefetch),) if prefetch is not None else ()))
        self.kernel = kernels.get_kernel(name, f"mx_chain_{fmt}", (*defines, *chain_defines))
        self.n = len(items)
        # split-K tile counters of its own (zero at rest; each tile's last block resets its own), not the recording
        # stream's, which products launched there meanwhile use
        self.counters = cp.zeros(1 << 16, cp.int32)
        for item, *_ in items:
            item.a.counters = cupy_ops.dev_ptr(self.counters)
        arr = (ItemC * self.n)(*(item for item, *_ in items))
        self.items = cp.asarray(np.frombuffer(bytes(arr), np.uint8))
        self.launches = tuple(launches)  # their arrays stay alive while the chain may run
        self.done = cp.zeros(self.n + 1, cp.uint32)
        self.err = cp.zeros(2, cp.uint32)  # [0]: a wait of some launch timed out (kept); [1]: of this launch
        self.blocks = blocks or self.resident() * cupy_ops.sm_count()
        assert self.blocks > 0, "no block of the chain kernel fits an SM"
        cp.cuda.runtime.deviceSynchronize()  # the items and zeros in place before a launch on any stream

    def resident(self) -> int:
        """Blocks of the chain kernel an SM keeps resident (the driver's occupancy; 1 where it cannot tell)."""
        return pdl.resident_blocks(self.kernel, int(np.prod(self.block))) or 1

    def __call__(self) -> None:
        pdl.launch(self.kernel, (self.blocks,), self.block, (self.items, np.int32(self.n), self.done, self.err))

    def timed_out(self) -> bool:
        """Whether a block's wait gave up in a launch since the chain was made or `clear()`ed (blocks not all
        resident: that launch's outputs are wrong). A host sync."""
        return bool(int(cp.asnumpy(self.err)[0]))

    def clear(self) -> None:
        """Forget earlier timeouts (`timed_out`)."""
        self.err[0] = 0

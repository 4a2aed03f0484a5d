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
has its own, or ones it shares with chains that never run beside it. It runs on the current stream, overlapped with
the kernel before it as the products are (`pdl.launch`), and a CUDA graph may capture it like any launch.
`retarget(launches)` points it at the same products recorded over other arrays (decapybara/backend/chain_tails.py
builds a decode graph's chains in the capture's warm-up and retargets them at the capture's arrays).

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


def chain_key(launch: pdl.Launch) -> tuple | None:
    """(kernel file, format, defines, block) of a recorded launch that a chain can run: a one-n-tile skinny
    product (`_1`, `_1s`, `_1r`, `_1rs`) without dynamic shared memory; None for any other launch. Launches of one
    key may share a chain."""
    origin = kernels.kernel_origin(launch.kernel)
    if origin is None:
        return None
    name, func, defines = origin
    head, _, suffix = func.rpartition("_")
    if not head.startswith("mx_gemm_") or suffix not in KINDS or launch.shared_mem or len(launch.args) != len(ARGS):
        return None
    return name, head[len("mx_gemm_"):], tuple(defines), (*launch.block, 1, 1)[:3]


def item_of(launch: pdl.Launch) -> tuple[ItemC, tuple]:
    """(the chain item, `chain_key`) of one recorded skinny-product launch."""
    key = chain_key(launch)
    origin = kernels.kernel_origin(launch.kernel)
    assert key is not None, f"{origin[1] if origin else launch.kernel}: not a one-n-tile skinny product without " \
                            f"dynamic shared memory"
    grid = (*launch.grid, 1, 1)[:3]
    kind = KINDS[origin[1].rpartition("_")[2]]
    item = ItemC(ArgsC(*(_value(a, t) for a, (_, t) in zip(launch.args, ARGS, strict=True))), kind, *grid)
    return item, key


def timed_out(err: Any) -> bool:
    """Whether chains' timeout flags (`ProductChain.err`) say a wait gave up since they were cleared (a host sync)."""
    return bool(int(cp.asnumpy(err)[0]))


class ProductChain:
    """Recorded skinny products (`pdl.recording()`) as one persistent launch; see the module docstring.

    `blocks`: the chain's grid (default: as many blocks as the device keeps resident, which every block's waits
    need). `prefetch`: chunks of weights past its register stages a block asks of the L2 before it waits for the
    item before (MX_CHAIN_PF; default the kernel's). `counters`: int32 split-K tile counters (zeros, at least
    1 << 16) that it may share with chains that never run at once with it (default its own); `err`: likewise its
    uint32 [2] timeout flags (zeros). `__call__` enqueues it
    on the current stream; `retarget` points it at the same products over other arrays; `timed_out()` (a host
    sync) says whether a wait gave up."""

    def __init__(self, launches: Sequence[pdl.Launch], blocks: int | None = None, prefetch: int | None = None,
                 counters: Any = None, err: Any = None):
        assert launches, "an empty chain"
        self.counters = cp.zeros(1 << 16, cp.int32) if counters is None else counters
        # split-K tile counters of its own (zero at rest; each tile's last block resets its own), not the recording
        # stream's, which products launched there meanwhile use
        assert self.counters.dtype == cp.int32 and self.counters.size >= 1 << 16, "counters: int32, 1 << 16 of them"
        host, self.key, self.shape = self._items(launches)
        name, fmt, defines, self.block = self.key
        mask = sum(1 << kind for kind in {kind for kind, _ in self.shape})
        chain_defines = (("MX_CHAIN", mask), *((("MX_CHAIN_PF", prefetch),) if prefetch is not None else ()))
        self.kernel = kernels.get_kernel(name, f"mx_chain_{fmt}", (*defines, *chain_defines))
        self.n = len(launches)
        self.items = cp.asarray(host)
        self.launches = tuple(launches)  # their arrays stay alive while the chain may run
        self.done = cp.zeros(self.n + 1, cp.uint32)
        # [0]: a wait of some launch timed out (kept); [1]: of this launch
        self.err = cp.zeros(2, cp.uint32) if err is None else err
        assert self.err.dtype == cp.uint32 and self.err.size == 2, "err: uint32, 2 of them"
        self.blocks = blocks or self.resident() * cupy_ops.sm_count()
        assert self.blocks > 0, "no block of the chain kernel fits an SM"
        cp.cuda.runtime.deviceSynchronize()  # the items and zeros in place before a launch on any stream

    def _items(self, launches: Sequence[pdl.Launch]) -> tuple[np.ndarray, tuple, tuple]:
        """(the items' bytes, with this chain's counters; their common `chain_key`; each item's (kind, grid))."""
        items = [item_of(launch) for launch in launches]
        keys = {key for _, key in items}
        assert len(keys) == 1, f"products of more than one kernel module or block width: {sorted(map(str, keys))}"
        for item, _ in items:
            item.a.counters = cupy_ops.dev_ptr(self.counters)
        arr = (ItemC * len(items))(*(item for item, _ in items))
        shape = tuple((item.kind, (item.gx, item.gy, item.gz)) for item, _ in items)
        return np.frombuffer(bytes(arr), np.uint8).copy(), keys.pop(), shape

    def matches(self, launches: Sequence[pdl.Launch]) -> bool:
        """Whether `launches` are this chain's products (kernels, kinds, grids, block), over any arrays."""
        if len(launches) != self.n or any(chain_key(launch) != self.key for launch in launches):
            return False
        return self._items(launches)[2] == self.shape

    def retarget(self, launches: Sequence[pdl.Launch]) -> None:
        """Run `launches` from now on: the same products (kernels, kinds, grids, block) as the chain's, recorded
        over other arrays (e.g. a graph's capture, where the chain was built from its warm-up's launches). Writes
        the device items and waits for the device: never during a capture, nor while the chain runs."""
        host, key, shape = self._items(launches)
        assert (key, shape) == (self.key, self.shape), "retargeted to other products"
        cp.cuda.runtime.deviceSynchronize()  # no launch of the chain still reads the items
        self.items[...] = cp.asarray(host)
        self.launches = tuple(launches)
        cp.cuda.runtime.deviceSynchronize()

    def resident(self) -> int:
        """Blocks of the chain kernel an SM keeps resident (the driver's occupancy; 1 where it cannot tell)."""
        return pdl.resident_blocks(self.kernel, int(np.prod(self.block))) or 1

    def __call__(self) -> None:
        pdl.launch(self.kernel, (self.blocks,), self.block, (self.items, np.int32(self.n), self.done, self.err))

    def timed_out(self) -> bool:
        """Whether a block's wait gave up in a launch since the chain was made or `clear()`ed (blocks not all
        resident: that launch's outputs are wrong). A host sync."""
        return timed_out(self.err)

    def clear(self) -> None:
        """Forget earlier timeouts (`timed_out`)."""
        self.err[0] = 0

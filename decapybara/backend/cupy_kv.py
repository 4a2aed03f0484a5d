"""Paged KV cache and DeltaNet state pool in device memory, with the same layouts as the numpy reference.

KV pages: per attention layer (MTP layers included) and per "k" / "v", the codec's storage parts
``{part: [num_pages, page_size, kv_heads, ...]}``, so `export_pages` yields exactly the `KVPageData` the numpy
backend would (pages move between backends and tiers unchanged). Kernels see a layer's keys or values as
(codes, scales, bits): bits 32 = float32, 16 = bf16 bits, 8 / 6 / 4 = MXFP codes + E8M0 scales.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import cupyx
import numpy as np

from decapybara.backend import cupy_ops, pdl
from decapybara.backend.base import HybridState, KVCache, KVPageData, StatePool
from decapybara.backend.cupy_ops import I32, I64, THREADS, check, grid_for, heads
from decapybara.backend.kv_codec import BF16Codec, F32Codec, KVCodec, MicroscaledCodec
from decapybara.kernels import get_kernel
from decapybara.model.config import ModelConfig


def codec_bits(codec: KVCodec) -> tuple[int, int]:
    """(key bits, value bits) of a codec as the kernels name them (32, 16, 8, 6, 4)."""
    if isinstance(codec, F32Codec):
        if np.dtype(codec.dtype) != np.float32:
            raise ValueError(f"the CUDA backend stores full-precision KV as float32, not {codec.dtype}")
        return 32, 32
    if isinstance(codec, BF16Codec):
        return 16, 16
    if isinstance(codec, MicroscaledCodec):
        return codec.key_bits, codec.value_bits
    raise ValueError(f"no CUDA KV kernels for codec {type(codec).__name__}")


def write_kv(codes: Any, scales: Any, bits: int, x: Any, slots: Any) -> None:
    """Store x [T, H, D] (float32) at flat slots [T] (int64, device) into one layer's k or v parts. x is read in
    place when its rows of D are contiguous (`heads`: e.g. the value columns of a fused q|k|v product)."""
    x, x_st, x_sh = heads(x)
    check(slots, np.int64, "slots", 1)
    t, h, d = x.shape
    assert slots.shape[0] == t, f"{t} rows but {slots.shape[0]} slots"
    if t == 0:
        return
    if bits in (32, 16):
        check(codes, np.float32 if bits == 32 else np.uint16, "codes")
        func = "kv_write_f32" if bits == 32 else "kv_write_bf16"
        blocks = grid_for(t * h * d)
    else:
        check(codes, np.uint8, "codes")
        check(scales, np.uint8, "scales")
        assert codes.shape[-1] == -(-d // 32) * 32 * bits // 8, f"codes {codes.shape} for head_dim {d}"
        func = f"kv_write_mx{bits}"
        blocks = -(-(t * h * -(-d // 32) * 32) // THREADS)  # one warp per (t, h, 32-block)
    pdl.launch(get_kernel("decode_ops", func), (blocks,), (THREADS,),
               (x, slots, codes, scales, I64(x_st), I64(x_sh), I32(t), I32(h), I32(d)))


class CupyKVCache(KVCache):
    """KV pages of every attention layer in device memory (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, codec: KVCodec):
        self.num_pages, self.page_size, self.codec = num_pages, page_size, codec
        self.key_bits, self.value_bits = codec_bits(codec)
        self.layers = list(cfg.attention_layers) + [("mtp", j) for j in range(cfg.mtp_num_hidden_layers)]
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        shape = (num_pages, page_size, self.kv_heads)
        self.store: dict[Any, dict[str, Any]] = {
            layer: {f"{kv}.{part}": cp.zeros(shape + pshape, dtype)
                    for kv in ("k", "v") for part, (pshape, dtype) in codec.parts(self.head_dim, kv).items()}
            for layer in self.layers
        }
        self._empty = cp.zeros(1, cp.uint8)

    @property
    def bytes_per_page(self) -> int:
        return sum(a[0].nbytes for parts in self.store.values() for a in parts.values())

    def parts(self, layer: Any, kv: str) -> tuple[Any, Any, int]:
        """(codes, scales, bits) of a layer's keys (kv="k") or values; scales is a dummy for 32 / 16 bits."""
        p = self.store[layer]
        bits = self.key_bits if kv == "k" else self.value_bits
        codes = p.get(f"{kv}.x", p.get(f"{kv}.codes"))
        return codes, p.get(f"{kv}.scales", self._empty), bits

    def write(self, layer: Any, slots: Any, k: Any, v: Any) -> None:
        """k, v [T, kv_heads, head_dim] at flat slots [T] (int64 device array)."""
        for kv, x in (("k", k), ("v", v)):
            codes, scales, bits = self.parts(layer, kv)
            write_kv(codes, scales, bits, x, slots)

    def export_pages(self, page_ids: np.ndarray) -> KVPageData:
        ids = cp.asarray(np.asarray(page_ids, np.int64))
        return KVPageData({f"{layer}|{p}": cp.asnumpy(a[ids])
                           for layer, parts in self.store.items() for p, a in parts.items()})

    def import_pages(self, page_ids: np.ndarray, data: KVPageData) -> None:
        ids = cp.asarray(np.asarray(page_ids, np.int64))
        for layer, parts in self.store.items():
            for p, a in parts.items():
                src = data.arrays[f"{layer}|{p}"]
                if src.dtype != a.dtype or src.shape[1:] != a.shape[1:]:
                    raise ValueError(f"page data {layer}|{p}: {src.dtype} {src.shape[1:]}, pool has "
                                     f"{a.dtype} {a.shape[1:]}")
                a[ids] = cp.asarray(src)

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        s, d = cp.asarray(np.asarray(src, np.int64)), cp.asarray(np.asarray(dst, np.int64))
        for parts in self.store.values():
            for a in parts.values():
                a[d] = a[s]


def host_copies(arrays: list[Any]) -> list[np.ndarray]:
    """Host copies of device arrays of one dtype in one device-to-host transfer into pinned memory: one
    synchronisation, where a copy each would wait on the stream once an array (a 27B model's hybrid state is 96
    arrays, 157 MB), at the pinned rate and without first-touch page faults (CuPy's pinned pool hands a freed
    block of the same size back: snapshots come and go at one size). The copies are views of one buffer, which
    stays pinned while any of them lives (a paused bundle or snapshot on its way to a tier: the Ray tiers
    serialise them into their own memory)."""
    if len(arrays) < 2 or len({a.dtype for a in arrays}) > 1:
        return [cp.asnumpy(a) for a in arrays]
    flat = cp.concatenate([cp.ravel(a) for a in arrays])
    host = cupyx.empty_pinned(flat.shape, flat.dtype)
    cp.asnumpy(flat, out=host)
    out, o = [], 0
    for a in arrays:
        out.append(host[o:o + a.size].reshape(a.shape))
        o += a.size
    return out


def on_device(a: Any) -> bool:
    """Whether `a` is a device array (not a host numpy array, pinned or not)."""
    return isinstance(a, cp.ndarray) and type(a) is not np.ndarray


def copy_many(pairs: list[tuple[Any, Any]]) -> None:
    """dst[...] = src for every (src, dst) pair of C-contiguous float32 device arrays of equal shapes, in one
    launch (decapybara/kernels/copy_segments.cu) on the current stream."""
    if not pairs:
        return
    for src, dst in pairs:
        assert src.shape == dst.shape and src.dtype == dst.dtype == cp.float32, (src.shape, dst.shape)
        assert src.flags.c_contiguous and dst.flags.c_contiguous, "contiguous arrays only"
    table = cp.asarray(np.asarray([(cupy_ops.dev_ptr(s), cupy_ops.dev_ptr(d), s.nbytes) for s, d in pairs],
                                  np.int64))
    words = max(s.nbytes for s, _ in pairs) // 16
    get_kernel("copy_segments", "copy_segments")((max(1, min(64, -(-words // 256))), len(pairs)), (256,),
                                                 (table,))


class CupyStatePool(StatePool):
    """Per-slot DeltaNet state in device memory: conv [slots, C, K - 1] and recurrent [slots, Hv, dk, dv]."""

    def __init__(self, cfg: ModelConfig, num_slots: int):
        self.num_slots = num_slots
        self.layers = list(cfg.linear_layers)
        c, k = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv = {i: cp.zeros((num_slots, c, k - 1), cp.float32) for i in self.layers}
        self.rec = {i: cp.zeros((num_slots, hv, dk, dv), cp.float32) for i in self.layers}

    def reset(self, slot: int) -> None:
        for i in self.layers:
            self.conv[i][slot] = 0
            self.rec[i][slot] = 0

    def get(self, slot: int) -> HybridState:
        n = len(self.layers)
        arrs = host_copies([self.conv[i][slot] for i in self.layers] + [self.rec[i][slot] for i in self.layers])
        return HybridState(arrs[:n], arrs[n:])

    def reserve_host_copies(self, n: int) -> None:
        """Have CuPy's pinned pool hold `n` blocks of one slot's state, so that `get` (snapshots, pauses) takes
        them rather than pinning fresh memory mid-step: ~0.1-0.2 s for a 27B model's 157 MB, measured."""
        floats = sum(a[0].size for a in self.conv.values()) + sum(a[0].size for a in self.rec.values())
        blocks = [cupyx.empty_pinned(floats, np.float32) for _ in range(n)]
        del blocks  # back to the pool, which hands a freed block of the same size out again

    def set(self, slot: int, state: HybridState) -> None:
        """The slot's state from host arrays, or from float32 device arrays (a verification graph's rollback
        point) in one launch."""
        if all(on_device(a) and a.dtype == cp.float32 and a.flags.c_contiguous
               for a in (*state.conv, *state.recurrent)):
            copy_many([(state.conv[j], self.conv[i][slot]) for j, i in enumerate(self.layers)]
                      + [(state.recurrent[j], self.rec[i][slot]) for j, i in enumerate(self.layers)])
            return
        for j, i in enumerate(self.layers):
            self.conv[i][slot] = cp.asarray(state.conv[j], dtype=cp.float32)  # host or device arrays
            self.rec[i][slot] = cp.asarray(state.recurrent[j], dtype=cp.float32)

    def copy(self, src: int, dst: int) -> None:
        copy_many([(self.conv[i][src], self.conv[i][dst]) for i in self.layers]
                  + [(self.rec[i][src], self.rec[i][dst]) for i in self.layers])

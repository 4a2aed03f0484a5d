"""The CUDA backend: CuPy arrays, cuBLAS matrix products and the kernels of decapybara/kernels/*.cu.

`CupyBackend("fp32")` computes the reference function in float32 (float32 weights and KV pages by default,
the DeltaNet recurrence in float64 like the numpy reference) and must match it to float rounding.
`CupyBackend("bf16")` stores matrices (and quantised weights, dequantised once at load) as bf16 and multiplies
bf16 operands with float32 accumulation; its default KV pages are bf16 ("16/16").

In both modes activations between ops are float32 device arrays: the residual stream keeps full precision and
decode, which reads every weight once per step, is bound by the weight bytes, not by activations. 1-D tensors
and the DeltaNet conv1d stay float32. Host metadata of a forward (slot mapping, block tables, work items,
DeltaNet runs) is uploaded once and reused by every layer.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any

import cupy as cp
import numpy as np

from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra, pdl
from decapybara.backend.base import Backend, DeltaNetParams, DeltaNetSegment
from decapybara.backend.cupy_attention import AttentionPlan, attention, gate_fuses, plan_attention
from decapybara.backend.cupy_deltanet import RunPlan, deltanet_core, plan_runs
from decapybara.backend.cupy_kv import CupyKVCache, CupyStatePool, host_copies
from decapybara.backend.cupy_ops_extra import (
    DENSE_ROWS,
    FUSED_ROWS,
    MOE_EXPERTS,
    MOE_TOP_K,
    SWIGLU_ROWS,
    FusedMoE,
    NormedRows,
    PackedWeight,
    dense_of,
    fuses_swiglu,
    gemm_ready,
    mx_linear,
    mx_linear_add_norm,
    mx_swiglu,
    product_rows,
    set_dense,
    skinny_product,
)
from decapybara.backend.kv_codec import BF16Codec, codec_for
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig

SKINNY_ROWS = DENSE_ROWS  # products with at most this many rows take the skinny-GEMM kernels (mx_linear's bound)
# `linear_pair` runs its second product on a side stream (False: both on the current stream, one after the other),
# launched overlapped (pdl.py) where `side_pdl`, else plainly (it then starts once the kernel before the fork ends)
PAIRS = {"side_stream": True, "side_pdl": False}


@functools.cache
def _side_stream(device: int) -> Any:
    return cp.cuda.Stream(non_blocking=True)


def _own_kernels(weight: Any, rows: int) -> bool:
    """Whether `linear` runs a product of `rows` rows over `weight` on decapybara/kernels/ alone (no cuBLAS): the skinny
    kernels over packed or bf16 weights they stream, gemv_f32 over contiguous float32 matrices."""
    if rows > SKINNY_ROWS:
        return False
    if isinstance(weight, PackedWeight) or weight.dtype == cp.uint16:
        w = _streamed(weight)
        return w is not None and skinny_product(w, rows)
    return weight.ndim == 2 and weight.dtype == cp.float32 and weight.flags.c_contiguous


def _is_matrix(name: str, ndim: int) -> bool:
    """Matrices (and stacked experts) go bf16 in bf16 mode; 1-D tensors and the conv1d stay float32."""
    return ndim >= 2 and not name.endswith("conv1d.weight")


def _bf16_packed(weight: Any) -> PackedWeight | None:
    """A bf16-bits matrix as the skinny kernels' PackedWeight (a model weight: `linear` takes those), else None."""
    if weight.ndim == 2 and weight.dtype == cp.uint16:
        return PackedWeight("bf16", weight.shape, weight, persistent=True)
    return None


def _bf16_stack(weight: Any) -> PackedWeight | None:
    """Stacked bf16 experts [E, N, K] (bf16 bits) as the grouped kernels' PackedWeight (a model weight, as
    `_bf16_packed`'s), a packed stack as it is; None for anything else (float32 stacks)."""
    if isinstance(weight, PackedWeight):
        return weight if len(weight.shape) == 3 else None
    if weight.ndim == 3 and weight.dtype == cp.uint16:
        return PackedWeight("bf16", weight.shape, weight, persistent=True)
    return None


def _layout(w: PackedWeight) -> tuple:
    """What PackedWeights must share to be stacked into one: format, K, tensor scale, code layouts, scales or none."""
    return w.fmt, w.K, w.tensor_scale, w.e2m1_split, w.tiled, w.scales is None


def _same_storage(parts: list[Any]) -> bool:
    """Whether weights are all bf16 bits or all PackedWeights of one `_layout`, over the same K."""
    if all(isinstance(w, cp.ndarray) for w in parts):
        return all(w.dtype == cp.uint16 and w.shape[-1] == parts[0].shape[-1] for w in parts)
    return all(isinstance(w, PackedWeight) for w in parts) and len({_layout(w) for w in parts}) == 1


def _stack_experts(blocks: list[list[Any]]) -> Any:
    """One expert stack [E', N, K] from `blocks`: expert stacks [E, N_i, K] or matrices [N_i, K] (one expert),
    grouped by expert ranges: each inner list's parts side by side along the rows (each expert's rows of its
    parts one after another), the lists one after another along the experts. Made in one allocation (no
    intermediate stack: the load's peak is the parts and the result). None where the parts' storage or shapes
    do not match (`_same_storage`)."""
    parts = [w for blk in blocks for w in blk]
    if not _same_storage(parts):
        return None
    lead = [w.shape[0] if len(w.shape) == 3 else 1 for w in (blk[0] for blk in blocks)]
    rows = [sum(w.shape[-2] for w in blk) for blk in blocks]
    if len(set(rows)) != 1 or any((w.shape[0] if len(w.shape) == 3 else 1) != n
                                  for blk, n in zip(blocks, lead, strict=True) for w in blk):
        return None
    packed = isinstance(parts[0], PackedWeight)
    fields = (("codes", "scales") if parts[0].scales is not None else ("codes",)) if packed else (None,)
    out = {}
    for name in fields:  # a PackedWeight's arrays (bf16 bits: the array itself)
        src = [[getattr(w, name) if name else w for w in blk] for blk in blocks]
        first = src[0][0]
        dst = cp.empty((sum(lead), rows[0], first.shape[-1]), first.dtype)
        e0 = 0
        for blk, n in zip(src, lead, strict=True):
            r = 0
            for a in blk:
                dst[e0:e0 + n, r:r + a.shape[-2]] = a.reshape(n, a.shape[-2], a.shape[-1])
                r += a.shape[-2]
            e0 += n
        out[name] = dst
    if not packed:
        return out[None]
    first = parts[0]
    return PackedWeight(first.fmt, (sum(lead), rows[0], first.K), out["codes"], out.get("scales"), first.tensor_scale,
                        all(w.persistent for w in parts), first.e2m1_split, first.tiled)


def _expert_rows(stack: Any, experts: Any, rows: tuple[int, int] | None, like: Any = None) -> Any:
    """A view of stack [E, N, K]: experts `experts` (an index: a matrix; a slice: a stack), rows (start, count)
    of each (None: all), as bf16 bits or a PackedWeight like the stack; with the kept bf16 values (`dense_of`) of
    `like`, the weight the view stands for, where it has them."""
    sel = (experts,) if rows is None else (experts, slice(rows[0], rows[0] + rows[1]))
    if not isinstance(stack, PackedWeight):
        return stack[sel]
    codes = stack.codes[sel]
    scales = None if stack.scales is None else stack.scales[sel]
    view = PackedWeight(stack.fmt, (*codes.shape[:-1], stack.K), codes, scales, stack.tensor_scale, stack.persistent,
                        stack.e2m1_split, stack.tiled)
    if isinstance(like, PackedWeight):
        set_dense(view, dense_of(like))
    return view


def _device_stacks(*experts: Any) -> list[PackedWeight] | None:
    """The expert stacks as `cupy_ops_extra.moe` takes them (`_bf16_stack`), or None where it cannot: not bf16 or
    packed, rows the skinny kernels do not stream (`gemm_ready`), more than MOE_EXPERTS experts."""
    stacks = [_bf16_stack(w) for w in experts]
    if any(s is None or not gemm_ready(s) or s.shape[0] > MOE_EXPERTS for s in stacks):
        return None
    return stacks  # type: ignore[return-value]


def _streamed(weight: Any) -> PackedWeight | None:
    """`weight` as the skinny kernels stream it (packed, or bf16 bits as a PackedWeight); None where they cannot."""
    w = weight if isinstance(weight, PackedWeight) else _bf16_packed(weight)
    return w if w is not None and gemm_ready(w) else None


def _plain_rows(x: Any) -> Any:
    """Rows from `linear_add_rms_norm` as the plain ops take them: `NormedRows` materialised (the norm kernel's
    bits), bf16 bits widened to float32 (exactly), anything else as it is."""
    if isinstance(x, NormedRows):
        return x.materialize()
    return ops.bf16_bits_to_f32(x) if x.dtype == cp.uint16 else x


def _reads_bf16(weight: Any, rows: int) -> bool:
    """Whether a product of `rows` rows over `weight` (or over the model's other weights, stored alike: the
    bf16 backend's matrices are all bf16 or packed) rounds x to bf16 anyway, so that its x may come in bf16 bits:
    packed or bf16 weights the skinny kernels stream, TUNE `bf16_rows` rows at least (0: off). Up to
    SKINNY_ROWS rows the skinny kernels stage it (half the bytes staged, the same results but for x below
    2^-126, which their float32 staging scales before it rounds); larger products are cuBLAS GEMMs over bf16
    operands (`mx_linear`, `linear`), which took x's rounded bits before (the same bits: one rounding to
    nearest even either way). For the bf16 backend only (the caller's check): the fp32 one keeps float32
    matrices beside packed ones."""
    w = _streamed(weight)
    if w is None:
        return False
    least = cupy_ops_extra.tune_for(w.fmt)["bf16_rows"]
    return bool(0 < least <= rows)


class CupyBackend(Backend):
    name = "cupy"
    xp = cp
    moe_takes_product_rows = True  # NormedRows (fused into the MoE launches or materialised) and bf16 bits

    def __init__(self, dtype: str = "bf16", attention_splits: int | None = None):
        """`dtype` "fp32" (the reference function) or "bf16"; `attention_splits` forces split-K (tests)."""
        if dtype not in ("fp32", "bf16"):
            raise ValueError(f"CupyBackend dtype must be 'fp32' or 'bf16', got {dtype!r}")
        self.dtype = dtype
        self.bf16 = dtype == "bf16"
        self.attention_splits = attention_splits
        self._attn: tuple[ForwardBatch, tuple[int, ...], AttentionPlan] | None = None
        self._runs: tuple[list[DeltaNetSegment], RunPlan] | None = None

    # ---- memory -------------------------------------------------------------------------------------
    def from_host(self, a: np.ndarray, dtype: Any = None) -> Any:
        return cp.asarray(np.ascontiguousarray(a, dtype=dtype or np.asarray(a).dtype))

    def to_host(self, a: Any) -> np.ndarray:
        return cp.asnumpy(a)

    def to_host_many(self, arrays: list[Any]) -> list[np.ndarray]:
        """Device arrays in one pinned transfer (`host_copies`); host arrays (snapshots, whose asynchronous
        copies `cupy_deltanet` queued) after one synchronisation of the stream."""
        if all(isinstance(a, np.ndarray) for a in arrays):
            cp.cuda.get_current_stream().synchronize()
            return list(arrays)
        return host_copies(arrays)

    def prepare_weight(self, name: str, value: Any) -> Any:
        """float32 device array, or bf16 bits (uint16) for matrices in bf16 mode. Quantised weights are
        dequantised on the device (bf16 or float32) until the packed-weight GEMV path takes them."""
        if hasattr(value, "dequantize"):  # QuantTensor
            return ops.dequantize(value, bf16=self.bf16 and _is_matrix(name, len(value.shape)))
        arr = np.ascontiguousarray(value, dtype=np.float32)
        dev = cp.asarray(arr)
        if self.bf16 and _is_matrix(name, arr.ndim):
            return ops.to_bf16_bits(dev)
        return dev

    def new_kv_cache(self, cfg: ModelConfig, num_pages: int, page_size: int, kv_mode: Any = None) -> CupyKVCache:
        codec = BF16Codec() if (kv_mode is None and self.bf16) else codec_for(kv_mode, np.float32)
        return CupyKVCache(cfg, num_pages, page_size, codec)

    def new_state_pool(self, cfg: ModelConfig, num_slots: int) -> CupyStatePool:
        return CupyStatePool(cfg, num_slots)

    def synchronize(self) -> None:
        cp.cuda.get_current_stream().synchronize()

    def argmax_prob(self, logits: Any) -> tuple[Any, Any]:
        """Two launches (decapybara/kernels/sample.cu `guess_partial` / `guess_finish`, `cupy_ops_extra.guesses`)
        where CuPy's argmax, the gather, the exponentials and their sum took several and a slow reduction."""
        if not cupy_ops_extra.guesses_take(logits):
            return super().argmax_prob(logits)
        return cupy_ops_extra.guesses(logits)

    def sample(self, logits: Any, rows: Any, eos_token_ids: Any = ()) -> Any:
        """The device sampler (decapybara/kernels/sample.cu, `cupy_ops_extra.cuda_sample`): the reference's tokens from
        the same seeds, but where a draw lands within rounding distance of a CDF step; greedy rows exactly.
        Vocabularies past its limit take the host reference."""
        if logits.shape[-1] > cupy_ops_extra.SAMPLE_MAX_VOCAB:
            return super().sample(logits, rows, eos_token_ids)
        return cupy_ops_extra.cuda_sample(logits, rows, eos_token_ids=eos_token_ids)

    # ---- ops ----------------------------------------------------------------------------------------
    def embedding(self, table: Any, ids: np.ndarray) -> Any:
        idx = cp.asarray(np.ascontiguousarray(ids, np.int64))
        if table.dtype == cp.uint16:
            return ops.embed_bf16(table, idx)
        return table[idx]

    def rms_norm(self, x: Any, weight: Any, eps: float, offset: float) -> Any:
        return ops.rms_norm(x, weight, eps, offset)

    def add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float, offset: float) -> tuple[Any, Any]:
        """(rms_norm(x + residual), x + residual) in one pass and one launch."""
        return ops.rms_norm(x, weight, eps, offset, residual=residual)

    def linear(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """Skinny products (at most SKINNY_ROWS rows: decode, speculative verification, small chunks) run on
        the skinny-GEMM kernels (decapybara/kernels/mx_gemv.cu); larger ones go to cuBLAS (on the stream's own handle,
        `blas`: capturable too, as the piecewise tails do). x may be `NormedRows` (from `linear_add_rms_norm`):
        bf16 products of up to 8 rows take them as they are (`mx_linear`), the rest take the materialised rows; or
        bf16 bits
        (uint16, also from `linear_add_rms_norm`), which the skinny kernels read as they are (they round x to
        bf16 anyway) and anything else widens to float32."""
        packed = _bf16_packed(weight) if x.shape[0] <= SKINNY_ROWS else None
        if packed is not None and gemm_ready(packed):
            return mx_linear(x if isinstance(x, NormedRows) else product_rows(x), packed, bias, out_dtype=cp.float32)
        if isinstance(x, NormedRows):
            x = x.materialize()
        if x.dtype == cp.uint16 and weight.dtype == cp.uint16 and weight.ndim == 2:  # bf16 operands as they are
            y = ops.gemm_bf16(cp.ascontiguousarray(x), weight)
            return y + bias if bias is not None else y
        if x.dtype == cp.uint16:
            x = ops.bf16_bits_to_f32(x)
        if x.shape[0] <= SKINNY_ROWS and weight.ndim == 2 and weight.dtype == cp.float32 and weight.flags.c_contiguous:
            return ops.gemv_f32(x, weight, bias)
        if weight.dtype == cp.uint16:
            y = ops.gemm_bf16(ops.to_bf16_bits(x), weight)
        else:
            y = cp.matmul(ops.f32(x), weight.T)
        return y + bias if bias is not None else y

    def linear_pair(self, x: Any, weight_a: Any, weight_b: Any) -> tuple[Any, Any]:
        """Skinny products (at most SKINNY_ROWS rows): the second on a side stream that forks from the current
        one before the first and joins it after the second (`PAIRS`): in a decode graph the second's blocks (the
        DeltaNet b|a product, a latency-bound 1 MB) take the SMs the first's (qkv|z) leave as its blocks end,
        instead of running after it. Each product's kernels are the ones `linear` launches on its own stream
        (NormedRows that a product materialises, it materialises itself), so the results are the same bits.
        Products that would take cuBLAS (GEMMs that each fill the GPU, nothing to gain side by side) run one after
        the other."""
        if not (PAIRS["side_stream"] and all(_own_kernels(w, x.shape[0]) for w in (weight_a, weight_b))):
            return super().linear_pair(x, weight_a, weight_b)
        main = cp.cuda.get_current_stream()
        side = _side_stream(cp.cuda.Device().id)
        side.wait_event(main.record())
        try:
            y_a = self.linear(x, weight_a)
            with side, contextlib.nullcontext() if PAIRS["side_pdl"] else pdl.serial():
                y_b = self.linear(x, weight_b)
        finally:
            main.wait_event(side.record())  # joined even when a launch fails (a capture must not end forked)
        return y_a, y_b

    def linear_add_rms_norm(self, x: Any, weight: Any, bias: Any, residual: Any, norm_weight: Any, eps: float,
                            offset: float) -> tuple[Any, Any]:
        """Products of up to 8 rows (decode) over packed or bf16 weights fuse the residual add into their
        epilogue and leave the norm to the products that read its rows (`NormedRows`, `mx_linear_add_norm`):
        no norm kernel between them. Where that does not apply, up to SKINNY_ROWS rows over weights the skinny
        kernels stream (`_reads_bf16`; bf16 backend), the norm writes its rows in bf16 bits: the products after
        it round x to bf16 anyway, and stage half the bytes (`linear`). Anything else runs the plain ops. x may
        be bf16 bits (the MLP activation, `silu_mul_halves` or `swiglu`)."""
        w = weight if isinstance(weight, PackedWeight) else _bf16_packed(weight)
        if (w is not None and x.shape[0] <= FUSED_ROWS and residual.dtype == cp.float32
                and residual.flags.c_contiguous and norm_weight.dtype == cp.float32):
            got = mx_linear_add_norm(product_rows(x), w, bias, residual, norm_weight, eps, offset)
            if got is not None:
                return got
        if self.bf16 and _reads_bf16(weight, x.shape[0]) and norm_weight.dtype == cp.float32:
            y = self.linear(x, weight, bias)
            return ops.rms_norm(y, norm_weight, eps, offset, residual=residual, out_dtype=cp.uint16)
        return super().linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps, offset)

    def silu_mul(self, gate: Any, up: Any) -> Any:
        return ops.silu_mul(gate, up)

    def swiglu(self, x: Any, gate_up: Any, to_product: Any = None) -> Any:
        """From TUNE `swiglu_rows` rows (0: never) up to SWIGLU_ROWS (64) over a [gate; up] matrix the skinny kernels stream: one
        launch (`mx_swiglu`: the product and silu(gate) * up in its epilogue, x NormedRows fused), its rows in the
        dtype `silu_mul_halves` would give them; anything else the two ops."""
        rows = x.shape[0]
        w = _streamed(gate_up) if rows <= SWIGLU_ROWS else None
        if w is not None and 0 < cupy_ops_extra.tune_for(w.fmt)["swiglu_rows"] <= rows and fuses_swiglu(w, rows):
            x = x if isinstance(x, NormedRows) else product_rows(x)
            return mx_swiglu(x, w, out_dtype=self._product_x_dtype(to_product, rows))
        return super().swiglu(x, gate_up, to_product)

    def silu_mul_halves(self, y: Any, to_product: Any = None) -> Any:
        """bf16 bits where the one product that reads the result rounds x to bf16 anyway (`_reads_bf16`)."""
        return ops.silu_mul_halves(y, out_dtype=self._product_x_dtype(to_product, y.shape[0]))

    def concat_rows(self, weights: list[Any]) -> tuple[Any, list[Any]] | None:
        """Stacks device matrices of one storage (float32, bf16 bits, or PackedWeights of one format, tensor
        scale and E2M1 code layouts); None for anything else (e.g. NVFP4 tensors of different tensor scales)."""
        if all(isinstance(w, PackedWeight) for w in weights):
            first = weights[0]
            if any(len(w.shape) != 2 for w in weights) or not _same_storage(weights):
                return None
            codes = cp.concatenate([w.codes for w in weights], axis=0)
            scales = cp.concatenate([w.scales for w in weights], axis=0) if first.scales is not None else None
            persistent = all(w.persistent for w in weights)  # stacked at load time from model weights
            fused = PackedWeight(first.fmt, (codes.shape[0], first.K), codes, scales, first.tensor_scale, persistent,
                                 first.e2m1_split, first.tiled)  # tiled parts are whole bands: so is their stack
            if not gemm_ready(fused):
                return None
            # bf16 values where every part keeps them (PackedWeightsMixin.dense_prefill): stacked likewise
            parts = [dense_of(w) for w in weights]
            dense = cp.concatenate(parts, axis=0) if all(d is not None for d in parts) else None
            set_dense(fused, dense)
            views, r = [], 0
            for w in weights:
                n = w.shape[0]
                views.append(PackedWeight(w.fmt, w.shape, codes[r:r + n], None if scales is None else scales[r:r + n],
                                          w.tensor_scale, persistent, w.e2m1_split, w.tiled))
                set_dense(views[-1], None if dense is None else dense[r:r + n])
                r += n
            return fused, views
        if not all(isinstance(w, cp.ndarray) and w.ndim == 2 for w in weights):
            return None
        if any(w.dtype != weights[0].dtype or w.shape[1] != weights[0].shape[1] for w in weights):
            return None
        fused = cp.concatenate(weights, axis=0)
        bounds = np.cumsum([0] + [w.shape[0] for w in weights])
        return fused, [fused[a:b] for a, b in itertools.pairwise(bounds)]

    def sigmoid(self, x: Any) -> Any:
        return ops.sigmoid(x)

    def rope(self, x: Any, cos: Any, sin: Any, rotary_dim: int) -> Any:
        return ops.rope(x, cos, sin, rotary_dim)

    def qk_norm_rope(self, q: Any, k: Any, q_weight: Any, k_weight: Any, eps: float, offset: float, cos: Any,
                     sin: Any, rotary_dim: int) -> tuple[Any, Any]:
        """Both norms and rotations in one launch (decapybara/kernels/decode_ops.cu `qk_norm_rope`, q and k read in
        place as the columns of a fused [query | gate] or q|k|v product); heads longer than the warp norm's rows take
        the four ops."""
        if q.shape[-1] > ops.WARP_ROW_MAX:
            return super().qk_norm_rope(q, k, q_weight, k_weight, eps, offset, cos, sin, rotary_dim)
        return ops.qk_norm_rope(q, k, q_weight, k_weight, eps, offset, cos, sin, rotary_dim)

    def sigmoid_gate(self, o: Any, gate: Any, to_product: Any = None) -> Any:
        """One launch (`sigmoid_mul_rows`), the gate columns read in place; bf16 bits where the one product that
        reads the result rounds x to bf16 anyway (`_reads_bf16`)."""
        return ops.sigmoid_gate(o, gate, out_dtype=self._product_x_dtype(to_product, o.shape[0]))

    def _product_x_dtype(self, to_product: Any, rows: int) -> Any:
        """The dtype of rows that only feed a product of `rows` rows over `to_product` (None: unknown): bf16
        bits where the skinny kernels read them (bf16 backend, `_reads_bf16`), else float32."""
        bf16 = self.bf16 and to_product is not None and _reads_bf16(to_product, rows)
        return cp.uint16 if bf16 else cp.float32

    def paged_attention(self, kv: CupyKVCache, layer: Any, q: Any, k: Any, v: Any, batch: ForwardBatch,
                        scale: float) -> Any:
        return self._attend(kv, layer, q, k, v, self._kv_plan(kv, q, batch), scale)

    def paged_attention_gated(self, kv: CupyKVCache, layer: Any, q: Any, k: Any, v: Any, batch: ForwardBatch,
                              scale: float, gate: Any, to_product: Any = None) -> Any:
        """A pure decode step's gate in the decode kernel's final items and attention_reduce (no
        sigmoid_mul_rows launch: the same bits, float32 or bf16 as `sigmoid_gate`'s); other steps run the two
        ops."""
        plan = self._kv_plan(kv, q, batch)
        if not gate_fuses(plan):
            return super().paged_attention_gated(kv, layer, q, k, v, batch, scale, gate, to_product)
        return self._attend(kv, layer, q, k, v, plan, scale, gate, self._product_x_dtype(to_product, q.shape[0]))

    def _kv_plan(self, kv: CupyKVCache, q: Any, batch: ForwardBatch) -> AttentionPlan:
        """The forward's attention plan for q [T, nq, d] over the pages of `kv`."""
        return self._attention_plan(batch, q.shape[1], kv.kv_heads, q.shape[2], (kv.key_bits, kv.value_bits))

    def _attend(self, kv: CupyKVCache, layer: Any, q: Any, k: Any, v: Any, plan: AttentionPlan, scale: float,
                gate: Any = None, out_dtype: Any = cp.float32) -> Any:
        """k, v written into the layer's pages, then `cupy_attention.attention` (with its output gate, if any)."""
        kv.write(layer, plan.slots, k, v)
        return attention(q, kv.parts(layer, "k"), kv.parts(layer, "v"), plan, kv.kv_heads, kv.page_size, scale,
                         gate, out_dtype)

    def _attention_plan(self, batch: ForwardBatch, nq: int, nkv: int, d: int,
                        kv_bits: tuple[int, int]) -> AttentionPlan:
        key = (nq, nkv, d, *kv_bits)
        if self._attn is not None and self._attn[0] is batch and self._attn[1] == key:
            return self._attn[2]
        plan = plan_attention(batch, nq, nkv, d, self.attention_splits, kv_bits)
        self._attn = (batch, key, plan)  # NOTE: holding the batch keeps `is` identity sound across layers
        return plan

    def deltanet_core(self, states: CupyStatePool, layer: int, mixed_qkv: Any, a: Any, b: Any,
                      params: DeltaNetParams, segments: list[DeltaNetSegment], cfg: ModelConfig,
                      snapshots: dict[tuple[int, int], dict[int, tuple[np.ndarray, np.ndarray]]],
                      gate: tuple[Any, Any, float] | None = None, out_dtype: Any = cp.float32) -> Any:
        """`gate` = (z, norm_weight, eps): `deltanet_core_gated` (cupy_deltanet.deltanet_core's `gate`,
        `out_dtype`)."""
        if self._runs is None or self._runs[0] is not segments:
            self._runs = (segments, plan_runs(segments))
        return deltanet_core(states, layer, mixed_qkv, a, b, params, self._runs[1], cfg, snapshots,
                             acc="float" if self.bf16 else "double", gate=gate, out_dtype=out_dtype)

    def deltanet_core_gated(self, states: CupyStatePool, layer: int, mixed_qkv: Any, a: Any, b: Any,
                            params: DeltaNetParams, segments: list[DeltaNetSegment], cfg: ModelConfig,
                            snapshots: dict[tuple[int, int], dict[int, tuple[np.ndarray, np.ndarray]]], z: Any,
                            norm_weight: Any, eps: float, to_product: Any = None) -> Any:
        """A decode forward's gated norm comes from the launch after gdn_decode, which also updates the conv
        state (`gdn_decode_finish`: no gated_rms_norm_warp launch, the same bits; in bf16 bits as
        `sigmoid_gate`'s); other forwards run the two ops (float32)."""
        return self.deltanet_core(states, layer, mixed_qkv, a, b, params, segments, cfg, snapshots,
                                  (z, norm_weight, eps), self._product_x_dtype(to_product, mixed_qkv.shape[0]))

    def gated_rms_norm(self, x: Any, z: Any, weight: Any, eps: float) -> Any:
        return ops.gated_rms_norm(x, z, weight, eps)

    def moe_captures(self, gate_w: Any, up_w: Any, down_w: Any) -> bool:
        """Whether `moe` over these experts runs without host synchronisation (so inside a CUDA graph): bf16
        expert stacks in bf16 mode (the float32 ones of the fp32 mode read their routing on the host)."""
        return self.bf16 and _device_stacks(gate_w, up_w, down_w) is not None

    def moe(self, x: Any, router: Any, gate_w: Any, up_w: Any, down_w: Any, top_k: int, normalize: bool,
            shared: Any = None, shared_gate: Any = None, fused: Any = None) -> Any:
        """bf16 mode, bf16 expert stacks: `cupy_ops_extra.moe` (router and top-k, dispatch grouped by expert,
        grouped skinny products, weighted combine with the shared expert: no host synchronisation, so decode
        steps and eager steps' tails capture it; `fused`: `fuse_moe`'s stacks). Otherwise (the fp32 mode's
        float32 experts: the reference function) the router softmax and top-k on the device, the experts hit by
        any row as row-gathered matrix products (one host sync per call for the list of hit experts), then
        `add_shared_expert`."""
        got = self._device_moe(x, router, gate_w, up_w, down_w, top_k, normalize, shared, shared_gate, fused)
        if got is not None:
            return got
        x = _plain_rows(x)
        return self.add_shared_expert(self._host_routed_moe(x, router, gate_w, up_w, down_w, top_k, normalize), x,
                                      shared, shared_gate)

    def moe_add_rms_norm(self, moe_args: tuple, residual: Any, weight: Any, eps: float,
                         offset: float) -> tuple[Any, Any]:
        """The device `moe`'s combine with the residual add and norm in one launch (`moe_combine_norm`); the two
        ops elsewhere."""
        got = self._device_moe(*moe_args, norm=(ops.f32(residual), weight, eps, offset))
        if got is not None:
            return got
        return super().moe_add_rms_norm((_plain_rows(moe_args[0]), *moe_args[1:]), residual, weight, eps, offset)

    def _device_moe(self, x: Any, router: Any, gate_w: Any, up_w: Any, down_w: Any, top_k: int, normalize: bool,
                    shared: Any = None, shared_gate: Any = None, fused: Any = None, *, norm: Any = None) -> Any:
        """`cupy_ops_extra.moe` (with `norm`, its combine and the next norm in one launch) where this backend's
        stacks take it: bf16 mode's bf16 stacks (packed ones: `PackedWeightsMixin`); else None."""
        stacks = _device_stacks(gate_w, up_w, down_w) if self.bf16 and top_k <= MOE_TOP_K else None
        if stacks is None:
            return None
        return cupy_ops_extra.moe(x if isinstance(x, NormedRows) else product_rows(x), router, *stacks, top_k,
                                  normalize, shared, shared_gate, fused, norm)

    def fuse_moe(self, weights: dict[str, Any]) -> tuple[FusedMoE, dict[str, Any]] | None:
        """The layer's router and shared gate stacked (`concat_rows`; where bf16 or packed), its experts' gate
        and up stacks stacked ([E, 2 I, H]: each expert's gate rows, then its up rows) and, where the shared
        expert's MLP has the routed experts' width and storage, that MLP appended to the stacks as expert E
        (gate|up [E + 1, 2 I, H], down [E + 1, H, I]; `FusedMoE.shared_slot`): what `cupy_ops_extra.moe` runs in
        fewer launches. For bf16 stacks in bf16 mode and packed ones (the fp32 mode's float32 experts take the
        host-routed path, which reads none of them)."""
        gate, up, down = weights["gate"], weights["up"], weights["down"]
        if not (self.bf16 or isinstance(gate, PackedWeight)):
            return None
        views: dict[str, Any] = {}
        fused = FusedMoE()
        if "shared_gate" in weights:
            got = self.concat_rows([weights["router"], weights["shared_gate"]])
            if got is not None:
                fused.router_gate, (views["router"], views["shared_gate"]) = got
        e, inter = gate.shape[0], gate.shape[1]
        sgu, sdown = weights.get("shared_gate_up"), weights.get("shared_down_proj")
        streamed = fused.router_gate is not None and _streamed(fused.router_gate) is not None
        gate_up = down_all = None
        if streamed and sgu is not None and sdown is not None:  # the shared expert as expert E
            gate_up = _stack_experts([[gate, up], [sgu]])
            down_all = _stack_experts([[down], [sdown]]) if gate_up is not None else None
        if down_all is None:
            gate_up = _stack_experts([[gate, up]])
        if gate_up is None or not gemm_ready(_bf16_stack(gate_up)):
            return (fused, views) if views else None
        views["gate"], views["up"] = (_expert_rows(gate_up, slice(0, e), r) for r in ((0, inter), (inter, inter)))
        if down_all is not None:
            fused.shared_slot = True
            views["down"] = _expert_rows(down_all, slice(0, e), None)
            views["shared_gate_up"] = _expert_rows(gate_up, e, None, sgu)
            for role, r in (("shared_gate_proj", (0, inter)), ("shared_up_proj", (inter, inter))):
                views[role] = _expert_rows(gate_up, e, r, weights.get(role))
            views["shared_down_proj"] = _expert_rows(down_all, e, None, sdown)
        fused.gate_up, fused.down = _bf16_stack(gate_up), _bf16_stack(down_all) if down_all is not None else None
        return fused, views

    def _host_routed_moe(self, x: Any, router: Any, gate_w: Any, up_w: Any, down_w: Any, top_k: int,
                         normalize: bool) -> Any:
        x = ops.f32(x)
        logits = self.linear(x, router)  # [T, E]
        probs = cp.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        top = cp.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # [T, k], ties to the lower index
        weights = cp.take_along_axis(probs, top, axis=-1)
        if normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        top_h = cp.asnumpy(top)
        out = cp.zeros_like(x)
        for e in np.unique(top_h):
            rows, which = np.nonzero(top_h == e)
            r_dev, w_dev = cp.asarray(rows), cp.asarray(which)
            xr = x[r_dev]
            h = ops.silu_mul(self.linear(xr, gate_w[e]), self.linear(xr, up_w[e]))
            out[r_dev] += self.linear(h, down_w[e]) * weights[r_dev, w_dev][:, None]
        return out

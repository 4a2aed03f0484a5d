"""The ops interface every backend implements (numpy reference, cupy/CUDA).

Contract: activations are 2-D or 3-D arrays of the backend's array type (`xp`), rows are tokens of a flattened
`ForwardBatch`. Elementwise arithmetic between activations (`a + b`, reshape) uses the array type's operators;
everything else goes through the methods below, so a backend may fuse or replace any of them. A backend must
compute the same function as the numpy reference within its precision class.

The backend owns device memory: weights (`prepare_weight`), the paged KV cache of the attention layers and
the per-sequence recurrent/conv state of DeltaNet layers (`new_kv_cache`, `new_state_pool`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig


@dataclass(slots=True)
class HybridState:
    """DeltaNet state of one sequence, host copies: per linear layer (in model order) conv and recurrent."""

    conv: list[np.ndarray]  # each [conv_dim, kernel - 1] float32
    recurrent: list[np.ndarray]  # each [num_v_heads, key_head_dim, value_head_dim] float32

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv) + sum(a.nbytes for a in self.recurrent)


@dataclass(slots=True)
class DeltaNetSegment:
    """A run of rows of one sequence processed with one state slot; optionally snapshotted at its end."""

    start: int
    length: int
    slot: int
    snapshot_key: tuple[int, int] | None = None  # (sequence index in batch, absolute token count)
    keep_on_device: bool = False  # its snapshot stays the backend's arrays (ForwardBatch.device_snapshots)


@dataclass(slots=True)
class DeltaNetParams:
    """Per-layer DeltaNet parameters in the form the backend's `deltanet_core` consumes."""

    conv_weight: Any  # [conv_dim, kernel]
    neg_A: Any  # [num_v_heads]  -exp(A_log), float32
    dt_bias: Any  # [num_v_heads]


@dataclass(slots=True)
class KVPageData:
    """Host copy of some KV pages of every attention layer (the unit pause/resume and the tiers move)."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # "{layer}.{part}" -> [n_pages, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class KVCache(ABC):
    """Paged KV storage for the attention layers: `num_pages` pages of `page_size` tokens each."""

    num_pages: int
    page_size: int

    @abstractmethod
    def export_pages(self, page_ids: np.ndarray) -> KVPageData:
        """Copy the given pages of every layer to host memory (storage format, no conversion)."""

    @abstractmethod
    def import_pages(self, page_ids: np.ndarray, data: KVPageData) -> None:
        """Write pages previously exported (same KV mode and shapes) into `page_ids`."""

    @abstractmethod
    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Device-side copy of pages src[i] -> dst[i] in every layer."""

    @property
    @abstractmethod
    def bytes_per_page(self) -> int:
        """Bytes one page occupies across all attention layers."""


class StatePool(ABC):
    """Per-sequence DeltaNet state: `num_slots` rows of conv + recurrent state for every linear layer."""

    num_slots: int

    @abstractmethod
    def reset(self, slot: int) -> None:
        """Zero the slot (a sequence starting from token 0)."""

    @abstractmethod
    def get(self, slot: int) -> HybridState:
        """Host copy of the slot's state."""

    @abstractmethod
    def set(self, slot: int, state: HybridState) -> None:
        """Overwrite the slot with a state from `get` or a snapshot."""

    @abstractmethod
    def copy(self, src: int, dst: int) -> None:
        """dst := src, on the device."""


class Backend(ABC):
    """Array library + ops. See the module docstring for the contract."""

    name: str
    xp: Any  # numpy or cupy

    # ---- memory -------------------------------------------------------------------------------------
    @abstractmethod
    def from_host(self, a: np.ndarray, dtype: Any = None) -> Any: ...

    @abstractmethod
    def to_host(self, a: Any) -> np.ndarray: ...

    def to_host_many(self, arrays: list[Any]) -> list[np.ndarray]:
        """`to_host` of each array (a device backend may move them together)."""
        return [self.to_host(a) for a in arrays]

    @abstractmethod
    def prepare_weight(self, name: str, value: Any) -> Any:
        """Device-ready form of one weight (float32 array or a `QuantTensor`) for `linear`/`embedding`."""

    @abstractmethod
    def new_kv_cache(self, cfg: ModelConfig, num_pages: int, page_size: int, kv_mode: Any = None) -> KVCache: ...

    @abstractmethod
    def new_state_pool(self, cfg: ModelConfig, num_slots: int) -> StatePool: ...

    # ---- ops ----------------------------------------------------------------------------------------
    @abstractmethod
    def embedding(self, table: Any, ids: np.ndarray) -> Any:
        """[T, H] rows of `table` for host token ids [T]."""

    @abstractmethod
    def rms_norm(self, x: Any, weight: Any, eps: float, offset: float) -> Any:
        """x * rsqrt(mean(x^2) + eps) * (offset + weight) over the last axis, computed in float32."""

    def add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float, offset: float) -> tuple[Any, Any]:
        """(rms_norm(h), h) with h = x + residual: the residual add before a decoder norm. Backends may fuse
        the two (one pass, one launch); the sum must equal the plain float32 `x + residual`."""
        h = residual + x
        return self.rms_norm(h, weight, eps, offset), h

    @abstractmethod
    def linear(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """x @ weight^T (+ bias): [T, in] -> [T, out]."""

    def row_slice(self, weight: Any, rows: int) -> Any:
        """A weight's first `rows` output rows (a multiple of 16), as `linear` takes it: a view of its memory."""
        return weight[:rows]

    def linear_pair(self, x: Any, weight_a: Any, weight_b: Any) -> tuple[Any, Any]:
        """(linear(x, weight_a), linear(x, weight_b)): two products of the same rows that do not depend on each
        other. A backend may run them concurrently; the results must be those of the two `linear` calls."""
        return self.linear(x, weight_a), self.linear(x, weight_b)

    def linear_add_rms_norm(self, x: Any, weight: Any, bias: Any, residual: Any, norm_weight: Any, eps: float,
                            offset: float) -> tuple[Any, Any]:
        """`add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps, offset)`: a block's output
        projection, the residual add and the next norm. A backend may fuse them and return the normed rows in a
        deferred form, or in the precision its products read them in: the caller passes them only to this
        backend's `linear` (as x), or where `moe_takes_product_rows` to its `moe` / `moe_add_rms_norm` (as x),
        and reads only their `shape`. The new residual must equal the plain float32 `linear(...) + residual`."""
        return self.add_rms_norm(self.linear(x, weight, bias), residual, norm_weight, eps, offset)

    # whether `moe` and `moe_add_rms_norm` take as x the rows `linear_add_rms_norm` gives (so that a model fuses
    # an MoE block's input norm into the output projection before it as it does a dense MLP's)
    moe_takes_product_rows = False

    @abstractmethod
    def silu_mul(self, gate: Any, up: Any) -> Any: ...

    def swiglu(self, x: Any, gate_up: Any, to_product: Any = None) -> Any:
        """silu(x @ gate^T) * (x @ up^T) for `gate_up` = [gate; up] stacked along rows (`concat_rows`): the fused
        gate|up product and its activation, `silu_mul_halves(linear(x, gate_up), to_product)`, which a backend may
        run as one kernel (the same values, up to float32 rounding of the product's sums). x as `linear` takes
        it."""
        return self.silu_mul_halves(self.linear(x, gate_up), to_product=to_product)

    def silu_mul_halves(self, y: Any, to_product: Any = None) -> Any:
        """silu(y[:, :n]) * y[:, n:] for y [T, 2n]: the activation of a fused gate|up product. `to_product`: the
        weight of the one product the caller passes the result to (this backend's `linear`, as x), where
        nothing else reads it; a backend may then return it in the precision that product reads x in."""
        n = y.shape[-1] // 2
        return self.silu_mul(y[..., :n], y[..., n:])

    def concat_rows(self, weights: list[Any]) -> tuple[Any, list[Any]] | None:
        """One matrix holding `weights` ([N_i, K] each, same K and storage) stacked along rows, plus a row-range
        view of it for each input (so the inputs' memory can go), or None where this backend does not fuse
        products. Fusing lets a skinny product read several matrices in one launch.

        A backend that fuses must accept column-range views of its `linear` outputs (rows not contiguous: row
        stride = the fused width) as `deltanet_core`'s mixed_qkv / a / b, `gated_rms_norm`'s z, `qk_norm_rope`'s
        q / k and `paged_attention`'s v (the columns of a fused q|k|v product), which is what `QwenModel` passes
        then; `QwenModel` also replaces the inputs' entries of its weight dict by the views."""
        return None

    @abstractmethod
    def sigmoid(self, x: Any) -> Any: ...

    def sigmoid_gate(self, o: Any, gate: Any, to_product: Any = None) -> Any:
        """o * sigmoid(gate), elementwise over one shape (gate may be a strided view, e.g. the gate columns of a
        fused [query | gate] product): an attention layer's output gate. Backends may fuse the two (one launch);
        the result must equal the two ops'. `to_product`: the weight of the one product that reads the result
        (`linear` or `linear_add_rms_norm`, as x); a backend may then return it in the precision that product
        reads x in."""
        return o * self.sigmoid(gate)

    @abstractmethod
    def rope(self, x: Any, cos: Any, sin: Any, rotary_dim: int) -> Any:
        """Rotate-half RoPE on the first `rotary_dim` dims of x [T, heads, head_dim]; cos/sin [T, rotary_dim/2]."""

    def qk_norm_rope(self, q: Any, k: Any, q_weight: Any, k_weight: Any, eps: float, offset: float, cos: Any,
                     sin: Any, rotary_dim: int) -> tuple[Any, Any]:
        """(rope(rms_norm(q, q_weight)), rope(rms_norm(k, k_weight))) for q [T, Hq, d], k [T, Hk, d]: an attention
        layer's per-head norms and RoPE (q and k may be strided views: the query columns of a fused [query | gate]
        product, the columns of a fused q|k|v product). Backends may fuse the four (one launch); the results must
        equal the four ops'."""
        q = self.rms_norm(q, q_weight, eps, offset)
        k = self.rms_norm(k, k_weight, eps, offset)
        return self.rope(q, cos, sin, rotary_dim), self.rope(k, cos, sin, rotary_dim)

    @abstractmethod
    def paged_attention(self, kv: KVCache, layer: int, q: Any, k: Any, v: Any, batch: ForwardBatch,
                        scale: float) -> Any:
        """Write k, v [T, kv_heads, d] at `batch.slot_mapping` (either may be a strided view: v the value columns
        of a fused q|k|v product), then causal attention of q [T, heads, d] over each sequence's cached + new
        tokens. Returns [T, heads, d]."""

    def paged_attention_gated(self, kv: KVCache, layer: int, q: Any, k: Any, v: Any, batch: ForwardBatch,
                              scale: float, gate: Any, to_product: Any = None) -> Any:
        """`sigmoid_gate(paged_attention(...), gate, to_product)`: qwen3_5's gated attention output (gate [T,
        heads, d], a strided view of the [query | gate] product's columns). Backends may apply the gate in the
        kernels that finish the attention's output (one launch fewer); the result must equal the two ops'."""
        return self.sigmoid_gate(self.paged_attention(kv, layer, q, k, v, batch, scale), gate, to_product)

    @abstractmethod
    def deltanet_core(self, states: StatePool, layer: int, mixed_qkv: Any, a: Any, b: Any, params: DeltaNetParams,
                      segments: list[DeltaNetSegment], cfg: ModelConfig,
                      snapshots: dict[tuple[int, int], dict[int, tuple[np.ndarray, np.ndarray]]]) -> Any:
        """Causal conv (silu) + L2-normed gated delta rule over each segment, updating the slot's conv and
        recurrent state in order. mixed_qkv [T, conv_dim], a/b [T, num_v_heads]. Returns [T, v_heads, v_dim].
        Segments with a `snapshot_key` add {layer: (conv, recurrent)} copies to `snapshots[key]`, apart from
        the pool (host arrays; a device backend's may still be in flight, and may keep other entries under keys
        that are not layers): the forward takes them through `to_host_many` once every layer has run."""

    @abstractmethod
    def gated_rms_norm(self, x: Any, z: Any, weight: Any, eps: float) -> Any:
        """rms_norm(x) * weight * silu(z) over the last axis (x, z [..., d])."""

    def deltanet_core_gated(self, states: StatePool, layer: int, mixed_qkv: Any, a: Any, b: Any,
                            params: DeltaNetParams, segments: list[DeltaNetSegment], cfg: ModelConfig,
                            snapshots: dict[tuple[int, int], dict[int, tuple[np.ndarray, np.ndarray]]], z: Any,
                            norm_weight: Any, eps: float, to_product: Any = None) -> Any:
        """gated_rms_norm(deltanet_core(...), z, norm_weight, eps) [T, v_heads, v_dim] (z [T, v_heads, v_dim],
        which may be a strided view as `gated_rms_norm` takes it): a DeltaNet layer's core and the norm after it,
        with `deltanet_core`'s state updates and snapshots. Backends may fuse the norm into the core's launches;
        the result must equal the two ops'. `to_product` as `sigmoid_gate`'s."""
        core = self.deltanet_core(states, layer, mixed_qkv, a, b, params, segments, cfg, snapshots)
        return self.gated_rms_norm(core, z, norm_weight, eps)

    @abstractmethod
    def moe(self, x: Any, router: Any, gate_w: Any, up_w: Any, down_w: Any, top_k: int, normalize: bool,
            shared: Any = None, shared_gate: Any = None, fused: Any = None) -> Any:
        """Softmax router over experts, top-k (optionally renormalised), SwiGLU experts, weighted sum. [T, H].
        With a shared expert (its output `shared` [T, H], or a function of no arguments that computes it, and
        its gate's weight `shared_gate` [1, H]): that sum + sigmoid(x @ shared_gate^T) * shared
        (`add_shared_expert`). `fused`: what this backend's `fuse_moe` made of the layer's weights at load (the
        arguments are then its views): the same function, which the backend may compute from those stacks (and
        then need not call `shared`)."""

    def moe_add_rms_norm(self, moe_args: tuple, residual: Any, weight: Any, eps: float,
                         offset: float) -> tuple[Any, Any]:
        """`add_rms_norm(moe(*moe_args), residual, weight, eps, offset)`: an MoE block's output, the residual add
        and the next layer's input norm, which a backend may fuse into the MoE's last launch."""
        return self.add_rms_norm(self.moe(*moe_args), residual, weight, eps, offset)

    def fuse_moe(self, weights: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        """At load: one MoE layer's weights by role ("router", "gate", "up", "down"; with a shared expert
        "shared_gate", its MLP's "shared_gate_proj", "shared_up_proj", "shared_down_proj" and, where
        `concat_rows` stacked those two, "shared_gate_up") -> (this backend's stacked form of them, which
        `moe` gets as `fused`; views that replace the given weights, by role, so that their memory can go), or
        None where this backend stacks nothing."""
        return None

    def add_shared_expert(self, y: Any, x: Any, shared: Any, shared_gate: Any) -> Any:
        """y + sigmoid(x @ shared_gate^T) * shared (y where `shared` is None; `shared` called where it is a
        function): `moe`'s last step, as a model computes it."""
        if shared is None:
            return y
        shared = shared() if callable(shared) else shared
        return y + self.sigmoid(self.linear(x, shared_gate)) * shared

    def moe_captures(self, gate_w: Any, up_w: Any, down_w: Any) -> bool:
        """Whether `moe` over these expert stacks runs without host synchronisation, so that a CUDA graph may
        capture it (a device backend's decode graphs and eager steps' layer tails). The default: no."""
        return False

    # ---- sampling ---------------------------------------------------------------------------------------
    def sample(self, logits: Any, rows: Any, eos_token_ids: Any = ()) -> Any:
        """One token per row of `logits` [len(rows), V] (this backend's float32 array) as
        `decapybara.engine.sampling.sample` draws it from the same rows (`SamplerRow`s): a `SampleOutput` on
        the host. The default copies the logits to the host and runs that numpy reference; a device backend
        samples where the logits are and copies back only the tokens and logprobs."""
        from decapybara.engine.sampling import sample

        return sample(self.to_host(logits).astype(np.float32, copy=False), rows, eos_token_ids=eos_token_ids)

    def argmax_prob(self, logits: Any) -> tuple[Any, Any]:
        """(the lowest id of each row's maximum [R] int64, its softmax probability [R] float32) of float32 logits
        [R, V], where they are (two numbers a row to read back, not a vocabulary's logits): the MTP head's
        greedy guesses and their confidence."""
        xp = self.xp
        guess = xp.argmax(logits, axis=-1)
        top = xp.take_along_axis(logits, guess[:, None], axis=-1)
        return guess, (1.0 / xp.exp(logits - top).sum(axis=-1)).astype(xp.float32)

    def token_logprobs(self, logits: Any, rows: np.ndarray, targets: np.ndarray, k: int
                       ) -> tuple[np.ndarray, list[list[tuple[int, float]]]]:
        """Each of `rows`' log-softmax (float32 logits [R', V], where they are) at its target id, and its `k` best
        (token_id, logprob), descending, ties by ascending id: the model's own distribution, no sampler edit
        (prompt logprobs). k argmax passes rather than a sort of the vocabulary (k <= 20). Host results: float32
        [len(rows)], lists."""
        xp = self.xp
        x = logits[self.from_host(np.asarray(rows, np.int64))].astype(xp.float32, copy=False)  # [R, V], a copy
        m = x.max(axis=-1, keepdims=True)
        lse = m[:, 0] + xp.log(xp.exp(x - m).sum(axis=-1))  # [R]
        tgt = self.from_host(np.asarray(targets, np.int64))
        lp = xp.take_along_axis(x, tgt[:, None], axis=-1)[:, 0] - lse
        ids, vals = [], []
        at = xp.arange(x.shape[0])
        for _ in range(min(max(k, 0), x.shape[-1])):  # the best left, lowest id among ties; then struck out
            best = x.argmax(axis=-1)
            ids.append(best)
            vals.append(x[at, best] - lse)
            x[at, best] = -xp.inf
        host = self.to_host_many([lp, *ids, *vals])
        lp, ids, vals = host[0], host[1:1 + len(ids)], host[1 + len(ids):]
        tops = [[(int(i[r]), float(np.float32(v[r]))) for i, v in zip(ids, vals) if np.isfinite(v[r])]
                for r in range(len(lp))]
        return lp.astype(np.float32), tops

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on the CPU)."""

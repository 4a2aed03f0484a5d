"""The numpy reference backend: float32 everywhere, the function every other backend must reproduce."""

from __future__ import annotations

from typing import Any

import numpy as np

from decapybara.backend.base import (
    Backend,
    DeltaNetParams,
    DeltaNetSegment,
    HybridState,
    KVCache,
    KVPageData,
    StatePool,
)
from decapybara.backend.kv_codec import KVCodec, codec_for
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig

F32 = np.float32
SMALL_ROWS = 16  # `linear` takes weight @ x^T up to this many rows


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class NumpyKVCache(KVCache):
    """KV pages per attention layer, in the codec's storage parts: {part: [num_pages, page_size, ...]}."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, codec: KVCodec):
        self.num_pages, self.page_size, self.codec = num_pages, page_size, codec
        self.layers = list(cfg.attention_layers) + [("mtp", j) for j in range(cfg.mtp_num_hidden_layers)]
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        shape = (num_pages, page_size, self.kv_heads)
        self.store: dict[Any, dict[str, np.ndarray]] = {
            layer: {f"{kv}.{part}": np.zeros(shape + pshape, dtype)
                    for kv in ("k", "v") for part, (pshape, dtype) in codec.parts(self.head_dim, kv).items()}
            for layer in self.layers
        }

    @property
    def bytes_per_page(self) -> int:
        return sum(a[0].nbytes for parts in self.store.values() for a in parts.values())

    def write(self, layer: Any, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        pages, offs = slots // self.page_size, slots % self.page_size
        parts = self.store[layer]
        for kv, x in (("k", k), ("v", v)):
            for part, arr in self.codec.encode(x, kv).items():
                parts[f"{kv}.{part}"][pages, offs] = arr

    def gather(self, layer: Any, block_table: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """k, v of the first n tokens of a sequence: [n, kv_heads, head_dim] float32."""
        parts = self.store[layer]
        out = []
        for kv in ("k", "v"):
            sel = {p.split(".", 1)[1]: a[block_table].reshape((-1,) + a.shape[2:])[:n]
                   for p, a in parts.items() if p.startswith(kv + ".")}
            out.append(self.codec.decode(sel, kv, self.head_dim))
        return out[0], out[1]

    def export_pages(self, page_ids: np.ndarray) -> KVPageData:
        return KVPageData({f"{layer}|{p}": a[page_ids].copy()
                           for layer, parts in self.store.items() for p, a in parts.items()})

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        for parts in self.store.values():
            for a in parts.values():
                a[dst] = a[src]

    def import_pages(self, page_ids: np.ndarray, data: KVPageData) -> None:
        for layer, parts in self.store.items():
            for p, a in parts.items():
                a[page_ids] = data.arrays[f"{layer}|{p}"]


class NumpyStatePool(StatePool):
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: Any = F32):
        self.num_slots = num_slots
        self.layers = list(cfg.linear_layers)
        c, k = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv = {i: np.zeros((num_slots, c, k - 1), dtype) for i in self.layers}
        self.rec = {i: np.zeros((num_slots, hv, dk, dv), dtype) for i in self.layers}

    def reset(self, slot: int) -> None:
        for i in self.layers:
            self.conv[i][slot] = 0
            self.rec[i][slot] = 0

    def get(self, slot: int) -> HybridState:
        return HybridState([self.conv[i][slot].copy() for i in self.layers],
                           [self.rec[i][slot].copy() for i in self.layers])

    def set(self, slot: int, state: HybridState) -> None:
        for j, i in enumerate(self.layers):
            self.conv[i][slot] = state.conv[j]
            self.rec[i][slot] = state.recurrent[j]

    def copy(self, src: int, dst: int) -> None:
        for i in self.layers:
            self.conv[i][dst] = self.conv[i][src]
            self.rec[i][dst] = self.rec[i][src]


def gated_delta_chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                      state: np.ndarray, chunk: int = 64) -> np.ndarray:
    """Chunked gated delta rule for one sequence, updating `state` in place.

    q, k: [H, L, dk] (L2-normed, q scaled); v: [H, L, dv]; g (log decay), beta: [H, L]; state: [H, dk, dv].
    Per token: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q. Returns o: [H, L, dv].
    Within a chunk the recurrence is solved in closed form (UT transform), as in the Gated DeltaNet paper.
    """
    h, n, _ = q.shape
    out = np.empty((h, n, v.shape[2]), q.dtype)
    # NOTE: float64 inside the chunk: the UT system (I + strict lower part) can be ill-conditioned, and the
    # reference must not depend on how a prompt was split into chunks. The state is stored in float32.
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        qc, kc, vc = (x[:, s:e].astype(np.float64) for x in (q, k, v))
        gc, bc = g[:, s:e].astype(np.float64), beta[:, s:e].astype(np.float64)
        st = state.astype(np.float64)
        c = e - s
        if c == 1:  # plain recurrent step (decode)
            st *= np.exp(gc[:, 0])[:, None, None]
            kv_mem = np.sum(st * kc[:, 0, :, None], axis=-2)  # same arithmetic as the batched decode path
            delta = (vc[:, 0] - kv_mem) * bc[:, 0, None]
            st += kc[:, 0, :, None] * delta[:, None, :]
            out[:, s] = np.sum(st * qc[:, 0, :, None], axis=-2)
            state[...] = st
            continue
        cum = np.cumsum(gc, axis=1)  # [H, C]
        lower = np.tril(np.ones((c, c), bool))
        diff = cum[:, :, None] - cum[:, None, :]
        decay = np.where(lower, np.exp(np.where(lower, diff, 0.0)), 0.0)  # [H, C, C]
        k_beta = kc * bc[..., None]
        v_beta = vc * bc[..., None]
        strict = (k_beta @ kc.transpose(0, 2, 1)) * decay * ~np.eye(c, dtype=bool)
        t_mat = np.eye(c)[None] + strict  # unit lower triangular
        rhs = np.concatenate([v_beta, k_beta * np.exp(cum)[..., None]], axis=2)
        sol = np.linalg.solve(t_mat, rhs)
        new_v, k_cum = sol[..., :v.shape[2]], sol[..., v.shape[2]:]
        intra = (qc @ kc.transpose(0, 2, 1)) * decay
        v_new = new_v - k_cum @ st
        out[:, s:e] = (qc * np.exp(cum)[..., None]) @ st + intra @ v_new
        k_dec = kc * np.exp(cum[:, -1:] - cum)[..., None]
        st *= np.exp(cum[:, -1])[:, None, None]
        st += k_dec.transpose(0, 2, 1) @ v_new
        state[...] = st
    return out


class NumpyBackend(Backend):
    name = "numpy"
    xp = np

    def __init__(self, dtype: Any = np.float32):
        """`dtype` float32 is the reference; float64 proves algorithms exact (e.g. chunking invariance)."""
        self.dtype = np.dtype(dtype)

    def from_host(self, a: np.ndarray, dtype: Any = None) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=dtype or a.dtype)

    def to_host(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def prepare_weight(self, name: str, value: Any) -> np.ndarray:
        if hasattr(value, "dequantize"):
            value = value.dequantize()
        return np.ascontiguousarray(value, dtype=self.dtype)

    def new_kv_cache(self, cfg: ModelConfig, num_pages: int, page_size: int, kv_mode: Any = None) -> NumpyKVCache:
        return NumpyKVCache(cfg, num_pages, page_size, codec_for(kv_mode, self.dtype))

    def new_state_pool(self, cfg: ModelConfig, num_slots: int) -> NumpyStatePool:
        return NumpyStatePool(cfg, num_slots, max(self.dtype, np.dtype(F32)))

    # ---- ops ----------------------------------------------------------------------------------------
    def embedding(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return table[ids]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float, offset: float) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return (x / np.sqrt(var + eps)) * (x.dtype.type(offset) + weight)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: Any = None) -> np.ndarray:
        # few rows (decodes, a decode's draft row): weight @ x^T, 2-3x faster than x @ weight^T under OpenBLAS
        # from 2 to 16 rows (its GEMM packs the transposed weight every call); as fast at one row
        y = np.ascontiguousarray((weight @ x.T).T) if x.ndim == 2 and x.shape[0] <= SMALL_ROWS else x @ weight.T
        return y + bias if bias is not None else y

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return _silu(gate) * up

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        return _sigmoid(x)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int) -> np.ndarray:
        half = rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, rot/2]
        out = x.copy()
        out[..., :half] = x1 * c - x2 * s
        out[..., half:rotary_dim] = x2 * c + x1 * s
        return out

    def paged_attention(self, kv: NumpyKVCache, layer: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                        batch: ForwardBatch, scale: float) -> np.ndarray:
        kv.write(layer, batch.slot_mapping, k, v)
        _t, nq, d = q.shape
        nkv = kv.kv_heads
        g = nq // nkv
        out = np.empty_like(q)
        for s in batch.seqs:
            keys, vals = kv.gather(layer, s.block_table, s.total)  # [S, nkv, d]
            qs = q[s.start:s.end].reshape(s.length, nkv, g, d)  # [L, nkv, g, d]
            scores = np.einsum("lhgd,shd->hgls", qs, keys) * q.dtype.type(scale)  # [nkv, g, L, S]
            allowed = np.arange(s.total)[None, :] <= (s.context + np.arange(s.length))[:, None]  # [L, S]
            scores = np.where(allowed, scores, -np.inf)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            o = np.einsum("hgls,shd->lhgd", probs, vals)  # [L, nkv, g, d]
            out[s.start:s.end] = o.reshape(s.length, nq, d)
        return out

    def deltanet_core(self, states: NumpyStatePool, layer: int, mixed_qkv: np.ndarray, a: np.ndarray,
                      b: np.ndarray, params: DeltaNetParams, segments: list[DeltaNetSegment], cfg: ModelConfig,
                      snapshots: dict[tuple[int, int], dict[int, tuple[np.ndarray, np.ndarray]]]) -> np.ndarray:
        kd, hk, hv = cfg.linear_key_head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        vd, kdim = cfg.linear_value_head_dim, cfg.linear_key_dim
        ksz = cfg.linear_conv_kernel_dim
        w = params.conv_weight  # [C, K]
        beta_all = _sigmoid(b)  # [T, Hv]
        g_all = params.neg_A * np.logaddexp(a.dtype.type(0), a + params.dt_bias)  # [T, Hv]
        out = np.empty((mixed_qkv.shape[0], hv, vd), a.dtype)
        conv_pool, rec_pool = states.conv[layer], states.rec[layer]
        rep = hv // hk

        def qkv(y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """Split conv output [n, C] into L2-normed, scaled q, k [n, Hv, dk] and v [n, Hv, dv]."""
            q = y[:, :kdim].reshape(n, hk, kd)
            k = y[:, kdim:2 * kdim].reshape(n, hk, kd)
            v = y[:, 2 * kdim:].reshape(n, hv, vd)
            if rep > 1:
                q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
            eps = y.dtype.type(1e-6)
            q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + eps)
            k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + eps)
            return q * y.dtype.type(kd ** -0.5), k, v

        # NOTE: a sequence whose segments are all one token (a decode; a decode and its draft, split at the
        # snapshot between them) goes through one vectorised path, a round per token (the first tokens of all
        # such sequences, then their second ones), also when it decodes alone, so a token's arithmetic never
        # depends on what else is in the batch. Other sequences (chunks of several tokens) run in order in the
        # loop below.
        by_slot: dict[int, list[DeltaNetSegment]] = {}
        for seg in segments:
            by_slot.setdefault(seg.slot, []).append(seg)
        ones = [segs for segs in by_slot.values() if all(seg.length == 1 for seg in segs)]
        done = {id(seg) for segs in ones for seg in segs}
        for r in range(max((len(segs) for segs in ones), default=0)):
            single = [segs[r] for segs in ones if r < len(segs)]
            rows = np.asarray([seg.start for seg in single])
            slots = np.asarray([seg.slot for seg in single])
            x = np.concatenate([conv_pool[slots].transpose(0, 2, 1), mixed_qkv[rows][:, None, :]], axis=1)
            conv_pool[slots] = x[:, 1:].transpose(0, 2, 1)  # x: [B, K, C]
            y = np.zeros((len(single), x.shape[2]), x.dtype)
            for j in range(ksz):
                y += x[:, j] * w[:, j]
            q, k, v = qkv(_silu(y), len(single))  # [B, Hv, d]
            st = rec_pool[slots].astype(np.float64)  # [B, Hv, dk, dv]
            st *= np.exp(g_all[rows].astype(np.float64))[..., None, None]
            kv_mem = np.sum(st * k[..., :, None], axis=-2)  # [B, Hv, dv]
            delta = (v - kv_mem) * beta_all[rows].astype(np.float64)[..., None]
            st += k.astype(np.float64)[..., :, None] * delta[..., None, :]
            out[rows] = np.sum(st * q.astype(np.float64)[..., :, None], axis=-2)
            rec_pool[slots] = st
            for seg in single:
                if seg.snapshot_key is not None:
                    snapshots.setdefault(seg.snapshot_key, {})[layer] = (conv_pool[seg.slot].copy(),
                                                                         rec_pool[seg.slot].copy())
        for seg in segments:
            if id(seg) in done:
                continue
            r0, r1 = seg.start, seg.start + seg.length
            x = np.concatenate([conv_pool[seg.slot].T, mixed_qkv[r0:r1]], axis=0)  # [K-1+L, C]
            conv_pool[seg.slot] = x[seg.length:].T  # the last K - 1 inputs (none for a width-1 conv)
            y = np.zeros((seg.length, x.shape[1]), x.dtype)
            for j in range(ksz):
                y += x[j:j + seg.length] * w[:, j]
            q, k, v = qkv(_silu(y), seg.length)
            o = gated_delta_chunk(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2),
                                  g_all[r0:r1].T, beta_all[r0:r1].T, rec_pool[seg.slot])
            out[r0:r1] = o.transpose(1, 0, 2)
            if seg.snapshot_key is not None:
                snapshots.setdefault(seg.snapshot_key, {})[layer] = (conv_pool[seg.slot].copy(),
                                                                     rec_pool[seg.slot].copy())
        return out

    def gated_rms_norm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return (x / np.sqrt(var + x.dtype.type(eps))) * weight * _silu(z)

    def moe(self, x: np.ndarray, router: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray,
            top_k: int, normalize: bool, shared: Any = None, shared_gate: Any = None,
            fused: Any = None) -> np.ndarray:
        logits = self.linear(x, router)  # [T, E]
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # [T, k]
        weights = np.take_along_axis(probs, top, axis=-1)
        if normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        out = np.zeros_like(x)
        for e in np.unique(top):
            rows, which = np.nonzero(top == e)
            h = self.silu_mul(self.linear(x[rows], gate_w[e]), self.linear(x[rows], up_w[e]))
            out[rows] += self.linear(h, down_w[e]) * weights[rows, which][:, None]
        return self.add_shared_expert(out, x, shared, shared_gate)

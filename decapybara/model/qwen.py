"""The forward pass of the four Qwen families over a backend's ops (numpy reference or CUDA).

`QwenModel.forward(batch, kv, states)` runs one flattened batch of sequence chunks through every layer,
writing new KV into the paged cache and advancing DeltaNet state, and returns logits for `batch.logits_rows`.
The math follows the HF reference (modeling_qwen3*.py) so that fp32 logits agree to float rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decapybara.backend.base import Backend, DeltaNetParams, DeltaNetSegment, HybridState, KVCache, StatePool
from decapybara.errors import WeightError
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import FULL_ATTENTION, ModelConfig
from decapybara.model.rope import RotaryTable
from decapybara.model.weights import expected_tensors


@dataclass(frozen=True, slots=True)
class Projection:
    """A block's output projection not yet run: `linear(x, weight, bias)`. `decoder_layers` runs it together
    with the residual add and the norm after it (`Backend.linear_add_rms_norm`)."""

    x: Any
    weight: Any
    bias: Any = None

    @staticmethod
    def output(out: Any, ops: Backend) -> Any:
        """A mixer's or FFN's output: `out` itself, or a `Projection` run plainly."""
        return ops.linear(out.x, out.weight, out.bias) if isinstance(out, Projection) else out


@dataclass(slots=True)
class ForwardOutput:
    """Logits [R, vocab] for the requested rows, the residual stream of those rows before the final norm,
    hybrid-state snapshots keyed by (sequence index in the batch, absolute token count), and, where the batch
    asked for it (`ForwardBatch.normed_rows`), every row's final-normed hidden state [T, H] (what the MTP head
    reads: `QwenModel.mtp_forward`), else None."""

    logits: Any
    hidden: Any
    snapshots: dict[tuple[int, int], HybridState] = field(default_factory=dict)
    normed: Any = None


@dataclass(frozen=True, slots=True)
class DraftHead:
    """The LM head's rows the MTP head guesses among (`QwenModel.draft_head`): the ids below `rows` (`weight`, a
    row slice of the head over its memory) and `extra_ids` past them (the eos and markup tokens a reply holds:
    `extra`, their rows gathered as float32 [len(extra_ids), H]; `id_map`, the ids as the backend's int64), the
    logits in that column order (`QwenModel.draft_logits`)."""

    weight: Any
    rows: int
    extra_ids: tuple[int, ...] = ()
    extra: Any = None
    id_map: Any = None


class QwenModel:
    """Weights on a backend + the forward pass. Construct with `from_tensors` or `decapybara.model.load`."""

    def __init__(self, cfg: ModelConfig, backend: Backend, weights: dict[str, Any]):
        self.cfg, self.backend, self.w = cfg, backend, weights
        self.weights_id = ""  # what identifies the weights' values (a loaded file's checksums; "" unknown)
        self.rotary = RotaryTable.for_config(cfg)
        self.scale = cfg.head_dim ** -0.5
        self.linear_index = {layer: j for j, layer in enumerate(cfg.linear_layers)}
        self.dn_params: dict[int, DeltaNetParams] = {}
        for i in cfg.linear_layers:
            p = f"model.layers.{i}.linear_attn"
            self.dn_params[i] = DeltaNetParams(
                conv_weight=weights[f"{p}.conv1d.weight"].reshape(cfg.linear_conv_dim, cfg.linear_conv_kernel_dim),
                neg_A=-backend.xp.exp(weights[f"{p}.A_log"]),
                dt_bias=weights[f"{p}.dt_bias"],
            )
        self.fused_mlp: dict[str, Any] = self._fuse_mlps()
        self._draft_heads: dict[tuple, DraftHead] = {}  # `draft_head`'s, by size and extra ids
        self.fused_dn: dict[str, tuple[Any, Any]] = self._fuse_deltanet_inputs()
        self.fused_qkv: dict[str, tuple[Any, Any]] = self._fuse_attention_inputs()
        self.fused_moe: dict[str, Any] = self._fuse_moe()

    def _fuse_attention_inputs(self) -> dict[str, tuple[Any, Any]]:
        """Attention prefix -> (q|k|v stacked [q_out + 2 kv_out, H], their biases stacked or None): one input
        product per attention layer instead of three, where the backend fuses (biases on all three or none).
        Every `*.self_attn` prefix counts, the MTP layers' (`mtp.layers.*`) too, as `_fuse_mlps` stacks theirs."""
        fused = {}
        for name in list(self.w):
            if not name.endswith(".self_attn.q_proj.weight"):
                continue
            a = name[: -len(".q_proj.weight")]
            names = [f"{a}.{n}_proj.weight" for n in "qkv"]
            bias_names = [f"{a}.{n}_proj.bias" for n in "qkv"]
            has_bias = [b in self.w for b in bias_names]
            if not all(n in self.w for n in names) or any(has_bias) != all(has_bias):
                continue
            got = self.backend.concat_rows([self.w[n] for n in names])
            if got is None:
                continue
            bias = None
            if all(has_bias):
                bias = self.backend.xp.concatenate([self.w[b] for b in bias_names])
                r = 0
                for b in bias_names:  # views of the stacked biases, as the weights below
                    rows = self.w[b].shape[0]
                    self.w[b], r = bias[r:r + rows], r + rows
            fused[a] = (got[0], bias)
            for n, view in zip(names, got[1], strict=True):
                self.w[n] = view
        return fused

    def _fuse_deltanet_inputs(self) -> dict[str, tuple[Any, Any]]:
        """DeltaNet prefix -> (qkv|z stacked, b|a stacked): two input products per layer instead of four,
        where the backend fuses both pairs."""
        fused = {}
        for i in self.cfg.linear_layers:
            la = f"model.layers.{i}.linear_attn"
            names = [f"{la}.in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")]
            # the small b|a pair first: when it declines, the large qkv|z copy is never made
            ba = self.backend.concat_rows([self.w[names[2]], self.w[names[3]]])
            qkvz = self.backend.concat_rows([self.w[names[0]], self.w[names[1]]]) if ba is not None else None
            if qkvz is None or ba is None:
                continue
            (self.w[names[0]], self.w[names[1]]), (self.w[names[2]], self.w[names[3]]) = qkvz[1], ba[1]
            fused[la] = (qkvz[0], ba[0])
        return fused

    def _fuse_mlps(self) -> dict[str, Any]:
        """MLP prefix -> its gate|up matrix stacked (one product per MLP), where the backend fuses."""
        fused = {}
        for name in list(self.w):
            if not name.endswith(".gate_proj.weight"):
                continue
            m = name[: -len(".gate_proj.weight")]
            up = f"{m}.up_proj.weight"
            if up not in self.w or f"{m}.gate_proj.bias" in self.w or f"{m}.up_proj.bias" in self.w:
                continue
            got = self.backend.concat_rows([self.w[name], self.w[up]])
            if got is not None:
                fused[m], (self.w[name], self.w[up]) = got[0], got[1]
        return fused

    def _fuse_moe(self) -> dict[str, Any]:
        """MoE prefix (`*.mlp`) -> the backend's stacked form of its weights (`Backend.fuse_moe`: e.g. the router
        with the shared gate, the experts' gate with their up stacks, the shared expert as one expert more), the
        weight dict's entries (and the shared expert's stacked gate|up in `fused_mlp`) replaced by its views."""
        fused = {}
        for name in list(self.w):
            if not name.endswith(".experts.gate_proj"):
                continue
            m = name[: -len(".experts.gate_proj")]
            s = f"{m}.shared_expert"
            names = {"router": f"{m}.gate.weight", "gate": name, "up": f"{m}.experts.up_proj",
                     "down": f"{m}.experts.down_proj", "shared_gate": f"{m}.shared_expert_gate.weight",
                     "shared_gate_proj": f"{s}.gate_proj.weight", "shared_up_proj": f"{s}.up_proj.weight",
                     "shared_down_proj": f"{s}.down_proj.weight"}
            names = {role: n for role, n in names.items() if n in self.w}
            parts = {role: self.w[n] for role, n in names.items()}
            if s in self.fused_mlp:
                parts["shared_gate_up"] = self.fused_mlp[s]
            got = self.backend.fuse_moe(parts) if {"router", "gate", "up", "down"} <= parts.keys() else None
            if got is None:
                continue
            fused[m], views = got
            for role, view in views.items():
                if role == "shared_gate_up":
                    self.fused_mlp[s] = view
                else:
                    self.w[names[role]] = view
        return fused

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, backend: Backend, tensors: Iterable[tuple[str, Any]] | Mapping[str, Any],
                     include_mtp: bool = True) -> QwenModel:
        """Check names/shapes against `expected_tensors` (WeightError naming the tensor) and upload."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        expected = expected_tensors(cfg, include_mtp=include_mtp)
        weights: dict[str, Any] = {}
        for name, value in items:
            if name not in expected:
                if name.startswith("mtp.") and not include_mtp:
                    continue
                raise WeightError(f"unexpected tensor {name!r}")
            shape = tuple(getattr(value, "logical_shape", None) or value.shape)
            if shape != expected[name]:
                raise WeightError(f"tensor {name!r} has shape {shape}, expected {expected[name]}")
            weights[name] = backend.prepare_weight(name, value)
        missing = [n for n in expected if n not in weights]
        if missing:
            raise WeightError(f"missing tensor {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
        if cfg.tie_word_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return cls(cfg, backend, weights)

    # ---- allocation helpers ----------------------------------------------------------------------------
    def new_kv_cache(self, num_pages: int, page_size: int, kv_mode: Any = None) -> KVCache:
        return self.backend.new_kv_cache(self.cfg, num_pages, page_size, kv_mode)

    def new_state_pool(self, num_slots: int) -> StatePool:
        return self.backend.new_state_pool(self.cfg, num_slots)

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, kv: KVCache, states: StatePool | None = None,
                tails: Any = None) -> ForwardOutput:
        """`tails`: an object whose `start(model, h)` returns None or a run whose `tail(i, out, h)` stands in for
        `block_tail` and `finish(h)` gives the residual stream at the end (`decoder_layers`; the CUDA backend's
        `PiecewiseTails` replays each layer's tail, with the next layer's input products, as a graph)."""
        cfg, ops = self.cfg, self.backend
        cos, sin = self.rotary.cos_sin(batch.positions)
        cos, sin = ops.from_host(cos), ops.from_host(sin)
        segments = self._segments(batch) if cfg.linear_layers else []
        raw_snaps: dict[tuple[int, int], dict[int, tuple[Any, Any]]] = {}
        h = ops.embedding(self.w["model.embed_tokens.weight"], batch.token_ids)  # [T, H]
        try:
            h = self.decoder_layers(h, lambda p, i, inputs: self._attention(p, i, inputs, batch, kv, cos, sin),
                                    lambda p, i, inputs: self._deltanet(p, i, inputs, states, segments, raw_snaps),
                                    tails)
        except BaseException:
            if raw_snaps:  # snapshots' device-to-host copies in flight into host buffers dropped with them
                with contextlib.suppress(Exception):
                    ops.synchronize()
            raise
        rows = batch.logits_rows
        last = self._rows(h, rows)
        normed = None
        if batch.normed_rows:  # every row's, the logits rows' taken from them (the same norm, row by row)
            normed = ops.rms_norm(h, self.w["model.norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
            hidden = self._rows(normed, rows)
        else:
            hidden = ops.rms_norm(last, self.w["model.norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
        logits = ops.linear(hidden, self.w["lm_head.weight"]) if len(rows) else hidden[:0, :0]
        snapshots, n = {}, len(cfg.linear_layers)
        for key, layers in raw_snaps.items():  # the backend's arrays (device copies on a GPU): one move each
            if key in batch.device_snapshots:  # kept where they are (a rollback point)
                snapshots[key] = HybridState([layers[i][0] for i in cfg.linear_layers],
                                             [layers[i][1] for i in cfg.linear_layers])
                continue
            arrs = ops.to_host_many([layers[i][0] for i in cfg.linear_layers] +
                                    [layers[i][1] for i in cfg.linear_layers])
            snapshots[key] = HybridState(arrs[:n], arrs[n:])
        return ForwardOutput(logits, last, snapshots, normed)

    @property
    def has_mtp(self) -> bool:
        """Whether the model holds a multi-token-prediction head (`mtp_forward`)."""
        return self.cfg.mtp_num_hidden_layers > 0 and "mtp.fc.weight" in self.w

    def draft_head(self, vocab: int = 0, extra: Iterable[int] = ()) -> DraftHead:
        """The LM head's rows the MTP head guesses among: the ids below `vocab` rounded up to a multiple of 16 (a
        byte-level BPE vocabulary lists its most frequent merges first; `Backend.row_slice`, a view of the head's
        memory) and the ids of `extra` past them (a reply's eos and markup tokens, which Qwen's vocabularies keep
        at the end: their rows gathered by `Backend.embedding`, a few float32 rows); the whole head where `vocab`
        is 0 or covers it. Made once a size and id set."""
        rows = -(-vocab // 16) * 16
        if not vocab or rows >= self.cfg.vocab_size:
            rows = self.cfg.vocab_size
        ids = tuple(sorted({int(i) for i in extra if rows <= int(i) < self.cfg.vocab_size}))
        got = self._draft_heads.get((rows, ids))
        if got is None:
            w, ops = self.w["lm_head.weight"], self.backend
            part = w if rows == self.cfg.vocab_size else ops.row_slice(w, rows)
            got = DraftHead(part, rows) if not ids else DraftHead(
                part, rows, ids, ops.embedding(w, np.asarray(ids, np.int64)), ops.from_host(np.asarray(ids, np.int64)))
            self._draft_heads[(rows, ids)] = got
        return got

    def draft_logits(self, hn: Any, head: DraftHead | None = None) -> Any:
        """The MTP head's logits [R, head's ids] of its final-normed rows hn [R, H] over `head`'s ids (default the
        whole vocabulary): the slice's columns, then its extra ids'."""
        head = head or self.draft_head()
        logits = self.backend.linear(hn, head.weight)
        if head.extra is not None:
            logits = self.backend.xp.concatenate([logits, self.backend.linear(hn, head.extra)], axis=1)
        return logits

    def draft_guesses(self, logits: Any, head: DraftHead | None = None) -> tuple[Any, Any]:
        """(each row's greedy id [R] int64, its probability [R] float32 among `head`'s ids) of `draft_logits`'
        logits: `Backend.argmax_prob`, an extra id's column mapped back to its id (no host synchronisation)."""
        guess, prob = self.backend.argmax_prob(logits)
        if head is not None and head.extra_ids:
            xp = self.backend.xp
            past = xp.clip(guess - head.rows, 0, len(head.extra_ids) - 1)
            guess = xp.where(guess < head.rows, guess, head.id_map[past])
        return guess, prob

    def mtp_forward(self, batch: ForwardBatch, normed: Any, kv: KVCache, own: bool = False,
                    head: DraftHead | None = None) -> Any:
        """The MTP head's logits [R, vocab] for `batch.logits_rows`, over `batch`'s rows as the head was trained
        (decapybara/builder/train_demo.py `MTPHead`): the row at position p of a sequence pairs the main model's
        final-normed hidden state at p (`normed` [T, H], `ForwardOutput.normed`'s rows) with the token at p + 1
        (`batch.token_ids`), and predicts the token at p + 2:
            fc([norm_e(embed(token p + 1)); norm_h(hidden p)]) -> the head's decoder layer(s) -> norm -> lm_head.
        The head's attention layers keep their keys and values in the cache's ("mtp", j) layers, at the
        sequences' own page slots of position p, causal over positions [0, p]. `own`: (the logits, the head's
        final-normed states [R, H] at those rows: what a chained guess pairs with the guess made there). `head`:
        the logits of its ids alone (`draft_head`, `draft_logits`; default every id)."""
        h, _, _ = self._mtp_trunk(batch, normed, kv)
        hn = self.mtp_normed(self._rows(h, batch.logits_rows))
        logits = self.draft_logits(hn, head)
        return (logits, hn) if own else logits

    def _mtp_trunk(self, batch: ForwardBatch, normed: Any, kv: KVCache,
                   layers: int | None = None) -> tuple[Any, Any, Any]:
        """(the head's residual stream after its first `layers` layers (default all), cos, sin) of `batch`'s pairs:
        what `mtp_forward` and `mtp_kv` share."""
        if not self.has_mtp:
            raise ValueError("the model has no MTP head")
        ops = self.backend
        cos, sin = (ops.from_host(a) for a in self.rotary.cos_sin(batch.positions))
        emb = ops.embedding(self.w["model.embed_tokens.weight"], batch.token_ids)
        return self.mtp_layers(emb, normed, batch, kv, cos, sin, layers=layers), cos, sin

    def mtp_kv(self, batch: ForwardBatch, normed: Any, kv: KVCache) -> None:
        """The MTP head's keys and values at `batch`'s rows (pairs as `mtp_forward`'s), the same values it writes,
        without what only its guesses need: its last layer's attention, MLP, final norm and lm_head (of a
        one-layer head, all but the fc and one input product). Keeps the head's cache whole over steps that
        draft nothing, so that its later guesses attend to every position."""
        ops = self.backend
        last = self.cfg.mtp_num_hidden_layers - 1
        h, cos, sin = self._mtp_trunk(batch, normed, kv, layers=last)
        self.mtp_kv_tail(h, batch, kv, cos, sin, ops.from_host(batch.slot_mapping))

    def mtp_kv_tail(self, h: Any, batch: ForwardBatch, kv: KVCache, cos: Any, sin: Any, slots: Any) -> None:
        """`mtp_kv` after the head's layers before its last (their residual stream h [T, H]): the last layer's keys
        and values written at page slots `slots` (device [T]); shared with the CUDA graphs' KV-only pass."""
        cfg, ops, w = self.cfg, self.backend, self.w
        last = cfg.mtp_num_hidden_layers - 1
        p = f"mtp.layers.{last}"
        x = ops.rms_norm(h, w[f"{p}.input_layernorm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
        _q, k, v, _gate = self._qkv(p, self._attention_inputs(p, x), cos, sin)
        kv.write(("mtp", last), slots, k, v)

    def mtp_normed(self, h: Any) -> Any:
        """The head's final norm of its residual rows h [R, H]."""
        return self.backend.rms_norm(h, self.w["mtp.norm.weight"], self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def mtp_layers(self, emb: Any, normed: Any, batch: ForwardBatch, kv: KVCache, cos: Any, sin: Any,
                   layers: int | None = None) -> Any:
        """The MTP head's residual stream [T, H] after its decoder layer(s) (the first `layers` of them; default
        all), from the embeddings of the tokens at p + 1 (`emb` [T, H]) and the normed hidden states at p
        (`normed` [T, H]), with RoPE at the rows' positions (`cos`, `sin`); shared by `mtp_forward`, `mtp_kv`
        and the CUDA graphs' MTP pass."""
        cfg, ops, w = self.cfg, self.backend, self.w
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        e = ops.rms_norm(emb, w["mtp.pre_fc_norm_embedding.weight"], eps, off)
        hn = ops.rms_norm(normed, w["mtp.pre_fc_norm_hidden.weight"], eps, off)
        h = ops.linear(ops.xp.concatenate([e, hn], axis=1), w["mtp.fc.weight"])  # [T, H]
        for j in range(cfg.mtp_num_hidden_layers if layers is None else layers):
            p = f"mtp.layers.{j}"
            x = ops.rms_norm(h, w[f"{p}.input_layernorm.weight"], eps, off)
            out = self._attention(p, ("mtp", j), self._attention_inputs(p, x), batch, kv, cos, sin)
            x, h = ops.add_rms_norm(Projection.output(out, ops), h, w[f"{p}.post_attention_layernorm.weight"], eps,
                                    off)
            h = h + Projection.output(self._ffn(p, j, x), ops)
        return h

    def _rows(self, a: Any, rows: Any) -> Any:
        """Rows `rows` (host indices) of a backend array a [T, ...]; a itself where they are all of its rows in
        order."""
        if len(rows) == a.shape[0] and np.array_equal(rows, np.arange(len(rows))):
            return a
        return a[self.backend.from_host(np.asarray(rows, np.int64))]

    def decoder_layers(self, h: Any, attention: Any, deltanet: Any, tails: Any = None) -> Any:
        """The decoder stack on the residual stream h [T, H]; `attention(p, i, inputs)` / `deltanet(p, i, inputs)`
        run the token mixer of layer i (prefix p) on its input products (`layer_inputs`) and return its output or
        its output `Projection`; `block_tail` runs the rest of the layer and the next layer's input products (or
        `tails`' run, `forward`)."""
        cfg, w = self.cfg, self.w
        x = self.backend.rms_norm(h, w["model.layers.0.input_layernorm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
        inputs = self.layer_inputs(0, x)
        run = tails.start(self, h) if tails is not None else None
        tail = run.tail if run is not None else self.block_tail
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            out = attention(p, i, inputs) if cfg.layer_types[i] == FULL_ATTENTION else deltanet(p, i, inputs)
            inputs, h = tail(i, out, h)
        return run.finish(h) if run is not None else h

    def block_tail(self, i: int, out: Any, h: Any) -> tuple[Any, Any]:
        """Layer i after its token mixer: (inputs, h) from the mixer's output `out` (an array or a `Projection`)
        and the residual stream h [T, H]: the residual add, the post-attention norm, the FFN, its residual add,
        the next layer's input norm and its input products (inputs: `layer_inputs(i + 1, ...)`; None after the
        last layer). Each residual add is fused into the norm that follows it, and a block's output projection
        into both where the norm's rows go only to products (`Backend.linear_add_rms_norm`; before a MoE block
        where the backend's `moe` takes such rows: `Backend.moe_takes_product_rows`)."""
        cfg, ops, w = self.cfg, self.backend, self.w
        eps, off = cfg.rms_norm_eps, cfg.norm_offset

        def add_norm(out: Any, h: Any, weight: Any, to_products: bool) -> tuple[Any, Any]:
            if to_products and isinstance(out, Projection):
                return ops.linear_add_rms_norm(out.x, out.weight, out.bias, h, weight, eps, off)
            return ops.add_rms_norm(Projection.output(out, ops), h, weight, eps, off)

        p = f"model.layers.{i}"
        moe = cfg.layer_is_moe(i)
        x, h = add_norm(out, h, w[f"{p}.post_attention_layernorm.weight"], not moe or ops.moe_takes_product_rows)
        if moe and i + 1 < cfg.num_hidden_layers:  # the MoE's output, its residual add and the next norm
            x, h = ops.moe_add_rms_norm(self._moe_args(f"{p}.mlp", x), h,
                                        w[f"model.layers.{i + 1}.input_layernorm.weight"], eps, off)
            return self.layer_inputs(i + 1, x), h
        out = self._ffn(p, i, x)
        if i + 1 < cfg.num_hidden_layers:
            x, h = add_norm(out, h, w[f"model.layers.{i + 1}.input_layernorm.weight"], True)
            return self.layer_inputs(i + 1, x), h
        return None, h + Projection.output(out, ops)

    def layer_inputs(self, i: int, x: Any) -> list[Any]:
        """Layer i's input products of its normed rows x [T, H] (an array or the backend's normed rows): 2-D
        arrays [T, *] that depend on x alone, whose columns its token mixer reads. Attention: [q|k|v] (one
        fused product) or [q, k, v]; DeltaNet: [qkv|z, b|a] (two fused products, `linear_pair`) or
        [qkv, z, b, a]."""
        ops, w = self.backend, self.w
        p = f"model.layers.{i}"
        if self.cfg.layer_types[i] == FULL_ATTENTION:
            return self._attention_inputs(p, x)
        la = f"{p}.linear_attn"
        if la in self.fused_dn:
            return list(ops.linear_pair(x, *self.fused_dn[la]))  # [T, conv_dim + Hv * dv], [T, 2 Hv]
        return [ops.linear(x, w[f"{la}.in_proj_{n}.weight"]) for n in ("qkv", "z", "b", "a")]

    def _attention_inputs(self, p: str, x: Any) -> list[Any]:
        """The input products of the attention layer at prefix p (a decoder layer's or an MTP layer's) over its
        normed rows x: [q|k|v] (one fused product, [T, q_out + 2 kv_out]) or [q, k, v]."""
        ops, w, a = self.backend, self.w, f"{p}.self_attn"
        if a in self.fused_qkv:
            return [ops.linear(x, *self.fused_qkv[a])]
        return [ops.linear(x, w[f"{a}.{n}_proj.weight"], w.get(f"{a}.{n}_proj.bias")) for n in "qkv"]

    def _segments(self, batch: ForwardBatch) -> list[DeltaNetSegment]:
        """Split each sequence's rows at its snapshot points (state must be copied out there)."""
        segs: list[DeltaNetSegment] = []
        for si, s in enumerate(batch.seqs):
            if s.state_slot is None:
                raise ValueError("a hybrid model needs a state slot for every sequence")
            cut = s.context
            for p in sorted(set(s.snapshot_at)):
                if not s.context < p <= s.total:
                    raise ValueError(f"snapshot point {p} outside ({s.context}, {s.total}]")
                segs.append(DeltaNetSegment(s.start + cut - s.context, p - cut, s.state_slot, (si, p),
                                            (si, p) in batch.device_snapshots))
                cut = p
            if cut < s.total:
                segs.append(DeltaNetSegment(s.start + cut - s.context, s.total - cut, s.state_slot, None))
        return segs

    def _attention(self, p: str, layer: Any, inputs: list[Any], batch: ForwardBatch, kv: KVCache, cos: Any,
                   sin: Any) -> Any:
        ops, w, a = self.backend, self.w, f"{p}.self_attn"
        t, nq, d = inputs[0].shape[0], self.cfg.num_attention_heads, self.cfg.head_dim
        q, k, v, gate = self._qkv(p, inputs, cos, sin)
        if gate is not None:  # [T, nq, d] times sigmoid(gate)
            o = ops.paged_attention_gated(kv, layer, q, k, v, batch, self.scale, gate, w[f"{a}.o_proj.weight"])
        else:
            o = ops.paged_attention(kv, layer, q, k, v, batch, self.scale)  # [T, nq, d]
        return Projection(o.reshape(t, nq * d), w[f"{a}.o_proj.weight"], w.get(f"{a}.o_proj.bias"))

    def _qkv(self, p: str, inputs: list[Any], cos: Any, sin: Any) -> tuple[Any, Any, Any, Any]:
        """An attention layer's (q [T, nq, d], k [T, nkv, d] after their norms and RoPE, v [T, nkv, d], the output
        gate [T, nq, d] or None) from its input products."""
        cfg, ops, w = self.cfg, self.backend, self.w
        t, d = inputs[0].shape[0], cfg.head_dim
        nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        a = f"{p}.self_attn"
        if len(inputs) == 1:  # column views of one fused product (the backend's kernels take row strides)
            qkv = inputs[0]  # [T, q_out + 2 kv_out]
            kv_out = nkv * d
            q_out = qkv.shape[1] - 2 * kv_out
            q, k, v = qkv[:, :q_out], qkv[:, q_out:q_out + kv_out], qkv[:, q_out + kv_out:]
        else:
            q, k, v = inputs
        if cfg.attn_output_gate:
            qg = q.reshape(t, nq, 2 * d)  # per head: [query | gate]
            q, gate = qg[..., :d], qg[..., d:]  # column views [T, nq, d]
        else:
            q, gate = q.reshape(t, nq, d), None
        k, v = k.reshape(t, nkv, d), v.reshape(t, nkv, d)
        q, k = ops.qk_norm_rope(q, k, w[f"{a}.q_norm.weight"], w[f"{a}.k_norm.weight"], cfg.rms_norm_eps,
                                cfg.norm_offset, cos, sin, cfg.rotary_dim)
        return q, k, v, gate

    def _deltanet(self, p: str, layer: int, inputs: list[Any], states: StatePool | None,
                  segments: list[DeltaNetSegment], raw_snaps: dict) -> Any:
        cfg, ops, w = self.cfg, self.backend, self.w
        if states is None:
            raise ValueError("a hybrid model needs a state pool")
        la = f"{p}.linear_attn"
        t = inputs[0].shape[0]
        hv, c = cfg.linear_num_value_heads, cfg.linear_conv_dim
        if len(inputs) == 2:  # column views of two fused products (the backend's kernels take row strides)
            qkvz, ba = inputs  # [T, conv_dim + Hv * dv], [T, 2 Hv]
            mixed, z, b, a = qkvz[:, :c], qkvz[:, c:], ba[:, :hv], ba[:, hv:]
        else:
            mixed, z, b, a = inputs  # [T, conv_dim], [T, Hv * dv], [T, Hv], [T, Hv]
        z = z.reshape(t, hv, cfg.linear_value_head_dim)
        core = ops.deltanet_core_gated(states, layer, mixed, a, b, self.dn_params[layer], segments, cfg, raw_snaps,
                                       z, w[f"{la}.norm.weight"], cfg.rms_norm_eps,
                                       to_product=w[f"{la}.out_proj.weight"])  # [T, Hv, dv], gated norm
        return Projection(core.reshape(t, cfg.linear_value_dim), w[f"{la}.out_proj.weight"])

    def _ffn(self, p: str, layer: int, x: Any) -> Any:
        m = f"{p}.mlp"
        if not self.cfg.layer_is_moe(layer):
            return self._mlp(m, x)
        return self.backend.moe(*self._moe_args(m, x))

    def _moe_args(self, m: str, x: Any) -> tuple:
        """`Backend.moe`'s arguments for MoE block `m` (`*.mlp`) over its normed rows x."""
        cfg, ops, w = self.cfg, self.backend, self.w
        shared = shared_gate = None
        if cfg.shared_expert_intermediate_size:  # the shared expert's output, gated and added by `moe`
            def shared() -> Any:  # where `moe` does not run it in its own launches
                return Projection.output(self._mlp(f"{m}.shared_expert", x), ops)

            shared_gate = w[f"{m}.shared_expert_gate.weight"]
        return (x, w[f"{m}.gate.weight"], w[f"{m}.experts.gate_proj"], w[f"{m}.experts.up_proj"],
                w[f"{m}.experts.down_proj"], cfg.num_experts_per_tok, cfg.norm_topk_prob, shared, shared_gate,
                self.fused_moe.get(m))

    def _mlp(self, m: str, x: Any) -> Projection:
        ops, w = self.backend, self.w
        if m in self.fused_mlp:
            h = ops.swiglu(x, self.fused_mlp[m], to_product=w[f"{m}.down_proj.weight"])
        else:
            h = ops.silu_mul(ops.linear(x, w[f"{m}.gate_proj.weight"]), ops.linear(x, w[f"{m}.up_proj.weight"]))
        return Projection(h, w[f"{m}.down_proj.weight"])

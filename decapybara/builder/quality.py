"""Quality metadata: how far each (weights preset, KV mode, YaRN context) moves the model from the reference.

The reference is the model with bf16 weights and 16/16 (bf16) KV pages at its trained context. For every
candidate, the numpy model runs over a fixed, seeded sample of held-out tokens (`token_windows`: windows of
`window` tokens, each one prefill on fresh KV pages and DeltaNet state), and at every position the candidate's
next-token distribution q is compared with the reference's p:

    kl   = mean over positions of KL(p || q) = sum_v p_v (log p_v - log q_v)   (nats, float64)
    top1 = % of positions where argmax q == argmax p

Quantised presets are materialised in memory from the float source (`materialize`, the very tensors a build
writes), so one build measures every preset and stores the same table in each preset's file
(``sections.quality``). A YaRN row runs the same weights under ``with_yarn(cfg, context)``: it shows what
extending the context costs at short range. The whole sample is evaluated for every candidate, so all rows
share one token count; numbers are rounded to 4 significant digits (KL) and 0.01 % (top-1).

NOTE: every candidate's weights are held as float32 at once (one copy per weights preset): this is meant for
the models the numpy backend can run (the tiny test models, the demo model), not for a 27B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.builder.calibrate import (
    DEFAULT_WINDOW,
    check_token_ids,
    run_window,
    token_windows,
    tokens_digest,
)
from decapybara.builder.progress import human_bytes
from decapybara.builder.quant_formats import QUANT_PRESETS, Quantizer, materialize, weights_bytes
from decapybara.config import PRESETS as LAUNCHER_PRESETS
from decapybara.errors import ConfigError
from decapybara.model.config import ModelConfig, with_yarn
from decapybara.model.quant import KV_MODES
from decapybara.model.qwen import QwenModel

REFERENCE_TEXT = "bf16 weights, 16/16 KV"
WEIGHTS_ORDER = (*QUANT_PRESETS, "bf16", "fp32")
KV_ORDER = ("4/4", "6/4", "6/6", "8/8", "16/16", "32/32")  # fewest bits first


@dataclass(slots=True, frozen=True)
class Candidate:
    """One row of the table: a weights preset, a KV mode ("32/32" = float32 pages) and an optional YaRN
    context (None = the trained context, no extension)."""

    weights: str
    kv_mode: str = "16/16"
    context: int | None = None

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS_ORDER:
            raise ConfigError(f"unknown weights {self.weights!r}; known: {', '.join(WEIGHTS_ORDER)}")
        if self.kv_mode not in KV_ORDER:
            raise ConfigError(f"unknown KV mode {self.kv_mode!r}; known: {', '.join(KV_ORDER)}")


REFERENCE = Candidate("bf16", "16/16")


def trained_context(cfg: ModelConfig) -> int:
    return cfg.rope.original_max_position_embeddings or cfg.max_position_embeddings


def default_contexts(cfg: ModelConfig) -> tuple[int, ...]:
    """The launcher presets' contexts (262,144 and 1,048,576 tokens) that need YaRN on this model."""
    return tuple(sorted({p.context for p in LAUNCHER_PRESETS.values() if p.context > trained_context(cfg)}))


def default_candidates(cfg: ModelConfig, contexts: Iterable[int] | None = None) -> list[Candidate]:
    """The rows a build measures:

    - the reference (bf16, 16/16) and fp32 weights with float32 pages (how far bf16 itself is from fp32);
    - every weights preset (tiny ... xxl, bf16) with every KV mode (16/16, 8/8, 6/6, 6/4, 4/4);
    - for each YaRN context (default: `default_contexts`): every weights preset with 16/16 KV and with the KV
      mode(s) of the launcher presets that use that context (medium 6/4 and max_quality 6/6 at 262,144;
      max_efficiency 4/4 at 1,048,576)."""
    rows = [REFERENCE, Candidate("fp32", "32/32")]
    weights = (*QUANT_PRESETS, "bf16")
    rows += [Candidate(w, kv) for w in weights for kv in KV_MODES]
    for ctx in default_contexts(cfg) if contexts is None else contexts:
        if ctx <= trained_context(cfg):
            continue  # no YaRN needed: the native rows already cover it
        kvs = {"16/16"} | {p.kv_mode for p in LAUNCHER_PRESETS.values() if p.context == ctx}
        rows += [Candidate(w, kv, int(ctx)) for w in weights for kv in sorted(kvs, key=KV_ORDER.index)]
    return sort_candidates(dict.fromkeys(rows))


def sort_candidates(cands: Iterable[Candidate]) -> list[Candidate]:
    """Table order: weights (fewest bits first), then context (native first), then KV bits (fewest first)."""
    return sorted(cands, key=lambda c: (WEIGHTS_ORDER.index(c.weights), c.context or 0, KV_ORDER.index(c.kv_mode)))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _kv(mode: str) -> str | None:
    return None if mode == "32/32" else mode


def measure_quality(cfg: ModelConfig, source: Mapping[str, np.ndarray], tokens: np.ndarray, *, num_tokens: int,
                    window: int = DEFAULT_WINDOW, seed: int = 0, candidates: Iterable[Candidate] | None = None,
                    quantizer: Quantizer | None = None, models: Mapping[str, QwenModel] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The ``sections.quality`` table of a model (see the module docstring).

    `source`: float32 weights by canonical name (`read_source`); `tokens`: the held-out stream, sampled by
    `token_windows(tokens, num_tokens, window, seed)`; `quantizer`: RTN or GPTQ for the quantised presets
    (default RTN); `models`: weights preset -> an already loaded model whose weights replace the in-memory
    materialisation (e.g. a model loaded from a built file, to check the file against the table).
    Deterministic: equal arguments give equal tables. `progress(done, total)` is called after every window."""
    quantizer = quantizer or Quantizer()
    cands = sort_candidates(dict.fromkeys(candidates if candidates is not None else default_candidates(cfg)))
    short = [c for c in cands if c.context is not None and c.context <= trained_context(cfg)]
    if short:
        raise ConfigError(f"YaRN context {short[0].context} does not extend the trained {trained_context(cfg)}")
    windows = token_windows(tokens, num_tokens, window, seed)
    check_token_ids(windows, cfg, "quality")
    backend = NumpyBackend()
    weight_sets: dict[str, dict[str, Any]] = {}
    for w in dict.fromkeys([REFERENCE.weights] + [c.weights for c in cands]):
        if models is not None and w in models:
            weight_sets[w] = models[w].w
        else:
            weight_sets[w] = QwenModel.from_tensors(cfg, backend, materialize(w, cfg, source, quantizer)).w
    configs = {c.context: with_yarn(cfg, c.context) if c.context else cfg for c in cands}
    kl = dict.fromkeys(cands, 0.0)
    agree = dict.fromkeys(cands, 0)
    ref_model = QwenModel(cfg, backend, weight_sets[REFERENCE.weights])
    for i, ids in enumerate(windows):
        ref_lp = _log_softmax(run_window(ref_model, ids, REFERENCE.kv_mode))  # [L, V]
        ref_p, ref_top = np.exp(ref_lp), ref_lp.argmax(axis=-1)
        for c in cands:
            if c == REFERENCE:
                agree[c] += len(ids)
                continue
            model = QwenModel(configs[c.context], backend, weight_sets[c.weights])
            lp = _log_softmax(run_window(model, ids, _kv(c.kv_mode)))
            kl[c] += float(np.sum(ref_p * (ref_lp - lp)))
            agree[c] += int(np.sum(lp.argmax(axis=-1) == ref_top))
        if progress is not None:
            progress(i + 1, len(windows))
    rows = [{"weights": c.weights, "kv_mode": c.kv_mode, "context": c.context or cfg.max_position_embeddings,
             "bytes": weights_bytes(c.weights, cfg), "kl": float(f"{kl[c] / num_tokens:.4g}"),
             "top1": round(100.0 * agree[c] / num_tokens, 2)} for c in cands]
    return {"reference": REFERENCE_TEXT, "tokens": num_tokens, "window": window, "seed": seed,
            "sha256": tokens_digest(windows), "quantizer": quantizer.info(), "rows": rows}


def find_row(table: Mapping[str, Any], weights: str, kv_mode: str = "16/16",
             context: int | None = None) -> dict[str, Any] | None:
    """The row of `table` for (weights, kv_mode, context); context None = the smallest (native) one."""
    rows = [r for r in table.get("rows", []) if r["weights"] == weights and r["kv_mode"] == kv_mode]
    if context is None:
        return min(rows, key=lambda r: r["context"], default=None)
    return next((r for r in rows if r["context"] == context), None)


def format_quality(table: Mapping[str, Any]) -> list[str]:
    """Text lines of a quality section: a header line, then aligned columns (one row per candidate)."""
    head = (f"reference: {table.get('reference')}; {table.get('tokens'):,} held-out tokens (windows of "
            f"{table.get('window')}, seed {table.get('seed')}); quantiser: "
            + ", ".join(f"{k}={v}" for k, v in (table.get("quantizer") or {}).items()))
    cells = [["weights", "kv", "context", "size", "kl", "top1"]]

    def num(r: Mapping[str, Any], key: str, fmt: Callable[[Any], str]) -> str:
        v = r.get(key)  # a table from another build may lack a column or hold a non-number: shown as "?"
        return fmt(v) if isinstance(v, int | float) and not isinstance(v, bool) else "?"

    for r in table.get("rows", []):
        if not isinstance(r, Mapping):
            continue
        cells.append([str(r.get("weights", "?")), str(r.get("kv_mode", "?")), num(r, "context", "{:,}".format),
                      num(r, "bytes", lambda v: human_bytes(v) if np.isfinite(v) else "?"), num(r, "kl", "{:.4g}".format),
                      num(r, "top1", lambda v: f"{v:.2f}%")])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return [head] + ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]

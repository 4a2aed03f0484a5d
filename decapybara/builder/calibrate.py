"""Calibration for GPTQ: H = sum x x^T of the input of every linear weight, from the float model's own forward.

`CalibrationBackend` is the numpy reference backend plus bookkeeping: `prepare_weight` remembers which prepared
array belongs to which weight name, `linear` adds x^T x of its input to that name's Hessian, and `moe` adds,
per expert, the Hessians of the tokens routed to it (gate/up: the expert's input rows; down: its SwiGLU
activations). The production forward (`QwenModel.forward`) runs unchanged on it.

NOTE: MoE experts get the Hessian of their routed tokens; an expert that saw fewer than `min_expert_tokens`
tokens falls back to the shared-input Hessian instead (gate/up: the MoE input over all tokens; down: that
expert's activations over all tokens, as if every token had been routed to it), so a rarely used expert is
not fitted to a handful of rows. Linear layers that share one input (q/k/v, gate/up, the DeltaNet in_proj_*)
share one Hessian. Tensors the forward never multiplies (embedding lookups, the MTP head) get none, so the
`Quantizer` rounds them to nearest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.errors import ConfigError
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig
from decapybara.model.qwen import QwenModel

DEFAULT_WINDOW = 512  # tokens per calibration / quality window
PAGE = 64  # KV page size of the throwaway caches used here


def read_tokens(path: str | Path) -> np.ndarray:
    """Token ids from a file: ``.npy`` (any integer dtype) or raw little-endian uint16 (train.bin / heldout.bin
    of the demo data). Returns int64 [n]."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"token file {p} does not exist")
    ids = np.load(p) if p.suffix == ".npy" else np.fromfile(p, dtype="<u2")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ConfigError(f"{p}: expected a 1-D array of integer token ids, got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64)


def token_windows(tokens: np.ndarray, num_tokens: int, window: int, seed: int) -> list[np.ndarray]:
    """A seeded, fixed sample of `num_tokens` tokens as windows of `window` (the last one shorter if needed).

    The stream is cut into aligned slots [i * window, (i + 1) * window); ceil(num_tokens / window) distinct
    slots are drawn with ``numpy.random.default_rng(seed)`` and kept in stream order."""
    tokens = np.asarray(tokens, np.int64)
    if num_tokens <= 0 or window <= 0:
        raise ConfigError(f"num_tokens ({num_tokens}) and window ({window}) must be positive")
    n_win = -(-num_tokens // window)
    slots = len(tokens) // window
    if n_win > slots:
        raise ConfigError(f"{num_tokens} tokens in windows of {window} need {n_win} windows; the token file "
                          f"({len(tokens)} tokens) holds {slots}")
    picks = np.sort(np.random.default_rng(seed).choice(slots, size=n_win, replace=False))
    sizes = [window] * (n_win - 1) + [num_tokens - window * (n_win - 1)]
    return [tokens[s * window:s * window + n] for s, n in zip(picks.tolist(), sizes, strict=True)]


def check_token_ids(windows: list[np.ndarray], cfg: ModelConfig, what: str) -> None:
    hi = max(int(w.max()) for w in windows)
    if min(int(w.min()) for w in windows) < 0 or hi >= cfg.vocab_size:
        raise ConfigError(f"{what} tokens must lie in [0, {cfg.vocab_size}); got an id of {hi}")


def tokens_digest(windows: list[np.ndarray]) -> str:
    """sha256 of the windows' int64 bytes: names a token sample in metadata without a path."""
    h = hashlib.sha256()
    for w in windows:
        h.update(np.ascontiguousarray(w, "<i8").tobytes())
    return h.hexdigest()


def run_window(model: QwenModel, ids: np.ndarray, kv_mode: str | None = None, logits: str = "all") -> np.ndarray:
    """Logits [len(ids), vocab] (or [0, 0] with logits="none") of one sequence run as a single prefill on
    fresh KV pages in `kv_mode` and a fresh DeltaNet state."""
    n = len(ids)
    pages = -(-n // PAGE)
    kv = model.new_kv_cache(pages, PAGE, kv_mode)
    states = model.new_state_pool(1) if model.cfg.linear_layers else None
    if states is not None:
        states.reset(0)
    batch = ForwardBatch.build([(ids, 0, np.arange(pages), 0 if states is not None else None)], PAGE,
                               logits=logits)
    return model.backend.to_host(model.forward(batch, kv, states).logits)


class CalibrationBackend(NumpyBackend):
    """NumpyBackend that accumulates the input Hessian of every named weight it multiplies (see module doc)."""

    def __init__(self, min_expert_tokens: int = 64) -> None:
        super().__init__(np.float32)
        self.min_expert_tokens = min_expert_tokens
        self.names: dict[int, str] = {}  # id(prepared array) -> weight name
        self.hessians: dict[str, np.ndarray] = {}  # key -> H, float64
        self.alias: dict[str, str] = {}  # weight name -> key of the H it shares
        self.experts: dict[str, dict[str, Any]] = {}  # gate_proj name -> stacked-expert accumulators
        self._keep: list[np.ndarray] = []  # the prepared arrays: keeps their ids unique
        self._last: tuple[Any, str] | None = None

    def prepare_weight(self, name: str, value: Any) -> np.ndarray:
        arr = super().prepare_weight(name, value)
        self.names[id(arr)] = name
        self._keep.append(arr)
        return arr

    def _observe(self, name: str, x: np.ndarray) -> None:
        if self._last is not None and self._last[0] is x:
            key = self._last[1]
        else:
            x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
            key = name
            self.hessians[key] = self.hessians.get(key, 0.0) + x2.T @ x2
            self._last = (x, key)  # NOTE: holding x keeps its id from being reused by a later array
        self.alias[name] = key

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: Any = None) -> np.ndarray:
        name = self.names.get(id(weight))
        if name is not None:
            self._observe(name, x)
        return super().linear(x, weight, bias)

    def moe(self, x: np.ndarray, router: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray,
            top_k: int, normalize: bool, shared: Any = None, shared_gate: Any = None,
            fused: Any = None) -> np.ndarray:
        self._observe(self.names[id(router)], x)
        logits = x @ router.T  # [T, E]: the routing of NumpyBackend.moe, op for op
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # [T, k]
        e_num, inter, hid = gate_w.shape
        acc = self.experts.setdefault(self.names[id(gate_w)], {
            "up": self.names[id(up_w)], "down": self.names[id(down_w)], "count": np.zeros(e_num, np.int64),
            "in": np.zeros((e_num, hid, hid)), "act": np.zeros((e_num, inter, inter)),
            "in_all": np.zeros((hid, hid)), "act_all": np.zeros((e_num, inter, inter))})
        x64 = x.astype(np.float64)
        acc["in_all"] += x64.T @ x64
        for e in range(e_num):
            h_all = self.silu_mul(x @ gate_w[e].T, x @ up_w[e].T).astype(np.float64)  # [T, I]
            acc["act_all"][e] += h_all.T @ h_all
            rows = np.nonzero((top == e).any(axis=1))[0]
            acc["count"][e] += len(rows)
            acc["in"][e] += x64[rows].T @ x64[rows]
            acc["act"][e] += h_all[rows].T @ h_all[rows]
        return super().moe(x, router, gate_w, up_w, down_w, top_k, normalize, shared, shared_gate)

    def result(self) -> dict[str, np.ndarray]:
        """weight name -> H ([K, K], stacked experts [E, K, K]); shared Hessians are the same array."""
        out = {name: self.hessians[key] for name, key in self.alias.items()}
        for gate, acc in self.experts.items():
            few = acc["count"] < self.min_expert_tokens  # [E]
            h_in = np.where(few[:, None, None], acc["in_all"][None], acc["in"])
            h_act = np.where(few[:, None, None], acc["act_all"], acc["act"])
            out[gate] = out[acc["up"]] = h_in
            out[acc["down"]] = h_act
        return out


@dataclass(slots=True, frozen=True)
class Calibration:
    """Hessians by weight name, and what they were computed from (for metadata)."""

    hessians: Mapping[str, np.ndarray]
    tokens: int
    windows: int
    seed: int
    sha256: str

    def describe(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "windows": self.windows, "seed": self.seed, "sha256": self.sha256}


def collect_hessians(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], tokens: np.ndarray, num_tokens: int,
                     window: int = DEFAULT_WINDOW, seed: int = 0, min_expert_tokens: int = 64) -> Calibration:
    """Run the float model (`tensors`, float32 by canonical name) over `num_tokens` calibration tokens drawn by
    `token_windows(tokens, num_tokens, window, seed)` and return every linear weight's input Hessian."""
    windows = token_windows(tokens, num_tokens, window, seed)
    check_token_ids(windows, cfg, "calibration")
    backend = CalibrationBackend(min_expert_tokens=min_expert_tokens)
    model = QwenModel.from_tensors(cfg, backend, tensors)
    for ids in windows:
        run_window(model, ids)  # logits of every row: lm_head sees every final hidden state
    return Calibration(backend.result(), num_tokens, len(windows), seed, tokens_digest(windows))

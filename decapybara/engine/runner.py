"""The data plane: the model, its paged KV cache and hybrid state pool, and one forward call per step.

`ModelRunner.run(plan)` turns a `StepPlan` into a `ForwardBatch`, runs the model, and returns the logits of
the sampling rows (host float32) plus hybrid-state snapshots. It also moves a sequence's pages and state to
and from host memory for pause/resume (`export_sequence` / `import_sequence`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decapybara.backend.base import HybridState, KVPageData
from decapybara.config import EngineConfig
from decapybara.engine.planner import StepPlan
from decapybara.model.batch import ForwardBatch
from decapybara.model.qwen import QwenModel


@dataclass(slots=True)
class StepOutput:
    logits: np.ndarray  # [num_sampling_chunks, vocab] float32, in plan order of chunks with sample=True
    snapshots: dict[tuple[int, int], HybridState] = field(default_factory=dict)  # (chunk index, token count)


@dataclass(slots=True)
class SequenceBundle:
    """A paused sequence's device data on the host: its KV pages and its hybrid state (if any)."""

    kv: KVPageData
    state: HybridState | None
    num_tokens: int  # tokens covered (= num_computed at pause)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.state.nbytes if self.state is not None else 0)


class ModelRunner:
    def __init__(self, model: QwenModel, cfg: EngineConfig):
        self.model, self.cfg = model, cfg
        self.kv = model.new_kv_cache(cfg.num_pages, cfg.page_size, cfg.kv_mode)
        self.hybrid = bool(model.cfg.linear_layers)
        self.states = model.new_state_pool(cfg.max_slots) if self.hybrid else None

    def run(self, plan: StepPlan) -> StepOutput:
        chunks = plan.chunks
        entries = []
        for c in chunks:
            s = c.seq
            new = s.tokens[s.num_computed:s.num_computed + c.num_tokens]
            entries.append((new, s.num_computed, np.asarray(s.pages, np.int32), s.state_slot))
        batch = ForwardBatch.build(entries, self.cfg.page_size, logits="none",
                                   snapshot_at=[c.snapshot_at for c in chunks])
        batch.logits_rows = np.asarray([b.end - 1 for b, c in zip(batch.seqs, chunks) if c.sample], np.int64)
        out = self.model.forward(batch, self.kv, self.states)
        logits = self.model.backend.to_host(out.logits).astype(np.float32, copy=False)
        return StepOutput(logits, out.snapshots)

    # ---- pause / resume --------------------------------------------------------------------------------
    def reset_state(self, slot: int, snapshot: HybridState | None = None) -> None:
        if self.states is None:
            return
        if snapshot is None:
            self.states.reset(slot)
        else:
            self.states.set(slot, snapshot)

    def export_sequence(self, pages: list[int], slot: int | None, num_tokens: int) -> SequenceBundle:
        kv = self.kv.export_pages(np.asarray(pages, np.int64))
        state = self.states.get(slot) if (self.states is not None and slot is not None) else None
        return SequenceBundle(kv, state, num_tokens)

    def import_pages(self, pages: list[int], bundle: SequenceBundle, which: list[int]) -> None:
        """Write bundle pages `which` (indices into the bundle) into pool pages `pages`."""
        if not which:
            return
        sel = np.asarray(which, np.int64)
        data = KVPageData({k: v[sel] for k, v in bundle.kv.arrays.items()})
        self.kv.import_pages(np.asarray(pages, np.int64), data)

    def import_state(self, slot: int | None, bundle: SequenceBundle) -> None:
        if self.states is not None and slot is not None and bundle.state is not None:
            self.states.set(slot, bundle.state)

    @property
    def bytes_per_page(self) -> int:
        return self.kv.bytes_per_page

    def info(self) -> dict[str, Any]:
        return {"pages": self.cfg.num_pages, "page_size": self.cfg.page_size,
                "bytes_per_page": self.bytes_per_page, "state_slots": self.cfg.max_slots if self.hybrid else 0}

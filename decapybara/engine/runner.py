"""The data plane: the model, its paged KV cache and hybrid state pool, and one forward call per step.

`ModelRunner.run(plan)` turns a `StepPlan` into a `ForwardBatch`, runs the model, and returns the logits of
the sampling rows (the backend's array: the engine samples them there, `Backend.sample`) plus hybrid-state
snapshots. It also moves a sequence's pages and state to
and from host memory for pause/resume (`export_sequence` / `import_sequence`).

On a backend with graph support (GRAPH_BACKENDS) and `cfg.cuda_graphs` on, forwards go through a
`DecodeGraphRunner` (decapybara/backend/cuda_graph.py): pure decode steps replay captured CUDA graphs, anything
else runs eagerly. Graph padding rows write a KV page and a DeltaNet state slot that no sequence may own;
`graph_plan` reserves them (the pool's last page, state slot `max_slots`) and the engine sizes its block
manager from `GraphPlan.usable_pages`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decapybara.backend.base import HybridState, KVPageData
from decapybara.config import EngineConfig
from decapybara.engine.planner import StepPlan
from decapybara.model.batch import ForwardBatch
from decapybara.model.qwen import ForwardOutput, QwenModel

log = logging.getLogger(__name__)

GRAPH_BACKENDS = ("cupy",)  # backend names whose decode steps can run as CUDA graphs
GRAPH_BUCKETS = (1, 2, 4, 8, 12)  # sequences a decode graph holds (a batch pads to the next)


def graph_buckets(max_slots: int) -> tuple[int, ...]:
    """The buckets an engine of `max_slots` sequences uses: GRAPH_BUCKETS up to the first that holds them all (its
    largest sizes the verification graphs' rollback checkpoints: one state a row)."""
    top = min((b for b in GRAPH_BUCKETS if b >= max_slots), default=max(GRAPH_BUCKETS))
    return tuple(b for b in GRAPH_BUCKETS if b <= top)


@dataclass(slots=True)
class StepOutput:
    logits: Any  # [num_sampling_rows, vocab], the backend's array (on the device for a device backend), in plan
    # order of chunks with sample=True, 1 + k rows for a chunk with k drafts (its real token's, its drafts'):
    # `backend.sample` draws from it where it is
    snapshots: dict[tuple[int, int], HybridState] = field(default_factory=dict)  # (chunk index, token count)
    normed: Any = None  # [T, H] every row's final-normed hidden state, where the plan speculates (the MTP's input)
    batch: Any = None  # the ForwardBatch run (its rows' places, for the MTP pass)
    # prompt logprobs: (chunk index, first row of `logits`, prompt position p0, rows n): rows p0 .. p0 + n - 1 of the
    # chunk's sequence, after the sampling rows, each predicting the prompt token after it
    prompt_rows: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class SequenceBundle:
    """A paused sequence's device data on the host: its KV pages and its hybrid state (if any)."""

    kv: KVPageData
    state: HybridState | None
    num_tokens: int  # tokens covered (= num_computed at pause)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.state.nbytes if self.state is not None else 0)


@dataclass(slots=True, frozen=True)
class GraphPlan:
    """How the KV pool and the state pool are laid out for CUDA-graph decode (pure data, see `graph_plan`).

    Padding rows of a graph replay write KV page `pad_page` and state slot `pad_slot`, so neither may ever
    belong to a sequence: the KV cache holds `kv_pages` pages of which the block manager owns pages
    [0, usable_pages), and the state pool holds `state_slots` slots of which the engine owns [0, max_slots).
    Without graphs nothing is reserved: usable_pages == kv_pages, state_slots == max_slots, no pad ids.
    """

    enabled: bool
    kv_pages: int  # pages in the KV cache (cfg.num_pages)
    usable_pages: int  # pages the block manager may hand out: ids [0, usable_pages)
    state_slots: int  # slots in the state pool of a hybrid model
    pad_page: int | None = None  # == usable_pages when enabled
    pad_slot: int | None = None  # == cfg.max_slots when enabled for a hybrid model, else None
    max_pages: int = 0  # block-table width of the graphs: pages of max_model_len, at most usable_pages
    buckets: tuple[int, ...] = GRAPH_BUCKETS  # `graph_buckets(cfg.max_slots)` when enabled


def graph_plan(cfg: EngineConfig, backend_name: str, max_model_len: int, hybrid: bool) -> GraphPlan:
    """The reservation for `cfg` on the backend named `backend_name`. Graphs are on only when
    `cfg.cuda_graphs` is and the backend is in GRAPH_BACKENDS; then the pool's last page is the pad page and,
    for hybrid models, an extra state slot `cfg.max_slots` is the pad slot."""
    if not (cfg.cuda_graphs and backend_name in GRAPH_BACKENDS):
        return GraphPlan(False, cfg.num_pages, cfg.num_pages, cfg.max_slots)
    usable = cfg.num_pages - 1  # EngineConfig guarantees num_pages >= 2
    pages_for_len = -(-max(1, max_model_len) // cfg.page_size)
    return GraphPlan(True, cfg.num_pages, usable, cfg.max_slots + (1 if hybrid else 0), pad_page=usable,
                     pad_slot=cfg.max_slots if hybrid else None, max_pages=min(pages_for_len, usable),
                     buckets=graph_buckets(cfg.max_slots))


def make_graph_runner(model: QwenModel, plan: GraphPlan, piecewise: bool = False, chains: bool = False,
                      draft_head: Any = None) -> Any:
    """A DecodeGraphRunner over `plan`'s reservation (`piecewise`: its eager steps replay the layers' tails as
    graphs, `PiecewiseTails`; `chains`: its graphs run the layers' tails as product chains, `ChainTails`;
    `draft_head`: the ids its MTP graphs guess among, `QwenModel.draft_head`). Imports cupy: call only for an
    enabled plan."""
    from decapybara.backend.cuda_graph import DecodeGraphRunner

    tails = None
    if piecewise:
        from decapybara.backend.piecewise import PiecewiseTails

        tails = PiecewiseTails()
    return DecodeGraphRunner(model, max_pages=plan.max_pages, pad_page=plan.pad_page, pad_slot=plan.pad_slot,
                             buckets=plan.buckets, tails=tails, chains=chains, draft_head=draft_head)


def _graph_key_name(key: Any) -> str:
    """A DecodeGraphRunner graph key (bucket, attention splits, rows a sequence; or "mtp" / "mtpkv", bucket,
    splits, rows) as a JSON key."""
    if isinstance(key, tuple) and len(key) == 4 and key[0] in ("mtp", "mtpkv"):
        return f"{key[0]} bucket={key[1]} splits={key[2]} rows={key[3]}"
    if isinstance(key, tuple) and len(key) == 3:
        return f"bucket={key[0]} splits={key[1]}" + (f" verify rows={key[2]}" if key[2] > 1 else "")
    return str(key)


class ModelRunner:
    def __init__(self, model: QwenModel, cfg: EngineConfig, max_model_len: int | None = None,
                 draft_ids: tuple[int, ...] = ()):
        """`max_model_len` (default: the model's max_position_embeddings) bounds the graphs' block tables;
        `draft_ids`: ids the MTP head may guess beside those below `cfg.draft_vocab` (eos and markup tokens)."""
        self.model, self.cfg = model, cfg
        # the ids the MTP head guesses among (QwenModel.draft_head), where it has one
        self.draft_head = model.draft_head(cfg.draft_vocab, draft_ids) if model.has_mtp else None
        self.hybrid = bool(model.cfg.linear_layers)
        self.plan = graph_plan(cfg, model.backend.name, max_model_len or model.cfg.max_position_embeddings,
                               self.hybrid)
        self.kv = model.new_kv_cache(self.plan.kv_pages, cfg.page_size, cfg.kv_mode)
        self.states = model.new_state_pool(self.plan.state_slots) if self.hybrid else None
        self.graphs: Any = None  # the DecodeGraphRunner when graphs are on and could be set up
        self.graph_error: str | None = None  # why they could not
        if self.plan.enabled:
            self._start_graphs()

    def _start_graphs(self) -> None:
        """Zero the pad slot and build the graph runner; a failure leaves the runner eager (the reservation
        stays: it costs one page and one slot)."""
        if self.states is not None and self.plan.pad_slot is not None:
            self.states.reset(self.plan.pad_slot)
        try:
            self.graphs = make_graph_runner(self.model, self.plan, self.cfg.piecewise_graphs, self.cfg.product_chains,
                                            self.draft_head)
        except Exception as e:  # noqa: BLE001 - no graphs is slower, never wrong
            self.graph_error = f"{type(e).__name__}: {e}"
            log.warning("CUDA graphs disabled: %s", self.graph_error)

    def forward(self, batch: ForwardBatch, eager: bool = False) -> ForwardOutput:
        """`QwenModel.forward` over this runner's pools; through the graph runner when there is one (it runs
        anything but a pure decode batch eagerly by itself) unless `eager` (then with its piecewise tails)."""
        if self.graphs is not None and not eager:
            return self.graphs.forward(batch, self.kv, self.states)
        return self.model.forward(batch, self.kv, self.states, tails=getattr(self.graphs, "tails", None))

    def graph_drafts(self, n: int) -> int:
        """Drafts a sequence that a verification graph of `n` sequences takes over this runner's cache (the graph
        runner's `max_drafts`); 0 without graphs."""
        return self.graphs.max_drafts(n, self.kv) if self.graphs is not None else 0

    def run(self, plan: StepPlan, normed: bool = False) -> StepOutput:
        """One forward over `plan`'s chunks: logits of each sampling chunk's last row (every row of a chunk with
        drafts); `normed`: every row's final-normed hidden state too (speculation's MTP pass)."""
        chunks = plan.chunks
        entries = []
        for c in chunks:
            s = c.seq
            if c.drafts:  # the last real token, then the drafts
                new = [*s.tokens[s.num_computed:s.num_computed + 1], *c.drafts]
            else:
                new = s.tokens[s.num_computed:s.num_computed + c.num_tokens]
            entries.append((new, s.num_computed, np.asarray(s.pages, np.int32), s.state_slot))
        batch = ForwardBatch.build(entries, self.cfg.page_size, logits="none",
                                   snapshot_at=[c.snapshot_at for c in chunks])
        rows = []
        for b, c in zip(batch.seqs, chunks):
            if c.sample:
                rows += list(range(b.start, b.end)) if c.drafts else [b.end - 1]
        prompt_rows = []  # then each prompt-logprob chunk's rows that predict a prompt token
        for ci, (b, c) in enumerate(zip(batch.seqs, chunks)):
            s = c.seq
            if s.params.prompt_logprobs is not None and s.num_computed + 1 < s.num_prompt:
                n = min(c.num_tokens, s.num_prompt - 1 - s.num_computed)
                prompt_rows.append((ci, len(rows), s.num_computed, n))
                rows += range(b.start, b.start + n)
        batch.logits_rows = np.asarray(rows, np.int64)
        batch.normed_rows = normed
        # drafts' rollback states stay on the device (device copies, not host round trips)
        batch.device_snapshots = frozenset((i, q) for i, c in enumerate(chunks) for q in c.rollback)
        # a prompt's chunk whose every row has logits is no verification (a graph would take up to 8 such rows)
        out = self.forward(batch, eager=bool(prompt_rows))
        return StepOutput(out.logits, out.snapshots, out.normed, batch, prompt_rows)

    def mtp(self, entries: list[tuple[list[int], int, list[int]]], normed_rows: np.ndarray, draft_rows: list[int],
            normed: Any, chain: bool = False) -> tuple[np.ndarray, np.ndarray, Any]:
        """The MTP head over (hidden, next token) pairs: per sequence (next tokens of positions [p0, p0 + n), p0,
        its pages); `normed_rows` [sum n]: their rows of the step's `normed`; the head's greedy guess and its
        probability (host arrays [len(draft_rows)]) at the rows listed (flat pair indices, each a sequence's last
        pair), and with `chain` the head's own final-normed states there (the backend's [len(draft_rows), H]: what
        `mtp_chain` pairs with those guesses), else None. Through the graph runner's MTP graphs where they take
        the pairs, else eagerly."""
        batch, hidden = self._pairs(entries, normed_rows, normed)
        return self._guesses(batch, hidden, np.asarray(draft_rows, np.int64), chain)

    def mtp_chain(self, entries: list[tuple[int, int, list[int]]], hidden: Any) -> tuple[np.ndarray, np.ndarray, Any]:
        """The head's next guesses after its own: per sequence (its latest guess, the position p0 of the pair,
        its pages) with `hidden` [len(entries), H] the head's final-normed state at p0 - 1 (what `mtp` or this
        gave with that guess); the pair at p0 writes the head's keys and values there (a later pass over computed
        positions writes them again). (guesses, probabilities, the head's states for the next link)."""
        batch = ForwardBatch.build([([t], p0, np.asarray(pages, np.int32), None) for t, p0, pages in entries],
                                   self.cfg.page_size, logits="none")
        return self._guesses(batch, hidden, np.arange(len(entries), dtype=np.int64), True)

    def _guesses(self, batch: ForwardBatch, hidden: Any, rows: np.ndarray, chain: bool) -> tuple[Any, Any, Any]:
        ops = self.model.backend
        batch.logits_rows = rows
        got = self.graphs.mtp(batch, hidden, self.kv, own=chain) if self.graphs is not None else None
        if got is not None:  # every sequence's last pair: those of the rows listed
            which = np.searchsorted([s.end - 1 for s in batch.seqs], rows)
            guess, prob = (ops.to_host(a) for a in got[:2])
            own = got[2][ops.from_host(which)] if chain else None
            return guess[which], prob[which], own
        logits, own = self.model.mtp_forward(batch, hidden, self.kv, own=True, head=self.draft_head)
        guess, prob = self.model.draft_guesses(logits, self.draft_head)
        return ops.to_host(guess), ops.to_host(prob), own if chain else None

    def mtp_kv(self, entries: list[tuple[list[int], int, list[int]]], normed_rows: np.ndarray, normed: Any) -> None:
        """The MTP head's keys and values over the pairs of `mtp`'s arguments, without its guesses
        (`QwenModel.mtp_kv`; through the graph runner's KV-only graphs where they take the pairs, else eagerly): a
        step after which no draft is verified keeps the head's cache whole."""
        batch, hidden = self._pairs(entries, normed_rows, normed)
        if self.graphs is not None and self.graphs.mtp_kv(batch, hidden, self.kv):
            return
        self.model.mtp_kv(batch, hidden, self.kv)

    def _pairs(self, entries: list[tuple[list[int], int, list[int]]], normed_rows: np.ndarray,
               normed: Any) -> tuple[ForwardBatch, Any]:
        """The MTP head's batch of (hidden, next token) pairs and their hidden rows of `normed`."""
        batch = ForwardBatch.build([(t, p0, np.asarray(pages, np.int32), None) for t, p0, pages in entries],
                                   self.cfg.page_size, logits="none")
        return batch, normed[self.model.backend.from_host(np.asarray(normed_rows, np.int64))]

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

    def graph_stats(self) -> dict[str, Any]:
        """Numbers of CUDA-graph decode: `enabled` (a graph runner is in use), forwards replayed as graphs
        (`graph_steps`, of which `verify_steps` verified drafts, with `checkpoint_bytes` of device memory for
        their rollback points; the MTP head's passes replayed, `mtp_steps`, or run eagerly, `mtp_eager`) or run eagerly by the graph runner (`eager_steps`), graphs captured, and graph keys
        whose capture failed (`failures`, those run eagerly); with piecewise tails, their replays, captures,
        failed buckets and the device memory they hold (`tail_memory_bytes`); with product chains, the chains and
        the products they run (`DecodeGraphRunner.chain_stats`). All zero without graphs."""
        s = self.graphs.stats if self.graphs is not None else {}
        tails = getattr(self.graphs, "tails", None)
        t = tails.stats if tails is not None else {}
        chained = bool(getattr(self.graphs, "chains", False))
        c = self.graphs.chain_stats() if chained else {}
        ckpt = getattr(self.graphs, "checkpoint_bytes", None)
        return {"enabled": self.graphs is not None, "graph_steps": s.get("graph_steps", 0),
                "verify_steps": s.get("verify_steps", 0), "mtp_steps": s.get("mtp_steps", 0),
                "mtp_kv_steps": s.get("mtp_kv_steps", 0), "mtp_eager": s.get("mtp_eager", 0),
                "checkpoint_bytes": ckpt() if ckpt is not None else 0,
                "eager_steps": s.get("eager_steps", 0), "captures": s.get("captures", 0),
                "failures": len(s.get("failures", {})), "piecewise": tails is not None,
                "tail_replays": t.get("tail_replays", 0), "tail_captures": t.get("captures", 0),
                "tail_failures": len(t.get("failures", {})),
                "tail_memory_bytes": tails.memory_bytes() if tails is not None else 0,
                "product_chains": chained, "chains": c.get("chains", 0),
                "chained_products": c.get("chained_products", 0), "launched_tails": c.get("launched_tails", 0),
                "recut_tails": c.get("recut_tails", 0), "chain_timeouts": s.get("chain_timeouts", 0)}

    def captures(self) -> int:
        """Graphs captured, or whose capture failed, so far (decode, verification, MTP and piecewise tails); 0
        without graphs. A step that captured one, or tried to, took many steps' time once."""
        if self.graphs is None:
            return 0
        n = self.graphs.stats.get("captures", 0) + len(self.graphs.stats.get("failures", {}))
        tails = getattr(self.graphs, "tails", None)
        if tails is not None:
            n += tails.stats.get("captures", 0) + len(tails.stats.get("failures", {}))
        return n

    def graph_failures(self) -> dict[str, str]:
        """Why graphs failed: per graph key ("bucket=B splits=S") and "setup" (JSON-able)."""
        out = {"setup": self.graph_error} if self.graph_error else {}
        if self.graphs is not None:
            for key, why in self.graphs.stats.get("failures", {}).items():
                out[_graph_key_name(key)] = why
            tails = getattr(self.graphs, "tails", None)
            for rows, why in (tails.stats["failures"] if tails is not None else {}).items():
                out[f"tails rows={rows}"] = why
        return out

    def info(self) -> dict[str, Any]:
        """Pool layout (`pages`: pages sequences may use; `kv_pages`: pages in the cache, the pad page
        included) and the graph numbers."""
        return {"pages": self.plan.usable_pages, "kv_pages": self.plan.kv_pages, "page_size": self.cfg.page_size,
                "bytes_per_page": self.bytes_per_page, "state_slots": self.cfg.max_slots if self.hybrid else 0,
                "pad_page": self.plan.pad_page, "pad_slot": self.plan.pad_slot, "graphs": self.graph_stats(),
                "graph_failures": self.graph_failures()}

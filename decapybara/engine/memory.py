"""Pool memory of the engine: admission with prefix reuse (incl. restoring tier-held pages), pause and resume
through the bundle store, recompute when a bundle is lost, adoption of paused conversations after a restart,
and the cached pages a finished sequence leaves behind. A mixin of `Engine` (it uses the engine's blocks,
runner, queues, slots and stats)."""

from __future__ import annotations

import logging
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import numpy as np

from decapybara.engine.block_manager import hash_chain, root_hash
from decapybara.engine.runner import SequenceBundle
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import SeqStatus, Sequence
from decapybara.errors import ConfigError, InvalidRequestError
from decapybara.kv.stores import ABSENT, PRESENT_WITH_SNAPSHOT

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CachedTrail:
    """What a finished sequence left in the prefix cache, without its tokens: its full pages' hashes, how many
    tokens it computed and the tokens of its partial last page (`demote_cached`'s input, small enough to keep for
    every conversation)."""

    page_hashes: tuple[bytes, ...]
    num_computed: int
    tail: tuple[int, ...]

    @classmethod
    def of(cls, seq: Sequence, page_size: int) -> CachedTrail:
        full = seq.num_computed // page_size
        return cls(tuple(seq.page_hashes), seq.num_computed, tuple(seq.tokens[full * page_size:seq.num_computed]))


class _Bundle:
    """Adapter: a single page's KV as the `import_pages` bundle argument."""

    def __init__(self, kv: Any):
        self.kv = kv



class MemoryMixin:
    """Admit / pause / resume and the prefix-cache side of finishing; see the module docstring."""

    def admit(self, seq: Sequence) -> bool:
        """Move a waiting sequence into a slot, reusing its cached prefix (pages in the pool, and pages a tier
        holds, which are restored). False when pages are short. A sequence that lost its paused bundle comes
        back through here and recomputes what the cache cannot give it."""
        assert seq.status == SeqStatus.WAITING and self.can_admit()
        # a request for prompt logprobs computes its whole prompt until they are sent: it matches no cached prefix
        # (one token never does)
        tokens = seq.tokens[:1] if seq.params.prompt_logprobs is not None and not seq.prompt_lps_sent else seq.tokens
        # pages short: refused before the tier-held pages of the match are fetched (disk reads) for nothing
        if not self.blocks.can_allocate(*self._admission_pages(seq, self.blocks.match_prefix(tokens, count=False))):
            return False
        match, restored = self._match_and_fetch(tokens)
        need, held = self._admission_pages(seq, match)
        pages = self.blocks.allocate(need, held)  # the tail is held until copied
        if pages is None:
            return False
        tail = [match.tail_page] if match.tail_page is not None else []
        table, it_pool, it_fresh = [], iter(held[:len(held) - len(tail)]), iter(pages[len(held):])
        for i, p in enumerate(match.pages):  # restored pages take fresh pages in place
            if p is None:
                page = next(it_fresh)
                kv, snap = restored[i]
                self.runner.import_pages([page], _Bundle(kv), [0])
                self.blocks.register(page, match.hashes[i])
                if snap is not None:
                    self.blocks.put_snapshot(match.hashes[i], snap, snap.nbytes)
                self.stats.restored_pages += 1
                table.append(page)
            else:
                table.append(next(it_pool))
        if tail:  # the page after the full ones receives a private copy of the cached partial tail
            own = next(it_fresh)
            self.runner.kv.copy_pages(np.asarray(tail, np.int64), np.asarray([own], np.int64))
            self.blocks.release(tail)
            table.append(own)
        table += list(it_fresh)
        self.waiting.remove(seq)
        seq.pages, seq.num_computed = table, match.num_tokens
        seq.page_hashes = hash_chain(seq.tokens, self.cfg.page_size, self.blocks.salt, len(match.pages))
        seq.state_slot = self.free_slots.pop()
        snapshot = match.snapshot
        if self.hybrid and match.pages and match.pages[-1] is None and not match.tail_len:
            snapshot = restored[len(match.pages) - 1][1]
        elif match.snapshot_from is not None:  # an in-pool page whose snapshot the tier kept
            snapshot = restored[-1][1]
            self.blocks.put_snapshot(match.snapshot_from, snapshot, snapshot.nbytes)
            self.stats.restored_snapshots += 1
        self.runner.reset_state(seq.state_slot, snapshot)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if seq.num_admissions == 0:
            seq.num_cached_prompt = min(match.num_tokens, seq.num_prompt)
            self.stats.prompt_tokens += seq.num_prompt
            self.stats.reused_prompt_tokens += seq.num_cached_prompt
        seq.num_admissions += 1
        return True

    def fixed_context_tokens(self, seq: Sequence) -> int:
        """The tokens whose pages an admission or a resume of `seq` reserves at once in fixed context mode (its
        whole context: prompt and max_tokens, up to the engine's context length); 0 in pool mode."""
        if self.cfg.context_mode != "fixed":
            return 0
        return min(seq.num_prompt + seq.params.max_tokens, self.max_model_len)

    def _admission_pages(self, seq: Sequence, match: Any) -> tuple[int, list[int]]:
        """The fresh pages an admission over `match` takes (its first chunk's; in fixed context mode the whole
        context's, reserved up front: never paused for memory) and the pool pages it holds (the match's, and a
        cached partial tail while it is copied)."""
        first_chunk = min(seq.num_tokens - match.num_tokens, self.cfg.max_batch_tokens)
        if self.cfg.context_mode == "fixed":
            first_chunk = self.fixed_context_tokens(seq) - match.num_tokens
        in_pool = [p for p in match.pages if p is not None]
        tail = [match.tail_page] if match.tail_page is not None else []
        return self.blocks.pages_for(match.num_tokens + first_chunk) - len(in_pool), in_pool + tail

    def _match_and_fetch(self, tokens: list[int]) -> tuple[Any, dict[int, tuple[Any, Any]]]:
        """match_prefix, with the tier-held pages of the match fetched into host memory (by their index in the
        match; -1: the tier copy of `match.snapshot_from`, for its snapshot). A page that cannot be fetched (lost,
        corrupt, or without the snapshot it was offloaded with) is forgotten and the match retried, so the result
        is always usable."""
        while True:
            match = self.blocks.match_prefix(tokens)
            restored: dict[int, tuple[Any, Any]] = {}
            wanted = [(i, h) for i, (p, h) in enumerate(zip(match.pages, match.hashes, strict=True)) if p is None]
            if match.snapshot_from is not None:
                wanted.append((-1, match.snapshot_from))
            last = len(match.pages) - 1 if self.hybrid and not match.tail_len else None  # its state resumes there
            fetched = self.page_store.fetch_many([h for _, h in wanted]) if wanted else []
            for (i, h), got in zip(wanted, fetched, strict=True):
                if got is None or (i in (-1, last) and got[1] is None):  # no snapshot where one was recorded
                    self.page_store.forget(h)
                    self.stats.lost_pages += 1
                    break
                restored[i] = got
            else:
                return match, restored

    def pause(self, seq: Sequence) -> SequenceBundle:
        """Take a running sequence out of the pool whole: pages + state to the bundle store, slot freed. The bundle
        is stored before anything is freed: where the store raises, the sequence is left running as it was."""
        assert seq.status == SeqStatus.RUNNING
        n_pages = self.blocks.pages_for(seq.num_computed)
        bundle = self.runner.export_sequence(seq.pages[:n_pages], seq.state_slot, seq.num_computed)
        seq.num_pauses += 1  # the bundle's key counts this pause
        try:
            handle = self.bundle_store.put(seq, bundle)
        except BaseException:
            seq.num_pauses -= 1
            raise
        self.blocks.release(seq.pages)
        seq.pages = []
        self._free_slot(seq)
        self.running.remove(seq)
        seq.status, seq.paused_bundle = SeqStatus.PAUSED, handle
        self.paused.append(seq)
        self.stats.pauses += 1
        return bundle

    def resume(self, seq: Sequence, bundle: SequenceBundle | None = None) -> bool:
        """Bring a paused sequence back from its bundle: no token is recomputed. False when pages are short (found
        before the bundle is read), or when the bundle was lost: then the sequence goes back to the queue and
        recomputes from its tokens (never wrong output)."""
        assert seq.status == SeqStatus.PAUSED and self.can_admit()
        # pages short: refused before the bundle is read from its store (a tier's disk) and written back for nothing
        if bundle is None and not self.blocks.can_allocate(*self._resume_pages(seq, seq.num_computed)):
            return False
        if bundle is None:
            bundle = self.bundle_store.get(seq, seq.paused_bundle)
            if bundle is None:
                self._requeue_for_recompute(seq)
                return False
        n_pages = self.blocks.pages_for(bundle.num_tokens)
        fresh, reuse = self._resume_pages(seq, bundle.num_tokens)
        pages = self.blocks.allocate(fresh, reuse)
        if pages is None:
            seq.paused_bundle = self.bundle_store.put(seq, bundle)  # back where it was
            return False
        self.runner.import_pages(pages[len(reuse):n_pages], bundle, list(range(len(reuse), n_pages)))
        for i in range(len(reuse), len(seq.page_hashes)):
            self.blocks.register(pages[i], seq.page_hashes[i])
        seq.pages, seq.num_computed = pages, bundle.num_tokens
        seq.state_slot = self.free_slots.pop()
        self.runner.import_state(seq.state_slot, bundle)
        self.paused.remove(seq)
        seq.status, seq.paused_bundle = SeqStatus.RUNNING, None
        seq.num_resumes += 1
        self.running.append(seq)
        self.stats.resumes += 1
        return True

    def _resume_pages(self, seq: Sequence, num_tokens: int) -> tuple[int, list[int]]:
        """The fresh pages a resume of `seq` with `num_tokens` computed tokens takes (in fixed context mode the whole
        context's again, as at admission: never paused for memory) and the pool pages it shares again: its full
        pages still in the prefix cache, in order up to the first that is not."""
        reuse = []
        for h in seq.page_hashes:
            page = self.blocks.page_of_hash.get(h)
            if page is None:
                break
            reuse.append(page)
        total = self.blocks.pages_for(num_tokens)
        total = max(total, self.blocks.pages_for(self.fixed_context_tokens(seq)))
        return total - len(reuse), reuse

    def _requeue_for_recompute(self, seq: Sequence) -> None:
        self.paused.remove(seq)
        seq.status, seq.paused_bundle, seq.num_computed, seq.pages = SeqStatus.WAITING, None, 0, []
        seq.page_hashes = []
        self.waiting.insert(0, seq)
        self.stats.lost_bundles += 1

    def import_paused(self, unit: Any) -> Sequence:
        """Adopt a paused conversation from a tier unit written by any engine on this model (e.g. before a
        restart): it joins the paused set and resumes exactly where it stopped."""
        from decapybara.engine.persist import restore_sequence
        from decapybara.kv.stores import model_fingerprint

        mark = unit.meta.get("model")  # units written before the mark was kept carry none
        if mark is not None and mark != model_fingerprint(self.blocks.salt):
            raise ConfigError(f"conversation {unit.meta.get('request_id')!r} was paused by an engine on another "
                              "model, weights, KV mode or page size: its KV cannot be adopted here")
        detok = None
        if self.tokenizer is not None:
            from decapybara.tokenizer import IncrementalDetokenizer

            def detok(params: SamplingParams) -> Any:
                return IncrementalDetokenizer(self.tokenizer, stop=params.stop)
        seq = restore_sequence(unit.meta, unit.extras, self.loop_guard_for)
        seq.json = self._json_state(seq.params, seq.request.prompt_ids)  # replayed with the detokeniser below
        if detok is not None:  # replayed as `_append_output` pushed it: no stop strings in the reasoning
            seq.detok = detok(seq.params)
            seq.in_thinking, seq.after_think = self._prompt_opens_thinking(seq.request.prompt_ids), False
            for t in seq.tokens[seq.num_prompt:]:
                self._detok_push(seq, t)
        if seq.request_id in self.seqs:
            raise InvalidRequestError(f"duplicate request id {seq.request_id!r}")
        seq.status, seq.paused_bundle = SeqStatus.PAUSED, self.bundle_store.put(seq, unit.to_bundle())
        seq.num_admissions = 1
        self.seqs[seq.request_id] = seq
        self.paused.append(seq)
        return seq

    def set_page_store(self, store: Any) -> None:
        """Send prefix pages evicted from the pool to `store` and restore them from it on later hits."""
        self.page_store = store
        self.blocks.external = store.lookup if store is not None else None
        self.blocks.on_evict = self._offload_page if store is not None else None

    def _offload_page(self, page: int, page_hash: bytes, snapshot: Any) -> None:
        """An evicted page to the tiers, except where a tier's copy has the state snapshot this page no longer has
        in the pool (a page a resume put back from its bundle): pages are content-addressed, so that copy holds the
        same KV, and one without the snapshot must not replace it."""
        if snapshot is None and self.page_store.lookup(page_hash) == PRESENT_WITH_SNAPSHOT:
            return
        kv = self.runner.kv.export_pages(np.asarray([page], np.int64))
        try:
            self.page_store.offload(page_hash, kv, snapshot)
        except Exception as e:  # noqa: BLE001 - a store that fails loses the page's copy, not the pool page or the step
            log.warning("KV tiers: evicted page not kept: %s: %s", type(e).__name__, e)
            self.stats.lost_pages += 1
            return
        self.stats.offloaded_pages += 1

    def save_cached_pages(self, budget_s: float | None = None) -> int:
        """Copy the prefix cache's full pages to where the page store keeps them across a restart (the disk tier), so
        that the next engine over it (`TierStores.adopt_pages`) restores them instead of prefilling them again.
        Pages live requests use come first, then the cached ones, the most recently used first, each with its
        hybrid state snapshot where the pool keeps one; the store ranks them in that order, so that where room runs
        out the later ones give way. A page the disk holds already, with a snapshot or without one where the pool
        has none, is skipped. Then the pages the store holds only in memory follow (`persist_pages`). Stops once
        `budget_s` seconds have passed, at the first page the store keeps no room for, or at a store error. The
        pool is left as it was. Returns the pages copied (also counted in `stats.saved_pages`)."""
        store = self.page_store
        if store is None or not hasattr(store, "begin_save") or not self.cfg.enable_prefix_cache:
            return 0
        deadline = None if budget_s is None else time.monotonic() + budget_s

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        b = self.blocks
        live = [p for p in b.hash_of_page if p not in b.lru]
        cached = [p for p in reversed(b.lru) if p in b.hash_of_page]  # not a partial tail: no page unit
        saved = 0
        try:
            store.begin_save(min(10.0, left() or 10.0))
            for page in live + cached:
                if deadline is not None and time.monotonic() > deadline:
                    break
                h = b.hash_of_page[page]
                kept = b.snapshots.get(h)
                snapshot = kept[0] if kept is not None else None
                held = store.durable(h)
                if held == PRESENT_WITH_SNAPSHOT or (held != ABSENT and snapshot is None):
                    continue
                kv = self.runner.kv.export_pages(np.asarray([page], np.int64))
                if not store.save(h, kv, snapshot, saved):
                    break
                saved += 1
            else:  # then the pages a tier holds only in memory (evicted earlier)
                saved += store.persist_pages(saved, left())
        except Exception as e:  # noqa: BLE001 - any store error: what was saved stays saved
            log.warning("KV tiers: the save stopped after %d pages: %s: %s", saved, type(e).__name__, e)
        finally:
            try:
                store.end_save()
            except Exception as e:  # noqa: BLE001
                log.warning("KV tiers: the saved pages' ranks stay: %s: %s", type(e).__name__, e)
        self.stats.saved_pages += saved
        return saved

    def _free_slot(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    # ---- the step --------------------------------------------------------------------------------------
    def _offer_tail(self, s: Sequence) -> None:
        """Keep the partial last page of a finishing sequence for its conversation's next turn."""
        ps = self.cfg.page_size
        full, rem = divmod(s.num_computed, ps)
        if s.state_ahead or not rem or not self.cfg.enable_prefix_cache or len(s.page_hashes) < full:
            return
        parent = s.page_hashes[full - 1] if full else root_hash(self.blocks.salt)
        snap = self.runner.states.get(s.state_slot) if self.snapshots else None
        self.blocks.register_tail(parent, tuple(s.tokens[full * ps:s.num_computed]), s.pages[full], snap,
                                  snap.nbytes if snap is not None else 0)

    def demote_cached(self, trail: CachedTrail, keep: Container[bytes] = frozenset()) -> int:
        """Make the unreferenced cached pages a finished sequence left (its `CachedTrail`: its full pages, then the
        partial tail it offered) the next to be evicted, deepest first, except full pages whose hash is in `keep`.
        Returns how many pages moved. Referenced pages are untouched."""
        b, ps = self.blocks, self.cfg.page_size
        pages = [b.page_of_hash.get(h) for h in trail.page_hashes if h not in keep]
        full = trail.num_computed // ps
        if trail.tail and len(trail.page_hashes) >= full:
            parent = trail.page_hashes[full - 1] if full else root_hash(b.salt)
            pages.append(b.tails.get(parent, {}).get(trail.tail))
        moved = 0
        for p in pages:  # each goes to the front, so the tail ends up evicted first and the opening last
            if p is not None and p in b.lru:
                b.lru.move_to_end(p, last=False)
                moved += 1
        self.stats.demoted_pages += moved
        return moved

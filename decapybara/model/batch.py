"""What one forward call computes: a flattened batch of sequence chunks (varlen, as vLLM/SGLang do).

Every sequence contributes `length` new tokens (a prefill chunk, or 1 for decode) on top of `context` tokens
whose KV/state is already cached. Rows of all sequences are concatenated into one [T] token array so that
every projection is one matrix product; mixers (attention, DeltaNet) work per sequence on their row range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SeqChunk:
    """One sequence's slice of a `ForwardBatch`.

    `block_table` lists the KV pages holding tokens [0, context + length) in order; `state_slot` is the row of
    the hybrid state pool (None for models without DeltaNet layers); `snapshot_at` lists absolute token counts p
    with context < p <= context + length after which the DeltaNet/conv state must be copied out (prefix reuse
    of hybrid models needs the state at page boundaries).
    """

    start: int
    length: int
    context: int
    block_table: np.ndarray  # [num_pages] int32
    state_slot: int | None = None
    snapshot_at: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def total(self) -> int:
        return self.context + self.length


@dataclass(slots=True)
class ForwardBatch:
    """A forward call: token ids and positions of all rows, their sequences, and which rows need logits."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    seqs: list[SeqChunk]
    logits_rows: np.ndarray  # [R] int64, rows whose logits are returned (R may be 0)
    page_size: int
    slot_mapping: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [T] flat KV slot per row
    normed_rows: bool = False  # also return every row's final-normed hidden state (ForwardOutput.normed: MTP)
    # snapshot keys (sequence index, token count) handed back as the backend's arrays, not host copies (a
    # speculative draft's rollback point: read back into the state pool within the step, or dropped)
    device_snapshots: frozenset = frozenset()

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def build(cls, chunks: list[tuple[list[int] | np.ndarray, int, np.ndarray, int | None]], page_size: int,
              logits: str = "last", snapshot_at: list[tuple[int, ...]] | None = None) -> ForwardBatch:
        """Assemble a batch from (new_token_ids, context, block_table, state_slot) per sequence.

        `logits` is "last" (one row per sequence), "all" (every row) or "none".
        """
        ids, pos, seqs, rows = [], [], [], []
        start = 0
        for i, (tokens, context, table, slot) in enumerate(chunks):
            tokens = np.asarray(tokens, dtype=np.int64)
            n = int(tokens.shape[0])
            if n <= 0:
                raise ValueError("every sequence chunk needs at least one token")
            table = np.asarray(table, dtype=np.int32)
            if table.shape[0] * page_size < context + n:
                raise ValueError(f"block table of {table.shape[0]} pages cannot hold {context + n} tokens")
            snaps = tuple(snapshot_at[i]) if snapshot_at else ()
            seqs.append(SeqChunk(start, n, context, table, slot, snaps))
            ids.append(tokens)
            pos.append(np.arange(context, context + n, dtype=np.int64))
            if logits == "all":
                rows.extend(range(start, start + n))
            elif logits == "last":
                rows.append(start + n - 1)
            start += n
        positions = np.concatenate(pos) if pos else np.zeros(0, np.int64)
        batch = cls(np.concatenate(ids) if ids else np.zeros(0, np.int64), positions, seqs,
                    np.asarray(rows, dtype=np.int64), page_size)
        batch.slot_mapping = batch.compute_slot_mapping()
        return batch

    def compute_slot_mapping(self) -> np.ndarray:
        """Flat KV slot (page * page_size + offset) of every row."""
        out = np.empty(self.num_tokens, dtype=np.int64)
        for s in self.seqs:
            p = np.arange(s.context, s.total, dtype=np.int64)
            out[s.start:s.end] = s.block_table[p // self.page_size].astype(np.int64) * self.page_size + p % self.page_size
        return out

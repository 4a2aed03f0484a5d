"""Engine and cache configuration (dataclasses) and the user-facing presets.

`EngineConfig` is what the in-process engine needs; the serve app's pydantic config maps onto it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from decapybara.errors import ConfigError

PREFILL_POLICIES = ("balanced", "decode-priority", "prefill-priority")
KV_MODES = ("16/16", "8/8", "6/6", "6/4", "4/4")
MIN_CONTEXT = 16  # the least max_model_len the server serves (and `decapybara plan --context` takes)
DEMO_MODEL = Path(__file__).resolve().parent / "assets" / "demo.mcapy"  # the embedded default model
RAM_CACHE_GB = 8.0  # the RAM tier's default budget (the server's ram_cache_gb, the planner's --ram-gb)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Knobs of one engine (one model on one device)."""

    max_slots: int = 12  # conversations decoding together (CONVERSATIONS, 1-12)
    page_size: int = 16  # tokens per KV page (512 on a GPU, as the original; small on the CPU)
    num_pages: int = 512  # pages in the KV pool
    max_batch_tokens: int = 256  # token budget of one step (prefill chunks + decodes)
    prefill_policy: str = "balanced"
    balanced_prefill_share: float = 0.5  # balanced: share of the budget prefill may take while others decode
    enable_prefix_cache: bool = True
    kv_mode: str | None = None  # None = float32 pages (numpy reference); "16/16", "8/8", "6/6", "6/4", "4/4"
    # host bytes of hybrid-state snapshots kept for prefix reuse; None: room for two a slot (the latest page
    # boundary and the finished turn's end of each conversation; 3.8 GB for a 27B model's 157 MB state at 12
    # slots), at least 64 MiB (`snapshot_budget`)
    snapshot_budget_bytes: int | None = None
    snapshot_interval: int = 256  # tokens between hybrid-state snapshots (rounded up to whole pages)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0  # seeds requests that bring none, so a whole run is reproducible
    loop_guard: str = "stop"  # stop | end_thinking | escape | off
    stream_interval: int = 1  # emit events every n tokens (1 = every token)
    context_mode: str = "pool"  # pool: one shared KV pool, pauses under pressure | fixed: whole context reserved
    # Decode steps as CUDA graphs (backends with graph support, i.e. cupy; ignored elsewhere). Graph padding
    # rows need one KV page (the pool's last) and one DeltaNet state slot of their own: with graphs on, the
    # engine hands out num_pages - 1 pages and the state pool has max_slots + 1 slots.
    cuda_graphs: bool = True
    # With cuda_graphs on, eager steps of 9-256 rows (a prompt chunk, alone or beside decode rows) replay each
    # layer's tail (output projection, norms, MLP, the next layer's input products) as a CUDA graph per row bucket
    # (decapybara/backend/piecewise.py); the attention and DeltaNet cores stay eager
    piecewise_graphs: bool = True
    # With cuda_graphs on, decode graphs run each layer's tail (its one-n-tile products, up to 8 rows) as
    # persistent product chains, one launch a run of products (decapybara/backend/chain_tails.py); off: on an
    # H200 a chain ran a layer's products 1.2x slower than their launches (docs/perf.md, fiftieth session)
    product_chains: bool = False
    # Speculative decoding: "mtp" drafts each decoding sequence's next token with the model's MTP head and verifies
    # it as a second row of the sequence's decode (a token gained where it matches what is sampled; outputs as
    # without speculation); "off". Models without an MTP head ignore it. On CUDA graphs, a step with drafts
    # replays a verification graph (1 + the most drafts rows a sequence). "ngram": prompt lookup (engine/ngram.py), the token that
    # followed the latest earlier occurrence of the last three tokens, any model (a two-token match: a guess for the
    # spare rows of spec_fill).
    speculator: str = "off"
    # ... a draft only where the MTP head's probability of its guess is at least this (on the demo model, guesses
    # under 0.3 were accepted 21-25% of the time, over 0.5 67-100%; docs/perf.md)
    spec_min_confidence: float = 0.3
    # ... in a decode step that verifies some draft through a verification graph, the other sequences' guesses
    # under spec_min_confidence are verified too: their second rows are computed anyway (throwaway rows
    # otherwise), so a guess costs at most its rollback
    spec_fill: bool = True
    # ... drafts verified only at the step widths (numbers of decoding sequences) where the steps that verify them
    # are measured to emit more tokens a second than those that do not (engine/spec_governor.py): a verification
    # row costs as any row, and on a GPU twelve agents' verification step can cost twice their decode step
    spec_adaptive: bool = True
    # ... at most this many drafts a sequence and step (DRAFT_LEN), verified as that many more rows of its decode
    # (1 + draft_len rows): ngram the tokens after the match, mtp the head's guesses chained (each guess paired with
    # the head's own hidden state for the next) while the product of their probabilities stays at
    # spec_min_confidence; with CUDA graphs a step of decodes alone at most what a verification graph of its
    # sequences takes (DecodeGraphRunner.max_drafts: up to 7, a hybrid model's bounded by its rollback checkpoints,
    # n sequences x drafts <= the largest graph bucket; a step of more would run eagerly, several times slower:
    # Engine._draft_cap), a step beside a prompt's chunk, eager anyway, every draft; 0 drafts nothing
    draft_len: int = 1
    # ... the MTP head guesses among the token ids below this (rounded up to a multiple of 16; a byte-level BPE
    # vocabulary lists its most frequent merges first) and the tokenizer's eos and markup tokens: its LM head pass
    # reads those rows of the head's weight alone (at 27B, 32,768 of 248,320: ~0.13 of a bf16 head's 2.5 GB a
    # guess); 0: the whole vocabulary. Drafts never change what is sampled, so this moves only which drafts are
    # made (another token past it is never drafted) and the head's confidence (its softmax over those ids)
    draft_vocab: int = 32768

    def __post_init__(self) -> None:
        if not 1 <= self.max_slots <= 12:
            raise ConfigError(f"max_slots must be in 1..12, got {self.max_slots}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages < 2:
            raise ConfigError("num_pages must be >= 2")
        if self.max_batch_tokens < self.max_slots:
            raise ConfigError("max_batch_tokens must be >= max_slots (every slot decodes one token per step)")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ConfigError(f"prefill_policy must be one of {PREFILL_POLICIES}, got {self.prefill_policy!r}")
        if not 0 < self.balanced_prefill_share <= 1:
            raise ConfigError("balanced_prefill_share must be in (0, 1]")
        if self.kv_mode not in (None, "32/32") + KV_MODES:
            raise ConfigError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if self.snapshot_interval < 1:
            raise ConfigError("snapshot_interval must be >= 1")
        if self.context_mode not in ("pool", "fixed"):
            raise ConfigError(f"context_mode must be pool or fixed, got {self.context_mode!r}")
        if not 0.0 <= self.spec_min_confidence <= 1.0:
            raise ConfigError("spec_min_confidence must be in [0, 1]")
        if self.draft_vocab < 0:
            raise ConfigError(f"draft_vocab must be >= 0, got {self.draft_vocab}")
        if not 0 <= self.draft_len <= 7:
            raise ConfigError(f"draft_len must be in 0..7, got {self.draft_len}")
        if self.speculator not in ("mtp", "ngram", "off"):
            raise ConfigError(f"speculator must be mtp, ngram or off, got {self.speculator!r}")
        if self.loop_guard not in ("stop", "end_thinking", "escape", "off"):
            raise ConfigError(f"loop_guard must be stop, end_thinking, escape or off, got {self.loop_guard!r}")

    @property
    def snapshot_every(self) -> int:
        """Snapshot spacing in tokens: `snapshot_interval` rounded up to a whole number of pages."""
        return max(self.page_size, -(-self.snapshot_interval // self.page_size) * self.page_size)

    def snapshot_budget(self, state_bytes: int) -> int:
        """The snapshot budget for a model whose sequences hold `state_bytes` of hybrid state."""
        if self.snapshot_budget_bytes is not None:
            return self.snapshot_budget_bytes
        return max(64 << 20, 2 * self.max_slots * state_bytes)

    def replace(self, **kw) -> EngineConfig:
        return dataclasses.replace(self, **kw)


@dataclass(slots=True, frozen=True)
class Preset:
    """A user-facing preset of the original launcher."""

    name: str
    conversations: int
    kv_mode: str
    activations: str
    context: int
    notes: str = ""
    extra: dict = field(default_factory=dict)


PRESETS = {
    "max_efficiency": Preset("max_efficiency", 8, "4/4", "fp8", 1_048_576, "YaRN context extension"),
    "medium": Preset("medium", 4, "6/4", "fp8", 262_144),
    "max_quality": Preset("max_quality", 1, "6/6", "bf16", 262_144),
}

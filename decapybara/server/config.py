"""The app's configuration, validated at the edge (pydantic): what `serve run serve_app:build_app k=v ...`,
`decapybara serve` and tests pass in. `AppConfig.engine_config(...)` maps it onto the engine's dataclass."""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from decapybara.config import DEMO_MODEL, KV_MODES, MIN_CONTEXT, PRESETS, RAM_CACHE_GB, EngineConfig
from decapybara.errors import ConfigError

__all__ = ["DEMO_MODEL", "AppConfig", "ContextPlan"]

ONE_MILLION = 1_048_576  # rope_scaling=1m: YaRN up to this many tokens


class ContextPlan(NamedTuple):
    """`AppConfig.context_plan`: `yarn_to` the context YaRN extends the model to (None: its trained rope),
    `max_model_len` the engine's (None: the model config's)."""

    yarn_to: int | None
    max_model_len: int | None


class AppConfig(BaseModel):
    """Server settings. Values arrive as strings from `serve run ... key=value`; pydantic coerces them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(default=str(DEMO_MODEL), description="path or fsspec URL of a .mcapy file, or the name of one "
                       "in the model folders ($DECAPYBARA_MODELS, ~/.cache/decapybara/models, the current folder; "
                       "`decapybara models` lists them)")
    served_model_name: str = Field(default="decapybara", description="the model's id in /v1/models (requests may "
                                   "name any model: this server serves its one)")
    preset: Literal["max_efficiency", "medium", "max_quality"] | None = Field(
        default=None, description="the launcher's presets: max_efficiency (8 conversations, KV 4/4, 1,048,576 tokens "
        "by YaRN), medium (4, KV 6/4, 262,144), max_quality (1, KV 6/6, 262,144): their conversations as slots, KV mode "
        "and context; settings given beside one win")
    slots: int = Field(default=12, ge=1, le=12, description="conversations decoding together (CONVERSATIONS)")
    kv_mode: str | None = Field(default=None, description="KV bits K/V: 16/16, 8/8, 6/6, 6/4, 4/4")
    page_size: int | None = Field(default=None, description="tokens per KV page (default 512 on GPU, 16 on CPU)")
    num_pages: int | None = Field(default=None, ge=2, description="KV pool pages (default: on CUDA what the free "
                                  "device memory holds beside keep_free_gb; 4096 on the CPU)")
    kv_memory_gb: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="KV pool size (instead of num_pages)")
    keep_free_gb: float = Field(default=0.0, ge=0, allow_inf_nan=False, description="KEEP_FREE: device memory (GiB) the server leaves "
                                "to other programs when it sizes the KV pool from the free memory (CUDA)")
    max_batch_tokens: int | None = Field(default=None, ge=1, description="tokens a step computes at most: a "
                                         "prompt's chunk beside the decoding agents (default 2048 on CUDA, 256 on "
                                         "the CPU; at least slots)")
    max_model_len: int | None = Field(default=None, ge=MIN_CONTEXT, description="the longest context a conversation has "
                                      "(default the model's, or the preset's context, or 1,048,576 under "
                                      "rope_scaling=1m; a KV pool that holds fewer tokens shortens it)")
    rope_scaling: Literal["auto", "off", "1m"] = Field(
        default="auto", description="ROPE_SCALING: auto extends the model's trained context with YaRN where "
        "max_model_len (or the preset's context) asks for more; 1m extends it to 1,048,576 tokens; off keeps the "
        "trained context (a longer max_model_len is then refused)")
    prefill_policy: Literal["balanced", "decode-priority", "prefill-priority"] = Field(
        default="balanced", description="PREFILL_POLICY: balanced (a prompt's chunk takes at most "
        "balanced_prefill_share of a step's max_batch_tokens beside decoding agents), decode-priority (the decoding "
        "agents' tokens first, a prompt's chunk the rest of the step), prefill-priority (a prompt's chunk first: "
        "agents decode in what it leaves)")
    balanced_prefill_share: float = Field(default=0.5, gt=0, le=1, description="balanced: the share of "
                                          "max_batch_tokens a prompt's chunks may take while others decode")
    loop_guard: Literal["stop", "end_thinking", "escape", "off"] = Field(
        default="stop", description="LOOP_GUARD: an agent that repeats itself gets a rising repetition penalty, and "
        "where the loop goes on: stop (the reply ends, saying why), end_thinking (a loop in its reasoning closes the "
        "reasoning so that it answers; elsewhere stop) or escape (the tokens that continued the loop are banned for a "
        "few tokens, a few times, then stop); off")
    context_mode: Literal["pool", "fixed"] = Field(default="pool", description="CONTEXT_MODE: shared pool or "
                                                   "a fixed reservation of the whole context per conversation")
    api_key: str | None = Field(default=None, description="required as Bearer / x-api-key when set")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="where the model runs: auto (a CUDA "
                                                   "device where CuPy finds one, else the CPU), cpu or cuda")
    ram_cache_gb: float = Field(default=RAM_CACHE_GB, ge=0, allow_inf_nan=False, description="RAM tier budget (RAM_CACHE)")
    disk_cache: str = Field(default="~/.cache/decapybara/kv", description="disk tier fsspec URL (DISK_CACHE)")
    disk_cache_gb: float = Field(default=64.0, ge=0, allow_inf_nan=False, description="disk tier budget (servers sharing its folder "
                                 "share the smallest of theirs; 0: no disk tier)")
    snapshot_memory_gb: float | None = Field(default=None, ge=0, allow_inf_nan=False, description="host memory for the prefix cache's "
                                             "hybrid-state snapshots (default: two states a slot, at least 64 MiB;"
                                             " 0: none taken)")
    idle_timeout_s: float = Field(default=1200.0, gt=0, description="a conversation idle this long is finished")
    save_cache_s: float = Field(default=20.0, ge=0, description="seconds a graceful stop may spend saving the "
                                "prefix cache to the disk tier, which the next server on it restores (0: none)")
    responses_store_mb: float = Field(default=64.0, ge=0, allow_inf_nan=False, description="memory for the Responses API's stored "
                                      "responses (previous_response_id, GET /v1/responses/{id}), in the scheduler "
                                      "actor, counted as their JSON text; the least recently used dropped past it "
                                      "(0: none stored); saved with the prefix cache at a graceful stop")
    responses_flush_s: float = Field(default=1.0, ge=0, description="seconds between writes of the stored "
                                     "responses' changes to the disk tier's folder (a journal), so that a crash "
                                     "loses at most this long's; where a graceful stop saves them (0: only then)")
    max_ongoing_requests: int = Field(default=512, ge=1, description="requests an ingress replica takes at "
                                      "once (Ray Serve's max_ongoing_requests; past it, requests queue)")
    ingress_replicas: int = Field(default=1, ge=1, description="Ray Serve replicas of the HTTP ingress (they share "
                                  "one scheduler and GPU actor)")
    cuda_graphs: bool = Field(default=True, description="decode steps as CUDA graphs (CUDA backend only)")
    piecewise_graphs: bool = Field(default=True, description="eager steps of 9-256 rows replay each layer's tail "
                                   "(projections, norms, MLP, the next layer's input products) as a CUDA graph "
                                   "(CUDA backend, cuda_graphs on)")
    product_chains: bool = Field(default=False, description="decode graphs run each layer's run of skinny products"
                                 " (up to 8 rows) as one persistent launch (CUDA backend, cuda_graphs on)")
    speculator: Literal["mtp", "ngram", "off"] = Field(
        default="off", description="SPECULATOR: mtp drafts each agent's next token with the model's MTP head and "
        "verifies it as a second row of its decode (the same outputs; a token gained per accepted draft; more drafts "
        "a step: draft_len); ngram: the draft is the token that followed the latest earlier occurrence of the agent's "
        "last three tokens (prompt lookup, any model); off")
    spec_min_confidence: float = Field(
        default=0.3, ge=0, le=1, description="speculator=mtp: draft only where the MTP head gives its guess at least "
        "this probability (confidence scheduling; a doubted guess is seldom accepted and its row costs as any)")
    spec_fill: bool = Field(
        default=True, description="speculator=mtp or ngram on CUDA graphs: a decode step that verifies a draft through a "
        "verification graph verifies the other agents' doubtful guesses too (their second rows are computed anyway)")
    spec_adaptive: bool = Field(
        default=True, description="speculator=mtp or ngram: verify drafts only at the numbers of decoding agents where "
        "steps that verify them are measured to emit more tokens a second than steps that do not (each choice tried "
        "again now and then)")
    draft_len: int = Field(
        default=1, ge=0, le=7, description="DRAFT_LEN: speculator=mtp or ngram: the most tokens an agent drafts a step, "
        "verified as as many more rows of its decode (ngram: the tokens after the match; mtp: the head's guesses "
        "chained while the product of their probabilities stays at spec_min_confidence); with CUDA graphs a step of "
        "decodes alone at most what a verification graph takes (up to 7; on a hybrid model agents x drafts <= the "
        "largest graph bucket, its rollback checkpoints), a step beside a prompt's chunk, eager anyway, every draft; "
        "0 drafts nothing")
    draft_vocab: int = Field(
        default=32768, ge=0, description="speculator=mtp: the MTP head guesses among the token ids below this (a BPE "
        "vocabulary's most frequent first), so each guess reads those rows of the LM head alone (a 27B's bf16 head: "
        "0.34 of 2.5 GB); drafts never change the outputs; 0: the whole vocabulary")
    prefill_weights: Literal["packed", "bf16"] = Field(
        default="packed", description="bf16: quantised product weights also kept as bf16 on the GPU (2 bytes a "
        "weight) so that products of 33+ rows (prompt chunks, mixed steps) run cuBLAS on them (CUDA backend only; `decapybara plan "
        "--prefill-weights bf16` counts it)")
    blas_threads: int = Field(default=0, ge=0, description="BLAS threads in the GPU actor (0 = cores - 1)")
    seed: int = Field(default=0, description="seeds the requests that bring none, in their order of arrival (a run "
                      "with the same requests in the same order draws the same tokens on the CPU)")
    name: str = Field(default="decapybara", description="prefix of the named actors of this app")

    @field_validator("kv_mode")
    @classmethod
    def _kv_mode(cls, v: str | None) -> str | None:
        if v is not None and v not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}")
        return v

    @field_validator("page_size")
    @classmethod
    def _page_size(cls, v: int | None) -> int | None:
        if v is not None and (v < 1 or v & (v - 1)):
            raise ValueError(f"page_size must be a power of two, got {v}")
        return v

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():  # e.g. --api-key "$KEY" with KEY unset: never silently open
            raise ValueError("api_key is empty: leave it out to serve without a key")
        return v

    def saves_cache(self) -> bool:
        """Whether a graceful stop saves the prefix cache (and the stored responses) to the disk tier's folder, and
        a start reads back what one saved: `save_cache_s` and both tiers on."""
        return self.save_cache_s > 0 and self.ram_cache_gb > 0 and self.disk_cache_gb > 0

    def use_cuda(self) -> bool:
        if self.device == "cpu":
            return False
        try:
            import cupy  # noqa: F401
            from cupy.cuda import runtime

            has = runtime.getDeviceCount() > 0
        except Exception:  # noqa: BLE001 - no CuPy, driver or device: the CPU backend
            has = False
        if self.device == "cuda" and not has:
            raise ValueError("device=cuda but no CUDA device / CuPy is available")
        return has

    def context_plan(self, trained: int) -> ContextPlan:
        """How long a context the model serves, for a file whose config serves `trained` tokens (its
        `max_position_embeddings`; `with_yarn` takes the factor from the rope's original context where the file
        already extends it): the YaRN extension (`with_yarn`'s target, None for none) and the engine's
        `max_model_len` (None: the model's own context). The context asked for is the explicit `max_model_len`,
        else the preset's: `auto` extends to it where it is longer than `trained`; `1m` extends to 1,048,576
        tokens whatever the preset says; `off` extends nothing and caps the preset's context at `trained`.
        ConfigError where an explicit `max_model_len` is longer than `off` or `1m` allow."""
        preset = PRESETS.get(self.preset) if self.preset else None
        want = self.max_model_len or (preset.context if preset else None)
        if self.rope_scaling == "1m":
            ctx = max(ONE_MILLION, trained)
            if self.max_model_len and self.max_model_len > ctx:
                raise ConfigError(f"max_model_len {self.max_model_len} exceeds the {ctx} tokens of rope_scaling=1m")
            return ContextPlan(ctx, self.max_model_len or ctx)
        if self.rope_scaling == "off":
            if self.max_model_len and self.max_model_len > trained:
                raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's trained context of "
                                  f"{trained} tokens with rope_scaling=off (auto or 1m extend it with YaRN)")
            return ContextPlan(None, min(want, trained) if want else None)
        if want and want > trained:
            return ContextPlan(want, want)
        return ContextPlan(None, want)

    def engine_config(self, cuda: bool, kv_bytes_per_page: int | None = None,
                      max_model_len: int | None = None) -> EngineConfig:
        """The engine's knobs: preset values first, explicit settings over them, device-aware defaults;
        `max_model_len` (`context_plan`'s) over the setting's."""
        preset = PRESETS.get(self.preset) if self.preset else None
        slots = self.slots if "slots" in self.model_fields_set or preset is None else preset.conversations
        kv_mode = self.kv_mode or (preset.kv_mode if preset else ("16/16" if cuda else None))
        page = self.page_size or (512 if cuda else 16)
        pages = self.num_pages
        if pages is None and self.kv_memory_gb and kv_bytes_per_page:
            pages = max(2, int(self.kv_memory_gb * 2**30 // kv_bytes_per_page))
        pages = pages or (4096 if not cuda else 512)
        batch = self.max_batch_tokens or (2048 if cuda else 256)
        return EngineConfig(max_slots=slots, page_size=page, num_pages=pages, max_batch_tokens=max(batch, slots),
                            prefill_policy=self.prefill_policy, balanced_prefill_share=self.balanced_prefill_share,
                            kv_mode=kv_mode, max_model_len=max_model_len or self.max_model_len,
                            seed=self.seed, loop_guard=self.loop_guard, context_mode=self.context_mode,
                            cuda_graphs=self.cuda_graphs, piecewise_graphs=self.piecewise_graphs,
                            product_chains=self.product_chains, speculator=self.speculator,
                            spec_min_confidence=self.spec_min_confidence, spec_fill=self.spec_fill,
                            spec_adaptive=self.spec_adaptive, draft_len=self.draft_len,
                            draft_vocab=self.draft_vocab,
                            snapshot_budget_bytes=None if self.snapshot_memory_gb is None
                            else int(self.snapshot_memory_gb * 2**30))

    def resolved_model(self) -> str:
        """The model's path or URL: a bare name is looked up in the model folders (launcher/discover.py)."""
        from decapybara.launcher.discover import resolve

        return resolve(self.model)

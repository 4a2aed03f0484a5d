"""Capacity planner: what fits in device memory, how long each conversation's context can be, how many paused
conversations the RAM tier holds, and the bandwidth roofline of a decode step, for a model and its settings.

Pure arithmetic over a `ModelConfig` (no device needed): the per-token KV bytes come from the KV codec's own
page parts, the per-conversation DeltaNet state from `ModelConfig.state_bytes_per_sequence`, so the plan is
the allocation the backends make (tests/test_launcher.py checks both against real caches). Measured inputs
(device memory, copy bandwidth) are arguments; `decapybara.launcher.probe` measures them.

The decode roofline is an upper bound: a step reads every weight the forward uses (not the embedding table, of
which it gathers a row per sequence, nor the MTP head; of a MoE layer's experts, the share the step's tokens
are expected to route to under uniform top-k routing), each sequence's KV in the decoder layers, and reads
and writes each sequence's DeltaNet state, all at the copy bandwidth (bench/gpu.py's roofline counts the same
bytes). docs/perf.md ("Where things stand") says how close the CUDA backend gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from decapybara.backend.kv_codec import kv_bytes_per_token
from decapybara.model.config import ModelConfig
from decapybara.model.weights import keeps_prefill_copy

GIB = 1 << 30
# activations, logits, CUDA-graph pools (the piecewise tails' ~1.1 GiB for the 27B over packed weights) and their
# cuBLAS workspaces (32 MiB a stream), and allocator slack beside weights and KV
MIN_RESERVE = 2 * GIB
RESERVE_SHARE = 0.05  # ... or this share of the device, whichever is larger


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """One setting's memory budget and what it buys. Byte counts are exact allocations but `reserve`."""

    kv_mode: str
    slots: int
    page_size: int
    device_bytes: int
    weight_bytes: int
    reserve_bytes: int
    state_bytes: int  # the state pool: slots + 1 (the CUDA graphs' padding slot)
    kv_token_bytes: int
    pages: int  # KV pages that fit beside weights, states and the reserve (0: does not fit)
    ram_bytes: int
    context: int  # the context each conversation is planned for
    max_context: int  # the model's position limit
    keep_free_bytes: int = 0  # device memory left to other programs (the server's keep_free_gb)
    checkpoints: int = 0  # speculative verification's rollback states, counted in state_bytes

    @property
    def kv_page_bytes(self) -> int:
        return self.kv_token_bytes * self.page_size

    @property
    def tokens(self) -> int:
        """KV tokens the engine can hand out: the pool less one page (CUDA graphs' padding rows own one)."""
        return max(0, self.pages - 1) * self.page_size

    @property
    def context_per_slot(self) -> int:
        """Tokens each of `slots` conversations can hold at once (`context_mode` fixed; the pool mode lends
        unused pages to whoever needs them)."""
        return (max(0, self.pages - 1) // self.slots) * self.page_size

    @property
    def fits(self) -> bool:
        return self.why_not is None

    @property
    def why_not(self) -> str | None:
        if self.pages < 2:
            short = (self.weight_bytes + self.state_bytes + self.reserve_bytes + self.keep_free_bytes
                     + 2 * self.kv_page_bytes - self.device_bytes)
            kept = ", reserve and the memory kept free" if self.keep_free_bytes else " and reserve"
            return f"weights, states{kept} leave no room for KV ({short / GIB:.1f} GiB short)"
        if self.context > self.max_context:
            return f"{self.context:,} tokens is past the model's {self.max_context:,}-token position limit"
        if self.context_per_slot < self.context:
            return (f"{self.slots} conversations get {self.context_per_slot:,} tokens each, "
                    f"{self.context:,} asked")
        return None

    @property
    def snapshot_bytes(self) -> int:
        """Host memory (pinned) that the engine's default budget of hybrid-state snapshots takes for the prefix
        cache: two states a conversation, at least 64 MiB (`EngineConfig.snapshot_budget`); 0 without DeltaNet."""
        from decapybara.config import EngineConfig

        each = self.state_bytes // (self.slots + 1 + self.checkpoints)
        return EngineConfig(max_slots=self.slots).snapshot_budget(each) if each else 0

    @property
    def paused_in_ram(self) -> int:
        """Paused conversations of `context` tokens (KV + state) the RAM tier holds."""
        each = self.context * self.kv_token_bytes + self.state_bytes // (self.slots + 1 + self.checkpoints)
        return self.ram_bytes // each if each else 0


def default_reserve(device_bytes: int) -> int:
    """The server's working reserve on a device of `device_bytes`: max(2 GiB, 5% of it)."""
    return max(MIN_RESERVE, int(RESERVE_SHARE * device_bytes))


def plan_capacity(cfg: ModelConfig, weight_bytes: int, device_bytes: int, kv_mode: str, slots: int,
                  context: int, page_size: int = 512, ram_bytes: int = 0,
                  reserve_bytes: int | None = None, keep_free_bytes: int = 0, checkpoints: int = 0) -> CapacityPlan:
    """The KV pool that fits on a device of `device_bytes` beside `weight_bytes` of weights, the state pool
    of `slots` conversations (+ `checkpoints`: speculative verification's rollback states), a reserve (default `default_reserve`) and `keep_free_bytes` left to other programs
    (the server's keep_free_gb). Raises ValueError on impossible settings (no slots, non-positive sizes)."""
    if slots < 1 or page_size < 1 or context < 1:
        raise ValueError(f"slots, page_size and context must be >= 1 (got {slots}, {page_size}, {context})")
    if device_bytes <= 0 or weight_bytes < 0 or ram_bytes < 0 or keep_free_bytes < 0:
        raise ValueError("device memory must be positive, weight, RAM and kept-free bytes non-negative")
    reserve = default_reserve(device_bytes) if reserve_bytes is None else reserve_bytes
    token = kv_bytes_per_token(cfg, kv_mode)
    states = cfg.state_bytes_per_sequence() * (slots + 1 + max(0, checkpoints))
    free = device_bytes - weight_bytes - states - reserve - keep_free_bytes
    pages = max(0, free // (token * page_size)) if token else 0
    return CapacityPlan(kv_mode, slots, page_size, device_bytes, weight_bytes, reserve, states, token, int(pages),
                        ram_bytes, context, cfg.max_position_embeddings, keep_free_bytes,
                        max(0, checkpoints))


@dataclass(frozen=True, slots=True)
class PoolFit:
    """`fit_pool`'s choice of a server's KV pool on a device whose memory it measured after loading the weights."""

    pages: int  # the pool: min(by_memory, cap); < 2 where nothing fits
    by_memory: int  # pages the free memory holds beside the states, the reserve and keep_free
    cap: int  # pages worth holding: every slot's whole context twice over, the graphs' padding page included
    page_bytes: int
    free_bytes: int  # device memory free when measured
    state_bytes: int
    reserve_bytes: int
    keep_free_bytes: int

    @property
    def fits(self) -> bool:
        return self.pages >= 2

    def why_not(self) -> str:
        """What a pool of fewer than two pages is short of (for the server's refusal)."""
        need = self.state_bytes + self.reserve_bytes + self.keep_free_bytes + 2 * self.page_bytes
        return (f"{self.free_bytes / GIB:.2f} GiB of device memory is free after the weights; the DeltaNet states "
                f"({self.state_bytes / GIB:.2f} GiB), the working reserve ({self.reserve_bytes / GIB:.2f} GiB), "
                f"keep_free ({self.keep_free_bytes / GIB:.2f} GiB) and two KV pages ({2 * self.page_bytes / GIB:.2f}"
                f" GiB) need {need / GIB:.2f} GiB")


def fit_pool(cfg: ModelConfig, free_bytes: int, device_bytes: int, kv_mode: str | None, slots: int, page_size: int,
             max_model_len: int, keep_free_bytes: int = 0, reserve_bytes: int | None = None,
             checkpoints: int = 0) -> PoolFit:
    """The KV pool a server takes when none is asked for: with `free_bytes` of the device's `device_bytes` free
    after the weights loaded, the pages left once the state pool of `slots` conversations (+1: the graphs'
    padding slot; + `checkpoints`: the states speculative verification graphs keep as rollback points), the
    working reserve (`default_reserve`: activations, graph pools, workspaces, allocator slack)
    and `keep_free_bytes` (left to other programs) are set aside; at most `cap` pages, which hold every slot's
    whole `max_model_len` twice over (the prefix cache's room), so that a small model does not take the device.
    The arithmetic of `plan_capacity` on measured rather than planned free memory."""
    if slots < 1 or page_size < 1 or max_model_len < 1:
        raise ValueError(f"slots, page_size and max_model_len must be >= 1 (got {slots}, {page_size}, "
                         f"{max_model_len})")
    if free_bytes < 0 or device_bytes <= 0 or keep_free_bytes < 0:
        raise ValueError("device memory must be positive, free and kept-free bytes non-negative")
    reserve = default_reserve(device_bytes) if reserve_bytes is None else reserve_bytes
    page = kv_bytes_per_token(cfg, kv_mode) * page_size
    states = cfg.state_bytes_per_sequence() * (slots + 1 + max(0, checkpoints))
    room = free_bytes - states - reserve - keep_free_bytes
    by_memory = max(0, room // page) if page else 0
    cap = 2 * slots * -(-max_model_len // page_size) + 1
    return PoolFit(int(min(by_memory, cap)), int(by_memory), cap, page, free_bytes, states, reserve, keep_free_bytes)


def routed_share(cfg: ModelConfig, sequences: int) -> float:
    """Expected share of a MoE layer's experts that `sequences` tokens route to (uniform top-k): 1 - (1 - k/E)^n;
    1 for dense models."""
    if not cfg.num_experts:
        return 1.0
    return 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** sequences


def streamed_weight_bytes(cfg: ModelConfig, tensor_bytes: dict[str, int], sequences: int = 1) -> float:
    """Weight bytes a decode step of `sequences` tokens reads (see the module docstring), from the bytes of
    each tensor as stored (`tensor_bytes`: name -> bytes)."""
    share = routed_share(cfg, sequences)
    total = 0.0
    for name, nbytes in tensor_bytes.items():
        if name.startswith("mtp.") or (name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings):
            continue
        total += nbytes * share if ".experts." in name else nbytes
    return total


def decode_roofline(cfg: ModelConfig, tensor_bytes: dict[str, int], kv_mode: str, contexts: list[int],
                    bandwidth: float) -> float:
    """Upper bound on decode tokens/s for sequences at `contexts` (one token each per step) at `bandwidth`
    bytes/s: bytes one step must move (weights, KV read, DeltaNet state read and written) / bandwidth."""
    if bandwidth <= 0 or not contexts:
        raise ValueError("bandwidth must be positive and at least one sequence given")
    step = (streamed_weight_bytes(cfg, tensor_bytes, len(contexts))
            + sum(contexts) * kv_bytes_per_token(cfg, kv_mode, include_mtp=False)
            + 2 * len(contexts) * cfg.state_bytes_per_sequence())
    return len(contexts) * bandwidth / step


def preset_tensor_bytes(cfg: ModelConfig, preset: str) -> dict[str, int]:
    """Bytes of every tensor of `cfg` stored under weight preset `preset` (`decapybara build --weights`)."""
    from decapybara.builder.quant_formats import storage_format
    from decapybara.model.quant.blocks import format_nbytes
    from decapybara.model.weights import expected_tensors

    return {name: format_nbytes(storage_format(preset, name, shape, cfg), shape)
            for name, shape in expected_tensors(cfg).items()}


def dense_prefill_bytes(shapes: dict[str, tuple[int, ...]], tensor_bytes: dict[str, int]) -> int:
    """Device bytes the server's `prefill_weights=bf16` adds: the bf16 values (2 bytes a weight) of every
    quantised 2-D product weight (`keeps_prefill_copy`, stored in fewer than 2 bytes a weight; the CUDA
    backend's `PackedWeightsMixin.dense_prefill`). `shapes` and `tensor_bytes` by the model's tensor names (a
    file's: `cli_plan.logical_tensors`)."""
    return sum(2 * math.prod(shape) for name, shape in shapes.items()
               if keeps_prefill_copy(name) and len(shape) == 2 and tensor_bytes.get(name, 0) < 2 * math.prod(shape))


def float32_tensor_bytes(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """What the numpy backend holds: every tensor expanded to float32."""
    return {name: 4 * math.prod(shape) for name, shape in shapes.items()}

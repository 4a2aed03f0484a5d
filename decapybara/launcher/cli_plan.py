"""`decapybara plan`: what fits on this machine, what each setting costs in quality, and the serve command.

    decapybara plan                                  # the embedded demo model on this machine
    decapybara plan model.mcapy --slots 12 --context 32768
    decapybara plan --config qwen3.8-27b --vram-gb 141 --bandwidth-gbps 4200 --slots 12 --context 32768

For each candidate (KV mode; with --config or a file's quality table, weight preset x KV mode): the KV pool
that fits beside weights, DeltaNet states and a reserve, the context each of `--slots` conversations gets, the
paused conversations the RAM tier holds, the decode roofline at 1 and `--slots` streams of `--context` tokens
(an upper bound, launcher/capacity.py) and, from the .mcapy quality table, KL and top-1 against bf16 weights
with bf16 KV. Device memory and bandwidth are measured here (launcher/probe.py) unless given.
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass
from typing import Any

from decapybara.config import DEMO_MODEL, KV_MODES, MIN_CONTEXT, RAM_CACHE_GB
from decapybara.errors import ConfigError
from decapybara.launcher.capacity import (
    GIB,
    CapacityPlan,
    decode_roofline,
    default_reserve,
    dense_prefill_bytes,
    float32_tensor_bytes,
    plan_capacity,
    preset_tensor_bytes,
)
from decapybara.model.config import ModelConfig, with_yarn


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="what fits on this machine, what each setting costs, the serve command")
    p.add_argument("model", nargs="?", help=".mcapy path, fsspec URL or the name of a model in the model folders "
                   "(`decapybara models`; default: the embedded demo model)")
    p.add_argument("--config", help="a named model shape instead of a file (qwen3.8-27b, qwen3.8-35b-a3b)")
    p.add_argument("--weights", help="weight preset(s) of --config, comma-separated (default: all)")
    p.add_argument("--kv-mode", dest="kv_mode", help=f"one KV mode ({', '.join(KV_MODES)}; default: all)")
    p.add_argument("--slots", type=int, default=12, help="conversations decoding together (1-12)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens each conversation should hold (default: the model's trained context, at most 32768)")
    p.add_argument("--page-size", dest="page_size", type=int, default=None,
                   help="tokens per KV page (default: 512 on CUDA, 16 on the CPU, as the server)")
    p.add_argument("--vram-gb", dest="vram_gb", type=float, help="device memory in GiB (default: measured)")
    p.add_argument("--ram-gb", dest="ram_gb", type=float, default=None,
                   help=f"RAM tier budget in GiB (default: the server's ram_cache_gb, {RAM_CACHE_GB:g})")
    p.add_argument("--bandwidth-gbps", dest="bandwidth", type=float,
                   help="copy bandwidth in GB/s, read + write (default: measured by the probe)")
    p.add_argument("--prefill-weights", dest="prefill_weights", choices=("packed", "bf16"), default="packed",
                   help="bf16: also hold the quantised product weights as bf16 on the GPU (the server's "
                        "prefill_weights=bf16: steps of 33+ rows run cuBLAS on them), counted here")
    p.add_argument("--keep-free-gb", dest="keep_free_gb", type=float, default=0.0,
                   help="device memory in GiB left to other programs (the server's keep_free_gb), planned out "
                        "of the KV pool")
    p.add_argument("--speculator", choices=("off", "mtp", "ngram"), default="off",
                   help="the server's speculator: on CUDA a hybrid model's verification graphs keep a rollback "
                        "state a conversation of their largest bucket, planned out of the KV pool")
    p.set_defaults(func=cmd_plan)


@dataclass(frozen=True, slots=True)
class Candidate:
    weights: str  # preset name, or the file's own weights
    stored_bytes: int  # as built (the file's size of weights)
    kv_mode: str
    plan: CapacityPlan  # its weight_bytes: what the backend holds (float32 on the numpy backend; + dense copies)
    tok_s_1: float
    tok_s_n: float
    kl: float | None = None
    top1: float | None = None


def candidates(cfg: ModelConfig, weights: dict[str, dict[str, int]], stored: dict[str, int], kv_modes: list[str],
               slots: int, context: int, page_size: int, device_bytes: int, ram_bytes: int, bandwidth: float,
               quality: dict[tuple[str, str], tuple[float, float]] | None = None,
               extra: dict[str, int] | None = None, keep_free: int = 0, checkpoints: int = 0,
               reserve: int | None = None) -> list[Candidate]:
    """Every (weights, KV mode) setting planned: `weights` maps a setting to the bytes of each tensor as the
    backend holds them, `extra` to further resident bytes that decode does not read (the prefill weights' bf16
    copies), `keep_free` device bytes left to other programs, `checkpoints` verification rollback states, `reserve`
    the working reserve (None: `default_reserve` of `device_bytes`). Capacity, roofline at 1 and `slots` streams of `context` tokens (0 when `bandwidth` is 0), quality
    where the table has the pair."""
    out = []
    for name, tensors in weights.items():
        resident = sum(tensors.values()) + (extra or {}).get(name, 0)
        for mode in kv_modes:
            plan = plan_capacity(cfg, resident, device_bytes, mode, slots, context, page_size, ram_bytes,
                                 reserve_bytes=reserve, keep_free_bytes=keep_free, checkpoints=checkpoints)
            t1 = decode_roofline(cfg, tensors, mode, [context], bandwidth) if bandwidth > 0 else 0.0
            tn = decode_roofline(cfg, tensors, mode, [context] * slots, bandwidth) if bandwidth > 0 else 0.0
            q = (quality or {}).get((name, mode))
            out.append(Candidate(name, stored[name], mode, plan, t1, tn, *(q or (None, None))))
    return out


def format_table(rows: list[Candidate], slots: int, context: int) -> list[str]:
    head = ["weights", "size", "kv", "KB/token", "pool tokens", f"ctx x {slots}", f"fits {context:,}",
            "paused in RAM", "roof tok/s 1", f"roof tok/s {slots}", "kl", "top1"]
    cells = [head]
    for c in rows:
        p = c.plan
        cells.append([c.weights, f"{c.stored_bytes / GIB:.2f} GiB", c.kv_mode, f"{p.kv_token_bytes / 1024:.1f}",
                      f"{p.tokens:,}", f"{p.context_per_slot:,}", "yes" if p.fits else "no",
                      f"{p.paused_in_ram:,}", f"{c.tok_s_1:.0f}" if c.tok_s_1 else "-",
                      f"{c.tok_s_n:.0f}" if c.tok_s_n else "-", "-" if c.kl is None else f"{c.kl:.4g}",
                      "-" if c.top1 is None else f"{c.top1:.2f}%"])
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))
            for r in cells]


def serve_command(model: str | None, c: Candidate, ram_gb: float | None = None, prefill_weights: str = "packed",
                  max_model_len: int | None = None, speculator: str = "off") -> str:
    """The `decapybara serve` line for a candidate: its exact pool (num_pages) and page size; `max_model_len`
    where the plan serves a context past the model's trained one (YaRN, the server's rope_scaling auto); the
    speculator whose rollback states the pool was planned beside. A shell command: the model's path quoted."""
    parts = ["decapybara serve"] + ([f"--model {shlex.quote(model)}"] if model else [])
    parts += [f"--slots {c.plan.slots}", f"--kv-mode {c.kv_mode}", f"--set num_pages={c.plan.pages}",
              f"--set page_size={c.plan.page_size}"]
    if max_model_len:
        parts.append(f"--max-model-len {max_model_len}")
    if prefill_weights != "packed":
        parts.append(f"--set prefill_weights={prefill_weights}")
    if ram_gb is not None:
        parts.append(f"--ram-cache-gb {ram_gb:g}")
    if speculator != "off":
        parts.append(f"--speculator {speculator}")
    return " ".join(parts)


def logical_tensors(entries: dict[str, Any]) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """({tensor: bytes}, {tensor: shape}) of a .mcapy directory by the model's tensor names: a quantised
    tensor's parts (``name:codes``, ``:scales``, ``:tensor_scale``) summed under ``name``, shaped as its codes'
    `quant` says (the shape of the values, not of the codes)."""
    nbytes: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in entries.items():
        base, sep, _ = name.rpartition(":")
        base = base if sep else name
        nbytes[base] = nbytes.get(base, 0) + int(t.nbytes)
        if not sep:
            shapes[base] = tuple(t.shape)
        elif t.quant and "shape" in t.quant:
            shapes[base] = tuple(int(v) for v in t.quant["shape"])
    return nbytes, shapes


Quality = dict[tuple[str, str], tuple[float, float]]  # (weights, kv mode) -> (KL, top-1 %)


def quality_at(by_context: dict[int, Quality], context: int) -> tuple[int | None, Quality]:
    """The quality table's rows that speak for conversations of `context` tokens: (the context they were
    measured at, their (weights, kv) -> (KL, top-1)). The table's shortest context is the trained one (its YaRN
    rows measure longer ones, decapybara/builder/quality.py): rows there for a context within it; past it, the
    shortest measured context that covers it (YaRN's factor, and the loss, grow with it), else (None, {})."""
    if not by_context:
        return None, {}
    trained = min(by_context)
    if context <= trained:
        return trained, by_context[trained]
    covering = [c for c in by_context if c >= context]
    return (min(covering), by_context[min(covering)]) if covering else (None, {})


def _file_inputs(path: str) -> tuple[ModelConfig, dict[str, dict[str, int]], dict[str, tuple[int, ...]],
                                     dict[int, Quality], str]:
    """(config, {weights: {tensor: bytes}} for this file and the presets its quality table measured, tensor
    shapes, quality by context (the trained one and the YaRN rows') and (weights, kv), this file's weights
    name)."""
    from decapybara.builder import load_config
    from decapybara.builder.quant_formats import WEIGHT_PRESETS
    from decapybara.mcapy import McapyFile

    with McapyFile.open(path) as f:
        cfg = load_config(f)
        own_tensors, shapes = logical_tensors(f.tensors)
        meta = f.metadata
    fmt = str((meta.get("weights") or {}).get("format", "file"))
    weights = {fmt: own_tensors}
    quality: dict[int, Quality] = {}
    table = (meta.get("sections") or {}).get("quality")
    rows = table.get("rows") if isinstance(table, dict) else None
    if isinstance(rows, list) and rows:
        for r in rows:
            name = str(r["weights"])
            if name == fmt or name in WEIGHT_PRESETS:
                if name not in weights:
                    weights[name] = preset_tensor_bytes(cfg, name)
                quality.setdefault(int(r["context"]), {})[(name, str(r["kv_mode"]))] = (float(r["kl"]),
                                                                                       float(r["top1"]))
    return cfg, weights, shapes, quality, fmt


def cmd_plan(args: argparse.Namespace) -> int:
    from decapybara.launcher.probe import this_machine

    _check_args(args)
    own = None
    by_context: dict[int, Quality] = {}
    if args.config:
        cfg, weights, shapes = _config_inputs(args.config, args.weights)
        model = None
    else:
        from decapybara.launcher.discover import resolve

        model = resolve(args.model) if args.model else str(DEMO_MODEL)
        if args.weights:
            raise ConfigError("--weights picks presets of --config; a file has its own weights")
        cfg, weights, shapes, by_context, own = _file_inputs(model)
    trained = cfg.max_position_embeddings
    if args.context is None:  # the server's default: the trained context (here at most 32k, a planning size)
        args.context = min(32768, trained)
    extend = args.context if args.context > trained else None  # served with YaRN (the server's rope_scaling auto)
    if extend:
        cfg = with_yarn(cfg, extend)
    measured_at, quality = quality_at(by_context, args.context)
    machine = this_machine(measure=args.bandwidth is None)
    on_gpu = machine.device.startswith("cuda") or args.vram_gb is not None
    ram = int((args.ram_gb if args.ram_gb is not None else RAM_CACHE_GB) * GIB)
    reserve = None  # default_reserve(device_bytes)
    if args.vram_gb:
        device_bytes, source = int(args.vram_gb * GIB), "given"
    elif on_gpu:  # the server's reserve is a share of the device's memory, not of what is free
        device_bytes, source = machine.free_bytes, "free"
        reserve = default_reserve(machine.memory_bytes)
    else:  # the numpy backend's KV pool shares host RAM with the RAM tier
        device_bytes, source = max(1, machine.free_bytes - ram), "available RAM less the RAM tier"
    stored = {name: sum(t.values()) for name, t in weights.items()}
    if not on_gpu:  # the numpy backend holds every weight as float32
        weights = {name: float32_tensor_bytes(shapes) for name in weights}
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else machine.bandwidth
    page = args.page_size or (512 if on_gpu else 16)
    modes = [args.kv_mode] if args.kv_mode else list(KV_MODES)
    dense = args.prefill_weights == "bf16" and on_gpu  # the numpy backend keeps no copies
    extra = {name: dense_prefill_bytes(shapes, t) for name, t in weights.items()} if dense else None
    keep_free = int(args.keep_free_gb * GIB)
    checkpoints = 0
    if on_gpu:  # as the server sets them aside (server/engine_setup.verify_checkpoints)
        from decapybara.config import EngineConfig
        from decapybara.server.engine_setup import verify_checkpoints

        checkpoints = verify_checkpoints(EngineConfig(max_slots=args.slots, max_batch_tokens=max(512, args.slots),
                                                      speculator=args.speculator), cfg)
    rows = candidates(cfg, weights, stored, modes, args.slots, args.context, page, device_bytes, ram, bandwidth,
                      quality, extra, keep_free, checkpoints, reserve)
    print(f"model: {args.config or model}: {cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"{len(cfg.attention_layers)} with KV, {len(cfg.linear_layers)} DeltaNet, "
          f"{trained:,}-token positions")
    if extend:
        measured = (f"; kl / top1 measured with YaRN at {measured_at:,} tokens" if measured_at else
                    "; kl / top1 not measured with YaRN at this context (the file's quality table: decapybara info)"
                    if by_context else "")
        print(f"context: {extend:,} tokens is past the model's {trained:,}: served with YaRN x{cfg.rope.factor:.4g} "
              f"(the server's rope_scaling auto, --max-model-len {extend}){measured}")
    bw = (f"{bandwidth / 1e9:.0f} GB/s ({'given' if args.bandwidth else 'measured'})" if bandwidth > 0
          else "not measured")
    print(f"machine: {machine.device}, {device_bytes / GIB:.1f} GiB ({source}), copy bandwidth {bw}; "
          f"RAM tier {ram / GIB:.1f} GiB; pages of {page} tokens"
          + ("" if on_gpu else "; weights held as float32 by the numpy backend"))
    if extra:
        print("prefill weights in bf16: " + ", ".join(f"{n} +{_size(b)}" for n, b in extra.items())
              + " of device memory (steps of 33+ rows run cuBLAS on them, not the 4-bit kernels)")
    snaps = rows[0].plan.snapshot_bytes
    print(f"plan: {args.slots} conversations of {args.context:,} tokens; reserve "
          f"{rows[0].plan.reserve_bytes / GIB:.1f} GiB for activations; "
          + (f"{keep_free / GIB:.1f} GiB kept free for other programs; " if keep_free else "")
          + (f"{checkpoints} rollback states for speculative verification "
             f"({checkpoints * cfg.state_bytes_per_sequence() / GIB:.1f} GiB) in the state pool; " if checkpoints else "")
          + (f"{snaps / GIB:.1f} GiB of host memory for prefix-cache state snapshots; " if snaps else "")
          + "roofline = bytes a decode step moves / bandwidth (an upper bound; docs/perf.md has measured fractions)")
    for line in format_table(rows, args.slots, args.context):
        print(line)
    pick = [c for c in rows if c.plan.fits]
    if not pick:
        print(f"nothing fits: {rows[0].plan.why_not}")
        return 0
    if any(c.top1 is not None for c in pick):
        best = max(pick, key=lambda c: (c.top1 if c.top1 is not None else -1.0, c.stored_bytes))
        print(f"best quality that fits (top-1 against bf16): {best.weights} weights, {best.kv_mode} KV")
    else:
        # KV_MODES runs from the most bits to the fewest (bytes a token can rank 8/8 above 16/16 at small heads,
        # whose microscaling factors weigh more). Weights past bf16 gain nothing measurable: among those, and on
        # ties, the file's own weights (no rebuild)
        bf16 = next((c.stored_bytes for c in rows if c.weights == "bf16"), None)
        best = max(pick, key=lambda c: (c.stored_bytes if bf16 is None else min(c.stored_bytes, bf16),
                                        -KV_MODES.index(c.kv_mode) if c.kv_mode in KV_MODES else 1,
                                        c.weights == own))
        why = "not measured at this context" if by_context else "no quality table measured"
        print(f"most bits that fit ({why}): {best.weights} weights, {best.kv_mode} KV")
    pw = "bf16" if extra and extra.get(best.weights) else "packed"  # copies only where weights are quantised
    if on_gpu and not dense:
        hint = prefill_weights_hint(cfg, weights, stored, best, args.slots, args.context, page, device_bytes, ram,
                                    shapes, keep_free, checkpoints, reserve)
        if hint:
            print(hint)
    line = serve_command(None, best, args.ram_gb, pw, extend, args.speculator)
    if args.config:
        print(f"run: `decapybara build SRC OUT --weights {best.weights}`, then {line.replace('serve', 'serve --model OUT', 1)}")
    elif best.weights == own:
        print(f"run: {serve_command(args.model, best, args.ram_gb, pw, extend, args.speculator)}")
    else:
        print(f"run: rebuild with `--weights {best.weights}` (this file is {own}), then serve it with "
              f"{line[len('decapybara serve '):]}")
    return 0


def prefill_weights_hint(cfg: ModelConfig, weights: dict[str, dict[str, int]], stored: dict[str, int], best: Candidate,
                         slots: int, context: int, page: int, device_bytes: int, ram: int,
                         shapes: dict[str, tuple[int, ...]], keep_free: int = 0, checkpoints: int = 0,
                         reserve: int | None = None) -> str | None:
    """What `prefill_weights=bf16` would cost the chosen setting (the bf16 copies of its quantised product weights)
    and whether the plan still fits with them; None where its weights are not quantised (no copies to keep)."""
    extra = dense_prefill_bytes(shapes, weights[best.weights])
    if not extra:
        return None
    with_copies = candidates(cfg, {best.weights: weights[best.weights]}, stored, [best.kv_mode], slots, context, page,
                             device_bytes, ram, 0.0, None, {best.weights: extra}, keep_free, checkpoints,
                             reserve)[0].plan
    cost = f"bf16 prefill weights (--prefill-weights bf16) would take {_size(extra)} of device memory"
    if not with_copies.fits:
        return f"{cost}: the plan would not fit with them ({with_copies.why_not})"
    return (f"{cost}; the plan still fits with them (KV pool {best.plan.tokens:,} -> {with_copies.tokens:,} tokens): "
            "products of 33+ rows (prompt chunks, steps beside other agents' decode rows) then run cuBLAS on bf16, "
            "~1.5x less GPU time for chunks of 32-256 tokens on an H200 (docs/perf.md, thirtieth session)")


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _check_args(args: argparse.Namespace) -> None:
    if args.model and args.config:
        raise ConfigError("give a model file or --config, not both")
    if args.kv_mode is not None and args.kv_mode not in KV_MODES:
        raise ConfigError(f"--kv-mode must be one of {', '.join(KV_MODES)}")
    if not 1 <= args.slots <= 12:
        raise ConfigError("--slots must be between 1 and 12")
    if args.context is not None and args.context < MIN_CONTEXT:
        raise ConfigError(f"--context must be >= {MIN_CONTEXT} (the server's least max_model_len)")
    if args.page_size is not None and (args.page_size < 1 or args.page_size & (args.page_size - 1)):
        raise ConfigError("--page-size must be a power of two")
    for name, flag, low in (("vram_gb", "--vram-gb", False), ("ram_gb", "--ram-gb", True),
                            ("bandwidth", "--bandwidth-gbps", False), ("keep_free_gb", "--keep-free-gb", True)):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and (v >= 0 if low else v > 0)):
            raise ConfigError(f"{flag} must be a finite number {'>= 0' if low else '> 0'}")


def _config_inputs(name: str, presets: str | None) -> tuple[ModelConfig, dict[str, dict[str, int]],
                                                             dict[str, tuple[int, ...]]]:
    from decapybara.builder.quant_formats import WEIGHT_PRESETS
    from decapybara.model.config import NAMED_CONFIGS, named_config
    from decapybara.model.weights import expected_tensors

    if name not in NAMED_CONFIGS:
        raise ConfigError(f"--config must be one of {', '.join(NAMED_CONFIGS)}")
    cfg = named_config(name)
    chosen = [p.strip() for p in presets.split(",")] if presets else [p for p in WEIGHT_PRESETS if p != "fp32"]
    bad = [p for p in chosen if p not in WEIGHT_PRESETS]
    if bad:
        raise ConfigError(f"unknown weight preset(s) {bad}; one of {', '.join(WEIGHT_PRESETS)}")
    return cfg, {p: preset_tensor_bytes(cfg, p) for p in chosen}, dict(expected_tensors(cfg))

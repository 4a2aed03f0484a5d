"""One build of one or more weight presets, with optional GPTQ calibration and the quality table.

`build_presets` reads the float source once, collects calibration Hessians (if asked), measures the quality of
every preset x KV mode from the float source (if asked), then writes each requested preset's .mcapy with the
same ``sections.quality`` table. The quantised tensors measured are the ones written (one shared `Quantizer`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decapybara.builder.build import BuildResult, build
from decapybara.builder.calibrate import DEFAULT_WINDOW, Calibration, collect_hessians, read_tokens
from decapybara.builder.quality import default_candidates, measure_quality
from decapybara.builder.quant_formats import (
    QUANT_PRESETS,
    WEIGHT_PRESETS,
    PresetFormat,
    Quantizer,
    read_source,
)
from decapybara.errors import ConfigError


@dataclass(slots=True, frozen=True)
class PresetBuildOptions:
    """What to measure besides writing: calibration (GPTQ) and quality. Token files: see `read_tokens`."""

    calib: str | Path | None = None  # calibration token file (e.g. the training split)
    calib_tokens: int = 4096
    gptq: bool | None = None  # None: GPTQ whenever calibration tokens are given
    quality: str | Path | None = None  # held-out token file
    quality_tokens: int = 8192
    window: int = DEFAULT_WINDOW
    seed: int = 0
    contexts: tuple[int, ...] | None = None  # YaRN contexts of the table (None: `default_contexts`)


def _log(msg: str, verbose: bool) -> None:
    if verbose:
        print(msg, file=sys.stderr, flush=True)


def prepare_quantizer(cfg: Any, source: Mapping[str, Any], opts: PresetBuildOptions,
                      verbose: bool = False) -> tuple[Quantizer, Calibration | None]:
    """The shared quantizer: GPTQ under Hessians from `opts.calib` when asked, else round-to-nearest."""
    gptq = opts.gptq if opts.gptq is not None else opts.calib is not None
    if gptq and opts.calib is None:
        raise ConfigError("GPTQ needs calibration tokens (--calib TOKENS_FILE)")
    if not gptq:
        return Quantizer(), None
    _log(f"calibrating on {opts.calib_tokens:,} tokens of {opts.calib} ...", verbose)
    cal = collect_hessians(cfg, source, read_tokens(opts.calib), opts.calib_tokens, opts.window, opts.seed)
    return Quantizer(cal.hessians), cal


def build_presets(src: str | Path, outs: Mapping[str, str | Path], opts: PresetBuildOptions | None = None, *,
                  progress: bool | None = None, verbose: bool = False) -> list[BuildResult]:
    """Write `outs[preset]` for every preset in `outs` (keys from WEIGHT_PRESETS) from the HF folder `src`.

    With `opts.quality`, every file gets the same ``sections.quality`` table (`measure_quality` over
    `opts.quality_tokens` held-out tokens, seed `opts.seed`). Raises ConfigError / WeightError before writing."""
    opts = opts or PresetBuildOptions()
    unknown = [p for p in outs if p not in WEIGHT_PRESETS]
    if unknown:
        raise ConfigError(f"unknown weight preset(s) {unknown}; known: {', '.join(WEIGHT_PRESETS)}")
    quantizer, cal, sections = Quantizer(), None, {}
    needs_source = opts.quality is not None or opts.calib is not None or opts.gptq
    if needs_source:
        cfg, source = read_source(src)
        quantizer, cal = prepare_quantizer(cfg, source, opts, verbose)
        if opts.quality is not None:
            held = read_tokens(opts.quality)
            cands = default_candidates(cfg, opts.contexts)
            _log(f"measuring quality: {len(cands)} configurations x {opts.quality_tokens:,} tokens ...", verbose)
            sections["quality"] = measure_quality(
                cfg, source, held, num_tokens=opts.quality_tokens, window=opts.window, seed=opts.seed,
                candidates=cands, quantizer=quantizer,
                progress=(lambda i, n: _log(f"  window {i}/{n}", verbose)) if verbose else None)
        del source
    results = []
    for preset, out in outs.items():
        fmt: Any = preset
        if preset in QUANT_PRESETS:
            fmt = PresetFormat(preset, quantizer, calibration=cal.describe() if cal is not None else None)
        results.append(build(src, out, fmt, progress=progress, sections=sections))
    return results


def preset_outputs(out: str | Path, weights: str, presets: Iterable[str] = WEIGHT_PRESETS) -> dict[str, Path]:
    """``--weights all``: OUT is a folder receiving ``{preset}.mcapy`` for every preset; else {weights: OUT}."""
    if weights != "all":
        return {weights: Path(out)}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    return {p: folder / f"{p}.mcapy" for p in presets}

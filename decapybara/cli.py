"""The `decapybara` command: `build SRC OUT` converts a HF folder to .mcapy, `info FILE` describes one, `models`
lists the ones in the model folders, `serve` runs the server, `plan` says what fits on this machine and what each
setting costs.

Errors a user can cause (bad checkpoint, corrupt file) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from decapybara.errors import ConfigError, DecapybaraError


def _cmd_build(args: argparse.Namespace) -> int:
    from decapybara.builder.preset_build import PresetBuildOptions, build_presets, preset_outputs
    from decapybara.builder.progress import human_bytes

    if args.weights and args.dtype and args.weights != args.dtype:
        raise ConfigError(f"--dtype {args.dtype} and --weights {args.weights} disagree (--dtype is --weights bf16|fp32)")
    weights = args.weights or args.dtype or "bf16"
    if args.seed < 0:  # it seeds numpy's generator, which takes none below 0
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    outs = preset_outputs(args.out, weights)
    existing = [str(p) for p in outs.values() if p.exists()]
    if existing and not args.force:
        print(f"decapybara: error: {', '.join(existing)} exists (pass --force to replace it)", file=sys.stderr)
        return 2
    try:
        contexts = tuple(int(c) for c in args.quality_contexts.split(",") if c.strip()) \
            if args.quality_contexts is not None else None
    except ValueError:
        raise ConfigError(f"--quality-contexts expects token counts like 262144,1048576, got "
                          f"{args.quality_contexts!r}") from None
    opts = PresetBuildOptions(calib=args.calib, calib_tokens=args.calib_tokens, gptq=args.gptq,
                              quality=args.quality, quality_tokens=args.quality_tokens, window=args.window,
                              seed=args.seed, contexts=contexts)
    folders = {p.parent for p in outs.values()}
    missing = sorted(str(f) for f in folders if not f.is_dir())
    if missing:
        raise ConfigError(f"output folder {', '.join(missing)} does not exist")
    t0 = time.monotonic()
    results = build_presets(args.src, outs, opts, progress=args.progress, verbose=True)
    for note in results[0].notes:
        print(f"note: {note}", file=sys.stderr)
    for preset, r in zip(outs, results, strict=True):
        print(f"wrote {r.path}: {r.num_tensors} tensors, {human_bytes(r.nbytes)} ({preset}) in {r.seconds:.1f}s")
    total = time.monotonic() - t0
    if total > sum(r.seconds for r in results) + 0.5:  # calibration / quality measurement before the writes
        print(f"done in {total:.1f}s (calibration and quality measurement included)")
    return 0


def _model_summary(cfg: Any) -> list[str]:
    from decapybara.model.config import param_count

    lines = [f"{cfg.model_type}: {cfg.num_hidden_layers} layers"
             + (f" ({len(cfg.linear_layers)} DeltaNet + {len(cfg.attention_layers)} full attention)"
                if cfg.is_hybrid else ""),
             (f"hidden {cfg.hidden_size}, heads {cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv x "
              f"{cfg.head_dim}, vocab {cfg.vocab_size}, context {cfg.max_position_embeddings}")]
    if cfg.is_moe:
        lines.append(f"experts {cfg.num_experts} (top {cfg.num_experts_per_tok}, {cfg.moe_intermediate_size} wide)"
                     + (f", shared expert {cfg.shared_expert_intermediate_size}"
                        if cfg.shared_expert_intermediate_size else ""))
    else:
        lines.append(f"MLP {cfg.intermediate_size}")
    lines.append(f"MTP layers {cfg.mtp_num_hidden_layers}, parameters {param_count(cfg) / 1e6:.2f}M")
    return lines


def format_table(rows: Any) -> list[str]:
    """A list of row objects (or a dict of them) as aligned text columns; anything else as JSON."""
    if isinstance(rows, dict) and all(isinstance(v, dict) for v in rows.values()):
        rows = [{"name": k, **v} for k, v in rows.items()]
    if not (isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows)):
        return [json.dumps(rows)]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(c) for c in cols]] + [["" if r.get(c) is None else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def _cmd_info(args: argparse.Namespace) -> int:
    from decapybara.builder import load_config
    from decapybara.builder.progress import human_bytes
    from decapybara.launcher.discover import resolve
    from decapybara.mcapy import McapyFile

    args.file = resolve(args.file)  # a name from the model folders (`decapybara models`), as plan and serve take
    with McapyFile.open(args.file) as f:
        if args.verify:
            f.verify()
        h, meta = f.header, f.metadata
        print(f"file: {args.file}" + (" (verified)" if args.verify else ""))
        print("header: " + ", ".join(f"{k}={getattr(h, k)}" for k in h.__slots__))
        total = sum(t.nbytes for t in f.tensors.values())
        dtypes = sorted({t.dtype for t in f.tensors.values()})
        print(f"tensors: {len(f.tensors)}, {human_bytes(total)} ({', '.join(dtypes) or 'none'})")
        if "model_config" in meta:
            for line in _model_summary(load_config(f)):
                print(f"model: {line}")
        if isinstance(meta.get("weights"), dict):
            print("weights: " + ", ".join(f"{k}={v}" for k, v in meta["weights"].items()))
        special = meta.get("special_tokens") or {}
        if "tokenizer" in meta:
            print(f"tokenizer: {human_bytes(len(meta['tokenizer'] or ''))} of JSON, chat template: "
                  f"{'yes' if meta.get('chat_template') else 'no'}, eos: {special.get('eos_token')} "
                  f"{special.get('eos_token_ids')}")
        for note in (meta.get("builder") or {}).get("notes") or []:
            print(f"note: {note}")
        quality = (meta.get("sections") or {}).get("quality")
        if quality is not None:
            print("quality:")
            if isinstance(quality, dict) and isinstance(quality.get("rows"), list):
                from decapybara.builder.quality import format_quality

                lines = format_quality(quality)
            else:
                lines = format_table(quality)
            for line in lines:
                print(f"  {line}")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from decapybara.builder.progress import human_bytes
    from decapybara.launcher.discover import discover, search_dirs

    dirs = search_dirs()
    print("model folders (in search order; $DECAPYBARA_MODELS adds more): " + ", ".join(dirs))
    rows = []
    for m in discover(dirs):
        if m.error:
            rows.append({"name": m.name, "error": m.error, "path": m.path})
            continue
        rows.append({"name": m.name, "size": human_bytes(m.size_bytes), "type": m.model_type, "layers": m.layers,
                     "params": f"{m.params / 1e6:.1f}M" if m.params < 1e9 else f"{m.params / 1e9:.2f}B",
                     "weights": m.weights, "context": f"{m.context:,}", "mtp": m.mtp_layers,
                     "top1": "-" if m.top1 is None else f"{m.top1:.2f}%",
                     "kl": "-" if m.kl is None else f"{m.kl:.4g}", "path": m.path})
    cols = ["name", "size", "type", "layers", "params", "weights", "context", "mtp", "top1", "kl"]
    cols += ["error"] * any("error" in r for r in rows) + ["path"]  # whichever row comes first
    for line in format_table([{c: r.get(c) for c in cols} for r in rows]):
        print(line)
    print("top1 / kl: the file's quality table, its own weights against bf16 with bf16 KV. "
          "Serve one by name: decapybara serve --model NAME; plan it: decapybara plan NAME")
    return 0


def make_parser() -> argparse.ArgumentParser:
    from decapybara.builder.quant_formats import WEIGHT_PRESETS

    p = argparse.ArgumentParser(prog="decapybara", description="Decapybara LLM inference server tools.")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="convert a HF checkpoint folder into a .mcapy file")
    b.add_argument("src", help="HF folder: config.json, *.safetensors, tokenizer.json")
    b.add_argument("out", help="the .mcapy file to write (atomically)")
    b.add_argument("--weights", choices=[*WEIGHT_PRESETS, "all"], default=None,
                   help="weight preset: tiny/small/medium/large/xxl (MXFP4/6/8 mixes, docs/quant.md), bf16 "
                        "(default) or fp32; 'all' writes OUT/{preset}.mcapy for every preset (OUT is a folder)")
    b.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="same as --weights bf16|fp32")
    b.add_argument("--calib", metavar="TOKENS_FILE", default=None,
                   help="calibration tokens (.npy, or raw uint16 like train.bin) for GPTQ")
    b.add_argument("--calib-tokens", type=int, default=4096, metavar="N", help="calibration tokens used")
    b.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ for every quantised tensor the calibration reaches (default: on when --calib is given)")
    b.add_argument("--quality", metavar="HELDOUT_TOKENS_FILE", default=None,
                   help="measure KL / top-1 of every preset x KV mode against bf16 + 16/16 KV and store the table")
    b.add_argument("--quality-tokens", type=int, default=8192, metavar="N", help="held-out tokens measured")
    b.add_argument("--quality-contexts", default=None, metavar="N,N",
                   help="YaRN contexts measured (default: the launcher presets' 262144,1048576; '' for none)")
    b.add_argument("--window", type=int, default=512, help="tokens per calibration / quality window")
    b.add_argument("--seed", type=int, default=0, help="seed of the calibration and quality token samples")
    b.add_argument("--force", action="store_true", help="replace OUT if it exists")
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="draw a progress bar (default: when stderr is a terminal)")
    b.set_defaults(func=_cmd_build)
    i = sub.add_parser("info", help="describe a .mcapy file (local path, fsspec URL, or a name `models` lists)")
    i.add_argument("file")
    i.add_argument("--verify", action="store_true", help="check every checksum first")
    i.set_defaults(func=_cmd_info)
    m = sub.add_parser("models", help="list the .mcapy models in the model folders (names for --model / plan)")
    m.set_defaults(func=_cmd_models)
    from decapybara.launcher import cli_plan, cli_settings, download
    from decapybara.server import cli_serve

    cli_serve.add_parser(sub)
    cli_plan.add_parser(sub)
    download.add_parser(sub)
    cli_settings.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except DecapybaraError as e:
        print(f"decapybara: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"decapybara: error: {_os_error_text(e)}", file=sys.stderr)
        return 1


def _os_error_text(e: OSError) -> str:
    """An OSError as one line that says what went wrong: fsspec's file systems raise FileNotFoundError(path), whose
    text is the bare path."""
    if e.strerror is None and isinstance(e, FileNotFoundError):
        return f"no such file: {e}"
    return str(e) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())

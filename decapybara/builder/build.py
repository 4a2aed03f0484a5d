"""HF checkpoint folder -> .mcapy, one tensor (one block) at a time.

`build` checks the whole checkpoint against the config from the shard headers before it writes a byte, then
streams every canonical tensor through the weight format into a `McapyWriter`. On any failure the writer's
temp file is removed and nothing is left at `out`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decapybara import __version__
from decapybara.builder.formats import WeightFormat, resolve_format
from decapybara.builder.hf import HFCheckpoint, SourceTensor, plan_tensors, read_checkpoint
from decapybara.builder.progress import Progress
from decapybara.mcapy import VERSION, McapyWriter


@dataclass(slots=True, frozen=True)
class BuildResult:
    """What `build` wrote: stored tensor count and data bytes, and notes (tensors skipped, MTP dropped...)."""

    path: Path
    num_tensors: int
    nbytes: int
    notes: tuple[str, ...]
    seconds: float


def build_metadata(ckpt: HFCheckpoint, fmt: WeightFormat, sections: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metadata dict of docs/mcapy.md. Holds no paths or times, so equal inputs give equal files."""
    return {
        "format": {"name": "mcapy", "version": VERSION},
        "builder": {"name": "decapybara", "version": __version__, "notes": list(ckpt.notes)},
        "model_config": ckpt.config.to_dict(),
        "hf_config": ckpt.hf_config,
        "generation_config": ckpt.generation_config,
        "tokenizer": ckpt.tokenizer_json,
        "chat_template": ckpt.chat_template,
        "special_tokens": ckpt.special_tokens,
        "weights": fmt.info(),
        "sections": dict(sections or {}),
    }


def build(src: str | Path, out: str | Path, weights: str | WeightFormat = "bf16", *,
          progress: bool | None = None, alignment: int = 256,
          sections: dict[str, Any] | None = None) -> BuildResult:
    """Convert the HF folder `src` into the .mcapy file `out` (replaced atomically if it exists).

    `weights`: "bf16" (default; matrices bf16, vectors f32), "fp32", a size preset ("tiny" ... "xxl",
    round-to-nearest; see decapybara.builder.quant_formats for GPTQ), a registered format name or a
    `WeightFormat`. `progress`: draw a bar on stderr (None: only when stderr is a TTY).
    Raises ConfigError (config, tokenizer, format) or WeightError (tensors) before writing anything.
    """
    t0 = time.monotonic()
    fmt = resolve_format(weights)
    ckpt = read_checkpoint(src)
    try:
        plan = plan_tensors(ckpt)
        prepare = getattr(fmt, "prepare", None)
        if callable(prepare):
            prepare(ckpt.config, plan)
        bar = Progress(sum(t.source_nbytes for t in plan), enabled=progress, title=f"{Path(out).name}")
        count = nbytes = 0
        try:
            with McapyWriter(out, build_metadata(ckpt, fmt, sections), alignment=alignment) as w:
                for tensor in plan:
                    count, nbytes = _write_tensor(w, fmt, tensor, count, nbytes)
                    bar.advance(tensor.source_nbytes, tensor.name)
        finally:
            bar.close()
    finally:
        ckpt.close()
    return BuildResult(Path(out), count, nbytes, tuple(ckpt.notes), time.monotonic() - t0)


def _write_tensor(w: McapyWriter, fmt: WeightFormat, tensor: SourceTensor, count: int,
                  nbytes: int) -> tuple[int, int]:
    for enc in fmt.encode(tensor):
        info = w.add_tensor_chunks(enc.name, enc.dtype, enc.shape, enc.chunks, enc.quant)
        count, nbytes = count + 1, nbytes + info.nbytes
    return count, nbytes

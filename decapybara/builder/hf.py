"""Read a HF checkpoint folder and map its tensors onto the canonical names of `expected_tensors`.

Name mapping:
- ``model.language_model.*`` (multimodal Qwen3.5 checkpoints) -> ``model.*``; the vision tower
  (``model.visual.*``, ``visual.*``) is skipped with a note.
- MoE experts, per expert (``...mlp.experts.{e}.{gate,up,down}_proj.weight``) or fused
  (``...mlp.experts.gate_up_proj`` [E, 2I, H], ``...mlp.experts.down_proj`` [E, H, I]) -> the stacked
  ``...mlp.experts.{gate_proj,up_proj}`` [E, I, H] and ``...mlp.experts.down_proj`` [E, H, I].
- ``mtp.*`` is kept when the config has MTP layers (if the checkpoint has no ``mtp.*`` at all, MTP is
  dropped from the config with a note); a tied ``lm_head.weight`` is skipped.
Anything missing, of the wrong shape, of a non-float dtype, or left over raises `WeightError`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from decapybara.builder.safetensors_io import ST_DTYPES, SafetensorsFile, TensorStore, open_store
from decapybara.dtypes import DTYPES, f32_to_bf16, to_float32
from decapybara.errors import ConfigError, WeightError
from decapybara.model.config import ModelConfig
from decapybara.model.weights import Shape, expected_tensors

_BLOCK = 1 << 23  # elements per converted block (32 MiB of float32)
_FLOAT_SOURCES = ("F32", "F16", "BF16", "F64")
_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
_STACKED = re.compile(r"^(?P<p>.+\.mlp\.experts)\.(?P<w>gate_proj|up_proj|down_proj)$")


@dataclass(slots=True, frozen=True)
class Piece:
    """A C-contiguous part of a source tensor: `key[index][rows[0]:rows[1]]` (each step optional)."""

    file: SafetensorsFile
    key: str
    index: int | None = None
    rows: tuple[int, int] | None = None

    @property
    def dtype(self) -> str:
        return ST_DTYPES[self.file.entries[self.key].dtype]

    def array(self) -> np.ndarray:
        a = self.file.array(self.key)
        if self.index is not None:
            a = a[self.index]
        if self.rows is not None:
            a = a[self.rows[0]:self.rows[1]]
        return a


@dataclass(slots=True, frozen=True)
class SourceTensor:
    """One canonical tensor, assembled lazily: the flattened pieces, in order, are its C-order elements."""

    name: str
    shape: Shape
    pieces: tuple[Piece, ...]

    @property
    def source_nbytes(self) -> int:
        return sum(p.array().nbytes for p in self.pieces)

    def blocks(self, dtype: str) -> Iterator[np.ndarray]:
        """Flat blocks converted to float storage dtype `dtype` (bf16 as uint16, rounded to nearest even)."""
        for p in self.pieces:
            flat, src = p.array().reshape(-1), p.dtype
            for start in range(0, max(flat.size, 1), _BLOCK):
                yield convert(flat[start:start + _BLOCK], src, dtype)

    def float32(self) -> np.ndarray:
        """The whole tensor as a new float32 array (for codecs that need it in one piece)."""
        out = np.empty(self.shape, np.float32)
        flat, pos = out.reshape(-1), 0
        for b in self.blocks("f32"):
            flat[pos:pos + b.size] = b
            pos += b.size
        return out


def convert(data: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Float data stored as `src` -> stored as `dst` (identity when equal; f32 -> bf16 rounds to even)."""
    if src == dst:
        return data
    if dst == "bf16":
        return f32_to_bf16(to_float32(data, src))
    return to_float32(data, src).astype(DTYPES[dst], copy=False)


@dataclass(slots=True)
class HFCheckpoint:
    """The parts of a HF folder the .mcapy keeps. `store` holds open shards: call `close()`."""

    folder: Path
    hf_config: dict[str, Any]
    config: ModelConfig
    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict[str, Any]
    generation_config: dict[str, Any] | None
    store: TensorStore
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.store.close()


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: {what} is not valid JSON ({e})") from None


def read_checkpoint(src: str | Path) -> HFCheckpoint:
    """Read config, tokenizer, chat template and special tokens, and open the safetensors shards."""
    folder = Path(src)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint folder {folder} "
                          + ("is a file: give the folder that holds config.json" if folder.exists() else "does not exist"))
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} has no config.json")
    hf = _read_json(folder / "config.json", "config.json")
    if not isinstance(hf, dict):
        raise ConfigError(f"{folder / 'config.json'} is not a JSON object")
    try:
        cfg = ModelConfig.from_hf(hf)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{folder / 'config.json'}: bad value ({e})") from None
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise ConfigError(f"{tok_path} is missing: the .mcapy embeds the tokenizer, so tokenizer.json is required")
    tokenizer_json = tok_path.read_text(encoding="utf-8")
    tokenizer = _read_json(tok_path, "tokenizer.json")
    tok_cfg = _read_json(folder / "tokenizer_config.json", "tokenizer_config.json") \
        if (folder / "tokenizer_config.json").is_file() else {}
    gen = _read_json(folder / "generation_config.json", "generation_config.json") \
        if (folder / "generation_config.json").is_file() else None
    if not isinstance(tok_cfg, dict) or not isinstance(tokenizer, dict) or not isinstance(gen, dict | None):
        raise ConfigError(f"{folder}: tokenizer.json, tokenizer_config.json and generation_config.json "
                          "must be JSON objects")
    return HFCheckpoint(folder, hf, cfg, tokenizer_json, _chat_template(folder, tok_cfg),
                        _special_tokens(tok_cfg, tokenizer, gen, cfg), gen, open_store(folder))


def _chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json (the "default" one of a list)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        tmpl = _read_json(folder / "chat_template.json", "chat_template.json")
        tmpl = tmpl.get("chat_template") if isinstance(tmpl, dict) else None
    else:
        tmpl = tok_cfg.get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    if tmpl is not None and not isinstance(tmpl, str):
        raise ConfigError(f"{folder}: chat_template must be a string, got {type(tmpl).__name__}")
    return tmpl


def _special_tokens(tok_cfg: dict[str, Any], tokenizer: dict[str, Any], gen: dict[str, Any] | None,
                    cfg: ModelConfig) -> dict[str, Any]:
    """Special token strings, their ids, and `eos_token_ids` (config + generation_config + eos_token)."""
    ids: dict[str, int] = {}
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids.update({k: v for k, v in vocab.items() if isinstance(v, int)})
    for t in tokenizer.get("added_tokens") or []:
        if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int):
            ids[t["content"]] = t["id"]
    out: dict[str, Any] = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = tok_cfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key], out[f"{key}_id"] = value, ids.get(value)
    eos = set(cfg.eos_token_id)
    gen_eos = (gen or {}).get("eos_token_id")
    eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if out.get("eos_token_id") is not None:
        eos.add(out["eos_token_id"])
    out["eos_token_ids"] = sorted(i for i in eos if isinstance(i, int))
    return out


# ---- name mapping ----------------------------------------------------------------------------------------
def _canonical_names(ckpt: HFCheckpoint) -> dict[str, str]:
    """canonical name -> checkpoint name, after prefix mapping and skips (recorded in `ckpt.notes`)."""
    cfg, out, skipped = ckpt.config, {}, {"vision": 0, "mtp": 0}
    for name in ckpt.store.where:
        canon = "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") \
            else name
        if canon.startswith(_VISION_PREFIXES):
            skipped["vision"] += 1
            continue
        if canon.startswith("mtp.") and not cfg.mtp_num_hidden_layers:
            skipped["mtp"] += 1
            continue
        if canon == "lm_head.weight" and cfg.tie_word_embeddings:
            ckpt.notes.append("skipped lm_head.weight: the config ties it to the embeddings")
            continue
        if canon in out:
            raise WeightError(f"checkpoint has both {out[canon]} and {name} (same tensor {canon})")
        out[canon] = name
    if skipped["vision"]:
        ckpt.notes.append(f"skipped {skipped['vision']} vision tower tensors (text model only)")
    if skipped["mtp"]:
        ckpt.notes.append(f"skipped {skipped['mtp']} mtp.* tensors: the config has no mtp_num_hidden_layers")
    if cfg.mtp_num_hidden_layers and not any(c.startswith("mtp.") for c in out):
        ckpt.config = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
        ckpt.notes.append("config has mtp_num_hidden_layers but the checkpoint has no mtp.* tensors: MTP dropped")
    return out


def plan_tensors(ckpt: HFCheckpoint) -> list[SourceTensor]:
    """Every canonical tensor of `ckpt.config`, in `expected_tensors` order, checked against the checkpoint
    headers (no data is read). Raises WeightError listing missing, mis-shaped, non-float or extra tensors."""
    names = _canonical_names(ckpt)
    store, cfg = ckpt.store, ckpt.config
    used: set[str] = set()
    problems: list[str] = []

    def piece(canon: str, shape: Shape, **kw: Any) -> Piece | None:
        name = names.get(canon)
        if name is None:
            problems.append(f"missing tensor {canon} (expected shape {list(shape)})")
            return None
        used.add(canon)
        e = store.entry(name)
        if e.shape != shape:
            problems.append(f"tensor {name} has shape {list(e.shape)}, expected {list(shape)}")
        elif e.dtype not in _FLOAT_SOURCES:
            problems.append(f"tensor {name} has dtype {e.dtype}; only F32/F16/BF16/F64 weights are supported")
        return Piece(store.where[name], name, **kw)

    plan: list[SourceTensor] = []
    for canon, shape in expected_tensors(cfg).items():
        m = _STACKED.match(canon)
        if canon in names or m is None:
            pieces = [piece(canon, shape)]
        elif m["w"] != "down_proj" and f"{m['p']}.gate_up_proj" in names:
            e, inter, h = shape
            half = (0, inter) if m["w"] == "gate_proj" else (inter, 2 * inter)
            fused = piece(f"{m['p']}.gate_up_proj", (e, 2 * inter, h))
            pieces = [None] if fused is None else [dataclasses.replace(fused, index=i, rows=half) for i in range(e)]
        else:
            pieces = [piece(f"{m['p']}.{i}.{m['w']}.weight", shape[1:]) for i in range(shape[0])]
        if all(p is not None for p in pieces):
            plan.append(SourceTensor(canon, shape, tuple(p for p in pieces if p is not None)))
    extra = sorted(names[c] for c in set(names) - used)
    if extra:
        problems.append(f"{len(extra)} unexpected tensor(s) for {cfg.model_type}: {', '.join(extra[:5])}"
                        + (", ..." if len(extra) > 5 else ""))
    problems = list(dict.fromkeys(problems))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightError(f"{ckpt.folder}: " + "; ".join(problems[:5]) + more)
    return plan

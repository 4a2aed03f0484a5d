"""Load a .mcapy file into a `QwenModel` on a backend, with its tokenizer.

Float tensors load as float32 (zero-copy views for f32 on a local file). Quantised weights are stored as
parts ``name:codes``, ``name:scales`` (and ``name:tensor_scale``), the ``:codes`` entry's `quant` dict naming
the block format and logical shape; they load as `QuantTensor`s, which each backend prepares its own way
(the numpy reference dequantises once; the CUDA backend keeps the packed bytes and dequantises in registers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from decapybara.backend.base import Backend
from decapybara.builder.load import load_config
from decapybara.dtypes import FLOAT_DTYPES, to_float32
from decapybara.errors import WeightError
from decapybara.mcapy import McapyFile
from decapybara.model.config import ModelConfig, with_yarn
from decapybara.model.qwen import QwenModel


@dataclass(slots=True)
class LoadedModel:
    model: QwenModel
    tokenizer: Any  # decapybara.tokenizer.Tokenizer
    file: McapyFile
    config: ModelConfig

    @property
    def metadata(self) -> dict[str, Any]:
        return self.file.metadata


def iter_weights(f: McapyFile, verify: bool = True) -> Iterator[tuple[str, Any]]:
    """(canonical name, float32 array or QuantTensor) for every weight in the file."""
    from decapybara.model.quant import FORMATS, QuantTensor

    groups: dict[str, dict[str, Any]] = {}
    for name in f.names():
        info = f.tensors[name]
        if ":" not in name:
            if info.quant is not None:
                raise WeightError(f"tensor {name!r} has quant info but no ':part' suffix")
            if info.dtype not in FLOAT_DTYPES:
                raise WeightError(f"tensor {name!r} is stored as {info.dtype}, not a float dtype")
            yield name, to_float32(f.tensor(name, verify=verify), info.dtype)
            continue
        base, part = name.rsplit(":", 1)
        groups.setdefault(base, {})[part] = name
    for base, parts in groups.items():
        if "codes" not in parts:
            raise WeightError(f"quantised tensor {base!r} has no ':codes' part")
        q = f.tensors[parts["codes"]].quant or {}
        fmt, shape = q.get("format"), q.get("shape")
        if not fmt or shape is None:
            raise WeightError(f"quantised tensor {base!r} lacks its format/shape description")
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise WeightError(f"quantised tensor {base!r}: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise WeightError(f"quantised tensor {base!r}: shape {shape!r} is not a list of integers")
        arrays = {p: f.tensor(n, verify=verify) for p, n in parts.items()}
        yield base, QuantTensor.from_parts(fmt, tuple(shape), arrays)


def load_model(path: str, backend: Backend | None = None, include_mtp: bool = True,
               verify: bool = True, context: Callable[[ModelConfig], int | None] | int | None = None) -> LoadedModel:
    """Open `path` (local path or fsspec URL), build the model on `backend` (numpy by default). `context`, a
    token count or a function of the file's config giving one (None: none), extends the model's trained context
    to it with YaRN (`with_yarn`: no change where it already fits)."""
    from decapybara.backend.numpy_backend import NumpyBackend
    from decapybara.tokenizer import Tokenizer

    f = McapyFile.open(path)
    cfg = load_config(f)
    target = context(cfg) if callable(context) else context
    if target:
        cfg = with_yarn(cfg, target)
    backend = backend or NumpyBackend()
    model = QwenModel.from_tensors(cfg, backend, iter_weights(f, verify), include_mtp=include_mtp)
    h = f.header  # the file's metadata, directory (every tensor's crc32) and data checksums
    model.weights_id = f"{h.metadata_crc32:08x}{h.directory_crc32:08x}{h.data_crc32:08x}"
    meta = f.metadata
    tok_json = meta.get("tokenizer")
    tokenizer = None
    if tok_json:
        # The default eos set (<|im_end|>, <|endoftext|>) is what ChatML checkpoints use.
        tokenizer = Tokenizer.from_json(tok_json, chat_template=meta.get("chat_template"))
    return LoadedModel(model, tokenizer, f, cfg)

"""Model discovery: the .mcapy files a user keeps in the model folders, found by name.

The folders, in order: each entry of `$DECAPYBARA_MODELS` (os.pathsep-separated local folders or fsspec URLs,
`scheme://` kept whole),
then `~/.cache/decapybara/models`, then the current folder. `discover` lists every `*.mcapy` in them (one level,
no recursion), each described from its header and metadata alone (no weights are read), with the embedded demo
model last under the name `demo`. A model's name is its file name without `.mcapy`; `resolve` turns a name into
its path (the first folder that has it wins, as on a shell's PATH), and leaves paths and URLs as they are, so
that `decapybara serve --model NAME`, `serve run ... model=NAME` and `decapybara plan NAME` take either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from decapybara.config import DEMO_MODEL
from decapybara.errors import ConfigError

MODELS_ENV = "DECAPYBARA_MODELS"
HOME_MODELS = "~/.cache/decapybara/models"
DEMO_NAME = "demo"
SUFFIX = ".mcapy"


@dataclass(frozen=True, slots=True)
class FoundModel:
    """One discovered file: what `decapybara models` prints. `error` names why a file could not be read (the other
    fields are then empty)."""

    name: str
    path: str
    size_bytes: int = 0
    model_type: str = ""
    layers: int = 0
    params: int = 0  # text-model parameters (`param_count`)
    weights: str = ""  # the weight format or preset it was built with
    context: int = 0  # trained positions (max_position_embeddings)
    mtp_layers: int = 0
    top1: float | None = None  # its quality table's top-1 against bf16 (its own weights, bf16 KV, trained context)
    kl: float | None = None
    error: str | None = None


def search_dirs(env: Mapping[str, str] | None = None, cwd: str | None = None) -> list[str]:
    """The model folders in search order: `$DECAPYBARA_MODELS`'s entries, the home folder, the current folder
    (each once; folders that do not exist are kept out by `discover`)."""
    env = os.environ if env is None else env
    dirs = [d for d in _split_path_list(env.get(MODELS_ENV, "")) if d.strip()]
    dirs += [HOME_MODELS, cwd or os.getcwd()]
    out: list[str] = []
    for d in dirs:
        d = d.strip() if "://" in d else os.path.abspath(os.path.expanduser(d.strip()))
        if d not in out:
            out.append(d)
    return out


def _split_path_list(value: str) -> list[str]:
    """`value` split on os.pathsep, an fsspec URL's `scheme://` kept whole where os.pathsep is ':'."""
    parts = value.split(os.pathsep)
    out: list[str] = []
    for p in parts:
        if out and os.pathsep == ":" and p.startswith("//") and out[-1].isidentifier():
            out[-1] += ":" + p
        else:
            out.append(p)
    return out


def _listing(folder: str) -> list[str]:
    """The .mcapy files directly in `folder` (local or fsspec), sorted; [] where it does not exist."""
    if "://" in folder:
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(folder)
        except (ImportError, ValueError) as e:  # an unknown protocol, or its package not installed
            raise ConfigError(f"model folder {folder} (${MODELS_ENV}): {e}") from None
        if not fs.isdir(root):
            return []
        return sorted(fs.unstrip_protocol(p) for p in fs.ls(root, detail=False)
                      if p.endswith(SUFFIX) and fs.isfile(p))
    p = Path(folder)
    if not p.is_dir():
        return []
    return sorted(str(f) for f in p.iterdir() if f.name.endswith(SUFFIX) and f.is_file())


def describe(path: str, name: str | None = None) -> FoundModel:
    """A file's FoundModel from its header and metadata (McapyError / OSError / a config the loader refuses become
    `error`)."""
    from decapybara.builder import load_config
    from decapybara.errors import DecapybaraError
    from decapybara.mcapy import McapyFile
    from decapybara.model.config import param_count

    name = name or _stem(path)
    try:
        with McapyFile.open(path) as f:
            cfg = load_config(f)
            meta, size = f.metadata, f.header.file_size
    except (DecapybaraError, OSError, ValueError, KeyError, ImportError) as e:  # ImportError: an fsspec protocol's
        return FoundModel(name, path, error=f"{type(e).__name__}: {e}")          # package is not installed
    winfo = meta.get("weights")
    weights = str(winfo.get("format", "")) if isinstance(winfo, dict) else ""
    top1, kl = _own_quality(meta, weights)
    return FoundModel(name, path, int(size), cfg.model_type, cfg.num_hidden_layers, param_count(cfg), weights,
                      cfg.max_position_embeddings, cfg.mtp_num_hidden_layers, top1, kl)


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _own_quality(meta: dict, weights: str) -> tuple[float | None, float | None]:
    """(top1, kl) of the quality table's row for the file's own weights with 16/16 KV at its smallest context;
    (None, None) where the metadata has no such row with numeric values (an older or foreign file)."""
    sections = meta.get("sections")
    quality = sections.get("quality") if isinstance(sections, dict) else None
    rows = quality.get("rows") if isinstance(quality, dict) else None
    if not isinstance(rows, list):
        return None, None
    own = [r for r in rows if isinstance(r, dict) and r.get("weights") == weights and r.get("kv_mode") == "16/16"
           and _number(r.get("top1")) and _number(r.get("kl")) and _number(r.get("context", 0))]
    if not own:
        return None, None
    r = min(own, key=lambda r: r.get("context", 0))
    return float(r["top1"]), float(r["kl"])


def discover(dirs: list[str] | None = None, include_demo: bool = True) -> list[FoundModel]:
    """Every .mcapy in `dirs` (default `search_dirs()`), folder by folder, then the embedded demo model."""
    found = [describe(path) for folder in (search_dirs() if dirs is None else dirs) for path in _listing(folder)]
    if include_demo:
        found.append(describe(str(DEMO_MODEL), DEMO_NAME))
    return found


def is_name(model: str) -> bool:
    """A bare model name (no folder, URL or .mcapy suffix), to be looked up in the model folders."""
    return bool(model) and "://" not in model and os.sep not in model and "/" not in model \
        and not model.endswith(SUFFIX) and not model.startswith("~")


def resolve(model: str, dirs: list[str] | None = None) -> str:
    """The path of `model`: a path or URL as given (`~` expanded), a name as found in the model folders (the
    first folder that has `<name>.mcapy`), `demo` the embedded model where no folder has one by that name.
    ConfigError where no folder has it (naming the folders searched)."""
    if not is_name(model):
        return model if "://" in model else os.path.expanduser(model)
    if os.path.isfile(model):  # a file of that exact name in the current folder
        return model
    folders = search_dirs() if dirs is None else dirs
    for folder in folders:
        for path in _listing(folder):
            if _stem(path) == model:
                return path
    if model == DEMO_NAME:
        return str(DEMO_MODEL)
    raise ConfigError(f"no model named {model!r} in {', '.join(folders)} (looked for {model}{SUFFIX}; set "
                      f"${MODELS_ENV} to add folders; `decapybara models` lists what is found)")


def _stem(path: str) -> str:
    base = path.rstrip("/").rsplit("/", 1)[-1]
    return base.removesuffix(SUFFIX)

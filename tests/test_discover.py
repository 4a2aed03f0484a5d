"""Model discovery (launcher/discover.py): the .mcapy files in the model folders ($DECAPYBARA_MODELS, the home
folder, the current folder), described from their metadata, found by name by `decapybara models`, `plan NAME`,
`serve --model NAME` and the Serve app, on real files (the demo model copied, a damaged one, an fsspec folder)."""

from __future__ import annotations

import os
import shutil

import fsspec
import numpy as np
import pytest

from decapybara.cli import main
from decapybara.config import DEMO_MODEL
from decapybara.errors import ConfigError
from decapybara.launcher import discover as D


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """Two model folders on $DECAPYBARA_MODELS: `a` holds coder.mcapy and a damaged broken.mcapy, `b` holds its
    own coder.mcapy (shadowed by a's) and tiny.mcapy; a notes.txt and a sub-folder are not models. The current
    folder is an empty third."""
    a, b, cwd = tmp_path / "a", tmp_path / "b", tmp_path / "cwd"
    for d in (a, b, cwd, a / "nested"):
        d.mkdir(parents=True)
    shutil.copy(DEMO_MODEL, a / "coder.mcapy")
    shutil.copy(DEMO_MODEL, b / "coder.mcapy")
    shutil.copy(DEMO_MODEL, b / "tiny.mcapy")
    shutil.copy(DEMO_MODEL, a / "nested" / "deep.mcapy")
    (a / "broken.mcapy").write_bytes(b"MCAPY but not really" * 10)
    (a / "notes.txt").write_text("not a model")
    monkeypatch.setenv(D.MODELS_ENV, f"{a}{os.pathsep}{b}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(cwd)
    return a, b, cwd


def test_search_dirs_in_order_each_once(folders, tmp_path):
    a, b, cwd = folders
    assert D.search_dirs() == [str(a), str(b), str(tmp_path / "home/.cache/decapybara/models"), str(cwd)]
    env = {D.MODELS_ENV: f"memory://m{os.pathsep}{a}{os.pathsep}{a}"}
    assert D.search_dirs(env, cwd=str(a)) == ["memory://m", str(a), os.path.expanduser(D.HOME_MODELS)]


def test_discover_describes_each_file_from_its_metadata(folders):
    a, b, _ = folders
    found = D.discover()
    assert [(m.name, m.path) for m in found] == [
        ("broken", str(a / "broken.mcapy")), ("coder", str(a / "coder.mcapy")),
        ("coder", str(b / "coder.mcapy")), ("tiny", str(b / "tiny.mcapy")), ("demo", str(DEMO_MODEL))]
    broken, coder = found[0], found[1]
    assert broken.error and "McapyError" in broken.error and broken.model_type == ""
    assert coder.error is None and coder.size_bytes == os.path.getsize(DEMO_MODEL)
    assert (coder.model_type, coder.layers, coder.weights, coder.context, coder.mtp_layers) == \
        ("qwen3_5_text", 8, "bf16", 32768, 1)
    assert 9.8e6 < coder.params < 10.0e6  # 8.94M + the MTP layer's 0.98M (docs/perf.md, the demo model)
    assert coder.top1 == 100.0 and coder.kl == 0.0  # its own bf16 weights against bf16
    assert [m.name for m in D.discover(include_demo=False)][-1] == "tiny"


def test_resolve_names_paths_and_urls(folders, tmp_path):
    a, b, cwd = folders
    assert D.resolve("coder") == str(a / "coder.mcapy")  # the first folder that has it
    assert D.resolve("tiny") == str(b / "tiny.mcapy")
    assert D.resolve("demo") == str(DEMO_MODEL)
    assert D.resolve(str(b / "coder.mcapy")) == str(b / "coder.mcapy")  # paths and URLs pass through
    assert D.resolve("memory://x/y.mcapy") == "memory://x/y.mcapy"
    assert D.resolve("~/m.mcapy") == str(tmp_path / "home/m.mcapy")
    with pytest.raises(ConfigError, match=r"no model named 'deep' in .*DECAPYBARA_MODELS"):
        D.resolve("deep")  # one level only
    shutil.copy(DEMO_MODEL, b / "demo.mcapy")  # a folder's own `demo` comes before the embedded one
    assert D.resolve("demo") == str(b / "demo.mcapy")
    shutil.copy(DEMO_MODEL, cwd / "local")  # a file by that exact name in the current folder
    assert D.resolve("local") == "local"


def test_an_fsspec_folder_is_searched_too(monkeypatch):
    fs = fsspec.filesystem("memory")
    with open(DEMO_MODEL, "rb") as f:
        fs.pipe("/models-url/remote.mcapy", f.read())
    try:
        monkeypatch.setenv(D.MODELS_ENV, "memory://models-url")
        path = D.resolve("remote")
        assert path == "memory:///models-url/remote.mcapy"
        m = next(m for m in D.discover() if m.name == "remote")
        assert m.error is None and m.model_type == "qwen3_5_text"
    finally:
        fs.rm("/models-url", recursive=True)


def test_models_command_lists_them(folders, capsys):
    a, b, _ = folders
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"model folders (in search order; $DECAPYBARA_MODELS adds more): {a}, {b}")
    rows = {line.split()[0]: line for line in out.splitlines()[2:] if line and not line.startswith("top1")}
    assert set(rows) == {"broken", "coder", "tiny", "demo"}
    assert "McapyError" in rows["broken"]
    # the damaged file comes first, and the columns keep their order
    assert out.splitlines()[1].split() == ["name", "size", "type", "layers", "params", "weights", "context", "mtp",
                                           "top1", "kl", "error", "path"]
    assert "qwen3_5_text" in rows["tiny"] and "100.00%" in rows["tiny"] and "32,768" in rows["tiny"]


def test_plan_and_serve_take_a_name(folders, capsys):
    from decapybara.server.cli_serve import add_parser, app_args
    from decapybara.server.config import AppConfig
    from decapybara.server.engine_setup import build_engine
    from decapybara.server.ingress import build_app

    a, _, _ = folders
    assert main(["plan", "tiny", "--vram-gb", "8", "--bandwidth-gbps", "20", "--slots", "2", "--context", "1024",
                 "--kv-mode", "16/16"]) == 0
    assert "run: decapybara serve --model tiny" in capsys.readouterr().out
    assert main(["plan", "nosuch", "--vram-gb", "8", "--bandwidth-gbps", "20"]) == 2
    assert "no model named 'nosuch'" in capsys.readouterr().err

    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert app_args(parser.parse_args(["serve", "--model", "tiny"])) == {"model": "tiny"}
    with pytest.raises(ConfigError, match="no model named 'nosuch'"):
        app_args(parser.parse_args(["serve", "--model", "nosuch"]))
    # the Serve app hands its actors the path, found in this process's folders
    app = build_app({"model": "coder"})
    assert app._bound_deployment.init_args[0]["model"] == str(a / "coder.mcapy")
    served = build_engine(AppConfig(device="cpu", model="tiny", slots=1, kv_memory_gb=0.001))
    assert served.engine.model.cfg.model_type == "qwen3_5_text"


def test_unknown_protocols_are_one_line(monkeypatch, capsys):
    """A model folder or file on an fsspec protocol that is unknown (or whose package is missing) is one error line,
    not a traceback: `models` and `plan NAME` through the folder, `info` and `plan` through the file."""
    monkeypatch.setenv(D.MODELS_ENV, "bogus://models")
    assert main(["models"]) == 2
    assert "model folder bogus://models ($DECAPYBARA_MODELS): Protocol not known: bogus" in capsys.readouterr().err
    assert main(["plan", "coder", "--vram-gb", "8", "--bandwidth-gbps", "20"]) == 2
    assert "Protocol not known" in capsys.readouterr().err
    monkeypatch.delenv(D.MODELS_ENV)
    for argv in (["info", "bogus://x.mcapy"], ["plan", "bogus://x.mcapy", "--vram-gb", "8", "--bandwidth-gbps", "20"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err == "decapybara: error: cannot open bogus://x.mcapy: Protocol not known: bogus\n", err
    assert main(["info", "memory:///no-such-model.mcapy"]) == 1
    assert capsys.readouterr().err == "decapybara: error: no such file: /no-such-model.mcapy\n"


@pytest.mark.parametrize("patch", [
    {"sections": {"quality": {"rows": [{"weights": "bf16", "kv_mode": "16/16"}]}}},
    {"sections": {"quality": {"rows": [{"weights": "bf16", "kv_mode": "16/16", "top1": None, "kl": 0.1}]}}},
    {"sections": {"quality": {"rows": [{"weights": "bf16", "kv_mode": "16/16", "top1": "abc", "kl": 0.1}]}}},
    {"sections": {"quality": {"rows": [{"weights": "bf16", "kv_mode": "16/16", "top1": 99, "kl": 0.1,
                                        "context": None}]}}},
    {"sections": "none"},
    {"weights": "bf16"},
])
def test_odd_metadata_is_described_not_raised(tmp_path, patch):
    from decapybara.mcapy import McapyFile, McapyWriter

    with McapyFile.open(str(DEMO_MODEL)) as f:
        meta = {**f.metadata, **patch}
    path = tmp_path / "odd.mcapy"
    with McapyWriter(path, meta) as w:
        w.add_tensor("x", np.zeros(1, "float32"))
    m = D.describe(str(path))
    assert m.error is None and m.model_type == "qwen3_5_text"
    assert m.top1 is None and m.kl is None
    found = D.discover([str(tmp_path)], include_demo=False)
    assert [f.name for f in found] == ["odd"]

"""HF checkpoint -> .mcapy: every family converts exactly (checked against transformers' own weights),
in any shard/expert/prefix layout, bad input fails typed with nothing left behind, and the CLI works."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from decapybara.builder import EncodedTensor, SourceTensor, build, iter_float32, load_config
from decapybara.dtypes import bf16_to_f32
from decapybara.errors import ConfigError, DecapybaraError, WeightError
from decapybara.mcapy import McapyFile
from decapybara.model.config import ModelConfig
from decapybara.model.weights import mtp_tensors
from decapybara.testing import FAMILIES, make_hf_model, save_hf_checkpoint

torch = pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models() -> dict:
    return {fam: make_hf_model(fam, seed=3) for fam in FAMILIES}


@pytest.fixture(scope="module")
def ckpts(models: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {fam: save_hf_checkpoint(m, root / fam, chat_template="{{ messages }}") for fam, m in models.items()}


def hf_reference(model) -> dict[str, torch.Tensor]:
    """transformers' in-memory weights under our canonical names (fused experts split into gate / up)."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)  # [E, 2I, H]: transformers computes gate, up = (x @ W.T).chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


def _read_all(path: Path) -> dict[str, np.ndarray]:
    with McapyFile.open(path) as f:
        f.verify()
        return {n: np.array(f.tensor(n)) for n in f.names()}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_build_equals_the_hf_weights_exactly(family: str, models: dict, ckpts: dict, tmp_path: Path) -> None:
    out = tmp_path / "m.mcapy"
    result = build(ckpts[family], out, weights="fp32")
    ref = hf_reference(models[family])
    got = _read_all(out)
    assert sorted(got) == sorted(ref) and result.num_tensors == len(ref)
    for name, t in ref.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], t.numpy(), err_msg=name)
    with McapyFile.open(out) as f:
        hf_cfg = json.loads((ckpts[family] / "config.json").read_text())
        assert load_config(f) == ModelConfig.from_hf(hf_cfg)
        assert f.metadata["hf_config"] == hf_cfg
        assert f.metadata["tokenizer"] == (ckpts[family] / "tokenizer.json").read_text()
        assert f.metadata["chat_template"] == "{{ messages }}"
        assert f.metadata["special_tokens"]["eos_token"] == "<|im_end|>"
        assert f.metadata["special_tokens"]["eos_token_ids"] == [2]  # <|im_end|> is special token 2
        assert f.metadata["weights"]["format"] == "fp32" and f.metadata["sections"] == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_build_matches_torch_bit_for_bit(family: str, models: dict, ckpts: dict, tmp_path: Path) -> None:
    build(ckpts[family], tmp_path / "m.mcapy")  # bf16 is the default
    got = _read_all(tmp_path / "m.mcapy")
    for name, t in hf_reference(models[family]).items():
        if t.ndim == 1:  # norms, A_log, dt_bias stay float32
            assert got[name].dtype == np.float32
            np.testing.assert_array_equal(got[name], t.numpy(), err_msg=name)
        else:
            want = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            assert got[name].dtype == np.uint16
            np.testing.assert_array_equal(got[name], want, err_msg=name)
    with McapyFile.open(tmp_path / "m.mcapy") as f:
        assert f.tensors["lm_head.weight"].dtype == "bf16"
        assert f.metadata["weights"] == {"format": "bf16", "matrix_dtype": "bf16", "vector_dtype": "f32"}
        for name, arr in iter_float32(f):
            assert arr.dtype == np.float32
            want = bf16_to_f32(got[name]) if f.tensors[name].dtype == "bf16" else got[name]
            np.testing.assert_array_equal(arr, want)


def test_bf16_checkpoint_is_read_without_torch(models: dict, tmp_path: Path) -> None:
    model = make_hf_model("qwen3_5_moe_text", seed=5).to(torch.bfloat16)
    src = save_hf_checkpoint(model, tmp_path / "hf")
    code = ("import sys; from decapybara.builder import build; "
            f"build({str(src)!r}, {str(tmp_path / 'f32.mcapy')!r}, 'fp32'); "
            f"build({str(src)!r}, {str(tmp_path / 'bf16.mcapy')!r}); "
            "assert 'torch' not in sys.modules, 'the builder imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    f32, bf16 = _read_all(tmp_path / "f32.mcapy"), _read_all(tmp_path / "bf16.mcapy")
    for name, t in hf_reference(model).items():
        np.testing.assert_array_equal(f32[name], t.float().numpy(), err_msg=name)
        if t.ndim > 1:  # bf16 -> bf16 is a raw copy
            np.testing.assert_array_equal(bf16[name], t.view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe_text"])
def test_sharded_checkpoint_builds_the_same_file(family: str, models: dict, ckpts: dict, tmp_path: Path) -> None:
    sharded = save_hf_checkpoint(models[family], tmp_path / "sharded", chat_template="{{ messages }}",
                                 max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 5
    build(sharded, tmp_path / "a.mcapy")
    build(ckpts[family], tmp_path / "b.mcapy")
    assert (tmp_path / "a.mcapy").read_bytes() == (tmp_path / "b.mcapy").read_bytes()


def _copy_without_weights(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if not p.name.startswith("model"):
            shutil.copy(p, dst / p.name)
    return dst


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
def test_fused_expert_layout_builds_like_per_expert(family: str, models: dict, ckpts: dict, tmp_path: Path) -> None:
    state = {k: v.numpy() for k, v in models[family].state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)  # transformers' own in-memory layout
    fused = _copy_without_weights(ckpts[family], tmp_path / "fused")
    save_file(state, str(fused / "model.safetensors"))
    build(fused, tmp_path / "a.mcapy", weights="fp32")
    build(ckpts[family], tmp_path / "b.mcapy", weights="fp32")
    assert (tmp_path / "a.mcapy").read_bytes() == (tmp_path / "b.mcapy").read_bytes()


def test_multimodal_checkpoint_maps_prefix_and_skips_vision(ckpts: dict, tmp_path: Path) -> None:
    src = ckpts["qwen3_5_text"]
    mm = _copy_without_weights(src, tmp_path / "mm")
    text_cfg = json.loads((src / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text_cfg,
                                                "vision_config": {"depth": 1}, "tie_word_embeddings": False}))
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(src / "model.safetensors").items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.ones((6, 2), np.float32)
    save_file(tensors, str(mm / "model.safetensors"))
    result = build(mm, tmp_path / "mm.mcapy", weights="fp32")
    build(src, tmp_path / "text.mcapy", weights="fp32")
    assert any("vision" in n for n in result.notes)
    a, b = _read_all(tmp_path / "mm.mcapy"), _read_all(tmp_path / "text.mcapy")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_tied_embeddings_store_no_lm_head(tmp_path: Path) -> None:
    model = make_hf_model("qwen3", seed=1, overrides={"tie_word_embeddings": True})
    src = save_hf_checkpoint(model, tmp_path / "hf")
    assert "lm_head.weight" not in load_file(src / "model.safetensors")
    build(src, tmp_path / "a.mcapy", weights="fp32")
    _edit_tensors(src, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    result = build(src, tmp_path / "b.mcapy", weights="fp32")  # a tied head saved anyway is skipped
    assert any("lm_head.weight" in n for n in result.notes)
    a, b = _read_all(tmp_path / "a.mcapy"), _read_all(tmp_path / "b.mcapy")
    assert "lm_head.weight" not in a and set(a) == set(b) == set(hf_reference(model)) - {"lm_head.weight"}


def _hf_mtp_tensors(cfg: ModelConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """MTP weights under checkpoint names (per-expert names for an MoE MTP layer)."""
    out = {}
    for name, shape in mtp_tensors(cfg).items():
        value = rng.standard_normal(shape).astype(np.float32)
        if name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")):
            prefix, leaf = name.rsplit(".", 1)
            out.update({f"{prefix}.{e}.{leaf}.weight": value[e] for e in range(shape[0])})
        else:
            out[name] = value
    return out


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_mtp_tensors_are_kept_when_the_config_has_mtp(family: str, ckpts: dict, tmp_path: Path) -> None:
    src = ckpts[family]
    hf_cfg = json.loads((src / "config.json").read_text())
    cfg = ModelConfig.from_hf({**hf_cfg, "mtp_num_hidden_layers": 1})
    mtp = _hf_mtp_tensors(cfg, np.random.default_rng(0))
    folder = _copy_without_weights(src, tmp_path / "mtp")
    (folder / "config.json").write_text(json.dumps({**hf_cfg, "mtp_num_hidden_layers": 1}))
    save_file({**load_file(src / "model.safetensors"), **mtp}, str(folder / "model.safetensors"))
    build(folder, tmp_path / "m.mcapy", weights="fp32")
    got = _read_all(tmp_path / "m.mcapy")
    assert {k for k in got if k.startswith("mtp.")} == set(mtp_tensors(cfg))
    for name in mtp_tensors(cfg):
        if name in mtp:
            np.testing.assert_array_equal(got[name], mtp[name])
        else:  # stacked experts
            prefix, leaf = name.rsplit(".", 1)
            np.testing.assert_array_equal(got[name], np.stack([mtp[f"{prefix}.{e}.{leaf}.weight"]
                                                               for e in range(cfg.num_experts)]))
    # Checkpoint saved by transformers (no mtp.*) under an MTP config: MTP is dropped from the model config.
    save_file(load_file(src / "model.safetensors"), str(folder / "model.safetensors"))
    result = build(folder, tmp_path / "n.mcapy")
    assert any("MTP dropped" in n for n in result.notes)
    with McapyFile.open(tmp_path / "n.mcapy") as f:
        assert load_config(f).mtp_num_hidden_layers == 0 and not any(n.startswith("mtp.") for n in f.names())


# ---- bad input -------------------------------------------------------------------------------------------
def _edit_config(folder: Path, fn) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, fn) -> None:
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


BAD_INPUTS = {
    "unknown_model_type": (lambda d: _edit_config(d, lambda c: c.update(model_type="llama")), ConfigError,
                           "'llama'"),
    "missing_config_field": (lambda d: _edit_config(d, lambda c: c.pop("hidden_size")), ConfigError,
                             "'hidden_size'"),
    "missing_tensor": (lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")),
                       WeightError, "missing tensor model.layers.1.self_attn.k_proj.weight (expected shape [32, 64])"),
    "missing_expert": (lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight")),
                       WeightError, "model.layers.2.mlp.experts.5.up_proj.weight"),
    "wrong_shape": (lambda d: _edit_tensors(d, lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)})),
                    WeightError, "model.norm.weight has shape [65], expected [64]"),
    "integer_tensor": (lambda d: _edit_tensors(d, lambda t: t.update(
        {"model.norm.weight": np.ones(64, np.int32)})), WeightError, "dtype I32"),
    "unexpected_tensor": (lambda d: _edit_tensors(d, lambda t: t.update({"model.extra.weight": np.ones(2)})),
                          WeightError, "unexpected tensor(s) for qwen3_moe: model.extra.weight"),
    "missing_tokenizer": (lambda d: (d / "tokenizer.json").unlink(), ConfigError, "tokenizer.json"),
    "missing_config": (lambda d: (d / "config.json").unlink(), ConfigError, "config.json"),
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), WeightError, "no model.safetensors"),
    "corrupt_safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), WeightError,
                            "not a safetensors file"),
    "truncated_safetensors": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-100]), WeightError, "outside"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_checkpoint_raises_a_typed_error_and_writes_nothing(case: str, ckpts: dict, tmp_path: Path) -> None:
    edit, error, match = BAD_INPUTS[case]
    src = shutil.copytree(ckpts["qwen3_moe"], tmp_path / "src")
    edit(src)
    (tmp_path / "out").mkdir()
    with pytest.raises(error) as ei:
        build(src, tmp_path / "out" / "m.mcapy")
    assert match in str(ei.value)
    assert _leftovers(tmp_path / "out") == []


class _Faulty:
    """A custom weight format (the quantisation seam): f16 with a quant note, failing at tensor `fail_at`."""

    name = "test-f16"

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.seen = fail_at, 0

    def info(self) -> dict:
        return {"format": self.name}

    def encode(self, tensor: SourceTensor) -> Iterable[EncodedTensor]:
        self.seen += 1
        if self.seen == self.fail_at:
            raise RuntimeError("codec failed")
        yield EncodedTensor(tensor.name + ":codes", "f16", tensor.shape, tensor.blocks("f16"), {"scheme": "f16"})


def test_custom_weight_format_plugs_in_and_a_failure_mid_write_leaves_nothing(ckpts: dict, tmp_path: Path) -> None:
    build(ckpts["qwen3"], tmp_path / "q.mcapy", weights=_Faulty())
    with McapyFile.open(tmp_path / "q.mcapy") as f:
        assert f.metadata["weights"] == {"format": "test-f16"}
        t = f.tensors["model.embed_tokens.weight:codes"]
        assert t.dtype == "f16" and t.quant == {"scheme": "f16"}
        with pytest.raises(WeightError, match="quant"):
            list(iter_float32(f))
    (tmp_path / "out").mkdir()
    with pytest.raises(RuntimeError, match="codec failed"):
        build(ckpts["qwen3"], tmp_path / "out" / "m.mcapy", weights=_Faulty(fail_at=5))
    assert _leftovers(tmp_path / "out") == []
    with pytest.raises(ConfigError, match="unknown weight format 'int3'"):
        build(ckpts["qwen3"], tmp_path / "out" / "m.mcapy", weights="int3")


# ---- CLI -------------------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decapybara.cli", *args], capture_output=True, text=True,
                          check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


def test_cli_build_and_info(ckpts: dict, tmp_path: Path) -> None:
    out = tmp_path / "m.mcapy"
    r = _cli("build", str(ckpts["qwen3_5_moe_text"]), str(out), "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    assert "76 tensors" in r.stdout
    with McapyFile.open(out) as f:
        assert f.metadata["weights"]["format"] == "fp32" and len(f.tensors) == 76
    r = _cli("build", str(ckpts["qwen3_5_moe_text"]), str(out))
    assert r.returncode == 2 and "exists" in r.stderr
    quality = [{"config": "Tiny", "GiB": 12.7, "kl": 0.0582, "top1": "92.7%"},
               {"config": "XXL", "GiB": 23.58, "kl": 0.0051, "top1": "98.3%"}]
    build(ckpts["qwen3_5_moe_text"], out, sections={"quality": quality})
    r = _cli("info", str(out), "--verify")
    assert r.returncode == 0, r.stderr
    for text in ("version=1", "header_size=144", "tensors: 76", "qwen3_5_moe_text: 4 layers",
                 "experts 8 (top 2", "format=bf16", "config  GiB    kl      top1", "XXL     23.58  0.0051  98.3%"):
        assert text in r.stdout, (text, r.stdout)
    r = _cli("info", "demo")  # a name, as `decapybara models` lists it and plan / serve take it
    assert r.returncode == 0 and "demo.mcapy" in r.stdout.splitlines()[0], r.stderr


def test_cli_errors_are_one_line_with_exit_code_2(ckpts: dict, tmp_path: Path) -> None:
    (tmp_path / "junk.mcapy").write_bytes(b"\x89MCAPY\r\n" + (1).to_bytes(4, "little") + bytes(200))
    r = _cli("info", str(tmp_path / "junk.mcapy"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "bad_checksum" in r.stderr
    src = shutil.copytree(ckpts["qwen3"], tmp_path / "src")
    (src / "tokenizer.json").unlink()
    r = _cli("build", str(src), str(tmp_path / "m.mcapy"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "tokenizer.json" in r.stderr
    assert not (tmp_path / "m.mcapy").exists()
    assert issubclass(ConfigError, DecapybaraError)


@pytest.mark.parametrize("flags, says", [
    (["--quality-contexts", "abc"], "--quality-contexts expects token counts"),
    (["--dtype", "fp32", "--weights", "tiny"], "--dtype fp32 and --weights tiny disagree"),
])
def test_cli_build_refuses_bad_flags_in_one_line(ckpts: dict, tmp_path: Path, capsys, flags, says) -> None:
    from decapybara.cli import main

    assert main(["build", str(ckpts["qwen3"]), str(tmp_path / "m.mcapy"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "m.mcapy").exists()


def test_cli_build_refuses_a_negative_seed_in_one_line(ckpts: dict, tmp_path: Path, capsys) -> None:
    """The calibration and quality samples' seed seeds numpy's generator, which takes no negative seed: refused
    as a bad flag, not a traceback from the calibration."""
    from decapybara.cli import main

    np.save(tmp_path / "tokens.npy", np.arange(8192, dtype=np.int64) % 64)
    assert main(["build", str(ckpts["qwen3"]), str(tmp_path / "m.mcapy"), "--calib", str(tmp_path / "tokens.npy"),
                 "--calib-tokens", "512", "--seed", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed" in err, err
    assert not (tmp_path / "m.mcapy").exists()


def test_cli_build_names_a_missing_output_folder_and_a_file_given_as_source(ckpts: dict, tmp_path: Path,
                                                                            capsys) -> None:
    from decapybara.cli import main

    assert main(["build", str(ckpts["qwen3"]), str(tmp_path / "nodir" / "m.mcapy")]) == 2
    assert capsys.readouterr().err == f"decapybara: error: output folder {tmp_path / 'nodir'} does not exist\n"
    assert main(["build", str(ckpts["qwen3"] / "config.json"), str(tmp_path / "m.mcapy")]) == 2
    assert "is a file: give the folder that holds config.json" in capsys.readouterr().err

"""Serving past the trained context: YaRN (`with_yarn`) against HF transformers' YaRN, and the server's
`rope_scaling` / preset context (`AppConfig.context_plan`) reaching the model the GPU actor serves."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import DEMO

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.errors import ConfigError
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig, with_yarn
from decapybara.model.load import load_model
from decapybara.model.qwen import QwenModel
from decapybara.server.config import AppConfig, ContextPlan
from decapybara.testing import TINY_HF_CONFIGS, canonical_tensors, make_hf_model

PROMPT = np.random.default_rng(4321).integers(0, 512, 40)


def prefill_logits(model: QwenModel, ids) -> np.ndarray:
    kv = model.new_kv_cache(16, 8)
    states = model.new_state_pool(1) if model.cfg.linear_layers else None
    if states is not None:
        states.reset(0)
    batch = ForwardBatch.build([(list(ids), 0, np.arange(16), 0)], 8, logits="all")
    return model.backend.to_host(model.forward(batch, kv, states).logits)


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_yarn_extension_matches_transformers(family):
    """`with_yarn(cfg, 4 x trained)` is the rope HF builds from `rope_type: yarn, factor 4`: same config once
    parsed, same logits (fp32, the plain rope's own tolerance against HF), and not the plain rope's."""
    base = make_hf_model(family, seed=7)
    cfg = ModelConfig.from_hf(base.config.to_dict())
    ext = with_yarn(cfg, 4 * cfg.max_position_embeddings)
    assert (ext.rope.kind, ext.rope.factor, ext.max_position_embeddings) == ("yarn", 4.0, 4096)
    params = {**base.config.rope_parameters, "rope_type": "yarn", "factor": 4.0,
              "original_max_position_embeddings": cfg.max_position_embeddings}
    hf = make_hf_model(family, seed=7, overrides={"rope_parameters": params, "max_position_embeddings": 4096})
    assert ModelConfig.from_hf(hf.config.to_dict()).rope == ext.rope
    ours = prefill_logits(QwenModel.from_tensors(ext, NumpyBackend(), canonical_tensors(base)), PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor(PROMPT)[None]).logits[0].numpy()
    assert rel_err(ours, ref) <= 1e-4
    plain = prefill_logits(QwenModel.from_tensors(cfg, NumpyBackend(), canonical_tensors(base)), PROMPT)
    assert rel_err(ours, plain) > 1e-2  # the extension changes the model's numbers, so the check above can fail


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("overrides", [
    {"rope_parameters": {**YARN, "truncate": False}},  # the correction range unrounded (gpt-oss style)
    {"rope_parameters": {**YARN, "factor": None}, "max_position_embeddings": 128},  # factor 128 / 32
    {"rope_parameters": {**YARN, "beta_fast": None, "beta_slow": None}},  # the defaults, 32 and 1
    {"rope_parameters": YARN, "original_max_position_embeddings": 16},  # the top-level one first (Phi-3 style)
    {"rope_parameters": {**YARN, "mscale_all_dim": 1.0}},  # one of the pair alone: the plain attention factor
    {"rope_parameters": {**YARN, "mscale": 0.8, "mscale_all_dim": 0.6}},  # both: their ratio
], ids=["truncate_false", "factor_null", "betas_null", "top_level_original", "mscale_all_dim_alone", "mscale_pair"])
def test_yarn_parameters_are_read_as_transformers_reads_them(overrides):
    """A config.json's YaRN fields as transformers reads them (`_compute_yarn_parameters`): the model built from
    the raw config (as the builder reads it) gives HF's logits over positions past the original context."""
    cfg = ModelConfig.from_hf({**TINY_HF_CONFIGS["qwen3"], **copy.deepcopy(overrides)})
    hf = make_hf_model("qwen3", seed=7, overrides=copy.deepcopy(overrides))  # transformers edits rope dicts
    ours = prefill_logits(QwenModel.from_tensors(cfg, NumpyBackend(), canonical_tensors(hf)), PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor(PROMPT)[None]).logits[0].numpy()
    assert rel_err(ours, ref) <= 1e-4


def test_with_yarn_keeps_a_model_that_fits_and_rescales_from_the_original_context():
    cfg = ModelConfig.from_hf(make_hf_model("qwen3", seed=7).config.to_dict())
    assert with_yarn(cfg, 512) is cfg and with_yarn(cfg, 1024) is cfg
    twice = with_yarn(with_yarn(cfg, 4096), 8192)  # factor from the original 1,024, not from 4,096
    assert (twice.rope.factor, twice.rope.original_max_position_embeddings) == (8.0, 1024)


@pytest.mark.parametrize(("settings", "plan"), [
    ({}, (None, None)),
    ({"max_model_len": 4096}, (None, 4096)),
    ({"max_model_len": 65536}, (65536, 65536)),
    ({"preset": "max_efficiency"}, (1_048_576, 1_048_576)),
    ({"preset": "max_quality"}, (262_144, 262_144)),
    ({"preset": "max_efficiency", "max_model_len": 100_000}, (100_000, 100_000)),
    ({"preset": "max_efficiency", "rope_scaling": "off"}, (None, 32768)),
    ({"rope_scaling": "off", "max_model_len": 20000}, (None, 20000)),
    ({"rope_scaling": "1m"}, (1_048_576, 1_048_576)),
    ({"rope_scaling": "1m", "preset": "medium"}, (1_048_576, 1_048_576)),
    ({"rope_scaling": "1m", "max_model_len": 200_000}, (1_048_576, 200_000)),
])
def test_context_plan(settings, plan):
    """A model trained on 32,768 tokens (the demo's config): what YaRN extends it to and the engine's
    max_model_len, from the explicit setting, else the preset's context, under each rope_scaling."""
    cfg = AppConfig(**settings)
    assert cfg.context_plan(32768) == ContextPlan(*plan)
    # the plan's length is the engine's (the GPU actor passes it), over the setting's
    assert cfg.engine_config(cuda=False, max_model_len=plan[1]).max_model_len == plan[1]
    assert AppConfig(preset="max_quality").engine_config(cuda=False, max_model_len=5000).max_model_len == 5000


@pytest.mark.parametrize("settings", [{"rope_scaling": "off", "max_model_len": 65536},
                                      {"rope_scaling": "1m", "max_model_len": 2_000_000}])
def test_context_plan_refuses_what_its_scaling_cannot_serve(settings):
    with pytest.raises(ConfigError, match="max_model_len"):
        AppConfig(**settings).context_plan(32768)
    with pytest.raises(ValueError, match="rope_scaling"):
        AppConfig(rope_scaling="2x")


def test_load_model_extends_the_files_context():
    plain = load_model(str(DEMO))
    ext = load_model(str(DEMO), context=lambda cfg: 2 * cfg.max_position_embeddings)
    trained = plain.config.max_position_embeddings
    assert (ext.config.rope.kind, ext.config.rope.factor, ext.config.max_position_embeddings) == ("yarn", 2.0,
                                                                                                  2 * trained)
    assert ext.model.cfg == ext.config
    assert load_model(str(DEMO), context=trained).config == plain.config
    ids = plain.tokenizer.encode("def add(a, b):\n    return")
    assert rel_err(prefill_logits(ext.model, ids), prefill_logits(plain.model, ids)) > 1e-3


def test_gpu_actor_serves_the_presets_context():
    """The GPU actor (in-process, CPU backend) under preset max_efficiency serves 1,048,576 tokens: the demo
    model (trained on 32,768) with YaRN x32 and an engine that admits such a context; rope_scaling=off keeps the
    trained context, and a longer explicit max_model_len with it is refused before the weights load. (The pool,
    0.5 GB, holds the whole context: a smaller one would shorten the served context to its own tokens.)"""
    pytest.importorskip("ray")
    from actors.gpu_actor import GPUActor

    actor = GPUActor({"device": "cpu", "preset": "max_efficiency", "kv_memory_gb": 0.5, "slots": 2})
    try:
        model, engine = actor.engine.model, actor.engine
        assert (model.cfg.rope.kind, model.cfg.rope.factor) == ("yarn", 32.0)
        assert engine.max_model_len == 1_048_576 and actor.info()["max_model_len"] == 1_048_576
        ids = load_model(str(DEMO)).tokenizer.encode("import os\n")
        want = prefill_logits(load_model(str(DEMO), context=1_048_576).model, ids)
        assert rel_err(prefill_logits(model, ids), want) == 0.0
    finally:
        actor.stop()
    actor = GPUActor({"device": "cpu", "preset": "max_efficiency", "rope_scaling": "off", "kv_memory_gb": 0.5,
                      "slots": 2})
    try:
        assert actor.engine.model.cfg.rope.kind == "default" and actor.engine.max_model_len == 32768
    finally:
        actor.stop()
    with pytest.raises(ConfigError, match="trained context"):
        GPUActor({"device": "cpu", "rope_scaling": "off", "max_model_len": 65536})


def test_yarn_extends_only_as_far_as_the_pool_holds():
    """Preset max_efficiency asks for 1,048,576 tokens, but a pool of 65,536 tokens serves no longer a
    conversation: YaRN's factor is fitted to the pool (x2 over the demo's 32,768, the same logits as a model loaded
    for that context), and a pool within the trained context keeps the trained rope."""
    from decapybara.server.config import AppConfig
    from decapybara.server.engine_setup import build_engine

    ids = load_model(str(DEMO)).tokenizer.encode("import os\n")
    for pages, factor in ((4096, 2.0), (1024, None)):  # pages of 16 tokens
        served = build_engine(AppConfig(device="cpu", preset="max_efficiency", num_pages=pages, slots=2))
        model, engine = served.engine.model, served.engine
        if factor is None:
            assert model.cfg.rope.kind == "default" and model.cfg.max_position_embeddings == 32768
            want = load_model(str(DEMO)).model
        else:
            assert (model.cfg.rope.kind, model.cfg.rope.factor) == ("yarn", factor)
            want = load_model(str(DEMO), context=pages * 16).model
        assert engine.max_model_len <= pages * 16
        assert rel_err(prefill_logits(model, ids), prefill_logits(want, ids)) == 0.0


def test_fit_yarn_keeps_a_files_own_rope_and_rounds_to_powers_of_two():
    """A file that ships YaRN (x4 over 32,768: 131,072 tokens) keeps its own rope where the pool fits it; past it
    the fit extends to the file's context times a power of two (so a few pages more or less of free memory do not
    change the rope, nor the prefix cache's salt), never past what was asked."""
    from types import SimpleNamespace

    from decapybara.model.rope import RotaryTable
    from decapybara.server.engine_setup import fit_yarn

    demo = load_model(str(DEMO)).config
    file_cfg = with_yarn(demo, 4 * 32768)

    def fitted(pool: int, asked: int = 1_048_576):
        model = SimpleNamespace(cfg=with_yarn(file_cfg, asked), rotary=None)
        changed = fit_yarn(model, file_cfg, pool, asked)
        assert changed == (model.rotary is not None)
        if changed:
            assert model.rotary.inv_freq.tolist() == RotaryTable.for_config(model.cfg).inv_freq.tolist()
        return model.cfg

    assert fitted(100_000) == file_cfg and fitted(131_072) == file_cfg  # the file's own x4
    assert (fitted(150_000).rope.factor, fitted(150_000).max_position_embeddings) == (8.0, 262_144)
    assert fitted(140_000) == fitted(262_000)  # one power of two
    assert fitted(2_000_000) == with_yarn(file_cfg, 1_048_576)  # never past what was asked
    assert fitted(600_000, asked=700_000).max_position_embeddings == 700_000


def test_serve_flags_reach_the_context_plan():
    from decapybara.cli import make_parser
    from decapybara.server.cli_serve import app_args

    args = make_parser().parse_args(["serve", "--rope-scaling", "1m", "--max-model-len", "200000"])
    settings = app_args(args)
    assert settings == {"rope_scaling": "1m", "max_model_len": 200000}
    assert AppConfig(**settings).context_plan(32768) == ContextPlan(1_048_576, 200_000)

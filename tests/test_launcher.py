"""The launcher's capacity planner against real allocations, and `decapybara plan` as a user runs it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.builder.quant_formats import weights_bytes
from decapybara.cli import main
from decapybara.config import DEMO_MODEL, KV_MODES
from decapybara.launcher import capacity as C
from decapybara.launcher.cli_plan import _file_inputs, quality_at
from decapybara.launcher.probe import host_bandwidth, host_memory, this_machine
from decapybara.model.config import ModelConfig, named_config
from decapybara.testing import TINY_HF_CONFIGS

NP = NumpyBackend()


@pytest.mark.parametrize("family", sorted(TINY_HF_CONFIGS))
@pytest.mark.parametrize("kv_mode", [None, *KV_MODES])
def test_kv_bytes_per_token_is_what_the_cache_allocates(family, kv_mode):
    cfg = ModelConfig.from_hf(dict(TINY_HF_CONFIGS[family]))
    kv = NP.new_kv_cache(cfg, num_pages=3, page_size=16, kv_mode=kv_mode)
    assert C.kv_bytes_per_token(cfg, kv_mode) * 16 == kv.bytes_per_page


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_state_bytes_are_what_the_pool_allocates(family):
    cfg = ModelConfig.from_hf(dict(TINY_HF_CONFIGS[family]))
    pool = NP.new_state_pool(cfg, 5)
    total = sum(a.nbytes for d in (pool.conv, pool.rec) for a in d.values())
    assert cfg.state_bytes_per_sequence() * 5 == total


def test_27b_figures():
    """The 27B's bf16 KV: 4 heads x 256 dims x (K, V) x 2 bytes in 16 attention layers + the MTP layer."""
    cfg = named_config("qwen3.8-27b")
    assert C.kv_bytes_per_token(cfg, "16/16") == 4 * 256 * 2 * 2 * 17
    # 8-bit pages: a byte per element plus an E8M0 scale per 32
    assert C.kv_bytes_per_token(cfg, "8/8") == 4 * (256 + 8) * 2 * 17
    # 48 DeltaNet layers of [48, 128, 128] float32 recurrent + conv [10240, 3] float32 states
    assert cfg.state_bytes_per_sequence() == 48 * 4 * (48 * 128 * 128 + 10240 * 3)


def test_plan_capacity_arithmetic():
    cfg = named_config("qwen3.8-27b")
    wb = weights_bytes("tiny", cfg)
    p = C.plan_capacity(cfg, wb, 141 * C.GIB, "16/16", slots=12, context=32768, page_size=512,
                        ram_bytes=64 * C.GIB)
    states = cfg.state_bytes_per_sequence() * 13
    assert p.reserve_bytes == int(0.05 * 141 * C.GIB)
    assert p.pages == (141 * C.GIB - wb - states - p.reserve_bytes) // (512 * C.kv_bytes_per_token(cfg, "16/16"))
    # one page belongs to the CUDA graphs' padding rows
    assert p.tokens == 512 * (p.pages - 1) and p.context_per_slot == 512 * ((p.pages - 1) // 12)
    assert p.fits and p.why_not is None
    assert p.paused_in_ram == 64 * C.GIB // (32768 * p.kv_token_bytes + cfg.state_bytes_per_sequence())
    assert p.snapshot_bytes == 24 * cfg.state_bytes_per_sequence()  # the engine's default: two states a slot
    assert C.plan_capacity(cfg, wb, 141 * C.GIB, "16/16", 1, 1024).snapshot_bytes == 2 * cfg.state_bytes_per_sequence()
    # fewer bits per token: more tokens in the same memory
    assert C.plan_capacity(cfg, wb, 141 * C.GIB, "4/4", 12, 32768).tokens > 3 * p.tokens
    # a context longer than the pool's share per conversation does not fit, and says why
    long = C.plan_capacity(cfg, wb, 141 * C.GIB, "16/16", 12, 262144)
    assert not long.fits and "tokens each" in long.why_not
    past = C.plan_capacity(cfg, wb, 141 * C.GIB, "4/4", 1, 10 ** 6)
    assert not past.fits and "position limit" in past.why_not
    small = C.plan_capacity(cfg, wb, 16 * C.GIB, "16/16", 12, 1024)
    assert small.pages == 0 and not small.fits and "no room for KV" in small.why_not
    # memory kept free for other programs is part of what is short
    kept = C.plan_capacity(cfg, wb, 141 * C.GIB, "16/16", 12, 1024, keep_free_bytes=1000 * C.GIB)
    short = wb + kept.state_bytes + kept.reserve_bytes + 1000 * C.GIB + 2 * kept.kv_page_bytes - 141 * C.GIB
    assert kept.pages == 0 and f"({short / C.GIB:.1f} GiB short)" in kept.why_not and "kept free" in kept.why_not
    assert short > 800 * C.GIB
    # speculation's rollback states take device memory, not a conversation's snapshots or its paused RAM
    spec = C.plan_capacity(cfg, wb, 141 * C.GIB, "16/16", slots=12, context=32768, page_size=512,
                           ram_bytes=64 * C.GIB, checkpoints=12)
    assert spec.state_bytes == cfg.state_bytes_per_sequence() * 25 and spec.pages < p.pages
    assert (spec.snapshot_bytes, spec.paused_in_ram) == (p.snapshot_bytes, p.paused_in_ram)
    with pytest.raises(ValueError):
        C.plan_capacity(cfg, wb, 16 * C.GIB, "16/16", 0, 1024)
    with pytest.raises(ValueError):
        C.plan_capacity(cfg, wb, 0, "16/16", 1, 1024)


def test_decode_roofline():
    cfg = named_config("qwen3.8-27b")
    tb = C.preset_tensor_bytes(cfg, "tiny")
    assert sum(tb.values()) == weights_bytes("tiny", cfg)
    bw = 4.2e12
    one = C.decode_roofline(cfg, tb, "16/16", [1024], bw)
    streamed = C.streamed_weight_bytes(cfg, tb)
    step = streamed + 1024 * C.kv_bytes_per_token(cfg, "16/16", include_mtp=False) \
        + 2 * cfg.state_bytes_per_sequence()
    assert math.isclose(one, bw / step)
    # neither the untied embedding table (gathered rows) nor the MTP head is streamed
    skipped = tb["model.embed_tokens.weight"] + sum(v for k, v in tb.items() if k.startswith("mtp."))
    assert streamed == sum(tb.values()) - skipped
    assert C.kv_bytes_per_token(cfg, "16/16", include_mtp=False) == 4 * 256 * 2 * 2 * 16
    twelve = C.decode_roofline(cfg, tb, "16/16", [1024] * 12, bw)
    assert 9 * one < twelve < 12 * one  # weights shared, KV and states per sequence
    assert C.decode_roofline(cfg, tb, "4/4", [32768] * 12, bw) > C.decode_roofline(cfg, tb, "16/16", [32768] * 12, bw)
    with pytest.raises(ValueError):
        C.decode_roofline(cfg, tb, "16/16", [], bw)


def test_moe_roofline_streams_the_routed_experts():
    cfg = named_config("qwen3.8-35b-a3b")  # 256 experts, top 8
    tb = C.preset_tensor_bytes(cfg, "tiny")
    assert math.isclose(C.routed_share(cfg, 1), 8 / 256) and C.routed_share(named_config("qwen3.8-27b"), 5) == 1
    experts = sum(v for k, v in tb.items() if ".experts." in k and not k.startswith("mtp."))
    dense = C.streamed_weight_bytes(cfg, tb, 1) - experts * 8 / 256
    assert dense < 0.2 * sum(tb.values())  # the experts are most of the bytes ...
    assert math.isclose(C.streamed_weight_bytes(cfg, tb, 12), dense + experts * C.routed_share(cfg, 12))
    # ... so one stream reads a small part of them, twelve a larger one
    assert C.decode_roofline(cfg, tb, "16/16", [1024], 4e12) > 5 * C.decode_roofline(
        dataclasses.replace(cfg, num_experts_per_tok=256), tb, "16/16", [1024], 4e12)


def test_probe_measures_the_host():
    total, avail = host_memory()
    assert total > avail > 0 or total == avail > 0
    assert host_bandwidth(8 << 20, repeats=2) > 1e8  # > 0.1 GB/s on any machine
    m = this_machine(measure=False)
    assert m.memory_bytes > 0 and m.bandwidth == 0.0


def test_file_inputs_read_the_quality_table():
    cfg, weights, shapes, quality, own = _file_inputs(str(DEMO_MODEL))
    assert own == "bf16" and cfg.model_type == "qwen3_5_text"
    assert {"tiny", "small", "medium", "large", "xxl"} <= set(weights)
    assert set(weights["tiny"]) == set(weights["bf16"]) == set(shapes)  # the same tensors, other formats
    assert sum(weights["tiny"].values()) < sum(weights["bf16"].values())
    trained = cfg.max_position_embeddings
    assert min(quality) == trained and quality[trained][("bf16", "16/16")] == (0.0, 100.0)  # the reference row
    assert sorted(quality) == [trained, 262_144, 1_048_576]  # the YaRN rows of the presets' contexts
    assert all(0 <= kl and 0 <= top1 <= 100 for q in quality.values() for kl, top1 in q.values())
    # the rows that speak for a context: the trained ones within it, past it the shortest YaRN context covering it
    assert quality_at(quality, 4096) == (trained, quality[trained]) == quality_at(quality, trained)
    assert quality_at(quality, trained + 1) == (262_144, quality[262_144]) == quality_at(quality, 262_144)
    assert quality_at(quality, 300_000)[0] == 1_048_576 and quality_at(quality, 2_000_000) == (None, {})
    assert quality_at({}, 4096) == (None, {})


def test_cli_plan_named_config(capsys):
    assert main(["plan", "--config", "qwen3.8-27b", "--vram-gb", "141", "--bandwidth-gbps", "4200",
                 "--slots", "12", "--context", "32768", "--weights", "tiny,bf16"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith(("tiny", "bf16"))]
    assert len(lines) == 2 * len(KV_MODES)
    assert "most bits that fit (no quality table measured): bf16 weights, 16/16 KV" in out
    assert "run: `decapybara build SRC OUT --weights bf16`, then decapybara serve --model OUT --slots 12 " \
           "--kv-mode 16/16 --set num_pages=" in out


def test_cli_plan_counts_bf16_prefill_weights(capsys):
    """--prefill-weights bf16: the quantised product weights' bf16 copies (2 bytes a weight of every 2-D
    `*_proj.weight` stored in fewer) come out of the KV pool; bf16 weights need none; the serve command asks for
    them only where the chosen weights are quantised. Without the flag, the plan says what they would cost the
    chosen setting (its pool with them) or that it would not fit with them."""
    cfg = named_config("qwen3.8-27b")
    from decapybara.model.weights import expected_tensors, is_product_weight, keeps_prefill_copy

    shapes = dict(expected_tensors(cfg))
    small, bf16 = C.preset_tensor_bytes(cfg, "small"), C.preset_tensor_bytes(cfg, "bf16")
    dense = C.dense_prefill_bytes(shapes, small)
    products = [n for n, sh in shapes.items() if is_product_weight(n) and len(sh) == 2]
    assert any(".in_proj_qkv." in n for n in products) and not any("embed" in n or "lm_head" in n for n in products)
    products = [n for n in products if keeps_prefill_copy(n)]
    assert products and not any(n.startswith("mtp.") for n in products)  # the engine runs no MTP layer
    assert dense == sum(2 * math.prod(shapes[n]) for n in products if small[n] < 2 * math.prod(shapes[n]))
    assert 40e9 < dense < 60e9  # the 27B's products, ~25 billion weights
    assert C.dense_prefill_bytes(shapes, bf16) == 0
    args = ["plan", "--config", "qwen3.8-27b", "--vram-gb", "141", "--bandwidth-gbps", "4200", "--slots", "12",
            "--context", "32768", "--kv-mode", "6/4"]
    pools, hints = {}, {}
    for pw in ("packed", "bf16"):
        assert main([*args, "--weights", "small", "--prefill-weights", pw]) == 0
        out = capsys.readouterr().out
        row = next(ln for ln in out.splitlines() if ln.startswith("small"))
        pools[pw] = int(row.split()[5].replace(",", ""))
        assert ("--set prefill_weights=bf16" in out) == (pw == "bf16")
        assert ("prefill weights in bf16: small +" in out) == (pw == "bf16")
        hint = [ln for ln in out.splitlines() if ln.startswith("bf16 prefill weights (--prefill-weights bf16)")]
        hints[pw] = hint[0] if hint else None
    page_bytes = C.kv_bytes_per_token(cfg, "6/4") * 512
    assert pools["packed"] - pools["bf16"] == pytest.approx(dense / page_bytes * 512, abs=512)
    # without the flag the plan says what the copies would cost the chosen setting and that it still fits
    assert hints["bf16"] is None and f"take {dense / 2**30:.1f} GiB" in hints["packed"]
    assert f"KV pool {pools['packed']:,} -> {pools['bf16']:,} tokens" in hints["packed"]
    assert main([*args, "--weights", "bf16", "--prefill-weights", "bf16"]) == 0
    assert "--set prefill_weights" not in capsys.readouterr().out
    assert main([*args, "--weights", "bf16"]) == 0  # nothing quantised: no copies to offer
    assert "bf16 prefill weights (" not in capsys.readouterr().out
    small_gpu = [*args[:4], "60", *args[5:]]
    assert main([*small_gpu, "--weights", "small"]) == 0
    out = capsys.readouterr().out
    assert "the plan would not fit with them (" in out and "--set prefill_weights" not in out


def test_plan_reads_a_quantised_file_by_tensor_names(tmp_path, capsys):
    """A quantised .mcapy stores a tensor as parts (name:codes, :scales): the planner sums them under the tensor's
    name with its values' shape, so that the bf16 prefill weights of a file are counted as of a preset."""
    from decapybara.builder.build import build
    from decapybara.model.weights import keeps_prefill_copy
    from decapybara.testing import make_hf_model, save_hf_checkpoint

    save_hf_checkpoint(make_hf_model("qwen3_5_text", seed=3), tmp_path / "hf")
    build(str(tmp_path / "hf"), str(tmp_path / "m.mcapy"), weights="small")
    cfg, weights, shapes, _, own = _file_inputs(str(tmp_path / "m.mcapy"))
    assert not any(":" in n for n in (*weights[own], *shapes))
    expected = dict(__import__("decapybara.model.weights", fromlist=["x"]).expected_tensors(cfg))
    assert {n: shapes[n] for n in expected} == expected  # the values' shapes, not the codes'
    dense = C.dense_prefill_bytes(shapes, weights[own])
    quantised = [n for n in shapes if keeps_prefill_copy(n) and len(shapes[n]) == 2
                 and weights[own][n] < 2 * math.prod(shapes[n])]
    assert quantised and dense == sum(2 * math.prod(shapes[n]) for n in quantised)
    assert main(["plan", str(tmp_path / "m.mcapy"), "--vram-gb", "16", "--bandwidth-gbps", "20", "--slots", "2",
                 "--context", "1024", "--kv-mode", "16/16", "--prefill-weights", "bf16"]) == 0
    out = capsys.readouterr().out
    assert f"small +{dense / 2**20:.1f} MiB" in out and "--set prefill_weights=bf16" in out


def test_cli_plan_demo_file_with_quality(capsys):
    assert main(["plan", "--vram-gb", "8", "--bandwidth-gbps", "20", "--slots", "4", "--context", "4096",
                 "--kv-mode", "6/4"]) == 0
    out = capsys.readouterr().out
    assert "0.0316" in out and "90.84%" in out  # tiny weights, 6/4 KV, from the file's quality table
    assert "best quality that fits (top-1 against bf16): bf16 weights, 6/4 KV" in out
    assert "run: decapybara serve --slots 4 --kv-mode 6/4 --set num_pages=" in out


def test_cli_plan_context_defaults_to_the_trained_one(capsys, tmp_path):
    """Without --context a model is planned at its trained context (at most 32k), as the server serves it by default:
    no YaRN and no --max-model-len in the serve line."""
    from decapybara.builder.build import build
    from decapybara.testing import make_hf_model, save_hf_checkpoint

    save_hf_checkpoint(make_hf_model("qwen3", overrides={"max_position_embeddings": 1024}), tmp_path / "hf")
    build(str(tmp_path / "hf"), str(tmp_path / "m.mcapy"))
    assert main(["plan", str(tmp_path / "m.mcapy"), "--vram-gb", "8", "--bandwidth-gbps", "20", "--slots", "2"]) == 0
    out = capsys.readouterr().out
    assert "plan: 2 conversations of 1,024 tokens" in out and "--max-model-len" not in out, out
    # with no quality table, the most bits that fit: 16/16 KV, though at head_dim 16 a token of 8/8 (with its
    # microscaling factors) takes more bytes
    cfg = _file_inputs(str(tmp_path / "m.mcapy"))[0]
    assert C.kv_bytes_per_token(cfg, "8/8") > C.kv_bytes_per_token(cfg, "16/16")
    assert "most bits that fit (no quality table measured): bf16 weights, 16/16 KV" in out


def test_cli_plan_past_the_trained_context_plans_yarn(capsys):
    """A context past the model's trained one is planned as the server serves it (YaRN, rope_scaling auto): the
    capacity at that context, KL / top-1 of the quality table's YaRN rows that cover it, and the serve command's
    --max-model-len; past every measured context, no quality and the most bits."""
    trained = _file_inputs(str(DEMO_MODEL))[0].max_position_embeddings
    assert main(["plan", "--vram-gb", "8", "--bandwidth-gbps", "20", "--slots", "2", "--context", "1048576",
                 "--kv-mode", "4/4"]) == 0
    out = capsys.readouterr().out
    assert f"context: 1,048,576 tokens is past the model's {trained:,}: served with YaRN x{1048576 / trained:.4g}" in out
    assert "kl / top1 measured with YaRN at 1,048,576 tokens" in out
    tiny = next(ln for ln in out.splitlines() if ln.startswith("tiny")).split()
    assert tiny[7] == "yes" and tiny[-2:] == ["0.1616", "80.62%"]  # the file's tiny 4/4 row at 1,048,576 tokens
    assert "--max-model-len 1048576" in out and "nothing fits" not in out
    assert main(["plan", "--vram-gb", "8", "--bandwidth-gbps", "20", "--slots", "1", "--context", "2000000",
                 "--kv-mode", "16/16"]) == 0
    out = capsys.readouterr().out
    assert "not measured with YaRN at this context" in out and "most bits that fit (not measured at this context)" in out
    assert "--max-model-len 2000000" in out
    # weights past bf16 gain nothing measurable: the file's own bf16 weights, not a rebuild as fp32
    assert "most bits that fit (not measured at this context): bf16 weights" in out and "rebuild" not in out
    assert main(["plan", "--vram-gb", "8", "--bandwidth-gbps", "20", "--slots", "2", "--context", str(trained),
                 "--kv-mode", "6/4"]) == 0
    out = capsys.readouterr().out
    assert "YaRN" not in out and "--max-model-len" not in out and "0.0316" in out
    assert main(["plan", "--config", "qwen3.8-27b", "--vram-gb", "141", "--bandwidth-gbps", "4200", "--slots", "1",
                 "--context", "1048576", "--kv-mode", "4/4", "--weights", "tiny"]) == 0
    out = capsys.readouterr().out  # a named config: no quality table to speak of
    assert "served with YaRN x4 (the server's rope_scaling auto, --max-model-len 1048576)\n" in out
    assert "--max-model-len 1048576" in out.splitlines()[-1]


def test_cli_plan_on_the_host_counts_float32_weights(capsys, monkeypatch):
    """Without CUDA (or --vram-gb) the numpy backend serves: weights expand to float32 in host RAM."""
    from decapybara.launcher import probe

    monkeypatch.setattr(probe, "cuda_machine", lambda measure=True: None)  # as on a machine without CUDA
    assert main(["plan", "--bandwidth-gbps", "20", "--kv-mode", "16/16", "--slots", "2", "--context", "1024",
                 "--ram-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "weights held as float32 by the numpy backend" in out and "RAM tier 1.0 GiB" in out
    assert "--ram-cache-gb 1" in out and "--set page_size=16" in out


def test_cli_plan_nothing_fits(capsys):
    assert main(["plan", "--config", "qwen3.8-27b", "--vram-gb", "16", "--bandwidth-gbps", "1000",
                 "--weights", "tiny", "--kv-mode", "16/16"]) == 0
    assert "nothing fits: weights, states and reserve leave no room for KV" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--kv-mode", "5/5"], "--kv-mode must be one of"),
    (["--slots", "13"], "--slots must be between 1 and 12"),
    (["--context", "0"], "--context must be >= 16"),
    (["--context", "10"], "--context must be >= 16"),
    (["--page-size", "100"], "--page-size must be a power of two"),
    (["--vram-gb", "-1"], "--vram-gb must be a finite number > 0"),
    (["--vram-gb", "inf"], "--vram-gb must be a finite number > 0"),
    (["--ram-gb", "-1"], "--ram-gb must be a finite number >= 0"),
    (["--bandwidth-gbps", "0"], "--bandwidth-gbps must be a finite number > 0"),
    (["--config", "qwen3.8-27b", "--weights", "huge"], "unknown weight preset"),
    (["--config", "nope"], "--config must be one of"),
    ([str(DEMO_MODEL), "--config", "qwen3.8-27b"], "a model file or --config, not both"),
    ([str(DEMO_MODEL), "--weights", "tiny"], "a file has its own weights"),
])
def test_cli_plan_bad_input(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_plan_missing_file(capsys, tmp_path):
    assert main(["plan", str(tmp_path / "none.mcapy"), "--vram-gb", "8", "--bandwidth-gbps", "10"]) != 0
    assert "decapybara: error" in capsys.readouterr().err


def test_kv_modes_order_tokens():
    cfg = named_config("qwen3.8-27b")
    per = [C.kv_bytes_per_token(cfg, m) for m in KV_MODES]
    assert per == sorted(per, reverse=True) and np.all(np.asarray(per) > 0)


@pytest.mark.parametrize("kv_mode", ["16/16", "6/4"])
def test_server_kv_memory_gb_is_the_planned_pool(kv_mode):
    """The GPU actor (in-process, CPU backend) turns kv_memory_gb into pages with the caches' own bytes per
    token (the MTP layer's KV and the scale bytes included), so the pool it allocates stays within the budget
    and is the pool `decapybara plan` counts."""
    pytest.importorskip("ray")
    from actors.gpu_actor import GPUActor

    actor = GPUActor({"device": "cpu", "kv_memory_gb": 0.01, "kv_mode": kv_mode, "slots": 2})
    try:
        cfg, engine = actor.engine.model.cfg, actor.engine
        per_page = C.kv_bytes_per_token(cfg, kv_mode) * engine.cfg.page_size
        assert engine.runner.bytes_per_page == per_page
        assert engine.cfg.num_pages == int(0.01 * C.GIB // per_page)
        assert engine.cfg.num_pages * engine.runner.bytes_per_page <= 0.01 * C.GIB
    finally:
        actor.stop()


def _fake_gpu(monkeypatch, total_gib: float, free_gib: float) -> None:
    from decapybara.launcher import probe

    machine = probe.Machine("cuda:Test GPU", int(total_gib * C.GIB), int(free_gib * C.GIB), 2e12)
    monkeypatch.setattr(probe, "cuda_machine", lambda measure=True: machine)


def _run_line(out: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith("run: "))


def test_cli_plan_on_a_shared_gpu_reserves_as_the_server(capsys, monkeypatch):
    """On a GPU whose memory other programs hold in part, the plan's pool is the one the server fits itself: the
    working reserve is a share of the device's memory, not of what is free, so the serve line's num_pages leaves
    the server its whole reserve."""
    import re

    _fake_gpu(monkeypatch, total_gib=80, free_gib=40)
    cfg = named_config("qwen3.8-27b")
    tiny = sum(C.preset_tensor_bytes(cfg, "tiny").values())
    assert main(["plan", "--config", "qwen3.8-27b", "--weights", "tiny", "--kv-mode", "16/16", "--slots", "4",
                 "--context", "8192", "--bandwidth-gbps", "2000"]) == 0
    out = capsys.readouterr().out
    served = C.fit_pool(cfg, 40 * C.GIB - tiny, 80 * C.GIB, "16/16", 4, 512, cfg.max_position_embeddings)
    assert served.pages < served.cap  # the memory, not the cap, sizes the server's pool
    assert f"reserve {C.default_reserve(80 * C.GIB) / C.GIB:.1f} GiB" in out
    assert re.search(r"--set num_pages=(\d+)", _run_line(out)).group(1) == str(served.pages)


def test_cli_plan_serve_line_keeps_the_speculator(capsys, monkeypatch):
    """--speculator plans the rollback states the server sets aside for it: the serve line asks for the same
    speculator, and the bf16 prefill weights' hint counts the same states."""
    _fake_gpu(monkeypatch, total_gib=80, free_gib=80)
    args = ["plan", "--config", "qwen3.8-27b", "--weights", "tiny", "--kv-mode", "6/6", "--slots", "12",
            "--context", "32768", "--bandwidth-gbps", "2000"]
    hints = {}
    for spec in ("off", "mtp"):
        assert main([*args, "--speculator", spec]) == 0
        out = capsys.readouterr().out
        assert ("--speculator mtp" in _run_line(out)) == (spec == "mtp")
        hints[spec] = next(ln for ln in out.splitlines() if ln.startswith("bf16 prefill weights"))
    assert hints["off"] != hints["mtp"]  # fewer tokens beside the copies with the rollback states


def test_cli_plan_serve_line_quotes_the_model_path(capsys, tmp_path):
    """The serve line is a command to paste into a shell: a model path with a space stays one argument."""
    import shlex
    import shutil

    path = tmp_path / "my models" / "demo copy.mcapy"
    path.parent.mkdir()
    shutil.copy(DEMO_MODEL, path)
    assert main(["plan", str(path), "--vram-gb", "8", "--bandwidth-gbps", "20", "--slots", "2",
                 "--context", "4096", "--kv-mode", "6/4"]) == 0
    argv = shlex.split(_run_line(capsys.readouterr().out)[len("run: "):])
    assert argv[argv.index("--model") + 1] == str(path)

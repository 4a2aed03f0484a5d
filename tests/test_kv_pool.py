"""The KV pool a server takes when none is asked for (`launcher.capacity.fit_pool`, KEEP_FREE as the server's
`keep_free_gb`), the order in which `server.engine_setup.build_engine` takes the pool settings, and the flags that
reach them. The fitted pool on a real device: tests/gpu/test_kv_pool.py."""

from __future__ import annotations

import dataclasses

import pytest

from decapybara.backend.kv_codec import kv_bytes_per_token
from decapybara.cli import main
from decapybara.errors import ConfigError
from decapybara.launcher import capacity as C
from decapybara.model.config import named_config
from decapybara.server.cli_serve import add_parser, app_args
from decapybara.server.config import AppConfig

GIB = C.GIB


def test_fit_pool_takes_the_free_memory_less_states_reserve_and_keep_free():
    cfg = named_config("qwen3.8-27b")
    page = kv_bytes_per_token(cfg, "6/4") * 512
    states = cfg.state_bytes_per_sequence() * 13
    free, total = 120 * GIB, 141 * GIB
    fit = C.fit_pool(cfg, free, total, "6/4", 12, 512, 1_048_576)
    reserve = C.default_reserve(total)
    assert reserve == int(0.05 * total) and fit.reserve_bytes == reserve
    assert fit.page_bytes == page and fit.state_bytes == states
    assert fit.by_memory == (free - states - reserve) // page
    assert fit.pages == fit.by_memory < fit.cap and fit.fits
    # KEEP_FREE comes out of the pool, page for page
    kept = C.fit_pool(cfg, free, total, "6/4", 12, 512, 1_048_576, keep_free_bytes=10 * GIB)
    assert kept.by_memory == (free - states - reserve - 10 * GIB) // page
    assert fit.pages - kept.pages in (10 * GIB // page, 10 * GIB // page + 1)
    # the planner's arithmetic on the device's whole memory less the weights gives the same pool
    weights = 15 * GIB
    plan = C.plan_capacity(cfg, weights, total, "6/4", 12, 32768, reserve_bytes=reserve, keep_free_bytes=10 * GIB)
    assert plan.pages == C.fit_pool(cfg, total - weights, total, "6/4", 12, 512, 1_048_576, 10 * GIB, reserve).pages


def test_fit_pool_sets_the_verification_checkpoints_aside():
    """With the MTP speculator, CUDA graphs and a hybrid model, the verification graphs' rollback states (one a
    row of the largest bucket) come out of the pool beside the state pool; otherwise nothing does."""
    from decapybara.config import EngineConfig
    from decapybara.engine.runner import GRAPH_BUCKETS
    from decapybara.server.engine_setup import verify_checkpoints

    cfg = named_config("qwen3.8-27b")
    one = cfg.state_bytes_per_sequence()
    base = C.fit_pool(cfg, 120 * GIB, 141 * GIB, "6/4", 12, 512, 1_048_576)
    spec = C.fit_pool(cfg, 120 * GIB, 141 * GIB, "6/4", 12, 512, 1_048_576, checkpoints=12)
    assert spec.state_bytes == base.state_bytes + 12 * one and 12 * one > GIB  # 27B: ~1.8 GB
    assert spec.by_memory == (120 * GIB - spec.state_bytes - spec.reserve_bytes) // spec.page_bytes < base.by_memory
    mtp = EngineConfig(speculator="mtp")
    assert cfg.mtp_num_hidden_layers > 0
    assert verify_checkpoints(mtp, cfg) == max(GRAPH_BUCKETS) == 12
    assert verify_checkpoints(mtp.replace(max_slots=3, max_batch_tokens=64), cfg) == 4  # buckets 1, 2, 4
    headless = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    assert verify_checkpoints(mtp, headless) == 0  # no head to draft
    assert verify_checkpoints(mtp.replace(speculator="ngram"), headless) == 12  # prompt lookup drafts for any
    assert verify_checkpoints(mtp.replace(cuda_graphs=False), cfg) == 0
    assert verify_checkpoints(EngineConfig(), cfg) == 0
    dense = dataclasses.replace(cfg, layer_types=("full_attention",) * cfg.num_hidden_layers)
    assert not dense.linear_layers and verify_checkpoints(mtp, dense) == 0


def test_fit_pool_caps_a_small_model_at_every_slots_context_twice():
    cfg = named_config("qwen3.8-27b")
    fit = C.fit_pool(cfg, 120 * GIB, 141 * GIB, "4/4", 2, 512, 4096)
    assert fit.cap == 2 * 2 * 8 + 1 and fit.pages == fit.cap < fit.by_memory
    odd = C.fit_pool(cfg, 120 * GIB, 141 * GIB, "4/4", 3, 512, 4097)  # a partial last page counts whole
    assert odd.cap == 2 * 3 * 9 + 1


def test_fit_pool_says_what_is_short_when_nothing_fits():
    cfg = named_config("qwen3.8-27b")
    fit = C.fit_pool(cfg, 7 * GIB, 24 * GIB, "16/16", 12, 512, 32768, keep_free_bytes=4 * GIB)
    assert not fit.fits and fit.pages < 2
    why = fit.why_not()
    assert "7.00 GiB of device memory is free" in why and "keep_free (4.00 GiB)" in why
    for bad in ({"free_bytes": -1}, {"keep_free_bytes": -1}, {"device_bytes": 0}):
        args = {"free_bytes": GIB, "device_bytes": 2 * GIB, "keep_free_bytes": 0, **bad}
        with pytest.raises(ValueError):
            C.fit_pool(cfg, args["free_bytes"], args["device_bytes"], "16/16", 1, 512, 1024,
                       keep_free_bytes=args["keep_free_bytes"])
    with pytest.raises(ValueError):
        C.plan_capacity(cfg, GIB, 24 * GIB, "16/16", 1, 1024, keep_free_bytes=-1)


def test_keep_free_reaches_the_app_config_from_the_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--keep-free-gb", "2.5"])
    assert app_args(args) == {"keep_free_gb": 2.5}
    assert AppConfig(keep_free_gb="1.5").keep_free_gb == 1.5
    assert AppConfig().keep_free_gb == 0.0
    with pytest.raises(ConfigError, match="keep_free_gb"):
        app_args(parser.parse_args(["serve", "--keep-free-gb", "-1"]))


def test_build_engine_on_the_cpu_takes_the_given_pool():
    from decapybara.server.engine_setup import build_engine

    served = build_engine(AppConfig(device="cpu", slots=2, kv_memory_gb=0.01))
    page = kv_bytes_per_token(served.engine.model.cfg, None) * 16
    assert not served.cuda and served.pool is None
    assert served.engine.cfg.num_pages == int(0.01 * GIB // page)
    assert build_engine(AppConfig(device="cpu", slots=2, num_pages=40)).engine.cfg.num_pages == 40
    assert build_engine(AppConfig(device="cpu", slots=2)).engine.cfg.num_pages == 4096  # the CPU's default


def test_plan_leaves_keep_free_out_of_the_pool(capsys):
    base = ["plan", "--config", "qwen3.8-27b", "--weights", "small", "--kv-mode", "6/4", "--vram-gb", "32",
            "--bandwidth-gbps", "1000", "--slots", "2", "--context", "8192"]

    def pool_tokens(argv: list[str]) -> int:
        assert main(argv) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("small "))
        return int(row.split()[5].replace(",", "")), out

    full, _ = pool_tokens(base)
    kept, out = pool_tokens(base + ["--keep-free-gb", "4"])
    assert "4.0 GiB kept free for other programs" in out
    per_page = kv_bytes_per_token(named_config("qwen3.8-27b"), "6/4") * 512
    assert full - kept in (4 * GIB // per_page * 512, (4 * GIB // per_page + 1) * 512)
    assert main(base + ["--keep-free-gb", "-1"]) == 2


def test_plan_sets_the_verification_checkpoints_aside(capsys):
    """`decapybara plan --speculator mtp|ngram` on a device: the rollback states of the slots' largest bucket (2
    slots: bucket 2) come out of the KV pool, as the server sets them aside; off, nothing does."""
    base = ["plan", "--config", "qwen3.8-27b", "--weights", "small", "--kv-mode", "6/4", "--vram-gb", "32",
            "--bandwidth-gbps", "1000", "--slots", "2", "--context", "8192"]

    def pool_tokens(argv: list[str]) -> tuple[int, str]:
        assert main(argv) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("small "))
        return int(row.split()[5].replace(",", "")), out

    cfg = named_config("qwen3.8-27b")
    off, out = pool_tokens(base)
    assert "rollback states" not in out
    for spec in ("mtp", "ngram"):
        spec_pool, out = pool_tokens(base + ["--speculator", spec])
        states = 2 * cfg.state_bytes_per_sequence()
        assert f"2 rollback states for speculative verification ({states / GIB:.1f} GiB)" in out
        per_page = kv_bytes_per_token(cfg, "6/4") * 512
        assert off - spec_pool in (states // per_page * 512, (states // per_page + 1) * 512), (off, spec_pool)
    with pytest.raises(SystemExit):
        main(base + ["--speculator", "eagle"])

"""`decapybara serve` flags map onto the validated app config; bad values are refused with exit code 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from decapybara.cli import main, make_parser
from decapybara.errors import ConfigError
from decapybara.server.cli_serve import app_args
from decapybara.server.config import AppConfig


def test_flags_map_onto_the_app_config():
    args = make_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "8080", "--kv-mode", "6/6",
                                     "--slots", "8", "--api-key", "k", "--context-mode", "fixed",
                                     "--set", "max_batch_tokens=1024"])
    settings = app_args(args)
    assert settings == {"kv_mode": "6/6", "slots": 8, "api_key": "k", "context_mode": "fixed",
                        "max_batch_tokens": "1024"}
    cfg = AppConfig(**settings)
    engine = cfg.engine_config(cuda=False)
    assert (engine.kv_mode, engine.max_slots, engine.context_mode, engine.max_batch_tokens) == ("6/6", 8, "fixed",
                                                                                                 1024)


def test_snapshot_memory_setting():
    assert AppConfig().engine_config(cuda=False).snapshot_budget_bytes is None  # the engine's default
    assert AppConfig(snapshot_memory_gb="0.5").engine_config(cuda=False).snapshot_budget_bytes == 2**29
    assert AppConfig(snapshot_memory_gb="0").engine_config(cuda=False).snapshot_budget(10) == 0


def test_prefill_weights_setting():
    """`--set prefill_weights=bf16` reaches the app config (the GPU actor's CUDA backend keeps bf16 copies of the
    quantised product weights); anything but packed / bf16 is refused."""
    args = make_parser().parse_args(["serve", "--set", "prefill_weights=bf16"])
    assert AppConfig(**app_args(args)).prefill_weights == "bf16"
    assert AppConfig().prefill_weights == "packed"
    with pytest.raises(ValueError, match="prefill_weights"):
        AppConfig(prefill_weights="fp8")


def test_bad_serve_flags_exit_with_2_before_starting_anything():
    from concurrent.futures import ThreadPoolExecutor

    bads = (["--kv-mode", "5/5"], ["--slots", "13"], ["--set", "no_such_field=1"], ["--set", "oops"],
            ["--rope-scaling", "off", "--max-model-len", "100000"],  # the GPU actor's own checks, made first
            ["--rope-scaling", "1m", "--max-model-len", "2000000"],
            ["--set", "page_size=3"], ["--set", "page_size=0"], ["--api-key", ""],
            ["--disk-cache", "file:///proc/decapybara-kv"])  # a folder that cannot be made

    def serve(bad: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "decapybara.cli", "serve", *bad], capture_output=True,
                              text=True, check=False, timeout=60)

    with ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool:  # processes side by side
        results = list(pool.map(serve, bads))
    for bad, r in zip(bads, results):
        assert r.returncode == 2 and "error" in r.stderr, (bad, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3, (bad, r.stderr)


def _cuda_devices() -> int:
    try:
        from cupy.cuda import runtime

        return runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy or no driver
        return 0


def test_serve_on_cuda_without_a_device_is_one_line():
    """`--device cuda` where CuPy finds no device is refused before Ray starts (not a failed deployment)."""
    if _cuda_devices():
        pytest.skip("this machine has a CUDA device")
    r = subprocess.run([sys.executable, "-m", "decapybara.cli", "serve", "--device", "cuda"], capture_output=True,
                       text=True, check=False, timeout=60)
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_build_app_refuses_what_the_gpu_actor_would_before_deploying(tmp_path):
    """`serve run serve_app:build_app ...` makes the same checks as `decapybara serve` (but the device's, which
    are the GPU actor's machine's): a bad setting is an error before any actor starts."""
    from pydantic import ValidationError

    from decapybara.errors import ConfigError
    from decapybara.server.ingress import build_app

    with pytest.raises(ValidationError, match="page_size must be a power of two"):
        build_app({"page_size": "3"})
    with pytest.raises(ConfigError, match="rope_scaling"):
        build_app({"rope_scaling": "off", "max_model_len": "100000"})
    with pytest.raises(ConfigError, match="disk_cache 'file:///proc/decapybara-kv' is not usable"):
        build_app({"disk_cache": "file:///proc/decapybara-kv"})
    assert build_app({"disk_cache": f"file://{tmp_path}/kv"}) is not None and (tmp_path / "kv").is_dir()
    for off in ({"disk_cache_gb": "0"}, {"ram_cache_gb": "0"}):  # no disk tier: its folder is not used
        assert build_app({"disk_cache": "file:///proc/decapybara-kv", **off}) is not None


def test_a_setting_given_at_its_default_beside_a_preset_still_wins(tmp_path):
    """`--preset medium --slots 12` (or `serve run serve_app:build_app preset=medium slots=12`) serves 12
    conversations: the settings the deployment hands its actors keep every setting given, even one equal to its
    default, so that the actors' AppConfig does not fall back to the preset's 4."""
    from decapybara.server.ingress import actor_settings, build_app

    given = {"preset": "medium", "slots": "12", "disk_cache": f"file://{tmp_path}/kv"}
    cfg = AppConfig(**given)
    assert cfg.engine_config(cuda=False).max_slots == 12
    settings = actor_settings(cfg)
    assert AppConfig(**settings).engine_config(cuda=False).max_slots == 12
    assert AppConfig(**actor_settings(AppConfig(preset="medium"))).engine_config(cuda=False).max_slots == 4
    bound = build_app(given)._bound_deployment.init_args[0]  # what Serve starts the ingress (and its actors) with
    assert AppConfig(**bound).engine_config(cuda=False).max_slots == 12


def test_sigterm_stops_the_server_as_ctrl_c_does():
    """`decapybara serve` turns SIGTERM into the KeyboardInterrupt that ends its blocking run quietly."""
    import os
    import signal

    from decapybara.server.cli_serve import stop_on_sigterm

    before = signal.getsignal(signal.SIGTERM)
    try:
        stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs between bytecodes
                pass
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("field", ["ram_cache_gb", "disk_cache_gb", "kv_memory_gb", "keep_free_gb",
                                   "snapshot_memory_gb", "responses_store_mb"])
def test_memory_budgets_must_be_finite(field):
    """The actors turn each budget into a byte count (int(gb * 2**30)): an infinite one is refused with the other
    bad settings, before Ray starts, not as an OverflowError in an actor."""
    with pytest.raises(ValueError, match=field):
        AppConfig(**{field: "inf"})
    args = make_parser().parse_args(["serve", "--set", f"{field}=inf"])
    with pytest.raises(ConfigError, match=field):
        app_args(args)
    assert getattr(AppConfig(**{field: "2"}), field) == 2.0


@pytest.mark.parametrize("port", ["0", "-1", "65536", "70000"])
def test_a_port_out_of_range_is_refused_before_ray_starts(port, monkeypatch, capsys):
    ray = pytest.importorskip("ray")

    def no_ray(*a, **k):
        raise AssertionError("Ray started")

    monkeypatch.setattr(ray, "init", no_ray)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", port])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err
    assert make_parser().parse_args(["serve", "--port", "65535"]).port == 65535


@pytest.mark.parametrize("argv, says", [
    (["--kv-mode", "6/6", "--set", "kv_mode=4/4"], "kv_mode is given twice (--kv-mode and --set kv_mode=4/4)"),
    (["--slots", "4", "--set", "slots=8"], "slots is given twice (--slots and --set slots=8)"),
    (["--set", "page_size=16", "--set", "page_size=32"], ("page_size is given twice (--set page_size=16 and "
                                                           "--set page_size=32)")),
])
def test_a_setting_given_twice_is_refused(argv, says):
    """A flag and a --set of the same setting (or two --set) conflict: one of them would be dropped unsaid."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        app_args(make_parser().parse_args(["serve", *argv]))
    assert app_args(make_parser().parse_args(["serve", "--kv-mode", "6/6", "--set", "page_size=16"])) == \
        {"kv_mode": "6/6", "page_size": "16"}


def test_python_m_decapybara_is_the_command():
    """`python3 -m decapybara` runs the `decapybara` command (its subcommands, its exit codes)."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "decapybara", "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "serve" in ok.stdout and "plan" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "decapybara", "info", "/nonexistent.mcapy"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode in (1, 2) and "decapybara: error:" in bad.stderr

"""`decapybara settings`: every server setting explained (the launcher's "?"), from AppConfig itself."""

from __future__ import annotations

import json

import pytest

from decapybara.cli import main
from decapybara.launcher.cli_settings import describe, serve_flags
from decapybara.server import cli_serve
from decapybara.server.config import AppConfig


def test_every_setting_says_what_it_does_and_its_serve_flag():
    rows = {r["name"]: r for r in describe()}
    assert set(rows) == set(AppConfig.model_fields)
    assert all(len(r["description"]) > 20 for r in rows.values()), [n for n, r in rows.items() if not r["description"]]
    assert serve_flags() == {field: "--" + flag.replace("_", "-") for flag, field in cli_serve.FLAGS.items()}
    assert rows["slots"]["bounds"] == ["ge 1", "le 12"] and rows["slots"]["default"] == 12
    assert rows["loop_guard"]["type"] == "stop | end_thinking | escape | off"
    assert rows["kv_mode"]["flag"] == "--kv-mode" and rows["seed"]["flag"] is None


def test_the_command_prints_them_and_names_the_closest_to_a_typo(capsys):
    assert main(["settings", "kv_mode", "responses_flush_s"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kv_mode = (none)") and "decapybara serve --kv-mode" in out and "16/16" in out
    assert "responses_flush_s = 1.0" in out and "crash" in out
    assert main(["settings", "--json"]) == 0
    assert {r["name"] for r in json.loads(capsys.readouterr().out)} == set(AppConfig.model_fields)
    assert main(["settings", "kv_mod"]) == 2
    assert "did you mean kv_mode" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["slots", "kv_mode", "rope_scaling"])
def test_a_settings_flag_sets_it(name):
    """The flag `settings` names for a setting is the one `decapybara serve` parses into it."""
    flag = describe([name])[0]["flag"]
    value = {"slots": "3", "kv_mode": "6/4", "rope_scaling": "off"}[name]
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    cli_serve.add_parser(sub)
    args = sub.choices["serve"].parse_args([flag, value])
    assert str(getattr(args, next(f for f, field in cli_serve.FLAGS.items() if field == name))) == value

"""The one settings schema: TOML files, presets, flags, precedence and validation messages."""
from __future__ import annotations

import argparse
import re
import tomllib

import pytest

from engine import config
from engine.config import Config
from engine.errors import UserError


def parse(*argv: str) -> Config:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    config.add_arguments(p)
    return config.from_args(p.parse_args(list(argv)))


def test_every_field_has_one_flag_and_one_toml_key():
    fields = {f for f in Config.__dataclass_fields__}
    assert fields == set(config.FIELDS)
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    flags = {s for a in p._actions for s in a.option_strings}
    assert {config.flag(f) for f in fields if f != "model"} <= flags and {"-c", "-t"} <= flags


def test_policies_match_the_hybrid_engine():
    from engine.moe.policy import POLICIES

    assert config.POLICIES == POLICIES


def test_flags_are_parsed_and_typed():
    cfg = parse("m.gguf", "-c", "8192", "-t", "6", "--moe-expert-cache-size", "all", "--moe-gpu-miss-fraction", "0.25",
                "--moe-profile-adapt", "lru", "--vram-budget-mib", "8000", "--engine", "llamacpp")
    assert (cfg.model, cfg.ctx, cfg.threads, cfg.moe_expert_cache_size) == ("m.gguf", 8192, 6, "all")
    assert cfg.miss_fraction == 0.25 and cfg.moe_profile_adapt == "lru" and cfg.vram_budget_mib == 8000
    assert parse("m", "--moe-expert-cache-size", "12").moe_expert_cache_size == 12
    assert parse("m").miss_fraction is None  # auto: measured at load (engine/moe/tune.py)


@pytest.mark.parametrize("argv, message", [
    (("--moe-expert-cache-size", "lots"), "moe_expert_cache_size must be 'auto' or 'all' or an integer >= 0"),
    (("--moe-gpu-miss-fraction", "2"), "moe_gpu_miss_fraction must be 'auto' or a number in [0, 1], got '2'"),
    (("-c", "-1"), "ctx must be an integer >= 0, got '-1'"),
    (("--port", "70000"), "port must be an integer in [0, 65535]"),
    (("--engine", "vllm"), "engine must be one of: auto, hybrid, llamacpp"),
    (("--moe-profile-adapt", "fifo"), "moe_profile_adapt must be one of: off, occurrence"),
    (("--device", "gpu"), "device must be auto, cpu, cuda or cuda:N"),
    (("--moe-expert-cache-size", "4", "--moe-expert-cache-mib", "100"), "not both"),
])
def test_validation_messages(argv, message):
    with pytest.raises(UserError, match=re.escape(message)):
        parse("m", *argv)


def test_toml_round_trip_and_precedence(tmp_path, monkeypatch):
    cfg = Config(model="/models/q3.gguf", ctx=16384, api_key='k"ey\\', moe_expert_cache_size=20, load_mode="none")
    path = config.write_toml(tmp_path / "s.toml", cfg)
    text = path.read_text()
    assert "port" not in text  # defaults are not written
    assert tomllib.loads(text)["api_key"] == 'k"ey\\' and Config(**config.read_toml(path)) == cfg
    config.save_preset("big-ctx", Config(ctx=32768, threads=3))
    assert "big-ctx" in config.list_presets() and config.preset_path("big-ctx").parent == config.presets_dir()
    # defaults < preset < --config < flags < positional model
    got = parse("other.gguf", "--preset", "big-ctx", "--config", str(path), "-t", "5")
    assert (got.model, got.ctx, got.threads, got.moe_expert_cache_size) == ("other.gguf", 16384, 5, 20)
    monkeypatch.setenv(config.API_KEY_ENV, "from-env")
    assert parse("m").api_key == "from-env" and parse("m", "--api-key", "flag").api_key == "flag"
    assert Config(api_key="secret").public()["api_key"] == "***"


def test_file_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("ctxx = 5\n")
    with pytest.raises(UserError, match="unknown setting.*ctxx"):
        config.read_toml(bad)
    bad.write_text("ctx = 'big'\n")
    with pytest.raises(UserError, match="bad.toml: ctx must be an integer"):
        config.read_toml(bad)
    bad.write_text("ctx = \n")
    with pytest.raises(UserError, match="not valid TOML"):
        config.read_toml(bad)
    with pytest.raises(UserError, match="no preset named 'nope'"):
        config.load_preset("nope")
    with pytest.raises(UserError, match="preset name"):
        config.preset_path("../escape")

"""Engine settings: YAML, environment and overrides, with errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig, load_config

REPO = Path(__file__).resolve().parents[2]


def test_default_yaml_serves_the_embedded_model_on_the_cpu():
    config = load_config(EngineConfig, REPO / "configs" / "default.yaml", environ={})
    assert config.model == "default"
    assert config.device == "cpu"
    assert config.kv_cache_memory == 2 * 1024**3


def test_precedence_is_yaml_then_environment_then_overrides(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("block_size: 8\nmax_num_seqs: 4\nseed: 1\n")
    env = {"PAGEDSERVE_MAX_NUM_SEQS": "16", "PAGEDSERVE_SEED": "2"}
    config = load_config(EngineConfig, path, overrides={"seed": 3}, environ=env)
    assert (config.block_size, config.max_num_seqs, config.seed) == (8, 16, 3)


def test_environment_values_are_parsed():
    env = {"PAGEDSERVE_ENABLE_PREFIX_CACHING": "false", "PAGEDSERVE_KV_CACHE_MEMORY": "1GiB"}
    config = load_config(EngineConfig, environ=env)
    assert config.enable_prefix_caching is False
    assert config.kv_cache_memory == 1024**3


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("blok_size: 16\n", "unknown setting 'blok_size'"),
        ("block_size: -4\n", "invalid setting 'block_size'"),
        ("memory_utilization: 1.5\n", "invalid setting 'memory_utilization'"),
        ("dtype: float8\n", "invalid setting 'dtype'"),
        ("- a list\n", "must hold a mapping"),
    ],
)
def test_invalid_yaml_names_the_key(tmp_path: Path, yaml_text: str, message: str):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(EngineConfig, path, environ={})
    assert "\n" not in str(info.value)


def test_missing_config_file_is_reported(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(EngineConfig, tmp_path / "nope.yaml", environ={})


def test_an_unknown_environment_variable_stops_loading_with_its_name():
    environ = {"PAGEDSERVE_MAX_NUM_SEQ": "4", "PAGEDSERVE_CACHE": "/tmp/x", "OTHER": "1"}
    with pytest.raises(ConfigError, match="PAGEDSERVE_MAX_NUM_SEQ") as error:
        load_config(EngineConfig, environ=environ)
    assert "PAGEDSERVE_CACHE" not in str(error.value)  # not a setting, but a known variable


def test_a_part_of_the_settings_warns_of_the_rest(caplog: pytest.LogCaptureFixture):
    config = load_config(
        EngineConfig, environ={"PAGEDSERVE_PORT": "9000"}, strict_environment=False
    )
    assert config == EngineConfig()
    assert "PAGEDSERVE_PORT" in caplog.text


LIMITS = ("max_stop_sequences", "max_stop_length", "max_stop_token_ids", "max_logit_bias_entries")


@pytest.mark.parametrize("key", LIMITS)
@pytest.mark.parametrize("value", ["0", "-5", "many", "1.5"])
def test_a_bad_request_limit_stops_loading_naming_it(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"invalid setting '{key}'"):
        load_config(EngineConfig, environ={f"PAGEDSERVE_{key.upper()}": value})


def test_request_limits_come_from_the_settings(tmp_path: Path) -> None:
    defaults = EngineConfig().request_limits()
    assert (defaults.max_stop_sequences, defaults.max_stop_length) == (64, 1000)
    assert (defaults.max_stop_token_ids, defaults.max_logit_bias_entries) == (1024, 1024)
    path = tmp_path / "c.yaml"
    path.write_text("max_stop_sequences: 200\nmax_stop_length: 5000\n")
    env = {"PAGEDSERVE_MAX_STOP_TOKEN_IDS": "4096", "PAGEDSERVE_MAX_LOGIT_BIAS_ENTRIES": "8"}
    limits = load_config(EngineConfig, path, environ=env).request_limits()
    assert (limits.max_stop_sequences, limits.max_stop_length) == (200, 5000)
    assert (limits.max_stop_token_ids, limits.max_logit_bias_entries) == (4096, 8)


SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_speculative_config_from_yaml_environment_or_overrides(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "speculative_config:\n  method: ngram\n  num_speculative_tokens: 4\n"
        "  prompt_lookup_max: 3\n"
    )
    from_yaml = load_config(EngineConfig, path, environ={}).speculative_config
    variable = {"PAGEDSERVE_SPECULATIVE_CONFIG": json.dumps(SPECULATIVE)}
    from_environment = load_config(EngineConfig, environ=variable).speculative_config
    override = {"speculative_config": SPECULATIVE}
    from_override = load_config(EngineConfig, overrides=override, environ={}).speculative_config
    assert from_yaml == from_environment == from_override
    assert from_yaml is not None
    # vLLM's rule: one n-gram bound sets the other.
    assert (from_yaml.prompt_lookup_min, from_yaml.prompt_lookup_max) == (3, 3)
    assert from_yaml.disable_by_batch_size == 4


@pytest.mark.parametrize("off", ["{}", "", "null"])
def test_an_empty_speculative_config_turns_it_off(off: str) -> None:
    variable = {"PAGEDSERVE_SPECULATIVE_CONFIG": off}
    assert load_config(EngineConfig, environ=variable).speculative_config is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"num_speculative_tokens": 2}, "'speculative_config.method': Field required"),
        ({"method": "ngram"}, "'speculative_config.num_speculative_tokens': Field required"),
        (SPECULATIVE | {"prompt_lookup_min": 4}, "prompt_lookup_min (4) must be at most"),
        (SPECULATIVE | {"prompt_lookup_max": 0}, "'speculative_config.prompt_lookup_max'"),
        (SPECULATIVE | {"draft_model": "x"}, "unknown setting 'speculative_config.draft_model'"),
    ],
)
def test_a_bad_speculative_config_names_the_key(value: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(EngineConfig, overrides={"speculative_config": value}, environ={})
    assert message in str(error.value) and "\n" not in str(error.value)

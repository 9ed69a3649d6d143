"""ServeConfig layering and the command line generated from its fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig, load_config
from pagedserve.cli import build_parser
from server.config import DEFAULT_PRESET, ServeConfig, resolve_serve_config

REPO = Path(__file__).resolve().parents[2]


def test_default_preset_equals_configs_default_yaml() -> None:
    from_file = load_config(ServeConfig, REPO / "configs" / "default.yaml", environ={})
    assert resolve_serve_config(None, {}, {}) == from_file
    assert resolve_serve_config(None, {}, {}) == ServeConfig(**DEFAULT_PRESET)


def test_preset_applies_only_without_config_and_model(tmp_path: Path) -> None:
    assert resolve_serve_config(None, {"model": "some/model"}, {}).device == "auto"
    assert resolve_serve_config(None, {}, {"PAGEDSERVE_MODEL": "some/model"}).device == "auto"
    config_file = tmp_path / "c.yaml"
    config_file.write_text("block_size: 32\n")
    assert resolve_serve_config(config_file, {}, {}).kv_cache_memory is None
    # A flag beside the preset still wins, and the environment beats the preset.
    assert resolve_serve_config(None, {"max_num_seqs": "4"}, {}).max_num_seqs == 4
    assert resolve_serve_config(None, {}, {"PAGEDSERVE_DEVICE": "auto"}).device == "auto"


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    config_file = tmp_path / "c.yaml"
    config_file.write_text("model: m\nport: 1000\nmax_num_seqs: 8\nblock_size: 32\n")
    environ = {"PAGEDSERVE_PORT": "2000", "PAGEDSERVE_MAX_NUM_SEQS": "16"}
    config = resolve_serve_config(config_file, {"max_num_seqs": "64"}, environ)
    assert (config.block_size, config.port, config.max_num_seqs) == (32, 2000, 64)


def test_api_key_from_environment_verbatim() -> None:
    config = resolve_serve_config(None, {}, {"PAGEDSERVE_API_KEY": "007"})
    assert config.api_key is not None and config.api_key.get_secret_value() == "007"
    assert "007" not in repr(config)
    flag = resolve_serve_config(None, {"api_key": "flag"}, {"PAGEDSERVE_API_KEY": "env"})
    assert flag.api_key is not None and flag.api_key.get_secret_value() == "flag"
    assert resolve_serve_config(None, {}, {"PAGEDSERVE_API_KEY": ""}).api_key is None


def test_engine_config_keeps_the_engine_settings() -> None:
    config = ServeConfig(model="m", block_size=32, port=1, api_key="k")
    engine = config.engine_config()
    assert type(engine) is EngineConfig
    assert engine == EngineConfig(model="m", block_size=32)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"block_size": "-1"}, "block_size"),
        ({"port": "99999"}, "port"),
        ({"dtype": "int3"}, "dtype"),
        ({"max_tools": "0"}, "max_tools"),
        ({"max_stop_sequences": "lots"}, "max_stop_sequences"),
    ],
)
def test_invalid_settings_raise_config_error_naming_them(overrides: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        resolve_serve_config(None, overrides, {})


def test_every_setting_has_a_flag() -> None:
    args = build_parser().parse_args(["serve"])
    assert set(ServeConfig.model_fields) <= set(vars(args))
    assert all(getattr(args, name) is None for name in ServeConfig.model_fields)
    args = build_parser().parse_args(
        ["serve", "--max-num-seqs", "4", "--no-enable-prefix-caching", "--served-model-name", "x"]
    )
    assert (args.max_num_seqs, args.enable_prefix_caching, args.served_model_name) == (
        "4",
        False,
        "x",
    )


def test_several_api_keys_from_a_list_and_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team a\nsk-a\n\n  sk-b  \n")
    config_file = tmp_path / "c.yaml"
    config_file.write_text(f"api_key: [sk-1, sk-2]\napi_key_file: {key_file}\n")
    config = resolve_serve_config(config_file, {}, {})
    assert config.api_keys() == ["sk-1", "sk-2", "sk-a", "sk-b"]
    assert "sk-1" not in repr(config)
    assert resolve_serve_config(None, {"api_key": "k"}, {}).api_keys() == ["k"]
    assert resolve_serve_config(None, {}, {}).api_keys() == []


@pytest.mark.parametrize(
    ("setting", "words"),
    [("api_key: []", "at least one key"), ("api_key: ['k', '']", "no empty one")],
)
def test_a_list_of_keys_may_not_be_empty(tmp_path: Path, setting: str, words: str) -> None:
    config_file = tmp_path / "c.yaml"
    config_file.write_text(setting + "\n")
    with pytest.raises(ConfigError, match=f"api_key.*{words}"):
        resolve_serve_config(config_file, {}, {})


def test_a_key_file_must_hold_a_key(tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("# nobody yet\n\n")
    with pytest.raises(ConfigError, match=r"api_key_file.*holds no key"):
        resolve_serve_config(None, {"api_key_file": str(empty)}, {})
    with pytest.raises(ConfigError, match=r"api_key_file.*cannot read"):
        resolve_serve_config(None, {"api_key_file": str(tmp_path / "missing")}, {})

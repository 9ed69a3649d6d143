"""ServeConfig layering and the command line generated from its fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig, load_config
from pagedserve.cli import build_parser, models_from_flags
from server.config import DEFAULT_PRESET, ServeConfig, keep_alive_seconds, resolve_serve_config

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
    """Every setting but `models` (`--model NAME=SOURCE`, repeated) has its flag."""
    args = build_parser().parse_args(["serve"])
    settings = set(ServeConfig.model_fields) - {"models"}
    assert settings <= set(vars(args)) and "models" not in vars(args)
    assert all(getattr(args, name) is None for name in settings)
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


def _settings(argv: list[str], tmp_path: Path | None = None) -> ServeConfig:
    """The ServeConfig `pagedserve serve ARGV` runs with (without starting it)."""
    args = build_parser().parse_args(["serve", *argv])
    overrides = {name: getattr(args, name, None) for name in ServeConfig.model_fields}
    return resolve_serve_config(args.config, overrides | models_from_flags(args.model or []), {})


def test_model_flags_name_several_models_and_one_keeps_its_meaning(tmp_path: Path) -> None:
    one = _settings(["--model", str(tmp_path)])
    assert one.model == str(tmp_path) and one.models is None
    several = _settings(["--model", f"a={tmp_path}", "--model", "b=default", "--keep-alive", "5m"])
    assert [(entry.name, entry.model) for entry in several.models or []] == [
        ("a", str(tmp_path)),
        ("b", "default"),
    ]
    assert several.keep_alive == 300.0
    assert several.engine_config(several.models[1]).model == "default"  # type: ignore[index]
    with pytest.raises(ConfigError, match="name every model"):
        _settings(["--model", "a=default", "--model", str(tmp_path)])
    with pytest.raises(ConfigError, match="more than once"):
        _settings(["--model", "default", "--model", str(tmp_path)])


def test_models_from_a_file_with_their_own_settings(tmp_path: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text(
        "kv_cache_memory: 1GiB\nmax_loaded_models: 1\nmodels:\n"
        "  - {name: small, model: default, kv_cache_memory: 256MiB, keep_alive: -1}\n"
        "  - {name: fp32, model: default, quantization: none, keep_alive: 90s}\n"
    )
    settings = _settings(["--config", str(config)])
    small, fp32 = settings.models or []
    assert settings.engine_config(small).kv_cache_memory == 256 * 2**20
    assert settings.engine_config(fp32).kv_cache_memory == 2**30
    assert settings.engine_config(fp32).quantization == "none"
    assert (small.keep_alive, fp32.keep_alive) == (float("inf"), 90.0)


@pytest.mark.parametrize(
    ("models", "named"),
    [
        ([{"name": "a", "model": "default"}, {"name": "a", "model": "default"}], "'a' twice"),
        ([{"name": "a", "model": "default", "max_num_seq": 4}], "'max_num_seq'"),
        ([{"name": "a", "model": "default", "max_num_seqs": 0}], "model 'a': 'max_num_seqs'"),
        ([{"name": "a", "model": "default", "keep_alive": "soon"}], "'soon'"),
        ([], "at least one"),
    ],
)
def test_bad_models_are_refused_by_name(models: list, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        resolve_serve_config(None, {"models": models}, {})


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(0, 0.0), ("0", 0.0), (-1, float("inf")), ("-1m", float("inf")), ("1h30m", 5400.0),
     ("500ms", 0.5), (2.5, 2.5), ("300", 300.0)],
)  # fmt: skip
def test_keep_alive_reads_ollamas_durations(value: object, seconds: float) -> None:
    assert keep_alive_seconds(value) == seconds

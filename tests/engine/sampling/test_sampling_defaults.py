"""Sampling defaults from generation configs (engine/sampling/params.py), the two
settings that choose them, and the offline `LLM`'s use of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import GenerationConfig

from engine import LLM
from engine.config import ConfigError, EngineConfig, load_config
from engine.sampling.params import (
    ensure_generation_config,
    resolve_defaults,
    sampling_defaults,
    with_defaults,
)


def _folder(tmp_path: Path, name: str, values: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_only_the_sampling_keys_vllm_reads_count_and_do_sample_is_ignored() -> None:
    written = {
        "do_sample": False,  # vLLM ignores it: the temperature still applies
        "temperature": 0.3,
        "top_k": 20,
        "max_new_tokens": 7,
        "eos_token_id": 2,
        "num_beams": 4,
        "min_p": None,
    }
    assert sampling_defaults(written) == {"temperature": 0.3, "top_k": 20, "max_tokens": 7}


def test_only_values_written_in_the_file_count(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "model", {"temperature": 0.6, "eos_token_id": 2})
    loaded = GenerationConfig.from_pretrained(folder)
    # Whatever transformers' class defaults are (top_k 50 in 4.x), none of them leaks in.
    assert resolve_defaults("auto", {}, loaded) == (
        {"temperature": 0.6},
        "the model's generation config",
    )


def test_vllm_ignores_the_model_and_a_path_replaces_it(tmp_path: Path) -> None:
    model = GenerationConfig.from_pretrained(_folder(tmp_path, "model", {"temperature": 0.6}))
    other = _folder(tmp_path, "other", {"top_p": 0.5, "max_new_tokens": 9})
    assert resolve_defaults("vllm", {}, model) == ({}, "")
    defaults, source = resolve_defaults(str(other), {}, model)
    assert defaults == {"top_p": 0.5, "max_tokens": 9}
    assert source == f"the generation config in {other}"


def test_overrides_win_and_extend(tmp_path: Path) -> None:
    model = GenerationConfig.from_pretrained(
        _folder(tmp_path, "model", {"temperature": 0.6, "top_p": 0.8})
    )
    defaults, source = resolve_defaults("auto", {"temperature": 0.1, "min_p": 0.05}, model)
    assert defaults == {"temperature": 0.1, "top_p": 0.8, "min_p": 0.05}
    assert source == "the model's generation config and override_generation_config"
    assert resolve_defaults("vllm", {"top_k": 5}, model) == (
        {"top_k": 5},
        "override_generation_config",
    )


def test_an_invalid_value_in_a_model_folder_names_the_source_and_key(tmp_path: Path) -> None:
    model = GenerationConfig.from_pretrained(_folder(tmp_path, "model", {"top_p": 1.5}))
    with pytest.raises(ValueError, match=r"from the model's generation config: top_p=1\.5"):
        resolve_defaults("auto", {}, model)


def test_a_request_value_wins_and_none_is_not_given() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 50}
    requested = {"temperature": 0.0, "top_p": None, "max_tokens": None, "n": 2}
    assert with_defaults(requested, defaults) == {
        "temperature": 0.0,
        "top_p": 0.9,
        "max_tokens": 50,
        "n": 2,
    }


def test_override_generation_config_from_yaml_environment_and_flags(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("override_generation_config:\n  temperature: 0.5\n  top_k: 40\n")
    assert load_config(EngineConfig, yaml_file, environ={}).override_generation_config == {
        "temperature": 0.5,
        "top_k": 40,
    }
    env = {"PAGEDSERVE_OVERRIDE_GENERATION_CONFIG": '{"min_p": 0.05}'}
    assert load_config(EngineConfig, environ=env).override_generation_config == {"min_p": 0.05}
    flag = {"override_generation_config": '{"max_new_tokens": 64}'}
    config = load_config(EngineConfig, overrides=flag, environ={})
    assert config.override_generation_config == {"max_new_tokens": 64}
    assert EngineConfig().override_generation_config == {}
    assert EngineConfig().generation_config == "auto"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"temp": 0.5}', "unknown key 'temp'"),
        ('{"max_tokens": 5}', "unknown key 'max_tokens'"),
        ('{"temperature": -1}', "temperature=-1: temperature must be >= 0.0"),
        ('{"top_p": 0}', "top_p=0: top_p must be in (0, 1]"),
        ('{"top_k": "40"}', "top_k='40': top_k must be an integer"),
        ('{"max_new_tokens": 0}', "max_new_tokens=0"),
        ("temperature=0.5", "not a JSON object"),
        ("[1]", "valid dictionary"),
    ],
)
def test_a_bad_override_is_a_config_error_naming_it(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(EngineConfig, overrides={"override_generation_config": value}, environ={})
    assert "invalid setting 'override_generation_config'" in str(error.value)
    assert message in str(error.value)


def test_generation_config_is_auto_vllm_or_a_folder_with_the_file(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "gc", {"temperature": 0.5})
    assert EngineConfig(generation_config=str(folder)).generation_config == str(folder)
    assert EngineConfig(generation_config="vllm").generation_config == "vllm"
    for bad in (str(tmp_path), str(tmp_path / "absent"), "Auto"):
        with pytest.raises(ConfigError, match="invalid setting 'generation_config'"):
            load_config(EngineConfig, overrides={"generation_config": bad}, environ={})


def test_ensure_generation_config_adds_values_and_keeps_the_rest(tmp_path: Path) -> None:
    # A folder converted before the defaults existed: token ids only.
    folder = _folder(tmp_path, "old", {"_from_model_config": True, "eos_token_id": 2})
    ensure_generation_config(folder, {"temperature": 0.2, "top_p": 0.9})
    path = folder / "generation_config.json"
    assert json.loads(path.read_text()) == {"eos_token_id": 2, "temperature": 0.2, "top_p": 0.9}
    assert [p.name for p in folder.iterdir()] == ["generation_config.json"]
    before = path.stat().st_mtime_ns
    ensure_generation_config(folder, {"temperature": 0.2})  # already there: not rewritten
    assert path.stat().st_mtime_ns == before
    empty = tmp_path / "empty"
    empty.mkdir()
    ensure_generation_config(empty, {"top_k": 3})
    assert json.loads((empty / "generation_config.json").read_text()) == {"top_k": 3}


def test_offline_generate_without_params_takes_the_defaults(tiny_model_paths: dict) -> None:
    settings = {"dtype": "float32", "kv_cache_memory": "16MiB"}
    override = {"temperature": 0, "max_new_tokens": 2}
    llm = LLM(str(tiny_model_paths["llama"]), override_generation_config=override, **settings)
    [output] = llm.generate("The quick brown fox", use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2
    assert output.outputs[0].finish_reason == "length"

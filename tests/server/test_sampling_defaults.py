"""Sampling defaults from generation configs, served: they fill the fields a request leaves
out (or sends as null), a request's own values win, and /v1/models shows them."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.cli import main
from tests.server.conftest import client, live_server, tiny_config

# The served model's own generation config: greedy, and 3 tokens unless asked otherwise.
MODEL_SAMPLING = {"temperature": 0.0, "max_new_tokens": 3}
CHAT = [{"role": "user", "content": "Paged attention"}]


@pytest.fixture(scope="module")
def model_folder(tiny_model_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The tiny Llama with sampling values written into its generation_config.json."""
    folder = tmp_path_factory.mktemp("with-defaults") / "tiny"
    shutil.copytree(tiny_model_paths["llama"], folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | MODEL_SAMPLING))
    return folder


@pytest.fixture(scope="module")
def auto_server(model_folder: Path) -> Iterator[str]:
    with live_server(tiny_config(model_folder, served_model_name="tiny")) as url:
        yield url


def _completion(url: str, **fields: object) -> dict:
    body = {"model": "tiny", "prompt": "Paged attention", "ignore_eos": True, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _chat(url: str, **fields: object) -> dict:
    body = {"model": "tiny", "messages": CHAT, "ignore_eos": True, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _texts(reply: dict) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in reply["choices"]]


def test_the_model_defaults_fill_omitted_and_null_fields(auto_server: str) -> None:
    for reply in (
        _chat(auto_server),
        _completion(auto_server),
        _completion(auto_server, max_tokens=None),
    ):
        assert reply["usage"]["completion_tokens"] == 3
        assert reply["choices"][0]["finish_reason"] == "length"
    # temperature 0 by default: n seeded samples are all the greedy answer.
    for temperature in ({}, {"temperature": None}):
        greedy = _completion(auto_server, n=4, seed=1, max_tokens=8, **temperature)
        assert len(set(_texts(greedy))) == 1
        assert _texts(greedy)[0] == _texts(_completion(auto_server, max_tokens=8, temperature=0))[0]
    assert len(set(_texts(_chat(auto_server, n=4, seed=1, max_tokens=8)))) == 1


def test_a_request_value_wins_over_the_defaults(auto_server: str) -> None:
    assert _chat(auto_server, max_tokens=5)["usage"]["completion_tokens"] == 5
    assert _chat(auto_server, max_completion_tokens=6)["usage"]["completion_tokens"] == 6
    assert _completion(auto_server, max_tokens=7)["usage"]["completion_tokens"] == 7
    sampled = _completion(auto_server, n=4, seed=1, max_tokens=8, temperature=2.0)
    assert len(set(_texts(sampled))) > 1


def test_models_show_the_defaults_to_the_openai_client(auto_server: str) -> None:
    [card] = client(auto_server).models.list().data
    assert card.id == "tiny"
    assert card.model_extra["default_sampling_params"] == {"temperature": 0.0, "max_tokens": 3}


def test_vllm_ignores_the_model_generation_config(model_folder: Path) -> None:
    config = tiny_config(model_folder, served_model_name="tiny", generation_config="vllm")
    with live_server(config) as url:
        [card] = client(url).models.list().data
        assert card.model_extra["default_sampling_params"] == {}
        assert _completion(url)["usage"]["completion_tokens"] == 16  # OpenAI's default
        # The neutral temperature 1 samples: the same seeded request is no longer greedy.
        assert len(set(_texts(_completion(url, n=4, seed=1, max_tokens=8)))) > 1


def test_a_folder_replaces_the_model_config_and_overrides_win(
    model_folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"max_new_tokens": 5, "top_k": 1}')
    config = tiny_config(
        model_folder,
        served_model_name="tiny",
        generation_config=str(folder),
        override_generation_config={"max_new_tokens": 4},
    )
    with caplog.at_level(logging.INFO, logger="engine.engine_builder"), live_server(config) as url:
        [card] = client(url).models.list().data
        assert card.model_extra["default_sampling_params"] == {"top_k": 1, "max_tokens": 4}
        assert _completion(url)["usage"]["completion_tokens"] == 4
    [line] = [r.getMessage() for r in caplog.records if "Default sampling" in r.getMessage()]
    assert line == (
        "Default sampling parameters have been overridden by the generation config in "
        f"{folder} and override_generation_config: {{'top_k': 1, 'max_tokens': 4}}"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--override-generation-config", '{"temp": 0.5}'], "unknown key 'temp'"),
        (["--override-generation-config", '{"top_p": 2}'], "top_p=2: top_p must be <= 1.0"),
        (["--generation-config", "/nonexistent"], "invalid setting 'generation_config'"),
    ],
)
def test_bad_generation_settings_stop_the_cli_in_one_line(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *args]) == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1 and expected in stderr, stderr

"""One live server on the tiny Llama, shared by the bench tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import live_server, tiny_config


@pytest.fixture(scope="package")
def tiny_server(tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    """The base URL of a server on the tiny Llama, served as 'tiny'."""
    config = tiny_config(tiny_model_paths["llama"], served_model_name="tiny")
    with live_server(config) as url:
        yield url

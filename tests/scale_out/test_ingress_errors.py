"""The server's own error conformance tests (`tests/server/test_errors.py`: bad requests,
the API key, typed client errors, refusals), collected here again against the Ray Serve
ingress over two tiny replicas that require a key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")

from tests.scale_out.conftest import deployed
from tests.server.conftest import tiny_config
from tests.server.test_errors import *  # noqa: F403 (the server's tests, run here too)
from tests.server.test_errors import KEY

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def keyed_server(serve_url: str, tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    """The ingress over two keyed replicas of the tiny Llama served as 'tiny', for the
    server's tests that take `keyed_server`."""
    config = tiny_config(tiny_model_paths["llama"], served_model_name="tiny", api_key=KEY)
    with deployed(serve_url, config) as url:
        yield url

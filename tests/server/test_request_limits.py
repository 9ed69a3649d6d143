"""Bounds on what one request may carry, as settings: past each, a 400 that names the field
and the setting; a server whose setting is raised accepts more."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import live_server, tiny_config

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}


# (field, setting, a body past the default, past the raised setting below)
CASES = [
    ("stop", "max_stop_sequences", {"stop": [f"s{i}" for i in range(65)]}),
    ("stop", "max_stop_length", {"stop": ["x" * 1001]}),
    ("stop_token_ids", "max_stop_token_ids", {"stop_token_ids": [1] * 1025}),
    ("logit_bias", "max_logit_bias_entries", {"logit_bias": {str(i): 1 for i in range(1025)}}),
    ("tools", "max_tools", {"tools": [tool(i) for i in range(129)], "tool_choice": "none"}),
]
RAISED = {
    "max_stop_sequences": 100, "max_stop_length": 2000, "max_stop_token_ids": 2000,
    "max_logit_bias_entries": 2000, "max_tools": 200,
}  # fmt: skip


@pytest.fixture(scope="module")
def servers(tiny_model_paths: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """A server with the default limits, and one with each raised."""
    model = tiny_model_paths["llama"]
    with (
        live_server(tiny_config(model, served_model_name="tiny")) as default,
        live_server(tiny_config(model, served_model_name="tiny", **RAISED)) as raised,
    ):
        yield default, raised


@pytest.mark.parametrize(("field", "setting", "extra"), CASES)
def test_past_a_limit_is_a_400_naming_the_field_and_the_setting(
    servers: tuple[str, str], field: str, setting: str, extra: dict[str, Any]
) -> None:
    default, raised = servers
    paths = ["/v1/chat/completions"] + ([] if field == "tools" else ["/v1/completions"])
    for path in paths:
        body = (CHAT if "chat" in path else COMPLETION) | extra
        reply = httpx.post(default + path, json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == field and setting in error["message"], error
        accepted = httpx.post(raised + path, json=body, timeout=60)
        if field == "logit_bias":  # past the tiny vocabulary: refused, but not by the limit
            assert accepted.status_code == 400 and "out of range" in accepted.text
            assert setting not in accepted.text
        else:
            assert accepted.status_code == 200, accepted.text

"""A server started with `speculative_config` answers as one without it, and reports
speculation under vLLM's `spec_decode` names; one without it reports none."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import client, live_server, scrape, tiny_config

# As the command line and the environment give it: JSON text.
SPECULATIVE = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
)
PROMPT = "red green blue red green blue red green blue red green"
MODEL = (("model_name", "tiny"),)


@pytest.fixture(scope="module")
def speculating_server(tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    config = tiny_config(
        tiny_model_paths["llama"], served_model_name="tiny", speculative_config=SPECULATIVE
    )
    with live_server(config) as url:
        yield url


def completion(url: str, **options: Any) -> tuple[str, list[float]]:
    reply = client(url).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=40, logprobs=1, **options
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None
    return choice.text, list(choice.logprobs.token_logprobs)


def test_outputs_equal_the_ones_without_speculation(
    speculating_server: str, tiny_server: str
) -> None:
    for options in [{"temperature": 0}, {"temperature": 0.9, "seed": 4}]:
        assert completion(speculating_server, **options) == completion(tiny_server, **options)


def test_spec_decode_counters_under_vllm_names(speculating_server: str, tiny_server: str) -> None:
    before = scrape(speculating_server)
    completion(speculating_server, temperature=0)
    after = scrape(speculating_server)

    def grew(name: str, labels: tuple[tuple[str, str], ...] = MODEL) -> float:
        return after[name][labels] - before[name][labels]

    assert grew("vllm:spec_decode_num_drafts_total") > 0
    drafted = grew("vllm:spec_decode_num_draft_tokens_total")
    accepted = grew("vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    per_position = [
        grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*MODEL, ("position", str(i))))
        for i in range(3)
    ]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        ours = after[f"pagedserve_spec_decode_num_{name}_total"][MODEL]
        assert after[f"vllm:spec_decode_num_{name}_total"][MODEL] == ours
    assert not any("spec_decode" in name for name in scrape(tiny_server))


def test_the_dashboard_shows_tokens_per_verification(
    speculating_server: str, tiny_server: str
) -> None:
    completion(speculating_server, temperature=0)
    state = httpx.get(f"{speculating_server}/dashboard/state").json()
    speculation = state["totals"]["speculation"]
    assert speculation["num_drafts"] > 0
    expected = 1 + speculation["num_accepted_tokens"] / speculation["num_drafts"]
    assert state["acceptance_length"] == pytest.approx(expected) and expected > 1
    idle = httpx.get(f"{tiny_server}/dashboard/state").json()
    assert idle["acceptance_length"] is None and idle["totals"]["speculation"] is None

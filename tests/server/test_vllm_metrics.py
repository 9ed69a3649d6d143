"""vLLM-named metrics beside the pagedserve ones, and the Grafana dashboard that reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.app import build_app
from tests.server.conftest import Labels, client, scrape, tiny_config

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "pagedserve.json"

# vLLM's name (as exposed) -> the pagedserve series that reports the same quantity.
GAUGES = {
    "vllm:num_requests_running": "pagedserve_num_requests_running",
    "vllm:num_requests_waiting": "pagedserve_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "pagedserve_kv_cache_usage_ratio",
}
COUNTERS = {
    "vllm:prompt_tokens_total": "pagedserve_prompt_tokens_total",
    "vllm:generation_tokens_total": "pagedserve_generation_tokens_total",
    "vllm:prefix_cache_queries_total": "pagedserve_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "pagedserve_prefix_cache_hits_total",
    "vllm:num_preemptions_total": "pagedserve_num_preemptions_total",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "pagedserve_time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds": "pagedserve_e2e_request_latency_seconds",
    "vllm:request_time_per_output_token_seconds": "pagedserve_time_per_output_token_seconds",
}
MODEL: Labels = (("model_name", "tiny"),)  # the tiny server's served name


def types(url: str) -> dict[str, str]:
    """/metrics as sample name -> the type of its family."""
    text = httpx.get(f"{url}/metrics").text
    return {
        sample.name: family.type
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def twin_pairs() -> list[tuple[str, str]]:
    """Every (vLLM sample name, pagedserve sample name) pair that must carry equal values."""
    pairs = [*GAUGES.items(), *COUNTERS.items()]
    for vllm, ours in HISTOGRAMS.items():
        pairs += [(vllm + suffix, ours + suffix) for suffix in ("_bucket", "_count", "_sum")]
    return pairs


def assert_twins_agree(samples: dict[str, dict[Labels, float]]) -> None:
    for vllm, ours in twin_pairs():
        relabelled = {
            tuple(sorted({**dict(labels), **dict(MODEL)}.items())): value
            for labels, value in samples[ours].items()
        }
        assert samples[vllm] == relabelled, vllm


def test_no_vllm_series_before_a_model_is_loaded(tiny_model_paths: dict[str, Path]) -> None:
    app = build_app(tiny_config(tiny_model_paths["llama"]))
    assert b"vllm:" not in app.state.server.metrics.render()


def test_every_vllm_series_is_exported_with_the_served_model_name(tiny_server: str) -> None:
    samples, kinds = scrape(tiny_server), types(tiny_server)
    for name, kind in [
        *((name, "gauge") for name in GAUGES),
        *((name, "counter") for name in COUNTERS),
        *((name + "_count", "histogram") for name in HISTOGRAMS),
    ]:
        assert kinds[name] == kind, name
        assert list(samples[name]) == [MODEL], name
    for name in HISTOGRAMS:
        buckets = samples[name + "_bucket"]
        assert buckets and all(dict(labels)["model_name"] == "tiny" for labels in buckets)
    assert 0 <= samples["vllm:kv_cache_usage_perc"][MODEL] <= 1


def test_vllm_series_move_with_requests_and_agree_with_their_twins(tiny_server: str) -> None:
    before = scrape(tiny_server)
    api = client(tiny_server)
    prompt = "Grafana reads the same numbers under two names. " * 4
    options = {"max_tokens": 4, "extra_body": {"ignore_eos": True}}
    first = api.completions.create(model="tiny", prompt=prompt, **options)
    second = api.completions.create(model="tiny", prompt=prompt, **options)
    chat = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], **options
    )
    with api.completions.create(model="tiny", prompt=prompt, stream=True, **options) as stream:
        next(iter(stream))
        assert_twins_agree(scrape(tiny_server))  # also while a request runs
        for _ in stream:
            pass
    after = scrape(tiny_server)
    assert_twins_agree(after)

    def grew(name: str) -> float:
        return after[name][MODEL] - before[name][MODEL]

    # The stream had the prompt of the first two requests.
    usages = [first.usage, second.usage, chat.usage, first.usage]
    assert grew("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 16
    assert grew("vllm:prefix_cache_queries_total") > 0
    assert grew("vllm:prefix_cache_hits_total") >= second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    for name in HISTOGRAMS:
        assert grew(name + "_count") == 4, name


def test_ttft_is_observed_at_the_first_token_not_at_the_end(tiny_server: str) -> None:
    ttft, e2e = "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"
    before = scrape(tiny_server)
    options = {"max_tokens": 480, "stream": True, "extra_body": {"ignore_eos": True}}
    with client(tiny_server).completions.create(model="tiny", prompt="Go on", **options) as stream:
        next(iter(stream))  # the first token; hundreds more to come
        during = scrape(tiny_server)
    assert during[ttft][MODEL] - before[ttft][MODEL] == 1
    assert during[e2e][MODEL] == before[e2e][MODEL]  # not finished yet


def test_the_dashboard_reads_only_series_the_server_exposes(tiny_server: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["model_name"]["type"] == "query"
    expressions = [variables["model_name"]["definition"]]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert '{model_name="$model_name"}' in target["expr"], panel["title"]
            expressions.append(target["expr"])
    referenced = {
        name
        for expression in expressions
        for name in re.findall(r"\b(?:vllm:|pagedserve_)[A-Za-z0-9_:]*", expression)
    }
    assert len(referenced) >= len(GAUGES) + len(COUNTERS) + len(HISTOGRAMS)
    client(tiny_server).completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert referenced <= set(scrape(tiny_server))

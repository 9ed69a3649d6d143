"""bench.serve: a live run counts every request; a peer without usage or with errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.grounded import grounded_prompts
from bench.serve import Benchmark, LevelReport, RequestResult, parse_args, summarize
from tests.server.conftest import live_server, tiny_config


def test_live_run_counts_every_request(tiny_server: str, tmp_path: Path) -> None:
    report_path, plot_path = tmp_path / "serve.json", tmp_path / "serve.png"
    command = [
        sys.executable, "-m", "bench.serve", "--url", tiny_server, "--concurrency", "1,4",
        "--num-requests", "10", "--max-tokens", "8", "--prompt-words", "12", "--ignore-eos",
        "--json", str(report_path), "--plot", str(plot_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(report_path.read_text())
    assert report["model"] == "tiny"
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert (level["requests"], level["successes"], level["errors"]) == (10, 10, 0)
        # ignore_eos: every request generates max_tokens, counted from the usage chunk.
        assert (level["output_tokens"], level["usage_reported"]) == (80, 10)
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            stats = level[metric]
            assert 0 < stats["p50"] <= stats["p99"], metric
        assert level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
    assert plot_path.read_bytes().startswith(b"\x89PNG")
    table = done.stdout.splitlines()
    assert table[1].split()[:5] == ["conc", "reqs", "errors", "req/s", "out"]
    assert [row.split()[:3] for row in table[3:]] == [["1", "10", "0"], ["4", "10", "0"]]


def test_grounded_prompts_are_distinct_and_seeded() -> None:
    prompts = grounded_prompts(40, seed=1)
    assert len(set(prompts)) == 40 and prompts == grounded_prompts(40, seed=1)
    assert prompts != grounded_prompts(40, seed=2)


@pytest.mark.parametrize(
    ("flags", "sent"),
    [
        ([], None),
        (["--workload", "grounded"], 1.0),
        (["--workload", "grounded", "--repetition-penalty", "1.1"], 1.1),
        (["--repetition-penalty", "1.2"], 1.2),
    ],
)
def test_the_grounded_workload_sends_no_repetition_penalty(
    flags: list[str], sent: float | None
) -> None:
    args = parse_args(["--url", "http://unused", *flags])
    body = Benchmark(None, "http://unused", args).body("m", "p")  # type: ignore[arg-type]
    assert body.get("repetition_penalty") == sent


def test_the_grounded_workload_reports_the_acceptance_length(
    tiny_model_paths: dict[str, Path], tmp_path: Path
) -> None:
    speculative = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    config = tiny_config(
        tiny_model_paths["llama"],
        served_model_name="tiny",
        max_model_len=2048,
        speculative_config=speculative,
    )
    path = tmp_path / "serve.json"
    with live_server(config) as url:
        command = [
            sys.executable, "-m", "bench.serve", "--url", url, "--concurrency", "1",
            "--num-requests", "3", "--max-tokens", "24", "--workload", "grounded",
            "--json", str(path),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    report = json.loads(path.read_text())
    assert (report["workload"], report["repetition_penalty"]) == ("grounded", 1.0)
    (level,) = report["levels"]
    assert level["acceptance_length"] > 1
    assert done.stdout.splitlines()[1].split()[-2:] == ["accept", "len"]


def test_no_acceptance_length_from_a_server_without_spec_decode_counters() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="# TYPE vllm:num_requests_running gauge\n")

    async def counters() -> tuple[float, float] | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await Benchmark(
                client, "http://peer", parse_args(["--url", "x"])
            ).spec_counters()

    assert asyncio.run(counters()) is None


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(event)}\n\n".encode() for event in events) + (
        b"data: [DONE]\n\n"
    )


def _run_level(handler: httpx.MockTransport, *flags: str) -> LevelReport:
    """One level of 4 requests at concurrency 2 against a fake server."""
    args = parse_args(["--url", "http://peer/v1", "--model", "m", "--max-tokens", "3", *flags])

    async def level() -> LevelReport:
        async with httpx.AsyncClient(transport=handler) as client:
            bench = Benchmark(client, "http://peer", args)
            return await bench.level("m", 2, ["a", "b", "c", "d"])

    return asyncio.run(level())


def test_a_peer_without_usage_has_its_chunks_counted() -> None:
    bodies: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunks = [{"choices": [{"index": 0, "text": text}]} for text in ("x", "", "y", "z")]
        return httpx.Response(200, content=_sse(*chunks))

    report = _run_level(httpx.MockTransport(handler))
    assert (report.successes, report.errors, report.output_tokens) == (4, 0, 12)
    assert report.usage_reported == 0
    assert "ignore_eos" not in bodies[0]  # only sent when asked for
    assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}


def test_a_peers_raw_unicode_line_separators_and_crlf_line_ends_read_as_one_event() -> None:
    # JSON may hold U+0085, U+2028 and U+2029 raw (a peer's `ensure_ascii=False`); SSE
    # splits lines at CR, LF and CRLF only.
    texts = ("a\u2028b", "c\x85d", "e\u2029f")
    events = [{"choices": [{"index": 0, "text": text}]} for text in texts]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=(body + "data: [DONE]\r\n\r\n").encode())

    report = _run_level(httpx.MockTransport(handler))
    assert (report.successes, report.errors, report.output_tokens) == (4, 0, 12)


def test_errors_are_counted_and_sampled() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        if prompt in ("a", "b"):
            return httpx.Response(400, json={"error": {"message": "bad"}})
        text = "" if prompt == "c" else "ok"
        return httpx.Response(200, content=_sse({"choices": [{"index": 0, "text": text}]}))

    report = _run_level(httpx.MockTransport(handler), "--ignore-eos")
    assert (report.requests, report.successes, report.errors) == (4, 1, 3)
    assert report.error_samples[0].startswith("HTTP 400")
    assert report.error_samples[1] == "the stream ended without any output text"


def test_summary_latencies() -> None:
    results = [
        RequestResult(ok=True, latency=1.0, chunk_times=[0.2, 0.6, 1.0], output_tokens=3),
        RequestResult(ok=True, latency=0.5, chunk_times=[0.5], output_tokens=1),
        RequestResult(ok=False, latency=0.1, error="HTTP 503"),
    ]
    report = summarize(2, results, duration=2.0)
    assert (report.successes, report.errors, report.output_tokens) == (2, 1, 4)
    assert report.request_throughput == 1.0 and report.output_throughput == 2.0
    assert report.ttft_ms.mean == pytest.approx(350.0)
    # (1.0 - 0.2) / (3 - 1); a single-token request has no TPOT.
    assert report.tpot_ms.mean == pytest.approx(400.0)
    assert report.itl_ms.p50 == pytest.approx(400.0)
    assert report.error_samples == ["HTTP 503"]

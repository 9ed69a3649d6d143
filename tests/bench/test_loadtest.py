"""bench/loadtest.sh against a live server: every request is counted, the report parses."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

LOADTEST = Path(__file__).parents[2] / "bench" / "loadtest.sh"


def run_loadtest(*args: str, **env: str) -> tuple[int, dict[str, str]]:
    """The exit status and the `key: value` report of one load test."""
    done = subprocess.run(
        [str(LOADTEST), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"MAX_TOKENS": "8", "DEADLINE": "50"} | env,
        check=False,
    )
    report = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    return done.returncode, report


def test_every_request_succeeds_and_is_counted(tiny_server: str) -> None:
    status, report = run_loadtest(tiny_server, "20", "4")
    assert status == 0
    assert report["model"] == "tiny"  # the first of /v1/models
    assert (report["requests"], report["concurrency"]) == ("20", "4")
    assert (report["successes"], report["failures"]) == ("20", "0")
    assert float(report["requests_per_s"]) > 0
    p50, p90, p99 = (float(report[f"latency_p{p}_s"]) for p in (50, 90, 99))
    assert 0 < p50 <= p90 <= p99 <= float(report["elapsed_s"])


def test_failed_requests_are_counted_and_fail_the_run(tiny_server: str) -> None:
    status, report = run_loadtest(f"{tiny_server}/v1", "6", "3", MODEL="no-such-model")
    assert status == 1
    assert (report["successes"], report["failures"]) == ("0", "6")
    assert report["latency_p50_s"] == "nan"


def test_bad_usage_and_unreachable_servers_exit_2(tiny_server: str) -> None:
    assert run_loadtest(tiny_server, "0")[0] == 2
    assert run_loadtest(tiny_server, "5", "many")[0] == 2
    assert run_loadtest("http://127.0.0.1:9", "5")[0] == 2

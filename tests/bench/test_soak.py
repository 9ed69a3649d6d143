"""bench.soak: a short live run samples the server at rest after every quarter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import parse_args


def test_a_short_soak_counts_disconnects_and_ends_with_no_kv_block_in_use(
    tiny_server: str, tmp_path: Path
) -> None:
    report_path = tmp_path / "soak.json"
    # The tiny server runs in this process, so the soak samples this process's RSS; the
    # growth limit is lifted, since eight requests say nothing about it.
    command = [
        sys.executable, "-m", "bench.soak", "--url", tiny_server, "--pid", str(os.getpid()),
        "--requests", "8", "--warmup", "2", "--concurrency", "3", "--min-tokens", "4",
        "--max-tokens", "8", "--min-prompt-words", "2", "--max-prompt-words", "6",
        "--disconnect-fraction", "0.5", "--max-growth", "1000", "--json", str(report_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    samples = report["samples"]
    assert [s["label"] for s in samples] == ["warm-up", "Q1", "Q2", "Q3", "Q4"]
    assert [s["requests"] for s in samples] == [2, 4, 6, 8, 10]
    last = samples[-1]
    # Half of the 10 requests leave mid-stream; none fails, and the server comes to rest.
    assert (last["errors"], last["disconnects"]) == (0, 5)
    assert all(value == 0 for s in samples for value in s["busy"].values())
    assert all(s["rss_bytes"] > 0 for s in samples)
    assert report["failures"] == [] and report["growth_percent"] is not None
    assert done.stdout.splitlines()[-1] == "PASS"


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://[::2]:80"])
def test_only_loopback_servers_are_soaked(url: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--url", url])

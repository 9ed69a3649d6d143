"""bench.kv_tier without servers: the workload is seeded, round-robin and the same for both
runs; the summary's percentiles, token sums and ratios."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import kv_tier
from bench.kv_tier import Result, RunReport, format_report, make_workload, summarize


def test_the_workload_is_seeded_and_round_robin_over_the_system_prompts() -> None:
    workload = make_workload(prompts=3, words=50, requests=8, seed=7)
    assert workload == make_workload(prompts=3, words=50, requests=8, seed=7)
    assert workload != make_workload(prompts=3, words=50, requests=8, seed=8)
    order = [r.system for r in workload]
    assert sorted(order[:3]) == [0, 1, 2] and order == (order[:3] * 3)[:8]
    systems = {r.system: r.prompt.split("\n\n")[0] for r in workload}
    assert all(len(text.split()) == 50 for text in systems.values())
    assert len(set(systems.values())) == 3
    for request in workload:
        system, user = request.prompt.split("\n\n")
        assert system == systems[request.system]
        assert len(user.split()) == 2 + kv_tier.SUFFIX_WORDS  # "User <i>:" and the words
    assert len({r.prompt for r in workload}) == 8, "every request has its own suffix"


def test_the_summary_leaves_failures_out_and_times_the_first_request_after_the_restart() -> None:
    results = [Result(ttft=t / 10, prompt_tokens=100, cached_tokens=40) for t in range(1, 11)]
    results.insert(5, Result(error="HTTP 500: boom"))
    report = summarize("tier on", results, tier_tokens=120, restart=5, wall=3.5)
    assert report.requests == 11 and report.errors == ["HTTP 500: boom"]
    assert report.ttft_ms == pytest.approx((550.0, 955.0, 550.0))  # linear percentiles
    assert (report.prefill_tokens, report.cached_tokens, report.tier_tokens) == (600, 400, 120)
    assert report.restart_ttft_ms is None, "the first request after the restart failed"
    assert summarize("x", results, 0, 6, 1.0).restart_ttft_ms == pytest.approx(600.0)
    empty = summarize("x", [Result(error="down")], 0, 1, 0.0)
    assert (empty.ttft_ms, empty.prefill_tokens, empty.restart_ttft_ms) == (None, 0, None)


def _report(label: str, ttft: tuple[float, float, float], prefill: int) -> RunReport:
    return RunReport(label, 4, [], ttft, prefill, 6000 - prefill, 0, ttft[0], 2.0)


def test_the_report_has_a_row_per_run_and_the_ratios_on_over_off() -> None:
    off = _report("tier off", (200.0, 400.0, 250.0), 6000)
    on = _report("tier on", (50.0, 300.0, 100.0), 1500)
    on.errors = ["ReadTimeout: slow"]
    lines = format_report(off, on).splitlines()
    assert lines[0].split()[:4] == ["run", "reqs", "errors", "TTFT"]
    assert lines[2].split()[:5] == ["tier", "off", "4", "0", "200"]
    assert lines[3].split()[:5] == ["tier", "on", "4", "1", "50"]
    assert lines[4] == "tier on / off: TTFT p50 0.25, TTFT p95 0.75, prefill tokens 0.25"
    assert lines[5] == "tier on error: ReadTimeout: slow"


def test_both_runs_get_the_same_workload_and_differ_only_in_the_tier(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, list[str], list[kv_tier.Request]]] = []

    def fake_run(
        label: str, command: list[str], workload: list[kv_tier.Request], conc: int, folder: Path
    ) -> RunReport:
        calls.append((label, list(command), list(workload)))
        return _report(label, (100.0, 100.0, 100.0), 10)

    monkeypatch.setattr(kv_tier, "run", fake_run)
    kv_tier.main(["--num-prompts", "2", "--prefix-words", "20", "--num-requests", "5",
                  "--server-arg=--max-num-seqs=4"])  # fmt: skip
    (off_label, off_command, off_work), (on_label, on_command, on_work) = calls
    assert (off_label, on_label) == ("tier off", "tier on")
    assert off_work == on_work == make_workload(2, 20, 5, 0)
    assert off_command[-2:] == ["--kv-disk-size", "0"] and "--max-num-seqs=4" in off_command
    assert on_command[: len(off_command) - 2] == off_command[:-2]
    assert on_command[-4:-1] == ["--kv-disk-size", "1GiB", "--kv-disk-path"]
    out = capsys.readouterr().out
    assert "restart after 2 requests" in out and "prefill tokens 1.00" in out

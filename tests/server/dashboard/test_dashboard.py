"""The dashboard: its data endpoint, its history, and its page in a real headless Chromium
with streams in flight.

The server's engine sleeps STEP_DELAY before each step, so that streams of a few hundred
tokens stay in flight for seconds without the CPU work of a bigger model.
"""

from __future__ import annotations

import asyncio
import functools
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.snapshot import EngineStats
from server.dashboard.history import StatsHistory
from server.metrics import ServerMetrics
from tests.server.conftest import live_server, scrape, slow_engine, tiny_config

API_KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_NUM_SEQS = 4
# One prompt for every stream, 64 tokens: 3 full blocks that the streams share, and 1.
PROMPT = "Paged attention keeps keys and values in fixed-size blocks of memory. " * 2
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path("/tmp/dashboard.png")
STATUSES = ("running", "waiting")


@pytest.fixture(scope="module")
def server(
    tiny_model_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A server with an API key, 256 KV blocks and room for MAX_NUM_SEQS running sequences,
    scheduling by priority, and a disk tier."""
    config = tiny_config(
        tiny_model_paths["llama"],
        served_model_name="tiny",
        api_key=API_KEY,
        kv_cache_memory="4MiB",
        max_num_seqs=MAX_NUM_SEQS,
        scheduling_policy="priority",
        # 4 sequences of 1,024 tokens could use all 256 blocks: none are left out.
        max_model_len=1024,
        kv_disk_size="16MiB",
        kv_disk_path=str(tmp_path_factory.mktemp("kv")),
    )
    with live_server(config, llm_factory=slow_engine) as url:
        yield url


@contextmanager
def streams_in_flight(
    url: str, count: int = 6, max_tokens: int = 400, priority: int = 0
) -> Iterator[None]:
    """`count` streamed completions of PROMPT at `priority`, read by background threads;
    the block's exit closes them, which aborts them, and checks that the server accepted
    them all."""
    stop = threading.Event()
    refusals: list[str] = []
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "priority": priority,
    }

    def read() -> None:
        with httpx.stream(
            "POST", f"{url}/v1/completions", headers=AUTH, json=body, timeout=60
        ) as response:
            if response.status_code != 200:
                refusals.append(response.read().decode())
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    readers = [threading.Thread(target=read, daemon=True) for _ in range(count)]
    for reader in readers:
        reader.start()
    try:
        yield
    finally:
        stop.set()
        for reader in readers:
            reader.join(timeout=30)
    assert not refusals


def state(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/dashboard/state", headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_state(url: str, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first state that meets `condition`, each checked against the invariants."""
    deadline = time.monotonic() + 20
    while True:
        current = state(url)
        check_invariants(current)
        if condition(current):
            return current
        assert time.monotonic() < deadline, f"no such state; the last: {current}"
        time.sleep(0.05)


def check_invariants(current: dict[str, Any]) -> None:
    """What any snapshot taken between two steps satisfies."""
    blocks, totals, sequences = current["blocks"], current["totals"], current["sequences"]
    counts = blocks["counts"]
    assert set(blocks["states"]) <= set(blocks["legend"])
    assert len(blocks["states"]) == totals["num_kv_blocks"] == sum(counts.values())
    for code, name in blocks["legend"].items():
        assert blocks["states"].count(code) == counts[name]
    assert counts["used"] + counts["shared"] == totals["used_kv_blocks"]
    assert counts["cached"] == totals["cached_free_kv_blocks"]
    statuses = [seq["status"] for seq in sequences]
    running = totals["num_running"]
    assert statuses == ["running"] * running + ["waiting"] * totals["num_waiting"]
    assert running <= MAX_NUM_SEQS


def generated(current: dict[str, Any]) -> dict[str, int]:
    return {seq["seq_id"]: seq["output_tokens"] for seq in current["sequences"]}


# -- the data endpoint over HTTP --------------------------------------------------------


def test_the_data_needs_the_api_key_and_the_page_does_not(server: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(f"{server}/dashboard/state", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    for path in ("/dashboard", "/dashboard/dashboard.js"):
        assert httpx.get(f"{server}{path}").status_code == 200


def test_the_page_refers_to_nothing_outside_the_server(server: str) -> None:
    page = httpx.get(f"{server}/dashboard")
    script = httpx.get(f"{server}/dashboard/dashboard.js")
    assert page.headers["content-type"].startswith("text/html")
    assert "javascript" in script.headers["content-type"]
    for response in (page, script):
        assert not re.search(r"https?:|//[\w.-]+\.\w|@import|url\(", response.text)
        assert "default-src 'none'" in response.headers["content-security-policy"]
    references = re.findall(r'(?:src|href)="([^"]*)"', page.text)
    assert references == ["data:,", "dashboard/dashboard.js"]


def test_an_idle_server_has_free_blocks_and_no_sequences(server: str) -> None:
    current = wait_for_state(server, lambda s: not s["sequences"])
    blocks = current["blocks"]
    assert current["model"] == "tiny" and blocks["block_size"] == 16
    assert len(blocks["states"]) == 256
    assert blocks["legend"] == {"f": "free", "c": "cached", "u": "used", "s": "shared"}
    assert blocks["counts"]["used"] == blocks["counts"]["shared"] == 0
    assert set(current["history"]) == {"interval", "window", "samples"}
    assert current["history"]["interval"] == 1.0 and current["history"]["window"] == 300.0


def test_blocks_and_sequences_follow_the_requests_in_flight(server: str) -> None:
    with streams_in_flight(server):
        busy = wait_for_state(
            server,
            lambda s: (
                len(s["sequences"]) == 6
                and all(seq["output_tokens"] > 0 for seq in s["sequences"][:MAX_NUM_SEQS])
            ),
        )
        assert (busy["totals"]["num_running"], busy["totals"]["num_waiting"]) == (MAX_NUM_SEQS, 2)
        # The streams share their prompt's full blocks; each has private ones besides.
        assert busy["blocks"]["counts"]["shared"] == 3
        assert busy["blocks"]["counts"]["used"] >= MAX_NUM_SEQS
        running = busy["sequences"][0]
        assert running["prompt_tokens"] == 64 and running["max_tokens"] == 400
        assert running["time_to_first_token"] is not None
        assert running["age"] >= running["time_to_first_token"]
        waiting = busy["sequences"][-1]
        assert waiting["output_tokens"] == waiting["computed_tokens"] == 0
        before = generated(busy)
        later = wait_for_state(
            server,
            lambda s: (
                any(before.get(k, n) < n for k, n in generated(s).items())
                and any(sample["generation_tokens_per_s"] > 0 for sample in s["history"]["samples"])
            ),
        )
        assert (
            later["totals"]["generation_tokens_total"] > busy["totals"]["generation_tokens_total"]
        )
    idle = wait_for_state(server, lambda s: not s["sequences"])
    counts = idle["blocks"]["counts"]
    assert counts["used"] == counts["shared"] == 0
    assert counts["cached"] >= 3  # the prompt's blocks stay cached for a later request
    assert idle["prefix_cache_hit_rate"] > 0


def test_waiting_sequences_show_their_priority_in_queue_order(server: str) -> None:
    with streams_in_flight(server, count=MAX_NUM_SEQS):
        wait_for_state(server, lambda s: s["totals"]["num_running"] == MAX_NUM_SEQS)
        # Queued behind the running set (priority 0 < theirs, so no preemption), the later
        # of the two first: its lower value puts it ahead.
        with streams_in_flight(server, count=1, priority=7):
            wait_for_state(server, lambda s: s["totals"]["num_waiting"] == 1)
            with streams_in_flight(server, count=1, priority=3):
                busy = wait_for_state(server, lambda s: s["totals"]["num_waiting"] == 2)
                metrics = scrape(server)
    assert busy["scheduling_policy"] == "priority"
    assert [seq["priority"] for seq in busy["sequences"]] == [0] * MAX_NUM_SEQS + [3, 7]
    assert busy["totals"]["num_preemptions"] == 0
    running, waiting = (metrics[f"pagedserve_num_requests_{s}_by_priority"] for s in STATUSES)
    model = ("model_name", "tiny")
    assert running == {(model, ("priority", "0")): MAX_NUM_SEQS}
    assert waiting == {(model, ("priority", "3")): 1, (model, ("priority", "7")): 1}


# -- the history --------------------------------------------------------------------------


def _stats(generation_tokens: int, queries: int = 0, hits: int = 0) -> EngineStats:
    return EngineStats(
        num_running=2,
        num_waiting=1,
        num_kv_blocks=10,
        used_kv_blocks=5,
        cached_free_kv_blocks=0,
        kv_usage=0.5,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        prefix_cache_evictions=0,
        prompt_tokens_total=0,
        generation_tokens_total=generation_tokens,
        num_preemptions=0,
    )


def test_the_history_samples_differences_of_the_counters() -> None:
    readings: list[EngineStats | None] = [None, _stats(0), _stats(100, 40, 10), _stats(130, 40, 10)]
    metrics = ServerMetrics(list, list)
    ttft = functools.partial(metrics.first_tokens, "m")
    history = StatsHistory(lambda: readings.pop(0), ttft, interval=1.0, window=300.0)
    history.record(0.0, 1000.0)  # no engine yet
    history.record(1.0, 1001.0)  # the baseline
    assert history.samples() == []
    metrics.time_to_first_token.labels("m").observe(0.2)
    metrics.time_to_first_token.labels("m").observe(0.4)
    metrics.time_to_first_token.labels("another model").observe(9.0)
    history.record(3.0, 1003.0)
    history.record(4.0, 1004.0)
    first, second = history.samples()
    assert (first.time, first.generation_tokens_per_s) == (1003.0, 50.0)
    assert first.time_to_first_token == pytest.approx(0.3)
    assert first.prefix_cache_hit_rate == 0.25
    assert (first.running, first.waiting, first.kv_usage) == (2, 1, 0.5)
    assert second.generation_tokens_per_s == 30.0
    assert second.time_to_first_token is None and second.prefix_cache_hit_rate is None


def test_the_history_keeps_its_window_only() -> None:
    history = StatsHistory(lambda: _stats(0), lambda: (0.0, 0.0), interval=1.0, window=3.0)
    for second in range(10):
        history.record(float(second), 1000.0 + second)
    assert [sample.time for sample in history.samples()] == [1007.0, 1008.0, 1009.0]


# -- the engine's snapshot ----------------------------------------------------------------


def test_a_snapshot_is_refused_once_the_engine_has_stopped(
    tiny_model_paths: dict[str, Path],
) -> None:
    config = EngineConfig(
        model=str(tiny_model_paths["llama"]),
        dtype="float32",
        kv_cache_memory="1MiB",
        max_model_len=512,
        enforce_eager=True,
    )
    llm = AsyncLLM.from_config(config)

    async def run() -> None:
        snapshot = await llm.snapshot()
        assert snapshot.block_map == "f" * llm.num_kv_blocks and snapshot.sequences == ()
        assert snapshot.stats.num_kv_blocks == llm.num_kv_blocks
        await llm.shutdown()
        with pytest.raises(EngineError, match="not running"):
            await llm.snapshot()

    asyncio.run(run())


# -- the page in Chromium -----------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium driven by Playwright (whose own browser downloads are not used)."""
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: install it with `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


# Counts the block map's pixels of a block state's color, read from the page's CSS.
_PIXELS_OF_STATE = """(state) => {
  const probe = document.createElement("canvas").getContext("2d");
  probe.fillStyle = getComputedStyle(document.documentElement).getPropertyValue("--" + state);
  probe.fillRect(0, 0, 1, 1);
  const [r, g, b] = probe.getImageData(0, 0, 1, 1).data;
  const map = document.getElementById("blocks");
  const data = map.getContext("2d").getImageData(0, 0, map.width, map.height).data;
  let count = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (data[i] === r && data[i + 1] === g && data[i + 2] === b && data[i + 3] === 255) count++;
  }
  return count;
}"""
_GENERATED_BY_ROW = """() => Object.fromEntries([...document.querySelectorAll("#sequences tr")]
  .map((row) => [row.dataset.seqId,
                 Number(row.querySelector("[data-field=generated]").textContent)]))"""


def wait_in_page(page: Any, predicate: str, arg: Any = None, timeout: float = 20) -> None:
    """Poll the function `predicate` in `page` until it returns true. (Playwright's own
    `wait_for_function` evaluates strings in the page, which its CSP refuses.)"""
    deadline = time.monotonic() + timeout
    while not page.evaluate(predicate, arg):
        assert time.monotonic() < deadline, f"the page never met {predicate}"
        page.wait_for_timeout(100)


def test_the_page_shows_live_blocks_and_requests_in_chromium(
    server: str, browser: Any, tmp_path: Path
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    requested: list[str] = []
    messages: list[str] = []
    context.on("request", lambda request: requested.append(request.url))
    # Without a key the page says so; one entered in its box is used at once.
    page = context.new_page()
    page.on("console", lambda message: messages.append(message.text))
    page.goto(f"{server}/dashboard")
    wait_in_page(page, "() => document.getElementById('status').textContent.includes('401')")
    page.fill("#key", API_KEY)
    page.click("#key-form button")
    wait_in_page(page, "() => document.getElementById('status').textContent.startsWith('live')")
    page.close()

    with streams_in_flight(server):
        # A new tab starts without the key: it comes in the fragment, which the page clears.
        page = context.new_page()
        page.on("console", lambda message: messages.append(message.text))
        page.goto(f"{server}/dashboard#key={API_KEY}")
        assert page.url == f"{server}/dashboard"
        wait_in_page(
            page,
            """() => ["used", "shared"].every((state) => Number(
                    document.querySelector(`#legend [data-state=${state}] b`)?.textContent) > 0)
                && document.querySelectorAll("#sequences tr").length === 6
                && document.querySelectorAll("#sequences .state.waiting").length === 2
                && [...document.querySelectorAll("#sequences [data-field=priority]")]
                     .every((cell) => cell.textContent === "0")
                && document.getElementById("policy").textContent.includes("by priority")
                && [...document.querySelectorAll("#sequences [data-field=generated]")]
                     .some((cell) => Number(cell.textContent) > 0)""",
        )
        assert page.is_visible("#tier-tile")
        assert page.text_content("#tier-medium") == "DISK"
        assert " of 16 MiB, " in page.text_content("#tier")
        assert page.evaluate(_PIXELS_OF_STATE, "used") > 0
        assert page.evaluate(_PIXELS_OF_STATE, "shared") > 0
        before = page.evaluate(_GENERATED_BY_ROW)
        wait_in_page(
            page,
            f"""(before) => Object.entries(({_GENERATED_BY_ROW})())
                 .some(([id, n]) => id in before && n > before[id])""",
            before,
        )
        assert page.text_content("#status").startswith("live")
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        shutil.copyfile(shot, SCREENSHOT)
    context.close()
    assert all(url.startswith((server, "data:")) for url in requested), requested
    # The page runs within its own Content-Security-Policy.
    assert not [text for text in messages if "Content Security Policy" in text], messages

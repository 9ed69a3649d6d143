"""`engine.first_use.build_once`: processes racing on one target build it once and all see
it; a process killed while building blocks no one and leaves nothing half made."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from multiprocessing.context import SpawnProcess
from pathlib import Path

from engine.first_use import build_once
from engine.first_use_manifest import MANIFEST

# spawn: the children start clean, not as copies of a pytest process that may hold torch.
CONTEXT = multiprocessing.get_context("spawn")
RACERS = 6


def build_and_read(target: str, count: str, log: str, seconds: float, go: str) -> None:
    """Say it is ready, and once the file `go` exists, build `target` (recording the build
    in `count`, taking `seconds`) unless it is there; exit 0 if it is then there whole."""
    logging.basicConfig(filename=log, level=logging.INFO, format="%(process)d %(message)s")
    Path(f"{log}.ready").touch()
    while not os.path.exists(go):
        time.sleep(0.01)

    def build(staging: Path) -> None:
        with open(count, "a") as file:
            file.write(f"{os.getpid()}\n")
        (staging / f"from-{os.getpid()}").write_text("written first")
        time.sleep(seconds)
        (staging / "result").write_text("whole")

    build_once(
        Path(target),
        build,
        complete=lambda folder: (folder / "result").is_file(),
        doing="making the test result",
        expected="a moment",
        done="made",
    )
    assert (Path(target) / "result").read_text() == "whole"


def start_builders(n: int, tmp_path: Path, seconds: float) -> list[SpawnProcess]:
    go = tmp_path / "go"
    go.unlink(missing_ok=True)
    ready = [tmp_path / f"log-{i}.ready" for i in range(n)]
    for path in ready:
        path.unlink(missing_ok=True)
    processes = [
        CONTEXT.Process(
            target=build_and_read,
            args=(
                str(tmp_path / "cache" / "target"),
                str(tmp_path / "count"),
                str(tmp_path / f"log-{i}"),
                seconds,
                str(go),
            ),
            daemon=True,  # a test that fails leaves none behind
        )
        for i in range(n)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 60
    while not all(path.exists() for path in ready):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    go.touch()
    return processes


def builds(tmp_path: Path) -> list[str]:
    count = tmp_path / "count"
    return count.read_text().split() if count.exists() else []


def test_racing_processes_build_once_and_all_see_the_result(tmp_path: Path) -> None:
    processes = start_builders(RACERS, tmp_path, seconds=1.0)
    for process in processes:
        process.join(timeout=60)
    assert [process.exitcode for process in processes] == [0] * RACERS
    assert len(builds(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path / "cache")) == [".target.lock", "target"]
    logs = "".join((tmp_path / f"log-{i}").read_text() for i in range(RACERS))
    [builder] = builds(tmp_path)
    assert logs.count("making the test result once into") == 1
    assert f"waiting for another process (pid {builder}) making the test result" in logs


def test_a_builder_killed_while_holding_the_lock_blocks_no_one(tmp_path: Path) -> None:
    [doomed] = start_builders(1, tmp_path, seconds=600)
    deadline = time.monotonic() + 60
    while not builds(tmp_path):  # it holds the lock and has begun to write
        assert time.monotonic() < deadline and doomed.is_alive()
        time.sleep(0.05)
    [waiter] = start_builders(1, tmp_path, seconds=0)
    waiting = f"waiting for another process (pid {doomed.pid}) making the test result"
    log = tmp_path / "log-0"  # both write log-0: the waiter appends its lines
    while waiting not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and waiter.is_alive()
        time.sleep(0.05)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join()
    waiter.join(timeout=60)
    assert waiter.exitcode == 0
    assert builds(tmp_path) == [str(doomed.pid), str(waiter.pid)]
    # The killed build's staging folder is gone, and none of it is in the result.
    assert sorted(os.listdir(tmp_path / "cache")) == [".target.lock", "target"]
    result = [MANIFEST, f"from-{waiter.pid}", "result"]
    assert sorted(os.listdir(tmp_path / "cache" / "target")) == result

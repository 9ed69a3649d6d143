"""`pagedserve serve` in a process of its own, as users run it, for tests that need no
thread of theirs in the server's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.tables import free_port

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def serve_process(
    args: Sequence[str],
    log: Path | None,
    *,
    module: str = "pagedserve",
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    started: list[subprocess.Popen] | None = None,
) -> Iterator[str]:
    """Run `python -m <module> serve <args> --port <a free one>` from the repository root,
    its output in `log` (None: nowhere); yield its URL once `/health` answers 200 (a
    failure to start shows the log's tail), and terminate it at exit. The process is
    appended to `started`, for a test that signals it itself."""
    port = free_port()
    command = [sys.executable, "-m", module, "serve", *args, "--port", str(port)]
    with log.open("wb") if log is not None else open(os.devnull, "wb") as sink:
        process = subprocess.Popen(
            command, cwd=ROOT, env=None if env is None else dict(env), stdout=sink, stderr=sink
        )
    if started is not None:
        started.append(process)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not healthy(url):
            assert process.poll() is None, f"the server exited:\n{tail(log)}"
            assert time.monotonic() < deadline, f"the server did not start:\n{tail(log)}"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def tail(log: Path | None) -> str:
    return "(no log kept)" if log is None else log.read_text(errors="replace")[-4000:]

"""Which of the project's files run while one streaming chat request is served.

`python -m bench.request_path` serves `make serve`'s settings (configs/default.yaml) in
this process, sends one streaming chat completion with logprobs after a warm-up request,
and prints every project file in which a Python function was called during it, on any
thread (event loop, intake, engine), except calls made by the dashboard's once-a-second
sampler, which runs beside requests, not for them. It measures how many files one request
passes through; a profiler hook on every thread makes the server slow meanwhile, so it
times nothing.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "engine", "scheduler", "cache")
# Code that runs beside the request on its own clock: what it calls is not the request's.
BESIDE = ROOT / "server" / "dashboard" / "history.py"


class FileRecorder:
    """A profile hook that records project files whose functions are called while on."""

    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.on and event == "call":
            path = Path(frame.f_code.co_filename)
            mine = path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PACKAGES
            if mine and not _beside(frame):
                self.files.add(str(path.relative_to(ROOT)))


def _beside(frame: FrameType | None) -> bool:
    """Whether `frame` runs for the dashboard's sampler (it, or a call it made)."""
    while frame is not None:
        if frame.f_code.co_filename == str(BESIDE):
            return True
        frame = frame.f_back
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=str(ROOT / "configs" / "default.yaml"), help="a serve config file"
    )
    args = parser.parse_args()
    recorder = FileRecorder()
    # Installed first, so every thread the server starts inherits the hook.
    threading.setprofile(recorder)
    sys.setprofile(recorder)
    from server.app import build_app
    from server.config import resolve_serve_config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = resolve_serve_config(args.config, {}, {})
    app = build_app(config.model_copy(update={"port": sock.getsockname()[1]}))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        while not _healthy(url):
            time.sleep(0.2)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
        }
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)  # warm-up
        time.sleep(0.5)
        recorder.on = True
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass
        time.sleep(0.5)  # the engine thread finishes its bookkeeping
        recorder.on = False
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    print(f"{len(recorder.files)} files:")
    print("\n".join(sorted(recorder.files)))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()

"""Two `pagedserve serve` started at once on an empty cache, with the shipped default
config: the first start's work (reading the default model's GGUF, building the C++ kernels
it uses, converting its tensors for them, compiling the forward) is done once, by one of
them, and both serve compiled.

Inductor's own cache (the C++ it generated and built, keyed by the graph) is the suite's:
the KV cache has the size of the other default-model servers of the suite, so the compile
that one of the two servers does and saves (tracing, lowering, packaging: the part that
can race) reuses their generated code rather than building it again for a minute.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.tables import free_port
from engine.config import cache_root
from tests.support.default_model import DEFAULT_MODEL_SETTINGS

pytestmark = pytest.mark.slow
PAGEDSERVE = Path(sys.executable).with_name("pagedserve")
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
# A first start converts the model and builds kernels; two at once share 2 cores here.
START_TIMEOUT = 600
ONCE = (
    "reading SmolLM2-135M-Instruct.Q4_1.gguf's config and tokenizer once into",
    "building the C++ paged_attention kernel once into",
    "building the C++ group_linear kernel once into",
    "converting SmolLM2-135M-Instruct.Q4_1.gguf's tensors for the kernels once into",
    "compiling the forward once into",
)


def test_two_servers_started_at_once_on_an_empty_cache_both_serve(tmp_path: Path) -> None:
    env = os.environ | {
        "PAGEDSERVE_CACHE": str(tmp_path / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root() / "inductor"),
    }
    env.pop("PAGEDSERVE_ENFORCE_EAGER", None)  # the suite's eager default: serve as shipped
    urls, logs, servers = [], [], []
    for i in range(2):
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        logs.append(tmp_path / f"server-{i}.log")
        with logs[-1].open("w") as out:
            command = [str(PAGEDSERVE), "serve", "--config", str(CONFIG), "--port", str(port)]
            command += ["--kv-cache-memory", DEFAULT_MODEL_SETTINGS["kv_cache_memory"]]
            servers.append(subprocess.Popen(command, env=env, stdout=out, stderr=out))
    try:
        for server, url, log in zip(servers, urls, logs, strict=True):
            wait_healthy(url, server, log)
        answers = [complete(url) for url in urls]
    finally:
        for server in servers:
            server.send_signal(signal.SIGINT)
        for server in servers:
            server.wait(timeout=60)
    text = "".join(log.read_text() for log in logs)
    assert answers[0] == answers[1] and answers[0], answers  # one model, greedy: same tokens
    for work in ONCE:
        assert text.count(work) == 1, (work, text[-5000:])
    assert text.count("compiled forward ready") == 2, text[-5000:]
    # One metadata folder and one converted model, and no staging folder beside them.
    for kind in ("gguf", "quantized"):
        folder = tmp_path / "cache" / kind
        [made] = [path for path in folder.iterdir() if not path.name.endswith(".lock")]
        assert made.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


def wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        assert server.poll() is None, f"a server exited: {log.read_text()[-5000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        assert time.monotonic() < deadline, f"not healthy in time: {log.read_text()[-5000:]}"
        time.sleep(0.5)


def complete(url: str) -> str:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is"}
    reply = httpx.post(
        f"{url}/v1/completions", json=body | {"max_tokens": 4, "temperature": 0}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]

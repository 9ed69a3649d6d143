"""`python -m pagedserve serve`: one-line errors with exit code 2, and a real start."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGUFWriter

from bench.tables import free_port
from pagedserve.cli import main

SERVE = [sys.executable, "-m", "pagedserve", "serve"]
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")


def test_invalid_configuration_exits_2_with_one_line(tmp_path: Path) -> None:
    unknown_key = tmp_path / "unknown.yaml"
    unknown_key.write_text("model: default\nmax_seqs: 4\n")
    foreign = tmp_path / "rwkv.gguf"  # a GGUF of an architecture pagedserve does not serve
    writer = GGUFWriter(str(foreign), "rwkv7")
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.close):
        write()
    cases = {
        "unknown setting 'max_seqs'": ["--config", str(unknown_key)],
        "invalid setting 'block_size'": ["--model", "default", "--block-size", "-1"],
        "model path not found": ["--model", str(tmp_path / "missing-model")],
        "GGUF architecture 'rwkv7' is not one pagedserve serves": ["--model", str(foreign)],
    }
    # Started together: each pays the interpreter's import time, in parallel.
    processes = {
        expected: subprocess.Popen(
            [*SERVE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for expected, args in cases.items()
    }
    try:
        for expected, process in processes.items():
            stdout, stderr = process.communicate(timeout=90)
            assert process.returncode == 2, (expected, stderr)
            # One line, after the log lines of what start-up did before it failed (a GGUF's
            # metadata read).
            lines = [line for line in stderr.strip().splitlines() if not LOG_LINE.match(line)]
            assert len(lines) == 1 and lines[0].startswith("pagedserve: error: "), stderr
            assert expected in stderr
            assert "Traceback" not in stderr and not stdout
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", "/nonexistent/absent.yaml"], "config file not found"),
        (["--max-num-seq", "4"], "unrecognized arguments"),
        (["--dtype", "int3"], "invalid choice"),
        (["--port", "-5"], "invalid setting 'port'"),
        (["--kv-cache-memory", "lots"], "invalid setting 'kv_cache_memory'"),
        (["--response-store", "/dev/null/in/a/file"], "cannot open the response store"),
        (["--api-key-file", "/nonexistent/keys"], "invalid setting 'api_key_file'"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            "invalid setting 'speculative_config.num_speculative_tokens'",
        ),
        (["--speculative-config", '{"method": "eagle"}'], "speculative_config.method"),
        (["--speculative-config", "ngram"], "invalid setting 'speculative_config'"),
    ],
)
def test_more_bad_settings_in_process(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(["serve", *args]))
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1 and expected in stderr, stderr


def test_serve_starts_answers_and_stops_on_ctrl_c(tiny_model_paths: dict[str, Path]) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--model", str(tiny_model_paths["llama"]), "--dtype", "float32", "--device", "cpu"]
    args += ["--kv-cache-memory", "64MiB", "--max-model-len", "256", "--port", str(port)]
    process = subprocess.Popen(
        [*SERVE, *args, "--served-model-name", "cli-tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_health(url, process)
        # ignore_eos: the tiny random model, sampled, may end early (once it stopped at 2).
        body = {"model": "cli-tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
        answer = _curl(
            f"{url}/v1/completions", "-H", "Content-Type: application/json", "-d", json.dumps(body)
        )
        assert json.loads(answer)["usage"]["completion_tokens"] == 3
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "KV blocks of 16 tokens" in stderr and "tokens of KV capacity" in stderr
    assert f"http://127.0.0.1:{port}/v1" in stderr


def _wait_for_health(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited: {process.communicate()[1]}")
        health = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"{url}/health"],
            capture_output=True,
            text=True,
        )
        if health.stdout == "200":
            return
        assert time.monotonic() < deadline, "the server never became healthy"
        time.sleep(0.2)


def _curl(url: str, *args: str) -> str:
    command = ["curl", "-sS", "--fail-with-body", url, *args]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout

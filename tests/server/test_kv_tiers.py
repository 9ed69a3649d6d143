"""The disk tier under the prefix cache, served as `make serve` serves (the default model,
its config, real HTTP, `pagedserve serve` processes): a long prompt pushed out of a small
RAM cache comes back from the disk with the cold answer's exact text and logprobs, at a
fraction of its cold TTFT, also after a SIGKILL and a restart; damaged files and another
model's folder give the cold answer; the folder keeps its budget, shared by two servers."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.model.device import resolve_dtype
from tests.server.conftest import engine_metrics
from tests.server.serve_process import serve_process

pytestmark = pytest.mark.slow

WORDS = (
    "agent",
    "tool",
    "schema",
    "search",
    "result",
    "cache",
    "block",
    "token",
    "prompt",
    "system",
    "user",
    "reply",
    "river",
    "mountain",
    "city",
    "light",
    "data",
    "model",
)
# ~2,900 tokens of the default model's KV, one long prompt and a half: 32 MiB per byte of the
# default dtype (128 in fp32, 64 in bf16, auto's where the CPU computes bf16 fast).
_KV_MIB = 32 * resolve_dtype("auto", torch.device("cpu")).itemsize
SETTINGS = ["--config", "configs/default.yaml", "--kv-cache-memory", f"{_KV_MIB}MiB",
            "--max-model-len", "2048"]  # fmt: skip


def text(seed: int, num_words: int = 1810) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def complete(url: str, prompt: str) -> dict[str, Any]:
    """A streamed greedy completion: its text, logprobs, usage and time to first token."""
    body = {
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 12,
        "temperature": 0, "logprobs": 2, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    ttft, pieces, logprobs, usage = None, [], [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if ttft is None:
                    ttft = time.perf_counter() - started
                pieces.append(choice["text"])
                logprobs.append(choice["logprobs"])
    assert usage is not None
    return {"text": "".join(pieces), "logprobs": logprobs, "ttft": ttft,
            "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}  # fmt: skip


def same_answer(one: dict[str, Any], other: dict[str, Any]) -> bool:
    return (one["text"], one["logprobs"]) == (other["text"], other["logprobs"])


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kv"))


def sizes(folder: Path) -> list[int]:
    """The block files' sizes (a file deleted meanwhile by a writer left out)."""
    found = []
    for path in files(folder):
        with contextlib.suppress(FileNotFoundError):
            found.append(path.stat().st_size)
    return found


def test_a_long_prompt_comes_back_from_disk_exactly_also_after_a_kill(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    tier = ["--kv-disk-size", "400MiB", "--kv-disk-path", str(folder)]
    prompt = text(0)
    with serve_process([*SETTINGS, *tier], tmp_path / "one.log") as url:
        cold = complete(url, prompt)
        assert cold["cached"] == 0 and cold["prompt_tokens"] >= 1800
        for seed in (1, 2):  # push it out of the RAM cache
            assert complete(url, text(seed))["cached"] == 0
        warm = complete(url, prompt)
        metrics = engine_metrics(url)
    assert warm["cached"] >= 0.9 * warm["prompt_tokens"]
    assert same_answer(warm, cold)
    assert warm["ttft"] <= 0.25 * cold["ttft"], (warm["ttft"], cold["ttft"])
    assert metrics["vllm:external_prefix_cache_hits_total"] >= 0.5 * warm["prompt_tokens"]
    assert metrics["pagedserve_kv_tier_stores_total"] > 0
    assert "KV disk tier: " in (tmp_path / "one.log").read_text()

    # Killed with SIGKILL while it computes and writes another prompt's blocks.
    started: list[subprocess.Popen] = []
    with serve_process([*SETTINGS, *tier], tmp_path / "two.log", started=started) as url:
        first = complete(url, prompt)  # the first request after a restart
        with httpx.Client(timeout=300) as http:
            pending = http.build_request(
                "POST", f"{url}/v1/completions",
                json={"model": "SmolLM2-135M-Instruct", "prompt": text(3), "max_tokens": 4},
            )  # fmt: skip
            http.send(pending, stream=True).close()
        time.sleep(1.5)
        started[0].send_signal(signal.SIGKILL)
        started[0].wait()
    assert first["cached"] >= 0.9 * first["prompt_tokens"] and same_answer(first, cold)
    assert first["ttft"] <= 0.25 * cold["ttft"]

    # Every file damaged one way or another: the cold answer, no error, files dropped.
    for index, path in enumerate(files(folder)):
        if index % 2:
            path.write_bytes(path.read_bytes()[:-7])
        else:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x5A
            path.write_bytes(bytes(data))
    with serve_process([*SETTINGS, *tier], tmp_path / "three.log") as url:
        damaged = complete(url, prompt)
        drops = engine_metrics(url)
    assert same_answer(damaged, cold) and damaged["cached"] < 32
    assert drops.get("pagedserve_kv_tier_drops_total", 0) >= 1
    assert "computing it again" in (tmp_path / "three.log").read_text()


def test_two_servers_share_a_folder_within_its_budget(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    budget = 200 * 2**20  # about two long prompts' blocks
    tier = ["--kv-disk-size", "200MiB", "--kv-disk-path", str(folder)]
    prompt = text(10)
    with (
        serve_process([*SETTINGS, *tier], tmp_path / "a.log") as one,
        serve_process([*SETTINGS, *tier], tmp_path / "b.log") as two,
    ):
        cold = complete(one, prompt)
        time.sleep(1.0)  # its writer writes while the answer streams
        shared = complete(two, prompt)  # the other server's blocks, read from the folder
        for seed in range(11, 15):  # a stream of new prompts through both
            complete(one if seed % 2 else two, text(seed))
            # Each writer sees the other's files at its next rescan (at most a second on).
            assert sum(sizes(folder)) <= budget + 120 * 737_280
        time.sleep(1.5)
        complete(one, text(15))  # its writer rescans: every file counts
        time.sleep(1.5)
    assert shared["cached"] >= 0.9 * shared["prompt_tokens"] and same_answer(shared, cold)
    final = sizes(folder)
    assert sum(final) <= budget
    assert len(set(final)) == 1  # every file whole
    assert not list(folder.glob("*/.*.tmp"))


def test_another_model_on_the_same_folder_reuses_nothing(
    tmp_path: Path, tiny_model_paths: dict[str, Path]
) -> None:
    folder = tmp_path / "kv"
    tier = ["--kv-disk-size", "64MiB", "--kv-disk-path", str(folder)]
    tiny = ["--model", str(tiny_model_paths["llama"]), "--dtype", "float32", "--kv-cache-memory",
            "16MiB", "--max-model-len", "512", "--enforce-eager"]  # fmt: skip
    prompt = text(20, 60)
    with serve_process([*SETTINGS, *tier], tmp_path / "default.log") as url:
        complete(url, prompt)
    with serve_process([*tiny, *tier], tmp_path / "tiny.log") as url:
        body = {"model": _model_id(url), "prompt": prompt, "max_tokens": 2}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, answer
    assert len(list(folder.iterdir())) == 2  # a folder per model and settings


def _model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

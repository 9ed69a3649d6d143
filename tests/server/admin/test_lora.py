"""LoRA adapters over real HTTP (the tiny Llama, random-weight PEFT adapters): a request
selects an adapter by its `model`; /v1/models lists adapters with their parent; eight
requests in flight over three adapters and the base model each answer as they do alone;
adapters load and unload at run time; bad ones are refused with a 400 naming the
problem; a model's adapters follow it through an unload and a load; KV events name the
adapter of their blocks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM

from tests.server.conftest import live_server, tiny_config
from tests.support.adapters import save_adapter
from tests.support.kv_events import free_endpoint, receive

PROMPTS = ["The river towns of the north", "A list of fruit: apple,", "Once upon a time"]


@pytest.fixture(scope="module")
def adapters(tiny_model_paths: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_paths["llama"], dtype=torch.float32)
    root = tmp_path_factory.mktemp("tiny-adapters")
    specs = {"a8": (8, ["q_proj", "v_proj"]), "b16": (16, ["o_proj", "up_proj", "down_proj"]),
             "c8": (8, ["k_proj", "gate_proj"]), "r32": (32, ["q_proj"])}  # fmt: skip
    return {
        name: save_adapter(model, root / name, rank, targets, seed, scale=1.0)
        for seed, (name, (rank, targets)) in enumerate(specs.items())
    }


def load(url: str, name: str, path: object) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def status(url: str, model: str) -> int:
    body = {"model": model, "prompt": "x", "max_tokens": 1}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code


def complete(url: str, model: str, prompt: str, **fields: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "logprobs": 2, **fields}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {
        "text": choice["text"],
        "logprobs": choice["logprobs"],
        "model": response.json()["model"],
    }


def test_adapters_selected_by_name_and_batched_together(
    tiny_model_paths: dict[str, Path], adapters: dict[str, Path]
) -> None:
    modules = {name: str(adapters[name]) for name in ("a8", "b16", "c8")}
    config = tiny_config(tiny_model_paths["llama"], served_model_name="tiny", lora_modules=modules)
    with live_server(config) as url:
        cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models").json()["data"]}
        assert set(cards) == {"tiny", "a8", "b16", "c8"}
        assert cards["a8"]["parent"] == "tiny" and cards["a8"]["root"] == modules["a8"]
        assert cards["tiny"]["parent"] is None
        names = ["tiny", "a8", "b16", "c8"]
        alone = {(m, p): complete(url, m, p) for m in names for p in PROMPTS}
        assert alone[("a8", PROMPTS[0])]["model"] == "a8"
        # Each its own logits (the tiny model's texts may coincide).
        assert len({repr(alone[(m, PROMPTS[0])]["logprobs"]) for m in names}) == 4
        jobs = [(m, p) for p in PROMPTS for m in names] * 2
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda job: complete(url, *job), jobs))
        assert together == [alone[job] for job in jobs]


def test_adapters_load_and_unload_at_run_time(
    tiny_model_paths: dict[str, Path], adapters: dict[str, Path], tmp_path: Path
) -> None:
    config = tiny_config(
        tiny_model_paths["llama"], served_model_name="tiny", allow_runtime_lora_updating=True,
        max_loras=2, keep_alive="200ms",
    )  # fmt: skip
    with live_server(config) as url:
        assert status(url, "a8") == 404
        loaded = load(url, "a8", adapters["a8"])
        assert loaded.status_code == 200, loaded.text
        first = complete(url, "a8", PROMPTS[0])
        assert first != complete(url, "tiny", PROMPTS[0])
        bad = {
            "missing": (tmp_path / "nowhere", "adapter_config.json"),
            "r32": (adapters["r32"], "above max_lora_rank"),
            "a8": (adapters["b16"], "taken"),
            "tiny": (adapters["b16"], "taken"),
        }
        for name, (path, named) in bad.items():
            response = load(url, name, path)
            assert response.status_code == 400 and named in response.json()["error"]["message"]
        assert load(url, "b16", adapters["b16"]).status_code == 200
        full = load(url, "c8", adapters["c8"])
        assert full.status_code == 400 and "max_loras" in full.json()["error"]["message"]
        # The model unloads after its keep_alive; its adapters come back with it.
        time.sleep(1.0)
        assert complete(url, "a8", PROMPTS[0]) == first
        assert unload(url, "a8").status_code == 200
        assert status(url, "a8") == 404
        assert unload(url, "a8").status_code == 404
        assert load(url, "c8", adapters["c8"]).status_code == 200  # the slot was freed


def test_runtime_updates_are_off_unless_allowed(
    tiny_model_paths: dict[str, Path], adapters: dict[str, Path]
) -> None:
    with live_server(tiny_config(tiny_model_paths["llama"])) as url:
        response = load(url, "a8", adapters["a8"])
        assert response.status_code == 400
        assert "allow_runtime_lora_updating" in response.json()["error"]["message"]


def test_kv_events_name_the_adapter_and_its_blocks_are_its_own(
    tiny_model_paths: dict[str, Path], adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A real ZMQ subscriber: the same prompt under an adapter and under the base model is
    stored as other blocks (other hashes), each event naming its adapter (`lora_name`), in
    memory and in the disk tier."""
    endpoint = free_endpoint()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv"}  # fmt: skip
    config = tiny_config(
        tiny_model_paths["llama"], served_model_name="tiny", kv_events_config=events,
        lora_modules={"a8": str(adapters["a8"])}, kv_disk_size="16MiB",
        kv_disk_path=str(tmp_path / "kv"),
    )  # fmt: skip
    with live_server(config) as url:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.5)  # ZMQ's slow joiner
        prompt = [(7 * i) % 200 + 10 for i in range(40)]  # 2 full blocks
        stored: dict[tuple[str | None, str], list[int]] = {}
        for model in ("a8", "tiny"):
            body = {"model": model, "prompt": prompt, "max_tokens": 2}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            for _, batch in receive(sub):
                for event in batch:
                    if event[0] == "BlockStored":
                        stored.setdefault((event[7], event[6]), []).extend(event[1])
        sub.close()
    assert set(stored) == {("a8", "CPU"), ("a8", "DISK"), (None, "CPU"), (None, "DISK")}
    assert stored[("a8", "CPU")] == stored[("a8", "DISK")]
    assert not set(stored[("a8", "CPU")]) & set(stored[(None, "CPU")])

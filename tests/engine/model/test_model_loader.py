"""Resolving the model setting: the embedded default, folders, GGUF files, hub ids."""

from __future__ import annotations

import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from engine.errors import ModelLoadError
from engine.model.device import cpu_has_fast_bf16, resolve_dtype
from engine.model.gguf import metadata_folder
from engine.model.loader import load_model


def test_local_folder_loads_with_eos_ids(tiny_model_paths: dict[str, Path]):
    loaded = load_model(
        str(tiny_model_paths["llama"]), dtype=torch.float32, device=torch.device("cpu")
    )
    assert loaded.name == "llama"
    assert loaded.eos_token_ids == {loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert not loaded.model.training


def test_missing_paths_are_clear_errors(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="model file not found"):
        load_model(str(tmp_path / "x.gguf"), dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "absent"), dtype=torch.float32, device=torch.device("cpu"))


def test_unreachable_hub_id_says_what_to_do(monkeypatch: pytest.MonkeyPatch):
    # The hub library reads HF_HUB_OFFLINE once, at import: set its constant too, or it
    # tries the (unreachable) network and its retries, about 45 s.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="local folder"):
        load_model("someone/no-such-model", dtype=torch.float32, device=torch.device("cpu"))


def test_a_file_that_is_not_a_gguf_is_a_clear_error_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match=r"broken\.gguf is not a readable GGUF file"):
        metadata_folder(gguf)
    # Only the lock file stays (no longer locked): no folder and no staging folder.
    [lock] = (tmp_path / "gguf").iterdir()
    assert lock.name.endswith(".lock") and lock.is_file()


def test_auto_dtype_follows_the_cpu_flags(tmp_path: Path):
    with_bf16 = tmp_path / "cpuinfo"
    with_bf16.write_text("flags : fpu avx512f avx512_bf16\n")
    without = tmp_path / "cpuinfo-old"
    without.write_text("flags : fpu avx2\n")
    assert cpu_has_fast_bf16(with_bf16) and not cpu_has_fast_bf16(without)
    assert resolve_dtype("float32", torch.device("cpu")) is torch.float32
    expected = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) is expected


@pytest.mark.slow
def test_default_model_answers_and_reloads_from_cache(default_model):
    tokenizer = default_model.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = default_model.model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    started = time.perf_counter()
    load_model("default", dtype=torch.float32, device=torch.device("cpu"))
    assert time.perf_counter() - started < 5

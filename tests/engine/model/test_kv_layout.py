"""Where each layer's K/V live: one tensor per K/V shape, all indexed by the same blocks,
sized from one budget. A tiny Gemma 4 (sliding layers with 2 KV heads of 32, global ones
with 1 of 64, the last two layers reading the first two's K/V) and a hybrid whose
recurrent layers keep none."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM
from engine.model.kv_cache import KVGroup
from tests.support.architectures import HYBRID, SERVED, build


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = build(tmp_path_factory.mktemp("gemma4") / "model", *SERVED["gemma4"])
    return LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", enforce_eager=True)


def test_layers_of_two_shapes_get_blocks_of_their_own(gemma4: LLM) -> None:
    layout = gemma4.engine.kv_layout
    assert layout.groups == (KVGroup(1, 2, 32), KVGroup(1, 1, 64))
    # Layers 2 and 3 read layers 0's and 1's K/V: they hold none of their own.
    assert layout.layers == {0: (0, 0), 1: (1, 0), 2: (0, 0), 3: (1, 0)}
    sliding, full = gemma4.engine.runner.kv_caches
    blocks = gemma4.engine.num_kv_blocks
    assert sliding.shape == (1, 2, blocks, 16, 2, 32) and full.shape == (1, 2, blocks, 16, 1, 64)
    # A block costs each shape's bytes, not four layers padded to the widest.
    assert layout.bytes_per_block(16, 4) == 16 * 2 * 4 * (2 * 32 + 64)
    assert blocks == 4 * 2**20 // layout.bytes_per_block(16, 4)


def test_a_hybrids_recurrent_layers_hold_no_kv(tmp_path: Path) -> None:
    folder = build(tmp_path / "qwen3_5", *HYBRID["qwen3_5"])
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", enforce_eager=True)
    assert llm.engine.kv_layout.groups == (KVGroup(1, 2, 32),)
    assert llm.engine.kv_layout.layers == {1: (0, 0)}  # layer 0 is Gated DeltaNet

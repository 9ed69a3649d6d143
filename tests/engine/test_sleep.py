"""engine/sleep.py on real memory: released KV pages read as zeros and leave the resident
set, and the KV cache takes pages only as it is written; a file mapping holding a model's
tensors is released only while no page of it was written, and reads back the file's
bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine import sleep
from engine.model.kv_cache import KVLayout, allocate_kv_cache

pytestmark = pytest.mark.skipif(not sleep.supported(), reason="Linux only")


def test_released_kv_pages_read_as_zeros_and_leave_the_resident_set():
    kv = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page written
    before = sleep.resident_bytes()
    sleep.release_tensor(kv)
    assert before - sleep.resident_bytes() > 60 * 2**20
    inside = kv[sleep.PAGE : -sleep.PAGE]
    assert torch.count_nonzero(inside) == 0
    kv.fill_(2.0)  # the pages come back when written
    assert torch.all(kv == 2.0)


def test_the_kv_cache_is_resident_as_it_is_written_and_released_by_sleep():
    layout = KVLayout.uniform(num_layers=4, num_kv_heads=4, head_dim=64)
    before = sleep.resident_bytes()
    (kv,) = allocate_kv_cache(layout, 1024, 16, torch.float32, torch.device("cpu"))  # 128 MiB
    assert kv.nbytes == 128 * 2**20 and kv.data_ptr() % sleep.PAGE == 0
    assert sleep.resident_bytes() - before < 16 * 2**20  # start-up writes none of it
    assert torch.count_nonzero(kv) == 0
    kv.fill_(1.0)
    written = sleep.resident_bytes()
    assert written - before > 120 * 2**20
    sleep.release_tensor(kv)
    assert written - sleep.resident_bytes() > 120 * 2**20
    assert torch.count_nonzero(kv) == 0


def model_over(path: Path, mode: str) -> tuple[nn.Module, np.memmap]:
    mapped = np.memmap(path, dtype=np.uint8, mode=mode)
    model = nn.Linear(1, 1)
    model.register_buffer("mapped", torch.from_numpy(mapped))
    return model, mapped


def test_unwritten_weight_mappings_are_released_and_read_back_from_their_file(tmp_path: Path):
    data = np.random.default_rng(0).integers(0, 255, 32 * 2**20, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    model, mapped = model_over(path, "c")
    assert int(mapped.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # all paged in
    mappings = sleep.weight_mappings(model)
    assert [mapping.path for mapping in mappings] == [str(path)]
    sleep.release_mappings(mappings)
    assert np.array_equal(mapped, data)  # read back from the file


def test_a_mapping_with_a_written_page_is_left_alone(tmp_path: Path):
    path = tmp_path / "weights.bin"
    np.zeros(4 * 2**20, dtype=np.uint8).tofile(path)
    model, mapped = model_over(path, "c")
    mapped[123] = 7  # a private copy of one page: releasing it would lose the write
    assert sleep.weight_mappings(model) == []
    assert mapped[123] == 7

"""The disk tier on a real disk: blocks come back with the bits they were stored with;
damaged, truncated, foreign and half-written files are never trusted; the budget holds,
also for two tiers sharing a folder; the index survives a restart."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cache import MEDIUM_DISK, BlockRemoved, BlockStored
from engine.kv_tiers.block_file import file_name, file_size
from engine.kv_tiers.disk_tier import DiskTier, tier_key
from scheduler import TierLoad
from tests.support.kv_tiers import BLOCK, KEY, TOKENS, kv_cache, loading, registered


def block_bytes() -> int:
    return file_size(BLOCK, 2 * 2 * BLOCK * 2 * 8 * 4)


def settle(tier: DiskTier, stores: int) -> None:
    deadline = time.monotonic() + 10
    while tier.stats().stores < stores:
        assert time.monotonic() < deadline, "the writer did not write"
        time.sleep(0.01)


def load(tier: DiskTier, job: TierLoad) -> int:
    tier.start_loads([job])
    [(done, num_blocks)] = tier.finish_loads(wait=10)
    assert done is job
    return num_blocks


def test_blocks_come_back_bit_identical_into_other_blocks(tmp_path: Path) -> None:
    source, target = kv_cache(0), kv_cache(1)
    stored: list = []
    writer = DiskTier((source,), 1 << 20, tmp_path, KEY, BLOCK, stored.extend)
    writer.store(registered(TOKENS, [3, 7, 1, 9]))
    settle(writer, 4)
    assert [type(event) for event in stored] == [BlockStored]
    assert stored[0].token_ids == tuple(TOKENS[:16]) and stored[0].medium == MEDIUM_DISK
    writer.close()
    # Another process's tier on the same folder (a restart): the index comes from names.
    reader = DiskTier((target,), 1 << 20, tmp_path, KEY, BLOCK)
    assert reader.stats().num_blocks == 4
    job = loading(TOKENS, [0, 2, 4, 5], 4)
    assert reader.lookup(job.block_hashes) == 4
    assert load(reader, job) == 4
    for stored_id, loaded_id in zip([3, 7, 1, 9], [0, 2, 4, 5], strict=True):
        assert torch.equal(target[:, :, loaded_id], source[:, :, stored_id])
    assert torch.equal(target[:, :, 8], kv_cache(1)[:, :, 8])  # nothing else written
    reader.close()


def test_blocks_of_two_kv_shapes_come_back_bit_identical(tmp_path: Path) -> None:
    """A model whose layers keep K/V of two shapes (Gemma 4): a block is both tensors'."""
    wide = (1, 2, 10, BLOCK, 1, 16)  # one layer, one KV head of 16
    source = (kv_cache(0), torch.randn(wide, generator=torch.Generator().manual_seed(3)))
    target = (kv_cache(1), torch.zeros(wide))
    writer = DiskTier(source, 1 << 20, tmp_path, KEY, BLOCK)
    writer.store(registered(TOKENS, [3, 7, 1, 9]))
    settle(writer, 4)
    writer.close()
    reader = DiskTier(target, 1 << 20, tmp_path, KEY, BLOCK)
    assert load(reader, loading(TOKENS, [0, 2, 4, 5], 4)) == 4
    for stored_id, loaded_id in zip([3, 7, 1, 9], [0, 2, 4, 5], strict=True):
        for into, came_from in zip(target, source, strict=True):
            assert torch.equal(into[:, :, loaded_id], came_from[:, :, stored_id])
    reader.close()


@pytest.mark.parametrize("damage", ["overwritten", "truncated", "foreign", "renamed"])
def test_a_damaged_file_is_dropped_and_the_blocks_before_it_are_kept(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier((kv_cache(0),), 1 << 20, tmp_path, KEY, BLOCK)
    blocks = registered(TOKENS, [3, 7, 1, 9])
    tier.store(blocks)
    settle(tier, 4)
    path = tier.folder / file_name(blocks[2].block_hash)
    if damage == "overwritten":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "foreign":  # a block of another model's folder, copied in
        other = DiskTier((kv_cache(0),), 1 << 20, tmp_path, "fedcba9876543210", BLOCK)
        other.store(blocks[2:3])
        settle(other, 1)
        path.write_bytes((other.folder / path.name).read_bytes())
        other.close()
    else:  # another block's file under this block's name
        path.write_bytes((tier.folder / file_name(blocks[1].block_hash)).read_bytes())
    target = kv_cache(5)
    with caplog.at_level(logging.WARNING, logger="engine.kv_tiers.disk_tier"):
        assert load(tier, loading(TOKENS, [0, 2, 4, 5], 4)) == 2
    [record] = caplog.records
    assert str(path) in record.getMessage()
    assert not path.exists() and tier.stats().drops == 1
    assert tier.lookup(loading(TOKENS, [0], 4).block_hashes) == 2
    assert torch.equal(target[:, :, 4], kv_cache(5)[:, :, 4])  # the dropped block unwritten
    tier.close()


def test_the_budget_holds_and_the_least_recently_used_go_first(tmp_path: Path) -> None:
    capacity = 13 * block_bytes()
    events: list = []
    tier = DiskTier((kv_cache(0),), capacity, tmp_path, KEY, BLOCK, events.extend)
    first = list(range(17))
    tier.store(registered(first, [0, 1, 2, 3]))
    settle(tier, 4)
    for n in range(1, 4):  # 12 more blocks of other prompts, the first used before the last
        if n == 3:
            assert load(tier, loading(first, [4, 5, 6, 7], 4)) == 4
        tier.store(registered([n * 1000 + i for i in range(17)], [0, 1, 2, 3]))
        settle(tier, 4 + 4 * n)
    files = list(tier.folder.glob("*.kv"))
    assert len(files) * block_bytes() <= capacity
    assert sum(f.stat().st_size for f in files) <= capacity
    assert tier.lookup(loading(first, [0], 4).block_hashes) == 4  # kept: recently used
    removed = [event for event in events if isinstance(event, BlockRemoved)]
    assert sum(len(event.block_hashes) for event in removed) == 16 - len(files)
    tier.close()


def test_two_tiers_on_one_folder_share_blocks_and_the_budget(tmp_path: Path) -> None:
    capacity = 12 * block_bytes()
    one = DiskTier((kv_cache(0),), capacity, tmp_path, KEY, BLOCK)
    two = DiskTier((kv_cache(1),), capacity, tmp_path, KEY, BLOCK)
    one.store(registered(TOKENS, [3, 7, 1, 9]))
    settle(one, 4)
    target = kv_cache(2)
    reader = DiskTier((target,), capacity, tmp_path, KEY, BLOCK)
    job = loading(TOKENS, [0, 2, 4, 5], 4)
    assert two.lookup(job.block_hashes) == 4  # written by the other one after its start
    for n in range(1, 6):
        writer = one if n % 2 else two
        writer.store(registered([n * 1000 + i for i in range(17)], [0, 1, 2, 3]))
        settle(writer, writer.stats().stores + 4)
    files = list(tmp_path.glob(f"{KEY}/*.kv"))
    assert len(files) * block_bytes() <= capacity
    assert not list(tmp_path.glob(f"{KEY}/.*"))  # no temporary file left behind
    for path in files:  # every file whole and its own block's
        assert path.stat().st_size == block_bytes()
    for tier in (one, two, reader):
        tier.close()


def test_a_writer_killed_mid_write_leaves_nothing_trusted(tmp_path: Path) -> None:
    """A process killed with SIGKILL while it writes block files: what it leaves is either
    a whole file or a temporary one, which no reader trusts and a later start deletes."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(Path.cwd())!r})
        from tests.support.kv_tiers import registered, kv_cache, KEY, BLOCK
        from engine.kv_tiers.disk_tier import DiskTier
        tier = DiskTier((kv_cache(0),), 1 << 30, Path({str(tmp_path)!r}), KEY, BLOCK)
        print("ready", flush=True)
        n = 0
        while True:
            n += 1
            tier.store(registered([n * 100 + i for i in range(17)], [0, 1, 2, 3]))
    """)  # fmt: skip
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    time.sleep(1.0)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    folder = tmp_path / KEY
    temporary = list(folder.glob(".*.tmp"))
    for path in temporary:  # as old as a killed writer's
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    tier = DiskTier((kv_cache(1),), 1 << 30, tmp_path, KEY, BLOCK)
    assert not list(folder.glob(".*.tmp"))
    files = list(folder.glob("*.kv"))
    assert files and all(path.stat().st_size == block_bytes() for path in files)
    assert tier.stats().num_blocks == len(files)
    tier.close()


def test_the_key_changes_with_the_settings_and_the_model_files(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    settings = {"quantization": "gguf", "dtype": "torch.float32", "block_size": "16"}
    key = tier_key(settings, model)
    assert key == tier_key(dict(settings), model)
    assert key != tier_key({**settings, "quantization": "int8"}, model)
    assert key != tier_key({**settings, "dtype": "torch.bfloat16"}, model)
    model.write_bytes(b"other weights")
    assert key != tier_key(settings, model)


def test_a_budget_below_one_block_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_disk_size"):
        DiskTier((kv_cache(0),), block_bytes() - 1, tmp_path, KEY, BLOCK)

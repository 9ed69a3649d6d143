"""Host RAM beside a GPU's KV tensor (`kv_offloading_size`), its class run on the CPU: a
block comes back bit for bit, the pool replaces its least recently used blocks, a block
whose tokens or parent differ is not served; on the CPU the setting is refused."""

from __future__ import annotations

import pytest
import torch

from cache import MEDIUM_CPU, BlockRemoved, BlockStored
from engine import LLM
from engine.config import ConfigError
from engine.kv_tiers.host_tier import HostTier
from tests.support.kv_tiers import BLOCK, TOKENS, kv_cache, loading, registered

BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 8 * 4


def test_blocks_come_back_bit_identical_and_the_oldest_go_first() -> None:
    source = kv_cache(0)
    events: list = []
    tier = HostTier((source,), 6 * BLOCK_BYTES, BLOCK, events.extend)
    tier.store(registered(TOKENS, [3, 7, 1, 9]))
    [stored] = events
    assert isinstance(stored, BlockStored) and stored.medium == MEDIUM_CPU
    job = loading(TOKENS, [0, 2, 4, 5], 4)
    assert tier.lookup(job.block_hashes) == 4
    tier.start_loads([job])
    assert tier.finish_loads() == [(job, 4)]
    for stored_id, loaded_id in zip([3, 7, 1, 9], [0, 2, 4, 5], strict=True):
        assert torch.equal(source[:, :, loaded_id], kv_cache(0)[:, :, stored_id])
    other = list(range(500, 517))
    tier.store(registered(other, [6, 8, 1, 2]))  # 8 blocks into 6 slots: 2 replaced
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed[0].block_hashes) == 2
    assert tier.lookup(job.block_hashes) == 0  # the first prompt's first blocks went first
    assert tier.stats().num_blocks == 6


def test_a_block_of_other_tokens_under_its_hash_is_not_served() -> None:
    tier = HostTier((kv_cache(0),), 8 * BLOCK_BYTES, BLOCK)
    tier.store(registered(TOKENS, [3, 7, 1, 9]))
    job = loading(TOKENS, [0, 2, 4, 5], 4)
    job.seq.prompt_token_ids[5] = 9999  # block 1 holds other tokens than were stored
    tier.start_loads([job])
    assert tier.finish_loads() == [(job, 1)]


def test_on_the_cpu_kv_offloading_size_is_refused(tiny_model_paths) -> None:
    with pytest.raises(ConfigError, match="on the CPU the KV cache is in RAM already"):
        LLM(str(tiny_model_paths["llama"]), device="cpu", kv_offloading_size="1GiB",
            kv_cache_memory="4MiB", max_model_len=128, enforce_eager=True)  # fmt: skip

"""The KV tiers' test helpers: a small KV tensor, its blocks as registered and as loaded."""

from __future__ import annotations

import torch

from cache import RegisteredBlock, extend_block_hashes
from scheduler import Sequence, SequenceStatus, TierLoad

BLOCK = 4
LAYOUT = (2, 2, 10, BLOCK, 2, 8)  # layers, K/V, blocks, block size, heads, head dim
KEY = "0123456789abcdef"
TOKENS = list(range(100, 117))  # 4 full blocks and one token


def kv_cache(seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT, generator=torch.Generator().manual_seed(seed))


def registered(tokens: list[int], block_ids: list[int]) -> list[RegisteredBlock]:
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BLOCK)
    return [
        RegisteredBlock(block_id, hashes[i], hashes[i - 1] if i else None,
                        tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
        for i, block_id in enumerate(block_ids)
    ]  # fmt: skip


def loading(tokens: list[int], block_ids: list[int], num_blocks: int) -> TierLoad:
    seq = Sequence("s", "s", list(tokens), max_tokens=1, status=SequenceStatus.LOADING)
    extend_block_hashes(seq.block_hashes, tokens, BLOCK)
    return TierLoad(seq, 0, tuple(block_ids), tuple(seq.block_hashes[:num_blocks]), 0)

"""KV-cache block manager: block pool, free queue, prefix cache, profiling."""

from cache.block import (
    BlockHashes,
    FreeBlockQueue,
    KVCacheBlock,
    cdiv,
    extend_block_hashes,
    hash_block,
)
from cache.block_manager import AllocStatus, BlockManager
from cache.block_map import BlockState
from cache.events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    stored_events,
)
from cache.profiling import (
    CacheSize,
    InsufficientKVCacheError,
    KVSizing,
    bytes_per_block,
    kv_cache_bytes_cpu,
    kv_cache_bytes_cuda,
    num_kv_blocks,
    profile_num_blocks,
)
from cache.state_pool import StatePool
from cache.stats import CacheStats
from cache.tier import PrefixTier, RegisteredBlock, held_prefix

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "AllocStatus",
    "BlockHashes",
    "BlockManager",
    "BlockRemoved",
    "BlockState",
    "BlockStored",
    "CacheSize",
    "CacheStats",
    "FreeBlockQueue",
    "InsufficientKVCacheError",
    "KVCacheBlock",
    "KVEvent",
    "KVSizing",
    "PrefixTier",
    "RegisteredBlock",
    "StatePool",
    "bytes_per_block",
    "cdiv",
    "extend_block_hashes",
    "hash_block",
    "held_prefix",
    "kv_cache_bytes_cpu",
    "kv_cache_bytes_cuda",
    "num_kv_blocks",
    "profile_num_blocks",
    "stored_events",
]

"""Block-manager cost per block at a small and a large pool: constant-time ops keep it flat.

Run: `python -m bench.block_manager`. Both pools run the same operations on the same
tokens; only the number of blocks differs. Each pool starts with every block free and
holding a prefix-cache hash, so each new block taken from the queue front is an eviction.
Each request then shares a hot prefix whose blocks sit free in the middle of the queue
(revived by removal from the middle), takes fresh blocks from the front, registers its
full blocks and is freed a few requests later. The printed ratio compares the two pools.
"""

from __future__ import annotations

import gc
import statistics
import time

from cache import BlockManager

BLOCK_SIZE = 16
POOL_SIZES = (1_000, 100_000)
NUM_HOT_PREFIXES = 16  # a hot prefix comes back every 16 requests ...
LIVE_REQUESTS = 8  # ... and its last user was freed 8 requests earlier: it sits free mid-queue
PREFIX_BLOCKS = 4
FRESH_BLOCKS = 4  # full, so they get registered and every block reuse is an eviction
REQUESTS_PER_REPEAT = 2_000
REPEATS = 7


class _Workload:
    """Requests `hot prefix + fresh tokens`, with LIVE_REQUESTS of them alive at a time."""

    def __init__(self, num_blocks: int) -> None:
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, watermark=0)
        self.hot = [
            list(range(-(i + 1) * PREFIX_BLOCKS * BLOCK_SIZE, -i * PREFIX_BLOCKS * BLOCK_SIZE))
            for i in range(NUM_HOT_PREFIXES)
        ]
        self.live: list[str] = []
        self.next_request = 0
        self.next_token = 0
        self._fill_cache()

    def _fill_cache(self) -> None:
        """Leave every block free but registered, so that reusing any block evicts a hash."""
        for i, prefix in enumerate(self.hot):
            self._register(f"hot{i}", prefix)
        remaining = self.bm.num_free_blocks
        while remaining:
            n = min(remaining, 64)
            self._register("fill", self._fresh(n * BLOCK_SIZE))
            self.bm.free("fill")
            remaining -= n
        for i in range(len(self.hot)):
            self.bm.free(f"hot{i}")

    def _register(self, seq_id: str, tokens: list[int]) -> None:
        self.bm.allocate(seq_id, tokens)
        self.bm.cache_full_blocks(seq_id, tokens, len(tokens))

    def _fresh(self, n: int) -> list[int]:
        start = self.next_token
        self.next_token += n
        return list(range(start, start + n))

    def run(self, num_requests: int) -> tuple[float, int]:
        """Seconds spent in allocate + cache_full_blocks + free, and blocks allocated."""
        first = self.next_request
        prompts = [
            self.hot[(first + i) % NUM_HOT_PREFIXES] + self._fresh(FRESH_BLOCKS * BLOCK_SIZE)
            for i in range(num_requests)
        ]
        seq_ids = [f"r{first + i}" for i in range(num_requests)]
        self.next_request += num_requests
        bm, live = self.bm, self.live
        gc.collect()
        gc.disable()  # as timeit does: collector pauses scale with the heap, not with our ops
        try:
            start = time.perf_counter()
            for seq_id, prompt in zip(seq_ids, prompts, strict=True):
                cached = bm.allocate(seq_id, prompt)
                assert cached == PREFIX_BLOCKS * BLOCK_SIZE
                bm.cache_full_blocks(seq_id, prompt, len(prompt))
                live.append(seq_id)
                if len(live) > LIVE_REQUESTS:
                    bm.free(live.pop(0))
            elapsed = time.perf_counter() - start
        finally:
            gc.enable()
        return elapsed, num_requests * (PREFIX_BLOCKS + FRESH_BLOCKS)


def measure(num_blocks: int) -> tuple[float, float, int]:
    """Median and best nanoseconds per allocated block, and evictions, over REPEATS."""
    workload = _Workload(num_blocks)
    workload.run(REQUESTS_PER_REPEAT)  # warm-up, also moves the hot prefixes mid-queue
    evictions_before = workload.bm.stats().evictions
    per_block = []
    for _ in range(REPEATS):
        elapsed, blocks = workload.run(REQUESTS_PER_REPEAT)
        per_block.append(elapsed / blocks * 1e9)
    evictions = workload.bm.stats().evictions - evictions_before
    return statistics.median(per_block), min(per_block), evictions


def main() -> None:
    print(
        f"allocate + cache_full_blocks + free; {REQUESTS_PER_REPEAT} requests x "
        f"{REPEATS} repeats; each request: {PREFIX_BLOCKS} revived prefix blocks + "
        f"{FRESH_BLOCKS} new"
    )
    print(f"{'pool blocks':>12} | {'ns/block median':>15} | {'ns/block best':>13} | evictions")
    results = {}
    for num_blocks in POOL_SIZES:
        median, best, evictions = measure(num_blocks)
        results[num_blocks] = median
        print(f"{num_blocks:>12,} | {median:>15.0f} | {best:>13.0f} | {evictions:,}")
    small, large = POOL_SIZES
    ratio = results[large] / results[small]
    print(f"ratio {large:,} / {small:,} blocks: {ratio:.2f} (constant-time ops: expect < 1.5)")


if __name__ == "__main__":
    main()

"""Decode attention per layer: the C++ paged kernel against the torch gather + einsum path.

Run: `python -m bench.decode_attention`. SmolLM2-135M's attention shape (9 query heads,
3 KV heads, head_dim 64), 16-token blocks, contexts of 250 to 350 tokens, batch 32 and
128, fp32 and bf16. Every row has its own shuffled blocks in one paged KV tensor of
NUM_LAYERS layers, and successive calls walk the layers, so that K and V come from memory
as they do in a real decode step (one layer at batch 32 would otherwise stay in L3). Both
paths get the same inputs in the same iteration; the ratio is torch / kernel, of medians.
GB/s is the K/V bytes the rows attend over per kernel median: the memory-bound floor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from cache import cdiv
from engine.model.attention import _decode_attention
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.kernels.decode_attention import KernelUnavailableError, paged_decode_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CONTEXT_RANGE = (250, 350)
NUM_LAYERS = 8


class Setup:
    """Inputs of both paths for one batch size and dtype, for every layer."""

    def __init__(self, batch: int, dtype: torch.dtype, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.context_lens = torch.randint(*CONTEXT_RANGE, (batch,), generator=generator)
        width = cdiv(CONTEXT_RANGE[1], BLOCK_SIZE)
        num_blocks = batch * width
        shape = (NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.kv_cache = torch.randn(shape, generator=generator).to(dtype)
        ids = torch.randperm(num_blocks, generator=generator).view(batch, width)
        used = (self.context_lens[:, None] + BLOCK_SIZE - 1) // BLOCK_SIZE
        # Padding as the model runner pads: block 0, masked out past each context length.
        self.block_tables = torch.where(torch.arange(width)[None, :] < used, ids, 0)
        self.q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
        self.scale = HEAD_DIM**-0.5
        self.metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.empty(0, dtype=torch.int64),
            decode_token_index=torch.arange(batch),
            decode_block_tables=self.block_tables,
            decode_context_lens=self.context_lens,
            prefills=[],
        )
        token_bytes = 2 * NUM_KV_HEADS * HEAD_DIM * self.kv_cache.element_size()
        self.kv_bytes = int(self.context_lens.sum()) * token_bytes

    def kernel(self, layer: int) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[layer]
        return paged_decode_attention(
            self.q, k_cache, v_cache, self.block_tables, self.context_lens, self.scale
        )

    def torch_path(self, layer: int) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[layer]
        return _decode_attention(self.q, k_cache, v_cache, self.metadata, self.scale)


def timed(fn: Callable[[int], torch.Tensor], layer: int, times: list[float]) -> torch.Tensor:
    start = time.perf_counter()
    out = fn(layer)
    times.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60, help="timed calls per path and row")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    args = parser.parse_args()
    try:
        Setup(1, torch.float32).kernel(0)  # builds the kernel on a first run
    except KernelUnavailableError as exc:
        raise SystemExit(f"bench.decode_attention: the kernel is unavailable: {exc}") from None

    print(
        f"decode attention per layer: H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} "
        f"block={BLOCK_SIZE} context {CONTEXT_RANGE[0]}-{CONTEXT_RANGE[1]}, "
        f"{torch.get_num_threads()} threads, {args.repeats} repeats, ms median (best)"
    )
    print(
        f"{'dtype':>8} | {'batch':>5} | {'kernel ms':>14} | {'torch ms':>14} | "
        f"{'torch/kernel':>12} | {'kernel GB/s':>11} | max |diff|"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for batch in args.batches:
            setup = Setup(batch, dtype)
            kernel_times: list[float] = []
            torch_times: list[float] = []
            max_diff = 0.0
            for i in range(args.repeats + 2):
                layer = i % NUM_LAYERS
                if i == 2:  # the first calls warm up allocators and caches
                    kernel_times.clear()
                    torch_times.clear()
                ours = timed(setup.kernel, layer, kernel_times)
                theirs = timed(setup.torch_path, layer, torch_times)
                max_diff = max(max_diff, (ours.float() - theirs.float()).abs().max().item())
            kernel_ms = statistics.median(kernel_times) * 1e3
            torch_ms = statistics.median(torch_times) * 1e3
            print(
                f"{str(dtype).removeprefix('torch.'):>8} | {batch:>5} | "
                f"{kernel_ms:>6.2f} ({min(kernel_times) * 1e3:>5.2f}) | "
                f"{torch_ms:>6.2f} ({min(torch_times) * 1e3:>5.2f}) | "
                f"{torch_ms / kernel_ms:>12.1f} | {setup.kv_bytes / kernel_ms / 1e6:>11.1f} | "
                f"{max_diff:.1e}"
            )


if __name__ == "__main__":
    main()

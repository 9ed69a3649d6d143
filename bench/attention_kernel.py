"""Attention per layer: the C++ paged kernel against the torch paths it replaced on the CPU.

Run: `python -m bench.attention_kernel`. SmolLM2-135M's attention shape (9 query heads,
3 KV heads, head_dim 64), 16-token blocks, fp32 and bf16, in two tables:

- decode: batch 32 and 128, contexts of 250 to 350 tokens, against the gathered torch
  path (gather + einsum). Every row has its own shuffled blocks in one paged KV tensor of
  NUM_LAYERS layers, and successive calls walk the layers, so that K and V come from
  memory as they do in a real decode step (one layer at batch 32 would otherwise stay in
  L3). GB/s is the K/V bytes the rows attend over per kernel median: the memory floor.
- prefill: one whole prompt of 256, 1,024 and 4,096 tokens, against torch's
  `scaled_dot_product_attention` (its fused flash kernel) over the gathered context, the
  CPU's prefill path before the kernel took prefill chunks too.

Both paths get the same inputs in the same iteration; the ratio is torch / kernel, of
medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from cache import cdiv
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.kernels.paged_attention import KernelUnavailableError, paged_attention
from engine.model.torch_attention import attend_causal, gathered_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CONTEXT_RANGE = (250, 350)
NUM_LAYERS = 8


class Setup:
    """Inputs of both paths for one step shape and dtype, for every layer: `queries[b]`
    query rows at the end of sequence b's `context_lens[b]` tokens."""

    def __init__(self, context_lens: list[int], queries: list[int], dtype: torch.dtype) -> None:
        generator = torch.Generator().manual_seed(len(context_lens))
        self.context_lens = torch.tensor(context_lens)
        width = cdiv(max(context_lens), BLOCK_SIZE)
        num_blocks = len(context_lens) * width
        shape = (NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.kv_cache = torch.randn(shape, generator=generator).to(dtype)
        ids = torch.randperm(num_blocks, generator=generator).view(len(context_lens), width)
        used = (self.context_lens[:, None] + BLOCK_SIZE - 1) // BLOCK_SIZE
        # Padding as the model runner pads: block 0, masked out past each context length.
        self.block_tables = torch.where(torch.arange(width)[None, :] < used, ids, 0)
        self.query_start = torch.tensor([0, *np.cumsum(queries)])
        self.q = torch.randn(sum(queries), NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
        self.scale = HEAD_DIM**-0.5
        self.metadata = PagedAttentionMetadata(
            kv_caches=(self.kv_cache,),
            slot_mapping=torch.empty(0, dtype=torch.int64),
            block_tables=self.block_tables,
            query_start=self.query_start,
            context_lens=self.context_lens,
            query_start_host=self.query_start.numpy(),
            context_lens_host=self.context_lens.numpy(),
            positions_host=np.concatenate(
                [np.arange(n - q, n) for n, q in zip(context_lens, queries, strict=True)]
            ),
            max_query_len=max(queries),
        )
        token_bytes = 2 * NUM_KV_HEADS * HEAD_DIM * self.kv_cache.element_size()
        self.kv_bytes = int(self.context_lens.sum()) * token_bytes

    def kernel(self, layer: int) -> torch.Tensor:
        return paged_attention(
            self.q, self.kv_cache[layer, 0], self.kv_cache[layer, 1], self.block_tables,
            self.query_start, self.context_lens, self.scale,
        )  # fmt: skip

    def gathered(self, layer: int) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[layer]
        return gathered_attention(self.q, k_cache, v_cache, self.metadata, self.scale)

    def sdpa(self, layer: int) -> torch.Tensor:
        """One whole prompt through SDPA, gathering its context as the old path did."""
        k_cache, v_cache = self.kv_cache[layer]
        length = int(self.context_lens[0])
        blocks = self.block_tables[0, : cdiv(length, BLOCK_SIZE)]
        keys = k_cache[blocks].flatten(0, 1)[:length]
        values = v_cache[blocks].flatten(0, 1)[:length]
        return attend_causal(self.q, keys, values, self.scale, NUM_HEADS // NUM_KV_HEADS)


def compare(
    ours: Callable[[int], torch.Tensor], theirs: Callable[[int], torch.Tensor], repeats: int
) -> tuple[list[float], list[float], float]:
    """Times both over `repeats` calls each (after two warm-up calls), interleaved."""
    times: tuple[list[float], list[float]] = ([], [])
    max_diff = 0.0
    for i in range(repeats + 2):
        outs = []
        for fn, record in zip((ours, theirs), times, strict=True):
            start = time.perf_counter()
            outs.append(fn(i % NUM_LAYERS))
            if i >= 2:  # the first calls warm up allocators and caches
                record.append(time.perf_counter() - start)
        max_diff = max(max_diff, (outs[0].float() - outs[1].float()).abs().max().item())
    return times[0], times[1], max_diff


def row(label: str, kernel: list[float], torch_times: list[float], extra: str) -> str:
    kernel_ms, torch_ms = statistics.median(kernel) * 1e3, statistics.median(torch_times) * 1e3
    return (
        f"{label} | {kernel_ms:>8.2f} ({min(kernel) * 1e3:>7.2f}) | "
        f"{torch_ms:>8.2f} ({min(torch_times) * 1e3:>7.2f}) | {torch_ms / kernel_ms:>11.2f} | "
        f"{extra}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60, help="timed decode calls per path")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 1024, 4096])
    args = parser.parse_args()
    try:
        Setup([1], [1], torch.float32).kernel(0)  # builds the kernel on a first run
    except KernelUnavailableError as exc:
        raise SystemExit(f"bench.attention_kernel: the kernel is unavailable: {exc}") from None
    print(
        f"attention per layer: H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}, "
        f"{torch.get_num_threads()} threads; ms median (best)"
    )
    print(f"\ndecode, contexts {CONTEXT_RANGE[0]}-{CONTEXT_RANGE[1]}, {args.repeats} repeats")
    print(
        f"{'dtype':>8} | {'batch':>5} | {'kernel ms':>18} | {'gathered ms':>18} | "
        f"{'torch/kernel':>11} | kernel GB/s | max |diff|"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for batch in args.batches:
            generator = torch.Generator().manual_seed(batch)
            lens = torch.randint(*CONTEXT_RANGE, (batch,), generator=generator).tolist()
            setup = Setup(lens, [1] * batch, dtype)
            ours, theirs, diff = compare(setup.kernel, setup.gathered, args.repeats)
            gbps = setup.kv_bytes / statistics.median(ours) / 1e9
            name = str(dtype).removeprefix("torch.")
            print(row(f"{name:>8} | {batch:>5}", ours, theirs, f"{gbps:>11.1f} | {diff:.1e}"))
    print("\nprefill, one whole prompt, repeats scaled to the prompt length")
    print(
        f"{'dtype':>8} | {'tokens':>6} | {'kernel ms':>18} | {'SDPA ms':>18} | "
        f"{'torch/kernel':>11} | max |diff|"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for length in args.prompts:
            setup = Setup([length], [length], dtype)
            repeats = max(3, min(30, 8192 // length))
            ours, theirs, diff = compare(setup.kernel, setup.sdpa, repeats)
            name = str(dtype).removeprefix("torch.")
            print(row(f"{name:>8} | {length:>6}", ours, theirs, f"{diff:.1e}"))


if __name__ == "__main__":
    main()

"""The group kernel's speed on a GGUF's super-block types, per row count, on one core.

Run: `python -m bench.ggml_kernel`. Random codes in the kernel formats of Q4_K, Q5_K and
Q6_K (the types of a Q4_K_M or Q5_K_M file's linears) at Llama-3.1-8B's FFN shapes (up:
14336x4096, down: 4096x14336), called with 1 to 130 rows: decode steps of one stream or
several, and prefill chunks. Speed does not depend on the codes' values. Each cell is the
best of `--calls` calls timed by the calling thread's CPU time (`time.thread_time`: another
process taking the CPU does not count, so runs of one machine compare), on one thread;
the figure is multiply-adds per second (rows x N x K / time).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.model.kernels import group_linear as gl

SHAPES = {"up": (14336, 4096), "down": (4096, 14336)}
# GGML type: (bits, scheme), as engine/linears/ggml_blocks.py converts them.
TYPES = {"Q4_K": (4, gl.SUPER_MIN), "Q5_K": (5, gl.SUPER_MIN), "Q6_K": (6, gl.SUPER_SIGNED)}


def random_weight(n: int, k: int, bits: int, scheme: int) -> gl.PackedWeight:
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, k // gl.SUPER) * 0.01).half()
    if scheme == gl.SUPER_SIGNED:
        sub = torch.randint(-32, 32, (n, k // 16), dtype=torch.int8)
        return gl.pack(codes, scales, None, bits, scheme, sub)
    offsets = (torch.rand(n, k // gl.SUPER) * 0.01).half()
    sub = torch.randint(0, 64, (n, k // gl.GROUP, 2), dtype=torch.uint8)
    return gl.pack(codes, scales, offsets, bits, scheme, sub)


def best_call(x: torch.Tensor, weight: gl.PackedWeight, calls: int) -> float:
    gl.group_linear(x, weight)
    times = []
    for _ in range(calls):
        start = time.thread_time()
        gl.group_linear(x, weight)
        times.append(time.thread_time() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 64, 130])
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"GMAC/s on one core ({gl.EXTENSION.load().instruction_set})")
    print("type  shape " + "".join(f"{rows:>8d}" for rows in args.rows))
    for name in args.types:
        for shape, (n, k) in SHAPES.items():
            weight = random_weight(n, k, *TYPES[name])
            cells = []
            for rows in args.rows:
                seconds = best_call(torch.randn(rows, k), weight, args.calls)
                cells.append(f"{rows * n * k / seconds / 1e9:8.1f}")
            print(f"{name:5s} {shape:5s} " + "".join(cells), flush=True)


if __name__ == "__main__":
    main()

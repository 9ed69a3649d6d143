"""Linear layers per row count: the engine's dense linear against the quantized kernel.

Run: `python -m bench.linear_kernels`. SmolLM2-135M's linear shapes (q/o 576x576, k/v
192x576, gate/up 1536x576, down 576x1536, the LM head 49152x576) at 1 to 32 rows, in
fp32 and bf16. `dense` is what the engine runs without quantization (`pack_linear_layers`:
in bf16 the row-invariant kernel, `Bf16Linear`, where the CPU has AVX512-BF16, else
`PackedLinear` where oneDNN packs the dtype, else `F.linear`); where `dense` is the bf16
kernel, `onednn` is oneDNN's `PackedLinear`, which it replaced; `int8` and `int4` are the
quantized layers' C++ op at 8 and 4 bits (the LM head at 8 bits in both, as the modes
have it), the path `quantization: int8 | int4` takes up to its row threshold.

Each shape has as many distinct weights as one decode step of the model has (60 q/o,
60 k/v, 60 gate/up, 30 down, one head), and successive calls walk them, so that weights
come from memory as in a real step rather than from a cache that one weight would stay
in. Both paths run interleaved, call by call, on the same input; times are medians of the
calling thread's CPU time (`time.thread_time`, so that other processes on a shared
machine, which take the CPU away, do not count; they still share its caches and memory
bus), on one thread. `step` adds up one decode step's linears (count x median).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.linears.bf16_linear import Bf16Linear
from engine.linears.packed_linear import PackedLinear, can_pack, pack_linear_layers
from engine.linears.quantized_linear import HEAD_BITS, MODES, QuantizedLinear
from engine.model.kernels import bf16_linear

CPU = torch.device("cpu")
NUM_LAYERS = 30
# name: (out_features, in_features, count in one decode step)
SHAPES = {
    "q/o": (576, 576, 2 * NUM_LAYERS),
    "k/v": (192, 576, 2 * NUM_LAYERS),
    "gate/up": (1536, 576, 2 * NUM_LAYERS),
    "down": (576, 1536, NUM_LAYERS),
    "head": (49152, 576, 1),
}


def dense_kind(dtype: torch.dtype) -> str:
    """The class name of the layer the engine makes of an unquantized linear in `dtype`."""
    model = nn.Sequential(nn.Linear(64, 16, dtype=dtype))
    if can_pack(CPU, dtype):
        pack_linear_layers(model)
    return type(model[0]).__name__


def layers(
    out_features: int, in_features: int, count: int, dtype: torch.dtype, head: bool
) -> dict[str, list[Callable]]:
    """Every path over `count` random weights."""
    paths: dict[str, list[Callable]] = {"dense": [], **{mode: [] for mode in MODES}}
    if dense_kind(dtype) == Bf16Linear.__name__:
        paths["onednn"] = []
    for _ in range(count):
        linear = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
        dense = nn.Sequential(linear)
        if can_pack(CPU, dtype):
            pack_linear_layers(dense)
        paths["dense"].append(dense[0])
        if "onednn" in paths:
            paths["onednn"].append(PackedLinear(linear))
        for mode, bits in MODES.items():
            paths[mode].append(
                QuantizedLinear.quantizing(linear, HEAD_BITS if head else bits, None)
            )
    return paths


def median_seconds(
    paths: dict[str, list[Callable]], x: torch.Tensor, budget: float
) -> dict[str, float]:
    """Interleaved timing of every path on `x`, walking its weights, about `budget` seconds
    each (at least 5 calls)."""
    start = time.thread_time()
    for fns in paths.values():
        fns[0](x)
    repeats = max(5, min(300, int(budget * len(paths) / (time.thread_time() - start))))
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(repeats):
        for name, fns in paths.items():
            fn = fns[i % len(fns)]
            start = time.thread_time()
            fn(x)
            times[name].append(time.thread_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per path and cell")
    parser.add_argument(
        "--without-amx",
        action="store_true",
        help="the bf16 kernel on AVX512-BF16 alone, as a CPU without AMX runs it",
    )
    args = parser.parse_args()
    if args.without_amx:
        bf16_linear.EXTENSION.load().set_amx(False)
    torch.set_num_threads(1)  # the clock counts the calling thread only
    print(f"1 thread, {torch.backends.cpu.get_cpu_capability()}; µs of CPU time, median")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        kind = dense_kind(dtype)
        names = ["dense", *MODES, *(["onednn"] if kind == Bf16Linear.__name__ else [])]
        print(f"\n{dtype_name} (dense: {kind})")
        print(
            f"{'shape':>8} | {'rows':>4} | "
            + " | ".join(f"{n:>9}" for n in names)
            + " | dense/"
            + " | dense/".join(names[1:])
        )
        totals = {m: dict.fromkeys(names, 0.0) for m in args.rows}
        for shape, (out_features, in_features, count) in SHAPES.items():
            paths = layers(out_features, in_features, count, dtype, head=shape == "head")
            for m in args.rows:
                x = torch.randn(m, in_features).to(dtype)
                with torch.inference_mode():
                    seconds = median_seconds(paths, x, args.budget)
                for name, value in seconds.items():
                    totals[m][name] += value * count
                print(row(shape, m, seconds), flush=True)
        for m in args.rows:
            print(row("step", m, totals[m]))


def row(label: str, rows: int, seconds: dict[str, float]) -> str:
    times = " | ".join(f"{value * 1e6:>9.1f}" for value in seconds.values())
    ratios = " | ".join(
        f"{seconds['dense'] / value:>10.2f}" for name, value in seconds.items() if name != "dense"
    )
    return f"{label:>8} | {rows:>4} | {times} | {ratios}"


if __name__ == "__main__":
    main()

"""Perplexity of the model with and without weight-only quantization, on a fixed text.

Run: `python -m bench.perplexity`. The text is CPython's own `pydoc_data.topics.topics`
(the English help topics every CPython ships), its values joined by blank lines in
sorted key order; the first `--tokens` tokens (default 4,096) are cut into windows of
`--window` tokens (default 512), each scored on its own: every token after a window's
first, given the ones before it in the window. The text differs a little between CPython
versions, so the version is printed with the table.

Each variant loads the model afresh and prepares its linears as the engine does
(`quantize_linear_layers`, then `pack_linear_layers` where oneDNN packs the dtype). A
window is one forward of 512 rows, so with a row threshold it runs the quantized model's
dense path; the `kernel` variant runs the kernel at every row count instead, which is what
decode at small batches computes. The table gives each variant's
perplexity and its change against the unquantized model of the same dtype.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from transformers.utils import logging as transformers_logging

from engine.linears.packed_linear import can_pack, pack_linear_layers
from engine.linears.quantized_linear import (
    MODES,
    max_kernel_rows,
    quantize_linear_layers,
    unavailable_reason,
)
from engine.model.loader import load_model, resolve_model_folder

CPU = torch.device("cpu")


def text() -> str:
    return "\n\n".join(topics[key] for key in sorted(topics))


def variants(dtype: torch.dtype) -> list[tuple[str, str, int | None]]:
    """(label, mode, kernel rows) of each model measured in `dtype`, unquantized first."""
    rows = max_kernel_rows(dtype)
    measured = [("none", "none", None)]
    for mode in MODES:
        if unavailable_reason(CPU, dtype, mode) is not None:
            continue
        if rows is not None:
            measured.append((f"{mode} (dense, >{rows} rows)", mode, rows))
        measured.append((f"{mode} (kernel)", mode, None))
    return measured


@torch.inference_mode()
def perplexity(model: torch.nn.Module, ids: torch.Tensor, window: int) -> float:
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = model(input_ids=chunk[None], use_cache=False).logits[0, :-1].float()
        total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    tokenizer = load_model(args.model, dtype=torch.float32, device=CPU).tokenizer
    ids = torch.tensor(tokenizer(text())["input_ids"][: args.tokens])
    version = ".".join(map(str, sys.version_info[:3]))
    print(
        f"{args.model}: {len(ids)} tokens of pydoc_data.topics (CPython {version}) in windows "
        f"of {args.window}, {torch.get_num_threads()} threads"
    )
    print(f"{'dtype':>8} | {'variant':<26} | {'perplexity':>10} | {'change':>16} | {'s':>5}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        reference = None
        for label, mode, rows in variants(dtype):
            model = load_model(args.model, dtype=dtype, device=CPU).model
            if mode != "none":
                quantize_linear_layers(model, mode, rows, Path(resolve_model_folder(args.model)[0]))
            if can_pack(CPU, dtype):
                pack_linear_layers(model)
            start = time.perf_counter()
            value = perplexity(model, ids, args.window)
            seconds = time.perf_counter() - start
            reference = reference or value
            change = f"{value - reference:+.3f} ({(value / reference - 1) * 100:+.2f}%)"
            print(
                f"{dtype_name:>8} | {label:<26} | {value:>10.3f} | {change:>16} | {seconds:>5.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

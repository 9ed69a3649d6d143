"""Perplexity of the model with and without weight-only quantization, on a fixed text.

Run: `python -m bench.perplexity`. The text is CPython's own `pydoc_data.topics.topics`
(the English help topics every CPython ships), its values joined by blank lines in
sorted key order; the first `--tokens` tokens (default 4,096) are cut into windows of
`--window` tokens (default 512), each scored on its own: every token after a window's
first, given the ones before it in the window. The text differs a little between CPython
versions, so the version is printed with the table.

Each variant loads the model afresh and prepares its linears as the engine does: a GGUF
in its own types (`gguf`, the kernel's layers over the file's blocks) and dequantized
(`none`), or quantized again (`quantize_linear_layers`, then `pack_linear_layers` where
oneDNN packs the dtype). A window is one forward of 512 rows, so with a row threshold it
runs the quantized model's dense path; the `kernel` variant runs the kernel at every row
count instead, which is what decode at small batches computes. The table gives each
variant's perplexity and its change against the unquantized model of the same dtype.

`--llama-cpp` scores as llama.cpp's `llama-perplexity -c WINDOW` does, to compare with it
on the same GGUF and text (`--write-text PATH` writes the text for it): the whole text's
tokens in consecutive windows, each window's first token replaced by BOS where the
tokenizer adds one, and only the tokens of each window's second half scored. Tokenizers
can differ (llama.cpp's pre-tokenizer and the one transformers builds from a GGUF split
some runs of spaces differently): `--token-ids` scores the tokens llama.cpp made.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from transformers.utils import logging as transformers_logging

from engine import capabilities
from engine.linears.packed_linear import can_pack, pack_linear_layers
from engine.linears.quantized_linear import (
    MODES,
    max_kernel_rows,
    quantize_linear_layers,
    unavailable_reason,
)
from engine.model.loader import checkpoint_quantization, load_model, resolve_model_folder

CPU = torch.device("cpu")


def text() -> str:
    return "\n\n".join(topics[key] for key in sorted(topics))


def variants(dtype: torch.dtype, model: str) -> list[tuple[str, str, int | None]]:
    """(label, mode, kernel rows) of each model measured in `dtype`, unquantized first."""
    rows = max_kernel_rows(dtype)
    measured = [("none", "none", None)]
    if checkpoint_quantization(model) == "gguf" and unavailable_reason(CPU, dtype, "gguf") is None:
        measured.append(("gguf (the file's types)", "gguf", None))
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


@torch.inference_mode()
def llama_cpp_perplexity(
    model: torch.nn.Module, ids: torch.Tensor, window: int, bos: int | None
) -> float:
    """llama-perplexity's estimate (see the module docstring)."""
    total, count = 0.0, 0
    first = window // 2
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start : start + window].clone()
        if bos is not None:
            chunk[0] = bos
        logits = model(input_ids=chunk[None], use_cache=False).logits[0].float()
        scored = logits[first : window - 1]
        total += F.cross_entropy(scored, chunk[first + 1 :], reduction="sum").item()
        count += window - first - 1
    return math.exp(total / count)


def prepared(model_name: str, dtype: torch.dtype, mode: str, rows: int | None) -> torch.nn.Module:
    """The model as the engine prepares it for `mode`."""
    install = capabilities.gguf_install(dtype) if mode == "gguf" else None
    model = load_model(model_name, dtype=dtype, device=CPU, install=install).model
    if mode in MODES:
        folder = Path(resolve_model_folder(model_name)[0])
        quantize_linear_layers(model, mode, rows, folder if folder.is_dir() else None)
    if can_pack(CPU, dtype):
        pack_linear_layers(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", help="only these variants' modes")
    parser.add_argument("--llama-cpp", action="store_true", help="score as llama-perplexity")
    parser.add_argument("--write-text", type=Path, help="write the text to this file and exit")
    parser.add_argument(
        "--token-ids",
        type=Path,
        help="the text's token ids (a JSON list, e.g. llama-server's /tokenize of it) instead "
        "of this tokenizer's, so that both sides score the very same tokens",
    )
    args = parser.parse_args()
    if args.write_text:
        args.write_text.write_text(text())
        return
    transformers_logging.disable_progress_bar()
    tokenizer = load_model(args.model, dtype=torch.float32, device=CPU).tokenizer
    if args.token_ids:
        encoded = json.loads(args.token_ids.read_text())
    else:
        encoded = tokenizer(text(), add_special_tokens=False)["input_ids"]
    ids = torch.tensor(encoded[: args.tokens])
    version = ".".join(map(str, sys.version_info[:3]))
    scoring = "llama-perplexity's scoring" if args.llama_cpp else "every token"
    print(
        f"{args.model}: {len(ids)} tokens of pydoc_data.topics (CPython {version}) in windows "
        f"of {args.window}, {scoring}, {torch.get_num_threads()} threads"
    )
    print(f"{'dtype':>8} | {'variant':<26} | {'perplexity':>10} | {'change':>16} | {'s':>5}")
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        reference = None
        for label, mode, rows in variants(dtype, args.model):
            if args.modes and mode not in args.modes:
                continue
            model = prepared(args.model, dtype, mode, rows)
            start = time.perf_counter()
            if args.llama_cpp:
                value = llama_cpp_perplexity(model, ids, args.window, bos)
            else:
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

"""The recurrent layers' C++ ops per layer and token, against the chunked torch algorithms
transformers runs them with (`torch_chunk_gated_delta_rule`, Mamba-2's `mamba2_chunk_scan`:
the chunked delta rule and the state-space dual form, 64- and 256-token chunks).

Run: `python -m bench.recurrent_kernel [--threads N]`. Real layers' shapes: Qwen3.5-0.8B's
Gated DeltaNet (16 heads of 128 x 128), Qwen3.5-4B's (32 value heads), Granite-4.0-H's
Mamba-2 (64 heads of 64, state 128, one group) and the causal convolutions in front of
them, fp32 (the state's dtype), one sequence:

- prefill: a 2,000-token chunk, microseconds per token and layer (the chunked torch
  algorithms beside them: what computing a prompt through transformers' own code costs);
- decode: one token from a state in memory (a step at c=1), microseconds per layer.

The C++ ops compute token after token (bits that never depend on chunking, and a state
copied out at any token for prefix checkpoints); the table says what that costs against
the chunked forms. Each figure is the minimum of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from bench.tables import format_table
from engine.model.kernels.recurrent import unavailable_reason

TOKENS = 2000
# name: (key heads, value heads, key dim, value dim)
DELTA_SHAPES = {"Qwen3.5-0.8B": (16, 16, 128, 128), "Qwen3.5-4B": (16, 32, 128, 128)}
# name: (heads, head dim, groups, state size)
SSD_SHAPES = {"Granite-4.0-H": (64, 64, 1, 128)}


def best(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def slots(rows: int, source: int) -> tuple[torch.Tensor, ...]:
    """One sequence of `rows` rows from slot `source` into slot 0, no checkpoint."""
    one = torch.tensor
    return one([0, rows]), one([0]), one([source]), one([-1]), one([0])


def delta_rows(name: str, repeats: int) -> list[list[str]]:
    key_heads, value_heads, key_dim, value_dim = DELTA_SHAPES[name]
    q = F.normalize(torch.randn(TOKENS, key_heads, key_dim), dim=-1) * key_dim**-0.5
    k = F.normalize(torch.randn(TOKENS, key_heads, key_dim), dim=-1)
    v, g = torch.randn(TOKENS, value_heads, value_dim), -torch.rand(TOKENS, value_heads)
    beta = torch.rand(TOKENS, value_heads)
    state = torch.zeros(1, 2, value_heads, key_dim, value_dim)
    op = torch.ops.pagedserve.gated_delta_rule
    prefill = best(lambda: op(q, k, v, g, beta, state, 0, *slots(TOKENS, -1)), repeats)
    one = [x[:1] for x in (q, k, v, g, beta)]
    decode = best(lambda: op(*one, state, 0, *slots(1, 0)), repeats * 20)
    chunked = best(
        lambda: torch_chunk_gated_delta_rule(
            q[None], k[None], v[None], g=g[None], beta=beta[None], output_final_state=True
        ),
        repeats,
    )
    return [
        [f"{name} Gated DeltaNet", f"{prefill / TOKENS * 1e6:.1f}",
         f"{chunked / TOKENS * 1e6:.1f}", f"{decode * 1e6:.0f}"],
        conv_row(name, 2 * key_heads * key_dim + value_heads * value_dim, repeats),
    ]  # fmt: skip


def ssd_rows(name: str, repeats: int) -> list[list[str]]:
    heads, head_dim, groups, state_size = SSD_SHAPES[name]
    x, dt = torch.randn(TOKENS, heads, head_dim), torch.rand(TOKENS, heads) * 0.1
    a, d = -torch.rand(heads), torch.randn(heads)
    b, c = torch.randn(TOKENS, groups, state_size), torch.randn(TOKENS, groups, state_size)
    state = torch.zeros(1, 2, heads, state_size, head_dim)
    op = torch.ops.pagedserve.ssd_scan
    prefill = best(lambda: op(x, dt, a, b, c, d, state, 0, *slots(TOKENS, -1)), repeats)
    one = [t[:1] for t in (x, dt)]
    decode = best(lambda: op(*one, a, b[:1], c[:1], d, state, 0, *slots(1, 0)), repeats * 20)
    chunked = best(
        lambda: mamba2_chunk_scan(
            x[None], dt[None], a, b[None], c[None], chunk_size=256, D=d,
            return_final_states=True,
        ),
        repeats,
    )  # fmt: skip
    channels = heads * head_dim + 2 * groups * state_size
    return [
        [f"{name} Mamba-2", f"{prefill / TOKENS * 1e6:.1f}", f"{chunked / TOKENS * 1e6:.1f}",
         f"{decode * 1e6:.0f}"],
        conv_row(name, channels, repeats),
    ]  # fmt: skip


def conv_row(name: str, channels: int, repeats: int) -> list[str]:
    x, weight = torch.randn(TOKENS, channels), torch.randn(4, channels)
    state = torch.zeros(1, 2, 3, channels)
    op = torch.ops.pagedserve.causal_conv
    prefill = best(lambda: op(x, weight, None, state, 0, *slots(TOKENS, -1)), repeats)
    decode = best(lambda: op(x[:1], weight, None, state, 0, *slots(1, 0)), repeats * 20)
    padded = F.pad(x.T[None], (3, 0))
    chunked = best(lambda: F.conv1d(padded, weight.T[:, None, :], groups=channels), repeats)
    return [
        f"{name} convolution ({channels} ch)", f"{prefill / TOKENS * 1e6:.1f}",
        f"{chunked / TOKENS * 1e6:.1f}", f"{decode * 1e6:.0f}",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.recurrent_kernel")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    reason = unavailable_reason(torch.device("cpu"))
    if reason is not None:
        raise SystemExit(f"bench: the recurrent kernels cannot run here: {reason}")
    torch.set_num_threads(args.threads)
    rows = []
    for name in DELTA_SHAPES:
        rows += delta_rows(name, args.repeats)
    for name in SSD_SHAPES:
        rows += ssd_rows(name, args.repeats)
    header = [
        f"layer ({args.threads} threads)", "prefill us/token (C++, token by token)",
        "prefill us/token (torch, chunked)", "decode us (C++)",
    ]  # fmt: skip
    print(format_table(header, rows))


if __name__ == "__main__":
    main()

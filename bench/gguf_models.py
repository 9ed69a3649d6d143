"""pagedserve and llama.cpp's llama-server on the GGUF models people run on a CPU.

`python -m bench.gguf_models` builds random-weight GGUFs of real shapes with llama.cpp's
own converter and quantizer (`bench.gguf_shapes`: Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B, Q4_K_M by default), then for each serves the same file with pagedserve and
with llama-server in turn, `--rounds` times, alternating which goes first, and measures
over HTTP with `bench.serve`:

- c=1 TPOT: one stream of `--max-tokens` tokens after a 100-word prompt (median);
- c=8 tok/s: eight streams at once, output tokens per second;
- TTFT of a `--long-prompt`-token prompt (2,000 by default): a one-token completion,
  not streamed (a random model's token may have no text to stream);
- peak and steady RSS of the server process (`VmHWM`, `VmRSS`), the peak including its
  start-up, the steady value read after the runs;
- the time from a server's launch to its health check answering: the first round's (for
  pagedserve a first start where its cache does not hold the file yet) and the later ones';
- and the fraction of the memory-bandwidth bound each server reaches at c=1: the file's
  tensor bytes (what a decode step reads) over this machine's streaming read bandwidth
  (`torch.sum` over 1 GiB on every core), against the measured TPOT.

Both servers get the same context: llama-server `-c 8 x 4096 --parallel 8` (eight slots of
4,096 tokens), pagedserve `--max-model-len 4096` with its default KV cache. `--memory`
adds a run of both at a single 4,096-token context (llama-server `-c 4096 --parallel 1`,
pagedserve `--kv-cache-memory` of 4,096 tokens and the watermark's reserve), c=1 only,
for the resident memory comparison. llama-server comes from `LLAMA_SERVER` or
`../shared/peers`' build.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from transformers import AutoTokenizer

from bench import serve
from bench.gguf_shapes import SHAPES, build_gguf, peers_script
from bench.run_all import stop_server, wait_healthy
from bench.tables import format_table, free_port
from engine.model.gguf import metadata_folder, read_source

SLOTS = 8
CONTEXT = 4096


@dataclass
class Measure:
    """One server's figures on one model, a list per figure (one entry per round)."""

    tpot_ms: list[float] = field(default_factory=list)
    tok_s_c8: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    peak_gb: list[float] = field(default_factory=list)
    steady_gb: list[float] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)


def llama_server_binary() -> Path:
    """`LLAMA_SERVER`, else the peers' build (built first if missing, ~13 min)."""
    if "LLAMA_SERVER" in os.environ:
        return Path(os.environ["LLAMA_SERVER"])
    built = subprocess.run(
        ["bash", str(peers_script()), "build"], check=True, capture_output=True, text=True
    )
    return Path(built.stdout.strip().splitlines()[-1]) / "llama-server"


def start(
    server: str, gguf: Path, port: int, log: Path, context: int, slots: int, kv_tokens: int | None
):
    """The server (`pagedserve` or `llama-server`) on 127.0.0.1:`port`, once healthy."""
    if server == "llama-server":
        command = [
            str(llama_server_binary()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(os.cpu_count() or 1), "--parallel", str(slots), "-c", str(context * slots),
            "--cont-batching", "--no-webui",
        ]  # fmt: skip
    else:
        command = [
            sys.executable, "-m", "pagedserve", "serve", "--model", str(gguf),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(context),
        ]  # fmt: skip
        if kv_tokens is not None:  # and the 1% watermark's reserve, one block more
            reserve = kv_tokens // 64
            command += ["--kv-cache-memory", str((kv_tokens + reserve) * kv_bytes_per_token(gguf))]
    print(f"$ {' '.join(command)} > {log} 2>&1", file=sys.stderr, flush=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    return wait_healthy(process, port, log)


def kv_bytes_per_token(gguf: Path) -> int:
    """K and V of every layer for one token in fp32 or bf16, as pagedserve's cache holds
    them on this CPU (its dtype: bf16 where the CPU has fast bf16)."""
    from transformers import AutoConfig

    from engine.model.device import resolve_dtype

    config = AutoConfig.from_pretrained(metadata_folder(gguf))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = torch.empty((), dtype=resolve_dtype("auto", torch.device("cpu"))).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize


def memory_gb(pid: int) -> tuple[float, float]:
    """(peak, current) resident memory of a process, in GB."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return tuple(int(status[key].split()[0]) * 1024 / 1e9 for key in ("VmHWM", "VmRSS"))  # type: ignore[return-value]


def words_for(gguf: Path, tokens: int) -> int:
    """How many of bench.serve's random words make a prompt of about `tokens` tokens."""
    tokenizer = AutoTokenizer.from_pretrained(metadata_folder(gguf))
    sample = serve.make_prompts(1, 1000, seed=0)[0]
    per_word = len(tokenizer(sample).input_ids) / 1000
    return max(1, round(tokens / per_word))


def level(
    url: str, concurrency: int, requests: int, max_tokens: int, words: int
) -> serve.LevelReport:
    args = serve.parse_args([
        "--url", url, "--concurrency", str(concurrency), "--num-requests", str(requests),
        "--max-tokens", str(max_tokens), "--prompt-words", str(words), "--ignore-eos",
        "--timeout", "3600",
    ])  # fmt: skip
    return asyncio.run(serve.run(args))[1][0]


def first_token_ms(url: str, prompt: str) -> float:
    """The time to a one-token completion of `prompt`, not streamed: its prefill and first
    token (a random-weight model's token may have no text, which a stream would not show)."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
    reply.raise_for_status()
    return (time.perf_counter() - start) * 1000


def measure(url: str, pid: int, args: argparse.Namespace, long_words: int, into: Measure) -> None:
    one = level(url, 1, args.requests, args.max_tokens, 100)
    into.tpot_ms.append(one.tpot_ms.p50 or float("nan"))
    if args.concurrency:
        eight = level(url, SLOTS, 2 * SLOTS, args.max_tokens, 100)
        into.tok_s_c8.append(eight.output_throughput)
    if args.long_prompt:
        into.ttft_ms.append(first_token_ms(url, serve.make_prompts(1, long_words, seed=1)[0]))
    peak, steady = memory_gb(pid)
    into.peak_gb.append(peak)
    into.steady_gb.append(steady)


def bandwidth() -> float:
    """Streaming read bandwidth of this machine on every core, bytes per second."""
    torch.set_num_threads(os.cpu_count() or 1)
    data = torch.ones(256 * 1024**2)  # 1 GiB
    data.sum()
    start = time.perf_counter()
    for _ in range(5):
        data.sum()
    return 5 * data.nbytes / (time.perf_counter() - start)


def run_model(gguf: Path, args: argparse.Namespace, logs: Path) -> dict[str, Measure]:
    results = {"pagedserve": Measure(), "llama-server": Measure()}
    long_words = words_for(gguf, args.long_prompt) if args.long_prompt else 0
    for round_ in range(args.rounds):
        order = list(results) if round_ % 2 == 0 else list(results)[::-1]
        for server in order:
            port = free_port()
            began = time.perf_counter()
            log = logs / f"{gguf.stem}-{server}-{round_}.log"
            process = start(server, gguf, port, log, CONTEXT, SLOTS, None)
            results[server].start_s.append(time.perf_counter() - began)
            try:
                measure(f"http://127.0.0.1:{port}", process.pid, args, long_words, results[server])
            finally:
                stop_server(process)
    return results


def run_memory(gguf: Path, args: argparse.Namespace, logs: Path) -> dict[str, Measure]:
    """Both servers at one 4,096-token context, c=1 only."""
    results = {"pagedserve": Measure(), "llama-server": Measure()}
    quiet = argparse.Namespace(**(vars(args) | {"concurrency": False, "long_prompt": 0}))
    for server in results:
        port = free_port()
        process = start(
            server, gguf, port, logs / f"{gguf.stem}-{server}-memory.log", CONTEXT, 1, CONTEXT
        )
        try:
            measure(f"http://127.0.0.1:{port}", process.pid, quiet, 0, results[server])
        finally:
            stop_server(process)
    return results


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def starts(seconds: list[float]) -> str:
    """The first start's time to healthy and the median of the later ones."""
    if not seconds:
        return "-"
    later = f", {median(seconds[1:]):.0f}" if len(seconds) > 1 else ""
    return f"{seconds[0]:.0f}{later}"


def table(rows: list[tuple[str, int, dict[str, Measure]]], bytes_per_s: float) -> str:
    lines = []
    for name, tensor_bytes, results in rows:
        bound_ms = tensor_bytes / bytes_per_s * 1000
        ours, peer = results["pagedserve"], results["llama-server"]
        for server, m in results.items():
            tpot = median(m.tpot_ms)
            lines.append([
                name, server, f"{tpot:.1f}", f"{bound_ms / tpot:.0%}",
                f"{median(m.tok_s_c8):.1f}" if m.tok_s_c8 else "-",
                f"{median(m.ttft_ms) / 1000:.1f}" if m.ttft_ms else "-",
                f"{max(m.peak_gb):.2f}", f"{median(m.steady_gb):.2f}", starts(m.start_s),
            ])  # fmt: skip
        lines.append([
            name, "ratio", f"{median(ours.tpot_ms) / median(peer.tpot_ms):.2f}", "",
            f"{median(ours.tok_s_c8) / median(peer.tok_s_c8):.2f}" if ours.tok_s_c8 else "-",
            f"{median(ours.ttft_ms) / median(peer.ttft_ms):.2f}" if ours.ttft_ms else "-",
            f"{max(ours.peak_gb) / max(peer.peak_gb):.2f}",
            f"{median(ours.steady_gb) / median(peer.steady_gb):.2f}", "",
        ])  # fmt: skip
    header = [
        "model",
        "server",
        "c=1 TPOT ms",
        "of bound",
        "c=8 tok/s",
        "TTFT s",
        "peak GB",
        "steady GB",
        "start s (first, later)",
    ]
    return format_table(header, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gguf_models", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type (default Q4_K_M)")
    parser.add_argument("--models", type=Path, default=Path("/var/tmp/pagedserve-gguf-models"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4, help="c=1 requests per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=2000, help="tokens; 0: no TTFT run")
    parser.add_argument("--no-concurrency", dest="concurrency", action="store_false")
    parser.add_argument("--memory", action="store_true", help="add the 4,096-token-context run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.models.mkdir(parents=True, exist_ok=True)
    logs = args.models / "logs"
    logs.mkdir(exist_ok=True)
    bytes_per_s = bandwidth()
    rows, memory_rows = [], []
    for shape in args.shapes:
        gguf = build_gguf(shape, args.type, args.models)
        tensor_bytes = step_bytes(gguf)
        rows.append((f"{shape} {args.type}", tensor_bytes, run_model(gguf, args, logs)))
        print(table(rows, bytes_per_s), flush=True)
        if args.memory:
            memory_rows.append(
                (f"{shape} {args.type}, 4096 ctx", tensor_bytes, run_memory(gguf, args, logs))
            )
            print(table(memory_rows, bytes_per_s), flush=True)
    print(f"stream read bandwidth: {bytes_per_s / 1e9:.1f} GB/s on {os.cpu_count()} threads")
    print(table(rows, bytes_per_s))
    if memory_rows:
        print(table(memory_rows, bytes_per_s))


def step_bytes(gguf: Path) -> int:
    """The bytes of the file's tensors that one decode step reads: all of them, but an
    embedding that is not also the LM head (its rows are read one a token)."""
    index = read_source(metadata_folder(gguf))["tensors"]
    untied = any(entry[0] == "output.weight" for entry in index)
    return sum(entry[4] for entry in index if not (untied and entry[0] == "token_embd.weight"))


if __name__ == "__main__":
    main()

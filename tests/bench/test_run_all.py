"""bench.run_all: the comparison of the served and the offline throughput, the suites'
defaults, and the GPU suite's flags and refusal without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import throughput
from bench.run_all import GPU_THROUGHPUT_FLAGS, comparison, main, parse_args, throughput_flags


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

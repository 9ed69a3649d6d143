"""bench.run_all's comparison of the served and the offline throughput."""

from __future__ import annotations

from bench.run_all import comparison, parse_args


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

"""Smoke tests of the offline benchmarks on the tiny Llama: they run, every engine does the
whole workload, and the reports hold what `bench.run_all` reads. Timings are never checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bench import decode_ab, step_profile, throughput
from bench.workloads import (
    Workload,
    ordinary_token_ids,
    random_workload,
    shared_prefix_workload,
)
from engine.config import ConfigError
from engine.model.attention import ATTN_IMPLEMENTATION, paged_attention_forward
from engine.model.attention_backend import unavailable_reason

# The tiny models' attention in fp32 (head size 32, blocks of 16): 'auto' takes cpp if it can.
CPP_UNAVAILABLE = unavailable_reason("cpp", torch.device("cpu"), torch.float32, 32, 16)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_paths: dict[str, Path]) -> str:
    return str(tiny_model_paths["llama"])


def test_workloads_are_seeded_and_avoid_excluded_ids():
    token_ids = ordinary_token_ids(50, excluded=[0, 1, 2])
    first = random_workload(6, 3, 9, 4, token_ids, seed=7)
    assert first == random_workload(6, 3, 9, 4, token_ids, seed=7)
    assert all(3 <= len(p) <= 9 for p in first.prompts)
    assert not {0, 1, 2} & {t for p in first.prompts for t in p}
    assert first.num_output_tokens == 24
    shared = shared_prefix_workload(3, 10, 2, 4, token_ids)
    assert all(p[:10] == shared.prompts[0][:10] and len(p) == 12 for p in shared.prompts)
    assert first.output_len == shared.output_len == 4


def test_output_lengths_per_request_leave_the_prompts_of_a_seed_alone():
    token_ids = ordinary_token_ids(50, excluded=[])
    fixed = random_workload(40, 3, 9, 5, token_ids, seed=7)
    varied = random_workload(40, 3, 9, 5, token_ids, seed=7, max_output_len=12)
    assert varied.prompts == fixed.prompts
    assert all(5 <= n <= 12 for n in varied.output_lens) and len(set(varied.output_lens)) > 1
    assert varied.output_len is None
    assert varied.num_output_tokens == sum(varied.output_lens)
    with pytest.raises(ValueError, match="output_len <= max_output_len"):
        random_workload(2, 3, 9, 5, token_ids, max_output_len=4)
    with pytest.raises(ValueError, match="one positive output length per prompt"):
        Workload("bad", [[1], [2]], [3])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--workload", "w1"], (64, 64, 256, 128, None, 128)),
        (["--workload", "w2"], (512, 128, 512, 256, None, 256)),
        (["--workload", "nano"], (256, 100, 1024, 100, 1024, 256)),
        # Flags given win over the preset, one by one.
        (["--workload", "w2", "--max-num-seqs", "64", "--output-len", "32"],
         (512, 128, 512, 32, None, 64)),
        (["--workload", "nano", "--num-requests", "8", "--max-output-len", "200"],
         (8, 100, 1024, 100, 200, 256)),
        (["--max-output-len", "300"], (64, 64, 256, 128, 300, 128)),
    ],
)  # fmt: skip
def test_presets_fill_only_the_flags_left_unset(argv: list[str], expected: tuple) -> None:
    args = throughput.parse_args(argv)
    names = ("num_requests", "min_prompt", "max_prompt", "output_len", "max_output_len")
    assert tuple(getattr(args, name) for name in (*names, "max_num_seqs")) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["--workload", "nano", "--output-len", "2000"],
        ["--workload", "shared-prefix", "--max-output-len", "9"],
    ],
)
def test_output_length_flags_that_cannot_hold_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        throughput.parse_args(argv)


def test_engine_settings_pass_through_and_are_validated() -> None:
    argv = ["--set", "attention_backend=triton", "--set", "enforce_eager=false"]
    config = throughput.build_config(throughput.parse_args(argv))
    assert config.attention_backend == "triton" and config.enforce_eager is False
    with pytest.raises(ConfigError, match="no_such_setting"):
        throughput.build_config(throughput.parse_args(["--set", "no_such_setting=1"]))
    with pytest.raises(SystemExit):
        throughput.parse_args(["--set", "enforce_eager"])


def test_row_lengths_stop_each_row_at_its_own_length():
    prompt_ids = torch.zeros((3, 4), dtype=torch.long)
    stop = throughput.RowLengths(prompt_ids, [1, 3, 2])
    assert stop(torch.zeros((3, 6)), None).tolist() == [True, False, True]
    assert stop(torch.zeros((3, 7)), None).tolist() == [True, True, True]


def test_left_pad_puts_prompts_at_the_right_edge():
    input_ids, mask = throughput.left_pad([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_w1_runs_every_engine_and_writes_json(tiny_llama: str, tmp_path: Path, capsys):
    path = tmp_path / "w1.json"
    throughput.main(
        [
            "--model", tiny_llama, "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--num-requests", "3", "--min-prompt", "4", "--max-prompt", "9",
            "--output-len", "3", "--generate-batch-size", "2", "--json", str(path),
        ]
    )  # fmt: skip
    report = json.loads(path.read_text())
    engines = [r["engine"] for r in report["results"]]
    assert engines == ["pagedserve", "generate_batch", "generate (batch 2)"]
    assert all(r["output_tokens"] == 9 and r["tokens_per_second"] > 0 for r in report["results"])
    assert report["workload"]["requests"] == 3
    assert report["ratios"]["generate_batch"] == pytest.approx(1.0)
    assert "pagedserve / generate_batch" in capsys.readouterr().out


def test_json_schema_run_sits_next_to_the_unconstrained_one(tiny_llama: str, tmp_path: Path):
    path = tmp_path / "schema.json"
    throughput.main(
        [
            "--model", tiny_llama, "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--engines", "pagedserve", "--num-requests", "2", "--min-prompt", "4",
            "--max-prompt", "6", "--output-len", "12", "--json-schema", "--json", str(path),
        ]
    )  # fmt: skip
    results = json.loads(path.read_text())["results"]
    assert [r["engine"] for r in results] == ["pagedserve", "pagedserve (JSON schema)"]
    assert all(r["output_tokens"] == 24 for r in results)


def test_per_request_output_lengths_reach_every_engine(tiny_llama: str, tmp_path: Path, capsys):
    path = tmp_path / "nano.json"
    throughput.main(
        [
            "--workload", "nano", "--model", tiny_llama, "--dtype", "float32",
            "--kv-cache-memory", "16MiB", "--num-requests", "5", "--min-prompt", "4",
            "--max-prompt", "9", "--output-len", "1", "--max-output-len", "6",
            "--generate-batch-size", "2", "--json", str(path),
        ]
    )  # fmt: skip
    report = json.loads(path.read_text())
    workload = report["workload"]
    assert workload["preset"] == "nano" and workload["output_len"] is None
    assert workload["min_output_len"] < workload["max_output_len"]
    # check_complete held: every engine generated exactly the requests' total, no more.
    assert {r["output_tokens"] for r in report["results"]} == {workload["output_tokens"]}
    notes = {r["engine"]: r["note"] for r in report["results"]}
    assert notes["pagedserve"] is None
    assert "add_request" in notes["generate_batch"] and "longest" in notes["generate (batch 2)"]
    assert "note, generate_batch: per-request lengths" in capsys.readouterr().out


def test_shared_prefix_reports_ttft_and_cache_hits(tiny_llama: str, tmp_path: Path):
    path = tmp_path / "prefix.json"
    throughput.main(
        [
            "--workload", "shared-prefix", "--model", tiny_llama, "--dtype", "float32",
            "--kv-cache-memory", "16MiB", "--num-requests", "4", "--prefix-len", "48",
            "--tail-len", "4", "--output-len", "2", "--json", str(path),
        ]
    )  # fmt: skip
    on, off = json.loads(path.read_text())["results"]
    assert on["cached_prompt_tokens"] > 0 and off["cached_prompt_tokens"] == 0
    assert on["ttft_median_ms"] > 0 and off["ttft_median_ms"] > 0


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="profiles the eager step of the CPU: on CUDA attention runs inside decode graphs",
)
def test_step_profile_splits_steps_and_restores_attention(tiny_llama: str):
    args = step_profile.parse_args(
        ["--model", tiny_llama, "--dtype", "float32", "--kv-cache-memory", "16MiB",
         "--batch-sizes", "2,3", "--context", "20", "--steps", "2"]
    )  # fmt: skip
    profiles = step_profile.run(args)
    assert [p.batch for p in profiles] == [2, 3]
    for profile in profiles:
        assert 0 < profile.attention_ms < profile.step_ms
        assert profile.rest_of_model_ms > 0 and profile.no_attention_forward_ms > 0
        assert profile.ops_per_step > 0
    # The timing wrapper is gone again: the engine's own registration (the paged function
    # bound to its backend: the C++ kernel where it builds) is back in place.
    backend = "torch" if CPP_UNAVAILABLE else "cpp"
    restored = ALL_ATTENTION_FUNCTIONS[f"{ATTN_IMPLEMENTATION}_{backend}_cpu"]
    assert restored.func is paged_attention_forward
    assert restored.keywords["backend"].name == backend


@pytest.mark.slow
@pytest.mark.skipif(CPP_UNAVAILABLE is not None, reason=f"no cpp attention: {CPP_UNAVAILABLE}")
def test_step_profile_counts_fewer_ops_in_a_compiled_step(tiny_llama: str):
    argv = ["--model", tiny_llama, "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--batch-sizes", "2", "--context", "20", "--steps", "2"]  # fmt: skip
    (eager,) = step_profile.run(step_profile.parse_args(argv))
    (compiled,) = step_profile.run(step_profile.parse_args([*argv, "--set", "enforce_eager=false"]))
    assert compiled.attention_ms == 0 and compiled.rest_of_model_ms > 0
    # Two layers: each dispatches its 7 linears, a K/V store and an attention call, and the
    # LM head is one more linear; eager mode dispatches every norm, rotary and add as well.
    assert compiled.ops_per_step < eager.ops_per_step / 2


def test_decode_ab_times_each_variant_at_each_batch_size(tiny_llama: str):
    args = decode_ab.parse_args(
        ["--model", tiny_llama, "--kv-cache-memory", "16MiB", "--batch-sizes", "1,3",
         "--context", "12", "--rounds", "3", "--variant", "cpp=",
         "--variant", "torch=attention_backend=torch,dtype=float32"]
    )  # fmt: skip
    assert args.variant[1] == ("torch", {"attention_backend": "torch", "dtype": "float32"})
    medians = decode_ab.run(args)
    assert list(medians) == [1, 3] and all(list(m) == ["cpp", "torch"] for m in medians.values())
    assert all(seconds > 0 for m in medians.values() for seconds in m.values())
    lines = decode_ab.report(medians).splitlines()
    assert len(lines) == 2 + 4 and lines[2].split()[-1] == "1.00x"
    with pytest.raises(SystemExit):
        decode_ab.parse_args(["--variant", "a=", "--variant", "a=seed=1"])

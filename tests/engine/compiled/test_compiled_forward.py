"""The compiled forward (`enforce_eager: false` on the CPU) against the eager engine.

Greedy tokens must equal eager mode's, and a request's logprobs must keep their bits
whatever else runs with it (alone, all at once, in small prefill chunks, after
prefix-cache hits), as the eager engine's do. One graph serves every step: a step whose
sizes broke the saved graph's guards would raise, failing these tests. A restart must
load the saved graph instead of compiling again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from engine import LLM, SamplingParams
from engine.compiled.compiled_forward import CACHE_DIR_VARIABLE, inductor_cache_dir
from engine.config import ConfigError, cache_root
from engine.linears.bf16_linear import Bf16Linear
from engine.model.attention_backend import unavailable_reason
from engine.model.kernels import bf16_linear

CPU = torch.device("cpu")
# The tiny models' attention: fp32, head size 32, blocks of 16.
CPP_UNAVAILABLE = unavailable_reason("cpp", CPU, torch.float32, 32, 16)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CPP_UNAVAILABLE is not None, reason=f"no cpp attention: {CPP_UNAVAILABLE}"),
]

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3 + "Paged attention",
    "The quick brown fox jumps over the lazy dog. " * 3 + "Continuous batching",
    "def main():\n    return",
    "Héllo wörld, naïve café",
]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)


def outputs(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    results = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results]


@pytest.fixture(scope="module")
def compiled_llm(tiny_model_paths: dict[str, Path]) -> LLM:
    # fp32 on every CPU (dtype auto is bf16 where the CPU computes it fast), so that the
    # logprobs' comparison with eager mode's has one tolerance.
    return LLM(
        str(tiny_model_paths["llama"]), dtype="float32", enforce_eager=False, kv_cache_memory="4MiB"
    )


def test_greedy_tokens_equal_eager_modes(compiled_llm: LLM, tiny_model_paths) -> None:
    got = outputs(compiled_llm, PROMPTS)
    assert compiled_llm.engine.runner.executor.name == "compiled"
    eager = LLM(str(tiny_model_paths["llama"]), dtype="float32", kv_cache_memory="4MiB")
    expected = outputs(eager, PROMPTS)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, compiled_logprobs), (_, eager_logprobs) in zip(got, expected, strict=True):
        assert compiled_logprobs == pytest.approx(eager_logprobs, abs=1e-4)


def test_a_requests_bits_do_not_depend_on_the_batch(compiled_llm: LLM, tiny_model_paths) -> None:
    alone = [outputs(compiled_llm, [prompt])[0] for prompt in PROMPTS]  # also warms the cache
    assert outputs(compiled_llm, PROMPTS) == alone  # together, with prefix-cache hits
    chunked = LLM(
        str(tiny_model_paths["llama"]),
        dtype="float32",
        enforce_eager=False,
        kv_cache_memory="4MiB",
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    assert outputs(chunked, PROMPTS) == alone  # steps of one token, one or no sampled row


def test_quantized_linears_run_compiled_too(tiny_model_paths) -> None:
    # fp32: the tiny random model's next-token distribution is nearly flat, and bf16's
    # rounding of the fused ops could flip its greedy choices.
    settings = {"kv_cache_memory": "4MiB", "quantization": "int4", "dtype": "float32"}
    eager = LLM(str(tiny_model_paths["llama"]), **settings)
    compiled = LLM(str(tiny_model_paths["llama"]), enforce_eager=False, **settings)
    expected, got = outputs(eager, PROMPTS), outputs(compiled, PROMPTS)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]


def test_bf16_linears_run_compiled_on_the_row_invariant_kernel(tiny_model_paths) -> None:
    if bf16_linear.unavailable_reason() is not None:
        pytest.skip("the bf16 kernel cannot run here")
    llm = LLM(
        str(tiny_model_paths["llama"]),
        dtype="bfloat16",
        enforce_eager=False,
        kv_cache_memory="4MiB",
    )
    assert llm.engine.runner.executor.name == "compiled"
    assert any(isinstance(m, Bf16Linear) for m in llm.engine.model.modules())
    alone = [outputs(llm, [prompt])[0] for prompt in PROMPTS]
    assert outputs(llm, PROMPTS) == alone


def test_padding_rows_store_nothing_and_attention_matches_the_kernel() -> None:
    from engine.model.kernels.paged_attention import CppAttention, load_attention_kernel

    torch.manual_seed(0)
    kv_cache = torch.zeros(2, 2, 4, 16, 2, 64)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    CppAttention(CPU).store_kv(key, value, kv_cache, 1, torch.tensor([5, -1, 17]))
    k_cache, v_cache = kv_cache[1]
    assert torch.equal(k_cache.view(-1, 2, 64)[[5, 17]], key[[0, 2]])
    assert torch.equal(v_cache.view(-1, 2, 64)[[5, 17]], value[[0, 2]])
    assert int((kv_cache != 0).sum()) == 2 * 2 * 2 * 64  # two tokens, K and V, nothing else

    q = torch.randn(2, 4, 64)
    tables = torch.tensor([[0, 1], [1, 0]])
    starts, lens = torch.tensor([0, 1, 2]), torch.tensor([6, 18])
    kernel = load_attention_kernel()
    assert kernel is not None
    expected = kernel(q, k_cache, v_cache, tables, starts, lens, 0.125)
    got = torch.ops.pagedserve.paged_attention(
        q, kv_cache, 1, tables, starts, lens, 0.125, 0, 0.0, None
    )
    assert torch.equal(got, expected) and got.is_contiguous()


def test_torch_attention_cannot_be_compiled(tiny_model_paths) -> None:
    with pytest.raises(ConfigError, match="attention_backend is 'torch'"):
        LLM(
            str(tiny_model_paths["llama"]),
            enforce_eager=False,
            attention_backend="torch",
            kv_cache_memory="4MiB",
        )


RESTART = """
import json, sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", enforce_eager=False, kv_cache_memory="4MiB")
out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4))
print(json.dumps({"loaded": llm.engine.runner.executor.loaded,
                  "tokens": out[0].outputs[0].token_ids}))
"""


def test_a_restart_loads_the_saved_graph(tiny_model_paths, tmp_path) -> None:
    # Inductor's cache is the suite's, which holds the generated code of `compiled_llm`'s
    # graph (the same model and shapes): the first process traces and saves the graph
    # without building its C++ again.
    env = os.environ | {"PAGEDSERVE_CACHE": str(tmp_path), CACHE_DIR_VARIABLE: inductor_cache_dir()}
    # The C++ kernels this session built, so that the first process only compiles.
    if (cache_root() / "kernels").is_dir():
        shutil.copytree(cache_root() / "kernels", tmp_path / "kernels", symlinks=True)
    root = Path(__file__).parents[3]
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", RESTART, str(tiny_model_paths["llama"])],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert not cold["loaded"] and warm["loaded"]
    assert warm["tokens"] == cold["tokens"]
    [saved] = [path for path in (tmp_path / "compiled").iterdir() if path.is_dir()]
    assert (saved / "forward.bin").is_file()


def test_compiled_code_goes_to_pagedserves_cache_unless_a_user_chose(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", "/srv/ps")
    monkeypatch.delenv(CACHE_DIR_VARIABLE, raising=False)
    assert inductor_cache_dir() == "/srv/ps/inductor"
    monkeypatch.setenv(CACHE_DIR_VARIABLE, default_cache_dir())  # torch's own, written by torch
    assert inductor_cache_dir() == "/srv/ps/inductor"
    monkeypatch.setenv(CACHE_DIR_VARIABLE, "/mine")
    assert inductor_cache_dir() == "/mine"


def test_unset_enforce_eager_serves_eager_with_one_warning_where_it_cannot_compile(
    tiny_model_paths, monkeypatch, caplog
) -> None:
    monkeypatch.delenv("PAGEDSERVE_ENFORCE_EAGER", raising=False)
    with caplog.at_level("WARNING", logger="engine.engine_builder"):
        llm = LLM(str(tiny_model_paths["llama"]), attention_backend="torch", kv_cache_memory="4MiB")
    assert llm.engine.config.enforce_eager is None and llm.engine.runner.executor.name == "eager"
    assert [r.getMessage() for r in caplog.records] == [
        "serving eager, not compiled: attention_backend is 'torch'"
    ]
    assert outputs(llm, PROMPTS[:1])[0][0]


NO_COMPILER = """
import sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_memory="4MiB")
out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4))
print(llm.engine.runner.executor.name, len(out[0].outputs[0].token_ids))
"""


def test_a_machine_without_a_compiler_serves_eager_and_says_so_once(
    tiny_model_paths, tmp_path
) -> None:
    bin_dir = tmp_path / "bin"  # python alone on PATH: no C++ compiler, no ninja
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PAGEDSERVE_ENFORCE_EAGER", CACHE_DIR_VARIABLE, "CXX")
    }
    env |= {"PATH": str(bin_dir), "PAGEDSERVE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", NO_COMPILER, str(tiny_model_paths["llama"])],
        cwd=Path(__file__).parents[3],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert done.stdout.split() == ["eager", "4"]
    warnings = [line for line in done.stderr.splitlines() if "serving eager" in line]
    assert len(warnings) == 1 and "compiler" in warnings[0], done.stderr


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_windows_softcaps_and_sinks_compile_right(tmp_path: Path, name: str) -> None:
    # Gemma 2: a window and a softcap; gpt-oss: a window and sinks, through the registered
    # attention op that the compiled graph calls.
    from tests.support.architectures import SERVED, build, greedy, prompts, reference

    folder = build(tmp_path / name, *SERVED[name])
    batch = prompts(384)
    llm = LLM(str(folder), dtype="float32", enforce_eager=False, kv_cache_memory="16MiB")
    assert llm.engine.compiled
    assert greedy(llm, batch) == reference(folder, batch)

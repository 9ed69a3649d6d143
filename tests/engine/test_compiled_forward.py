"""The compiled forward (`enforce_eager: false` on the CPU) against the eager engine.

Greedy tokens must equal eager mode's, and a request's logprobs must keep their bits
whatever else runs with it (alone, all at once, in small prefill chunks, after
prefix-cache hits), as the eager engine's do. A restart must load the compiled code from
the on-disk cache instead of compiling again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.model.compiled_forward import CACHE_DIR_VARIABLE, inductor_cache_dir
from engine.model.kernels import custom_ops
from engine.model.kernels.paged_attention import load_attention_kernel

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(load_attention_kernel() is None, reason="the C++ kernel cannot build here"),
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
    graphs = counters["stats"]["unique_graphs"]
    got = outputs(compiled_llm, PROMPTS)
    assert counters["stats"]["unique_graphs"] == graphs  # prefill and decode: no recompile
    assert compiled_llm.engine.runner.compiled is not None
    eager = LLM(str(tiny_model_paths["llama"]), dtype="float32", kv_cache_memory="4MiB")
    expected = outputs(eager, PROMPTS)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, compiled_logprobs), (_, eager_logprobs) in zip(got, expected, strict=True):
        assert compiled_logprobs == pytest.approx(eager_logprobs, abs=1e-4)


def test_a_requests_bits_do_not_depend_on_the_batch(compiled_llm: LLM, tiny_model_paths) -> None:
    graphs = counters["stats"]["unique_graphs"]
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
    assert outputs(chunked, PROMPTS) == alone
    # Steps of one token, one sequence, one or no sampled row: no graph of their own.
    assert counters["stats"]["unique_graphs"] == graphs + 1  # the chunked engine's


def test_quantized_linears_run_compiled_too(tiny_model_paths) -> None:
    # fp32: the tiny random model's next-token distribution is nearly flat, and bf16's
    # rounding of the fused ops could flip its greedy choices.
    settings = {"kv_cache_memory": "4MiB", "quantization": "int4", "dtype": "float32"}
    eager = LLM(str(tiny_model_paths["llama"]), **settings)
    compiled = LLM(str(tiny_model_paths["llama"]), enforce_eager=False, **settings)
    expected, got = outputs(eager, PROMPTS), outputs(compiled, PROMPTS)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]


def test_padding_rows_store_nothing_and_attention_matches_the_kernel() -> None:
    torch.manual_seed(0)
    kv_cache = torch.zeros(2, 2, 4, 16, 2, 64)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    custom_ops.register_kernel_ops()
    custom_ops.store_kv(key, value, kv_cache, 1, torch.tensor([5, -1, 17]))
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
    got = custom_ops.paged_attention(q, kv_cache, 1, tables, starts, lens, 0.125)
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
from torch._dynamo.utils import counters
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], enforce_eager=False, kv_cache_memory="4MiB")
out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4))
print(json.dumps({"hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "tokens": out[0].outputs[0].token_ids}))
"""


def test_a_restart_loads_the_compiled_code_from_disk(tiny_model_paths, tmp_path) -> None:
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    root = Path(__file__).parents[2]
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
    assert cold["misses"] >= 1 and cold["hits"] == 0
    assert warm["misses"] == 0 and warm["hits"] >= 1
    assert warm["tokens"] == cold["tokens"]
    assert any((tmp_path / "inductor").iterdir())


def test_compiled_code_goes_to_pagedserves_cache_unless_a_user_chose(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", "/srv/ps")
    monkeypatch.delenv(CACHE_DIR_VARIABLE, raising=False)
    assert inductor_cache_dir() == "/srv/ps/inductor"
    monkeypatch.setenv(CACHE_DIR_VARIABLE, default_cache_dir())  # torch's own, written by torch
    assert inductor_cache_dir() == "/srv/ps/inductor"
    monkeypatch.setenv(CACHE_DIR_VARIABLE, "/mine")
    assert inductor_cache_dir() == "/mine"

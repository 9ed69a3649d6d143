"""The engine on the Triton backend, eager and with bucketed decode graphs: greedy output
equals transformers' `generate()`, padding rows touch no KV slot, and settings that cannot
run are refused. Without CUDA, Triton runs through its interpreter and the decode graphs
run their static, padded forward without capture (see `engine.compiled.decode_graphs`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.compiled.decode_graphs import decode_buckets
from engine.config import ConfigError
from engine.model.attention_backend import choose_backend
from tests.support.greedy import (
    MAX_TOKENS,
    TINY_BLOCK_BYTES,
    engine_greedy,
    random_prompts,
    reference_greedy,
)

pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA torch)")

# Short prompts: the interpreter runs every Triton program in Python.
PROMPT_LENGTHS = (1, 3, 7, 17, 40, 5, 12)
# A tiny-model block of 16 tokens: four of the 4-token blocks TINY_BLOCK_BYTES measures.
BLOCK_BYTES = 4 * TINY_BLOCK_BYTES
SETTINGS = {
    "eager": dict(),
    # Three sequences at a time: decode batches of 1 to 3 run padded to buckets 1, 2, 4.
    "graphs": dict(enforce_eager=False, max_num_seqs=3),
    "graphs-chunked": dict(enforce_eager=False, max_num_batched_tokens=40),
    # 8 blocks: sequences run out of blocks while decoding and are preempted.
    "graphs-preemption": dict(
        enforce_eager=False, max_model_len=64, kv_cache_memory=8 * BLOCK_BYTES
    ),
    # CUDA's defaults: graphs and async scheduling, with preemption.
    "graphs-async-preemption": dict(
        enforce_eager=False,
        async_scheduling=True,
        max_model_len=64,
        kv_cache_memory=8 * BLOCK_BYTES,
    ),
}


@pytest.fixture(scope="module")
def references(tiny_model_paths) -> tuple[list[list[int]], list[list[int]]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_paths["llama"], dtype=torch.float32)
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENGTHS)
    return prompts, reference_greedy(model.eval(), prompts, MAX_TOKENS)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_output_matches_generate(tiny_model_paths, references, setting):
    settings = {"kv_cache_memory": "4MiB", **SETTINGS[setting]}
    llm = LLM(
        str(tiny_model_paths["llama"]),
        dtype="float32",
        block_size=16,
        attention_backend="triton",
        **settings,
    )
    executor = llm.engine.runner.executor
    graphs = executor if executor.name == "graphs" else None
    runs: list[int] = []
    if graphs is not None:
        replay = graphs.replay
        graphs.replay = lambda step, inputs: runs.append(step.num_seqs) or replay(step, inputs)
    prompts, expected = references
    assert engine_greedy(llm, prompts, MAX_TOKENS) == expected
    stats = llm.engine.stats()
    assert stats.used_kv_blocks == 0
    if graphs is not None:
        assert runs, "no decode step ran through the bucketed graphs"
    if setting == "graphs":
        assert 3 in runs  # padded to bucket 4
    if setting.endswith("preemption"):
        assert stats.num_preemptions > 0


def test_padding_rows_write_no_kv_slot(tiny_model_paths):
    # Synchronous steps: with async scheduling (CUDA's default) a step also launches the
    # next one, whose writes would mix with the one under test.
    llm = LLM(
        str(tiny_model_paths["llama"]), dtype="float32", block_size=16,
        attention_backend="triton", enforce_eager=False, kv_cache_memory="4MiB",
        async_scheduling=False,
    )  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(3):  # three decode rows: bucket 4 with one padding row
        engine.add_request(f"r{i}", engine.processor.from_prompt([5 + i] * (3 + i), params))
    engine.step()  # the prefills
    (kv_cache,) = engine.runner.kv_caches
    before = kv_cache.clone()
    engine.step()  # one decode step of 3 sequences through bucket 4
    changed = (kv_cache != before).any(dim=(0, 1, 4, 5)).nonzero().tolist()
    # Each sequence wrote its new token's slot (position = prompt length), nothing else.
    tables = engine.runner.block_tables
    assert sorted(changed) == sorted([tables.blocks(f"r{i}")[0], 3 + i] for i in range(3))


def test_buckets() -> None:
    assert decode_buckets(1) == [1, 2, 4, 8]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 24]
    assert decode_buckets(128)[-3:] == [112, 120, 128]


def test_triton_backend_refuses_what_it_cannot_run(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # unset where CUDA is (tests/conftest.py)
    with pytest.raises(ConfigError, match=r"attention_backend 'triton' .*block_size 8"):
        choose_backend("triton", cpu, torch.float32, 32, block_size=8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"attention_backend 'triton' .*runs on CUDA"):
        choose_backend("triton", cpu, torch.float32, 32, block_size=16)

"""The paged engine's greedy output equals transformers' `generate()` token for token."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.support.greedy import (
    MAX_TOKENS,
    TINY_BLOCK_BYTES,
    engine_greedy,
    random_prompts,
    reference_greedy,
)

SETTINGS = {
    "one-batch": dict(block_size=4, max_num_batched_tokens=2048),
    "torch-attention": dict(block_size=4, attention_backend="torch"),
    "chunked-prefill": dict(block_size=4, max_num_batched_tokens=13),
    # 70 blocks: the seven short prompts are admitted together and run out of blocks
    # while decoding, so the newest are preempted and recomputed.
    "preemption": dict(block_size=4, max_model_len=264, kv_cache_memory=70 * TINY_BLOCK_BYTES),
    # CUDA's default: each step launched before the previous one's text is made.
    "async-scheduling": dict(block_size=4, max_num_batched_tokens=13, async_scheduling=True),
    "async-preemption": dict(
        block_size=4,
        max_model_len=264,
        kv_cache_memory=70 * TINY_BLOCK_BYTES,
        async_scheduling=True,
    ),
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tiny_models_match_generate(tiny_model_paths, references, arch, setting):
    settings = {"kv_cache_memory": "16MiB", **SETTINGS[setting]}
    llm = LLM(str(tiny_model_paths[arch]), dtype="float32", **settings)
    (prompts, expected), _ = references[arch]
    assert engine_greedy(llm, prompts, MAX_TOKENS) == expected
    stats = llm.engine.stats()
    assert stats.used_kv_blocks == 0
    if setting.endswith("preemption"):
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_keep_outputs_exact(tiny_model_paths, references, arch):
    llm = LLM(str(tiny_model_paths[arch]), dtype="float32", block_size=8, kv_cache_memory="16MiB")
    _, (shared, expected) = references[arch]
    # Submitted together: later prompts hit the blocks the first one fills in the same step.
    assert engine_greedy(llm, shared, MAX_TOKENS) == expected
    hits_together = llm.engine.stats().prefix_cache_hits
    assert hits_together >= 40 * (len(shared) - 1)
    # Submitted again: everything but the last block of each prompt comes from the cache.
    assert engine_greedy(llm, shared, MAX_TOKENS) == expected
    assert llm.engine.stats().prefix_cache_hits > hits_together


@pytest.mark.slow
def test_default_model_matches_generate(default_model):
    prompts = random_prompts(default_model.model.config.vocab_size)
    expected = reference_greedy(default_model.model, prompts, MAX_TOKENS)
    llm = LLM(
        "default", dtype="float32", max_model_len=1024, max_num_batched_tokens=64,
        kv_cache_memory="256MiB", quantization="none",  # generate() runs the dequantized weights
    )  # fmt: skip
    assert engine_greedy(llm, prompts, MAX_TOKENS) == expected

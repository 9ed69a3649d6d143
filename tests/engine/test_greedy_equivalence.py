"""The paged engine's greedy output equals transformers' `generate()` token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engine import LLM, SamplingParams

PROMPT_LENGTHS = (1, 3, 7, 16, 31, 64, 100, 250)
MAX_TOKENS = 12


def random_prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def reference_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    # Neutral generation settings: generate() fills what a call leaves at its default from
    # the model's own generation config, whose sampling defaults (the default model's
    # repetition penalty among them) would change greedy choices.
    saved, model.generation_config = model.generation_config, GenerationConfig()
    outputs = []
    try:
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    finally:
        model.generation_config = saved
    return outputs


def engine_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def references(tiny_model_paths: dict[str, Path]) -> dict[str, tuple[list, list]]:
    """Per architecture: the prompts (plain and with a shared prefix) and their references."""
    result = {}
    for arch, path in tiny_model_paths.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = random_prompts(model.config.vocab_size)
        prefix = prompts[-1][:48]
        shared = [prefix + tail for tail in random_prompts(model.config.vocab_size, seed=1)]
        result[arch] = (
            (prompts, reference_greedy(model, prompts, MAX_TOKENS)),
            (shared, reference_greedy(model, shared, MAX_TOKENS)),
        )
    return result


# A tiny-model block of 4 tokens takes 2 layers x K,V x 4 tokens x 2 heads x 32 x 4 bytes.
TINY_BLOCK_BYTES = 4096
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

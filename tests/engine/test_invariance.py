"""Same request, same output: a greedy request's token ids and logprobs have the same bits
alone, in a batch, in small chunks, after preemption and after prefix-cache hits.

The real default model on real text, compared with `==` on floats, never a tolerance, in
bf16 (the default dtype on CPUs with AVX512-BF16) as served (the checkpoint's int4) and
unquantized (the row-invariant bf16 kernel where the CPU has AVX512-BF16), in fp32, and
with the pure-torch attention backend in the dtype this CPU defaults to.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

# A shared system-like opening (three full KV blocks) with distinct endings, so that the
# prefix cache has something to hit and the prompts differ in length.
OPENING = "You are a careful assistant. Answer briefly and precisely, in plain words. " * 2
PROMPTS = [f"{OPENING}Write one sentence about the number {i}." for i in range(16)]
PARAMS = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)

Result = list[tuple[list[int], list[float]]]


def make_llm(settings: dict[str, Any], **overrides: Any) -> LLM:
    values = {"enable_prefix_caching": False, "max_model_len": 512, "kv_cache_memory": "64MiB"}
    return LLM("default", **(values | settings | overrides))


def tokens_and_logprobs(llm: LLM, prompts: list[str]) -> Result:
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


def kv_memory(llm: LLM, blocks: int) -> int:
    """Bytes of KV cache that hold `blocks` blocks of `llm`'s model in its dtype."""
    (kv_cache,) = llm.engine.runner.kv_caches
    return kv_cache[:, :, 0].numel() * kv_cache.element_size() * blocks


@pytest.fixture(
    scope="module",
    params=[
        {"dtype": "bfloat16"},
        {"dtype": "bfloat16", "quantization": "none"},
        {"dtype": "float32"},
        {"attention_backend": "torch"},
    ],
    ids=["bf16", "bf16-unquantized", "fp32", "torch-attention"],
)
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, Any], Result]]:
    """The settings under test and each prompt's output computed alone."""
    llm = make_llm(request.param)
    alone = [tokens_and_logprobs(llm, [prompt])[0] for prompt in PROMPTS]
    yield request.param, alone


def test_all_at_once(setup: tuple[dict[str, Any], Result]) -> None:
    settings, alone = setup
    assert tokens_and_logprobs(make_llm(settings), PROMPTS) == alone


def test_in_chunks_of_64_tokens(setup: tuple[dict[str, Any], Result]) -> None:
    settings, alone = setup
    llm = make_llm(settings, max_num_batched_tokens=64)
    assert tokens_and_logprobs(llm, PROMPTS) == alone


def test_after_preemptions(setup: tuple[dict[str, Any], Result]) -> None:
    settings, alone = setup
    # Room for 12 blocks: the 24 sequences need about 100, and the three or four that fit
    # at a time preempt each other as they grow.
    memory = kv_memory(make_llm(settings, max_model_len=80), 12)
    llm = make_llm(settings, max_model_len=80, kv_cache_memory=memory)
    assert tokens_and_logprobs(llm, PROMPTS) == alone
    assert llm.engine.scheduler.num_preemptions >= 2


def test_with_prefix_cache_hits(setup: tuple[dict[str, Any], Result]) -> None:
    settings, alone = setup
    llm = make_llm(settings, enable_prefix_caching=True)
    tokens_and_logprobs(llm, PROMPTS[:2])  # warms the shared opening and two whole prompts
    assert tokens_and_logprobs(llm, PROMPTS) == alone
    assert llm.engine.scheduler.cache_stats().prefix_hits >= 24 * 3

"""Speculation changes nothing a request gets: with prompt-lookup drafts verified in the
step's forward, every case's token ids and logprobs equal, bit for bit, the ones the same
engine settings give without speculation. Greedy and seeded sampling; logprobs, n > 1,
stop strings and ids, max_tokens, min_tokens, penalties and logit_bias, structured
outputs; each case alone and with eight other requests running; and under chunked
prefill, prefix-cache hits and preemption. The real default model on real text that it
copies, so drafts are taken (the tests check that they were) and rejected.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.sampling.params import StructuredOutputs
from tests.support.default_model import DEFAULT_MODEL_SETTINGS

pytestmark = pytest.mark.slow

SOURCE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. "
    "Visitors may borrow up to five books at a time, for three weeks."
)
TASKS = [
    f"Rename the variable subtotal to net and print the whole code again.\n\n{SOURCE}",
    f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Convert to a JSON object with keys opens, closes and books:\n\n{PARAGRAPH}",
]
# Every draft length is allowed (min 1), and speculation runs in a batch of nine too.
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": 64,
}
GREEDY = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
SEEDED = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=32, logprobs=1)
CASES: dict[str, tuple[str, SamplingParams]] = {
    "greedy": (TASKS[0], GREEDY),
    "seeded": (TASKS[1], SEEDED),
    "seeded n=2": (TASKS[0], replace(SEEDED, n=2, seed=3)),
    "stop string": (TASKS[1], replace(GREEDY, stop=["five books"])),
    "stop token id": (TASKS[0], replace(SEEDED, stop_token_ids=[3024])),  # " tax"
    "max_tokens": (TASKS[1], replace(GREEDY, max_tokens=7)),
    "min_tokens": (TASKS[1], replace(SEEDED, min_tokens=24, seed=5)),
    "penalties": (
        TASKS[0],
        replace(SEEDED, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2),
    ),
    "logit_bias": (TASKS[1], replace(GREEDY, logit_bias={28: 2.0, 30: -5.0})),
    "json schema": (
        TASKS[2],
        replace(
            GREEDY,
            structured_outputs=StructuredOutputs(
                json={
                    "type": "object",
                    "properties": {
                        "opens": {"type": "string"},
                        "closes": {"type": "string"},
                        "books": {"type": "integer"},
                    },
                    "required": ["opens", "closes", "books"],
                }
            ),
        ),
    ),
    "regex": (
        TASKS[0],
        replace(
            SEEDED,
            structured_outputs=StructuredOutputs(
                regex=r"def [a-z_]+\(items, [a-z_]+\):\n( {4}[^\n]+\n){2,5}"
            ),
        ),
    ),
}
OTHERS = [
    (f"Write a short note number {i} about the weather, then repeat it.", replace(SEEDED, seed=i))
    for i in range(8)
]

Result = list[list[tuple[list[int], list[float]]]]
SERVED = {"max_model_len": 4096, **DEFAULT_MODEL_SETTINGS}


def run(llm: LLM, cases: list[tuple[str, SamplingParams]]) -> Result:
    outputs = llm.chat(
        [[{"role": "user", "content": prompt}] for prompt, _ in cases],
        [params for _, params in cases],
        use_tqdm=False,
    )
    assert llm.engine.scheduler.cache_stats().used_blocks == 0, "blocks leaked"
    return [
        [(s.token_ids, [lp.logprob for lp in s.logprobs or []]) for s in out.outputs]
        for out in outputs
    ]


def make_llm(speculative: bool, **settings: Any) -> LLM:
    # The compiled forward, the one that serves: speculation's rows go through it. The
    # shipped config's shapes with the suite's default-model KV size, so that every engine
    # here and the default-model servers share one compiled graph.
    values = {**SERVED, "enforce_eager": False} | settings
    if speculative:
        values["speculative_config"] = SPECULATIVE
    return LLM("default", **values)


SETTINGS = {
    "plain": {"enable_prefix_caching": False},
    # Prompts of ~100 tokens in chunks of 24 that share steps with drafts; repeated prompts
    # (the cases share three tasks) hit the prefix cache.
    "chunked prefill, prefix cache": {"max_num_batched_tokens": 24},
}


@pytest.fixture(scope="module", params=list(SETTINGS), ids=list(SETTINGS))
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[LLM, Result]]:
    """The speculating engine, and every case's outputs without speculation."""
    settings = SETTINGS[request.param]
    expected = run(make_llm(False, **settings), list(CASES.values()))
    yield make_llm(True, **settings), expected


def test_each_case_alone(engines: tuple[LLM, Result]) -> None:
    llm, expected = engines
    for (name, case), want in zip(CASES.items(), expected, strict=True):
        before = llm.engine.speculator.stats.num_drafts
        assert run(llm, [case]) == [want], name
        if name != "max_tokens":
            assert llm.engine.speculator.stats.num_drafts > before, f"{name}: no drafts"
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # taken and refused


def test_with_eight_others_running(engines: tuple[LLM, Result]) -> None:
    llm, expected = engines
    before = llm.engine.speculator.stats.num_accepted_tokens
    got = run(llm, [*OTHERS[:4], *CASES.values(), *OTHERS[4:]])
    assert got[4 : 4 + len(CASES)] == expected
    assert llm.engine.speculator.stats.num_accepted_tokens > before


def test_after_preemptions() -> None:
    """Room for 14 blocks of 16 tokens: the sequences preempt each other as they grow,
    drafts included (a draft only takes blocks no sequence needs). Eager: a KV cache this
    small is a graph of its own to compile, and the eager forward is row-invariant too."""
    cases = list(CASES.values())
    settings = {"max_model_len": 224, "enable_prefix_caching": False, "enforce_eager": True}
    probe = make_llm(False, **settings, kv_cache_memory="32MiB")  # room in fp32 too
    (kv_cache,) = probe.engine.runner.kv_caches
    settings["kv_cache_memory"] = 14 * kv_cache[:, :, 0].numel() * kv_cache.element_size()
    expected = run(make_llm(False, **settings), cases)
    on = make_llm(True, **settings)
    assert run(on, cases) == expected
    assert on.engine.scheduler.num_preemptions >= 2
    assert on.engine.speculator.stats.num_accepted_tokens > 0

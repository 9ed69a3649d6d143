"""Structured outputs in the engine, on the tiny Llama: every sample matches its constraint
whatever the sampling mode, batch or preemption; unconstrained rows are untouched; a
constraint the grammar engine refuses is an error at intake, naming it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.grammar.grammar import apply_token_bitmask
from engine.sampling.params import StructuredOutputs
from engine.sampling.sampler import Sampler, SamplingRow
from tests.support.greedy import TINY_BLOCK_BYTES

ITEMS = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["fox", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["id", "kind", "tags"],
    "additionalProperties": False,
}
# [0-9], not \d: the grammar engine's \d takes every Unicode digit, Python's re only those
# of its (older) Unicode version, so a sampled digit of a newer script failed the check.
REGEX = r"[a-f]{3}-[0-9]{2}"


@pytest.fixture(scope="module")
def llm(tiny_model_paths: dict[str, Path]) -> LLM:
    # 70 blocks of 4 tokens: the batch below runs out of blocks and preempts.
    return LLM(
        str(tiny_model_paths["llama"]), dtype="float32", block_size=4, max_model_len=160,
        kv_cache_memory=70 * TINY_BLOCK_BYTES,
    )  # fmt: skip


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=1.5, n=3)],
    ids=["greedy", "seeded", "n3"],
)
def test_every_sample_matches_its_constraint(llm: LLM, sampling: dict) -> None:
    json_params = SamplingParams(
        max_tokens=120, structured_outputs=StructuredOutputs(json=ITEMS), **sampling
    )
    regex_params = SamplingParams(
        max_tokens=20, structured_outputs=StructuredOutputs(regex=REGEX), **sampling
    )
    plain = SamplingParams(max_tokens=30, ignore_eos=True, **sampling)
    prompts = ["The quick brown fox", "Paged attention", "def main():", "Héllo"] * 2
    params = [json_params, regex_params, plain, json_params] * 2
    before = llm.engine.stats().num_preemptions
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, p in zip(outputs, params, strict=True):
        for sample in output.outputs:
            if p is json_params:
                assert sample.finish_reason == "stop", sample.text
                jsonschema.validate(json.loads(sample.text), ITEMS)
            elif p is regex_params:
                assert sample.finish_reason == "stop" and re.fullmatch(REGEX, sample.text)
            else:
                assert len(sample.token_ids) == 30
    if sampling.get("n") == 3:
        assert llm.engine.stats().num_preemptions > before
    assert llm.engine.stats().used_kv_blocks == 0


def test_choice_and_grammar(llm: LLM) -> None:
    choice = SamplingParams(
        temperature=1.0, max_tokens=10, structured_outputs=StructuredOutputs(choice=["yes", "no"])
    )
    grammar = SamplingParams(
        temperature=1.0, max_tokens=40,
        structured_outputs=StructuredOutputs(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'),
    )  # fmt: skip
    [a, b] = llm.generate(["Answer:", "Sum:"], [choice, grammar], use_tqdm=False)
    assert a.outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", b.outputs[0].text), b.outputs[0].text


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs(json={"type": "objectt"}),
        StructuredOutputs(json="{not json"),
        StructuredOutputs(regex="(unclosed"),
        StructuredOutputs(grammar="start: undefined_rule"),
    ],
)
def test_a_constraint_the_engine_cannot_compile_is_refused_at_intake(llm: LLM, spec) -> None:
    params = SamplingParams(max_tokens=5, structured_outputs=spec)
    with pytest.raises(ValueError, match=r"^structured_outputs: "):
        llm.generate("x", params, use_tqdm=False)
    assert llm.engine.stats().used_kv_blocks == 0


def test_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=[])


def test_only_constrained_rows_are_masked(llm: LLM) -> None:
    grammars = llm.engine.grammars
    matcher = grammars.matcher(grammars.compile(StructuredOutputs(choice=["yes", "no"])))
    logits = torch.randn(3, llm.engine.vocab_size, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    rows = [
        SamplingRow(greedy, [1], []),
        SamplingRow(greedy, [1], [], matcher=matcher),
        SamplingRow(greedy, [1], []),
    ]
    original = logits.clone()
    out = Sampler(constraints=grammars).sample(logits, rows)
    tokenizer = llm.get_tokenizer()
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == int(
        logits[2].argmax()
    )
    assert "yes".startswith(tokenizer.decode([out.token_ids[1]])) or "no".startswith(
        tokenizer.decode([out.token_ids[1]])
    )
    assert torch.equal(logits, original)  # the caller's logits are not modified


@pytest.mark.parametrize(("vocab", "words"), [(49152, 1536), (49153, 1537), (100, 3), (70, 3)])
def test_the_token_bitmask_is_applied_as_llguidances_reference(vocab: int, words: int) -> None:
    """`apply_token_bitmask` equals llguidance's uncompiled (NumPy) reference bit for bit:
    a forbidden logit is -inf, an allowed one is unchanged (NaN and inf too), and tokens
    past the mask's bits are forbidden."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator)
    logits[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=generator)
    bitmask[1] = -1  # every token allowed
    bitmask[2] = 0  # none
    bitmask[3, 0] = 0b1011  # a few, and the sign bit of the next word
    bitmask[3, 1] = -(2**31)
    expected = logits.numpy().copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, bitmask.numpy())
    got = logits.clone()
    apply_token_bitmask(got, bitmask)
    assert np.array_equal(got.numpy(), expected, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(torch.from_numpy(expected)))


def test_the_grammar_engines_view_of_the_tokenizer_is_built_with_the_engine(
    tiny_model_paths: dict[str, Path], monkeypatch
) -> None:
    # Built on the first structured request, it held the GIL for 0.3 s on the default
    # model and froze every running stream (bench.first_structured).
    fresh = LLM(str(tiny_model_paths["llama"]), dtype="float32", kv_cache_memory="4MiB")
    built = []
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: built.append(a))
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(regex=REGEX)
    )
    [output] = fresh.generate(["The quick brown fox"], params, use_tqdm=False)
    assert re.fullmatch(REGEX, output.outputs[0].text) and built == []

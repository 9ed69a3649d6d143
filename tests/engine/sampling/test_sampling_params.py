"""SamplingParams: defaults, normalisation and validation messages that name the parameter."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.sampling.params import DEFAULT_LIMITS, SamplingParams


def test_defaults_are_valid_and_random() -> None:
    params = SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and params.stop == []
    assert not params.greedy and not params.has_penalties


def test_stop_string_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop=None).stop == []  # type: ignore[arg-type]


def test_top_k_minus_one_means_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=0.5).has_penalties


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=5.0),
        dict(top_p=1.0),
        dict(top_p=1e-9),
        dict(top_k=1),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(repetition_penalty=0.01),
        dict(n=128),
        dict(max_tokens=None, min_tokens=1000),
        dict(max_tokens=5, min_tokens=5),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(seed=-3),
        dict(seed=2**64 - 1, stop=[f"s{i}" for i in range(64)]),
        dict(stop_token_ids=[0, 7]),
        dict(logit_bias={0: -100, 7: 100.0, 9: 0.5}),
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("n", dict(n=0)),
        ("n", dict(n=129)),
        ("n", dict(n=True)),
        ("n", dict(n=2.0)),
        ("max_tokens", dict(max_tokens=0)),
        ("temperature", dict(temperature=-1)),
        ("temperature", dict(temperature=math.nan)),
        ("temperature", dict(temperature=math.inf)),
        ("temperature", dict(temperature="1")),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-2)),
        ("min_p", dict(min_p=-0.1)),
        ("min_p", dict(min_p=1.1)),
        ("presence_penalty", dict(presence_penalty=2.5)),
        ("frequency_penalty", dict(frequency_penalty=-2.5)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("seed", dict(seed=1.5)),
        ("seed", dict(seed=2**64)),
        ("seed", dict(seed=-(2**63) - 1)),
        ("stop", dict(stop=[""])),
        ("stop", dict(stop=["ok", 3])),
        ("stop", dict(stop=3)),
        ("stop_token_ids", dict(stop_token_ids=[-1])),
        ("min_tokens", dict(min_tokens=-1)),
        ("min_tokens", dict(max_tokens=4, min_tokens=5)),
        ("logprobs", dict(logprobs=-1)),
        ("logprobs", dict(logprobs=21)),
        ("logit_bias", dict(logit_bias=[(1, 2.0)])),
        ("logit_bias token id", dict(logit_bias={-1: 1.0})),
        ("logit_bias token id", dict(logit_bias={"5": 1.0})),
        ("logit_bias value", dict(logit_bias={5: 100.5})),
        ("logit_bias value", dict(logit_bias={5: -101})),
        ("logit_bias value", dict(logit_bias={5: math.nan})),
    ],
)
def test_invalid_values_raise_naming_the_parameter(name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("field", "setting", "past_default", "at_default"),
    [
        ("stop", "max_stop_sequences", dict(stop=["s"] * 65), dict(stop=["s"] * 64)),
        ("stop", "max_stop_length", dict(stop=["x" * 1001]), dict(stop=["x" * 1000])),
        ("stop_token_ids", "max_stop_token_ids", dict(stop_token_ids=[1] * 1025), None),
        ("logit_bias", "max_logit_bias_entries", dict(logit_bias=dict.fromkeys(range(1025), 1)),
         dict(logit_bias=dict.fromkeys(range(1024), 1))),
    ],
)  # fmt: skip
def test_each_count_limit_is_a_setting_named_in_its_error(
    field: str, setting: str, past_default: dict, at_default: dict | None
) -> None:
    """The params hold any count; the engine's limits (its settings) refuse too many."""
    if at_default is not None:
        DEFAULT_LIMITS.check(SamplingParams(**at_default))
    params = SamplingParams(**past_default)
    with pytest.raises(ValueError, match=rf"^{field} must hold at most .*{setting}") as error:
        DEFAULT_LIMITS.check(params)
    assert str(getattr(DEFAULT_LIMITS, setting)) in str(error.value)
    dataclasses.replace(DEFAULT_LIMITS, **{setting: 2000}).check(params)  # raised: accepted
    lowered = dataclasses.replace(DEFAULT_LIMITS, **{setting: 1})
    with pytest.raises(ValueError, match=f"at most 1 .*{setting}"):
        lowered.check(params)

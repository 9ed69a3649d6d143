"""Sampler: every sampling parameter, seeds across batch mixes, and raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.request.state import ending_token_ids
from engine.sampling import sampler as sampler_module
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import (
    HISTORY_FOLD,
    Sampler,
    SamplingRow,
    _logsumexp,
    apply_logit_bias,
    apply_penalties,
    seeded_generator,
)

EOS = 3
VOCAB = 64


def row(
    params: SamplingParams,
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> SamplingRow:
    stops = ending_token_ids(params, [EOS])
    return SamplingRow(params, prompt or [1, 2], output or [], generator, stops)


def random_logits(batch: int, vocab: int = VOCAB, seed: int = 0, scale: float = 1.0):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def repeat_distribution(probs: list[float], batch: int) -> torch.Tensor:
    """`batch` identical rows whose softmax is `probs`, for empirical frequency checks."""
    return torch.tensor(probs).log().repeat(batch, 1)


def drawn(sampler: Sampler, logits: torch.Tensor, params: SamplingParams) -> set[int]:
    return set(sampler.sample(logits, [row(params)] * logits.shape[0]).token_ids)


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


def test_greedy_is_argmax_and_logits_are_not_modified(sampler: Sampler) -> None:
    logits = random_logits(8)
    before = logits.clone()
    out = sampler.sample(logits, [row(SamplingParams(temperature=0))] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_mixed_batch_keeps_greedy_rows_greedy(sampler: Sampler) -> None:
    logits = random_logits(6)
    rows = [row(SamplingParams(temperature=0 if i % 2 else 1.0)) for i in range(6)]
    tokens = sampler.sample(logits, rows).token_ids
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()


def test_random_rows_are_not_greedy(sampler: Sampler) -> None:
    # The control for the truncation tests below: plain sampling of flat rows differs.
    logits = random_logits(64, scale=0.5)
    tokens = sampler.sample(logits, [row(SamplingParams())] * 64).token_ids
    assert tokens != logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)],
    ids=["top_k=1", "tiny top_p", "min_p=1"],
)
def test_extreme_truncation_equals_greedy(sampler: Sampler, params: SamplingParams) -> None:
    logits = random_logits(64, scale=0.5)
    assert sampler.sample(logits, [row(params)] * 64).token_ids == logits.argmax(-1).tolist()


def test_temperature_near_zero_is_the_greedy_limit(sampler: Sampler) -> None:
    logits = random_logits(64, scale=3.0)
    # A top-2 gap of at least 0.1 makes the runner-up exp(-100) times less likely at
    # T=1e-3; random logits alone leave some rows with gaps small enough to flip.
    logits[torch.arange(64), logits.argmax(-1)] += 0.1
    rows = [row(SamplingParams(temperature=1e-3))] * 64
    assert sampler.sample(logits, rows).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_draws_follow_softmax_of_logits_over_temperature(
    sampler: Sampler, temperature: float
) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    torch.manual_seed(0)
    tokens = sampler.sample(
        repeat_distribution(probs, 20000), [row(SamplingParams(temperature=temperature))] * 20000
    ).token_ids
    expected = torch.tensor(probs).log().div(temperature).softmax(-1)
    observed = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    assert torch.allclose(observed, expected, atol=0.015), (observed, expected)


def test_top_k_keeps_the_k_most_likely(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = repeat_distribution([0.1, 0.4, 0.3, 0.2], 2000)
    assert drawn(sampler, logits, SamplingParams(top_k=2)) == {1, 2}
    assert drawn(sampler, logits, SamplingParams(top_k=-1)) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_nucleus_reaching_p(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = repeat_distribution([0.5, 0.3, 0.15, 0.05], 2000)
    assert drawn(sampler, logits, SamplingParams(top_p=0.7)) == {0, 1}
    assert drawn(sampler, logits, SamplingParams(top_p=0.85)) == {0, 1, 2}


def test_a_top_p_below_float32s_smallest_keeps_the_top_token(sampler: Sampler) -> None:
    # 1e-46 is a valid p (> 0) that float32 rounds to 0: the first token still stays.
    logits = repeat_distribution([0.5, 0.3, 0.15, 0.05], 50)
    assert drawn(sampler, logits, SamplingParams(top_p=1e-46)) == {0}


def reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Full sort: keep tokens until the ones before reach top_p (ties with the last kept)."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    probs = sorted_logits.softmax(-1)
    kept = (probs.cumsum(-1) - probs < top_p).sum(-1, keepdim=True)
    floor = sorted_logits.gather(1, kept - 1)
    return logits.masked_fill(logits < floor, -torch.inf)


def test_top_p_widens_its_candidates_until_the_nucleus_fits(monkeypatch) -> None:
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", (8, 64))
    # Scales from peaked to near flat give nuclei inside each stage and beyond the last.
    scales = torch.tensor([20.0, 5.0, 3.0, 1.0, 0.05])[:, None]
    logits = random_logits(5, vocab=1000) * scales
    sizes = []
    for top_p in [0.3, 0.9]:
        expected = reference_top_p(logits, top_p)
        sizes += expected.isfinite().sum(-1).tolist()
        actual = logits.clone()
        sampler_module._top_p(actual, [top_p] * 5)
        assert torch.equal(actual, expected)
    assert min(sizes) <= 8 and any(8 < n <= 64 for n in sizes) and max(sizes) > 64


def test_min_p_drops_tokens_below_a_fraction_of_the_top(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = repeat_distribution([0.5, 0.3, 0.15, 0.05], 2000)
    assert drawn(sampler, logits, SamplingParams(min_p=0.5)) == {0, 1}
    assert drawn(sampler, logits, SamplingParams(min_p=0.2)) == {0, 1, 2}


def test_truncations_compose_per_row(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = repeat_distribution([0.5, 0.3, 0.15, 0.05], 4000)
    rows = [
        row(SamplingParams(top_k=3)),
        row(SamplingParams(top_p=0.7)),
        # min_p sees the tempered distribution: at T=0.7, p1/p0 = 0.6**(1/0.7) = 0.48.
        row(SamplingParams(top_k=3, min_p=0.5, temperature=0.7)),
        row(SamplingParams(top_k=3, min_p=0.4, temperature=0.7)),
    ] * 1000
    tokens = sampler.sample(logits, rows).token_ids
    assert set(tokens[0::4]) == {0, 1, 2}
    assert set(tokens[1::4]) == {0, 1}
    assert set(tokens[2::4]) == {0}
    assert set(tokens[3::4]) == {0, 1}


def greedy_pick(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, **kw) -> int:
    return sampler.sample(logits[None], [row(params, **kw)]).token_ids[0]


def test_presence_penalty_counts_output_tokens_once(sampler: Sampler) -> None:
    logits = torch.tensor([2.0, 1.9, 0.0, 0.0])
    params = SamplingParams(temperature=0, presence_penalty=0.5)
    assert greedy_pick(sampler, logits, SamplingParams(temperature=0), output=[0]) == 0
    assert greedy_pick(sampler, logits, params, output=[0]) == 1
    assert greedy_pick(sampler, logits, params, prompt=[0, 0], output=[2]) == 0
    repeated = torch.tensor([2.0, 1.4, 0.0, 0.0])
    assert greedy_pick(sampler, repeated, params, output=[0, 0, 0]) == 0


def test_frequency_penalty_scales_with_the_count(sampler: Sampler) -> None:
    logits = torch.tensor([2.0, 1.9, 0.0, 0.0])
    params = SamplingParams(temperature=0, frequency_penalty=0.05)
    assert greedy_pick(sampler, logits, params, output=[0]) == 0
    assert greedy_pick(sampler, logits, params, output=[0, 2, 0, 0]) == 1


def test_negative_presence_penalty_encourages_repeats(sampler: Sampler) -> None:
    logits = torch.tensor([2.0, 1.9, 0.0, 0.0])
    params = SamplingParams(temperature=0, presence_penalty=-0.5)
    assert greedy_pick(sampler, logits, params, output=[1]) == 1


def test_repetition_penalty_covers_prompt_and_negative_logits(sampler: Sampler) -> None:
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert greedy_pick(sampler, torch.tensor([2.0, 1.9, 0.0]), params, prompt=[0]) == 1
    # Negative logits are multiplied, so they move away from zero too.
    logits = torch.tensor([-1.0, -1.2, -5.0])
    assert greedy_pick(sampler, logits, params, prompt=[2], output=[0]) == 1


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 100, generator=generator) * 3
    history = torch.randint(0, 100, (4, 30), generator=generator)
    rows = [
        row(
            SamplingParams(repetition_penalty=penalty),
            prompt=h[:20].tolist(),
            output=h[20:].tolist(),
        )
        for h in history
    ]
    expected = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
    assert torch.allclose(apply_penalties(logits, rows), expected)


def test_repetition_penalty_follows_outputs_as_they_grow() -> None:
    """The same rows over 50 steps (their outputs growing, with rows penalised and not
    interleaved), each step equal bit for bit to transformers' processor over the whole
    history: the rows' memo of their ids (folded every HISTORY_FOLD outputs) misses none."""
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 100, (n,), generator=generator).tolist() for n in (1, 40, 7)]
    rows = [row(SamplingParams(repetition_penalty=1.3), prompt=p) for p in prompts]
    rows.insert(1, row(SamplingParams(), prompt=[5]))
    for _ in range(3 * HISTORY_FOLD + 2):
        logits = torch.randn(4, 100, generator=generator) * 3
        penalised = apply_penalties(logits, rows)
        for i, r in enumerate(rows):
            if r.params.repetition_penalty == 1.0:
                assert torch.equal(penalised[i], logits[i])
                continue
            history = torch.tensor([[*r.prompt_token_ids, *r.output_token_ids]])
            processor = RepetitionPenaltyLogitsProcessor(1.3)
            assert torch.equal(penalised[i], processor(history, logits[i : i + 1].clone())[0])
        for r in rows:
            r.output_token_ids.append(int(torch.randint(0, 100, (), generator=generator)))
    assert all(r.history_outputs for r in rows if r.params.repetition_penalty != 1.0)


def test_logsumexp_without_denormals_has_torchs_bits() -> None:
    """Low temperatures (logits scaled up to 100x), masked tokens and a wholly masked row."""
    generator = torch.Generator().manual_seed(3)
    for trial in range(300):
        scale = float(torch.rand((), generator=generator)) * 100
        logits = torch.randn(3, 5000, generator=generator) * scale
        if trial % 3 == 0:
            logits[torch.rand(3, 5000, generator=generator) < 0.9] = -torch.inf
        if trial % 10 == 0:
            logits[1] = -torch.inf
        assert torch.equal(_logsumexp(logits), logits.logsumexp(dim=-1, keepdim=True))


def test_penalties_apply_only_to_their_rows() -> None:
    logits = random_logits(3)
    rows = [
        row(SamplingParams(), output=[0, 1]),
        row(SamplingParams(frequency_penalty=1.0), output=[0, 0]),
        row(SamplingParams(), output=[0]),
    ]
    penalised = apply_penalties(logits, rows)
    assert torch.equal(penalised[[0, 2]], logits[[0, 2]])
    assert math.isclose(penalised[1, 0], logits[1, 0] - 2.0, rel_tol=1e-6)
    assert torch.equal(penalised[1, 1:], logits[1, 1:])


def test_min_tokens_masks_eos_and_stop_token_ids(sampler: Sampler) -> None:
    logits = torch.zeros(VOCAB)
    logits[EOS], logits[7], logits[9] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])
    assert greedy_pick(sampler, logits, params, output=[5, 5]) == 9
    assert greedy_pick(sampler, logits, params, output=[5, 5, 5]) == EOS
    # With ignore_eos, EOS is an ordinary token: only stop_token_ids stay masked.
    ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    assert greedy_pick(sampler, logits, ignore, output=[5]) == EOS
    logits[EOS] = 0.0
    assert greedy_pick(sampler, logits, ignore, output=[5]) == 9


def test_min_tokens_masks_random_rows_too(sampler: Sampler) -> None:
    logits = torch.zeros(200, 8)
    logits[:, EOS] = 5.0
    rows = [row(SamplingParams(min_tokens=1))] * 200
    assert EOS not in sampler.sample(logits, rows).token_ids


def test_logit_bias_bans_and_forces_greedy_tokens_and_logprobs_stay_raw(
    sampler: Sampler,
) -> None:
    logits = random_logits(3, scale=3.0)
    top = logits.argmax(-1).tolist()
    rows = [
        row(SamplingParams(temperature=0, logprobs=1, logit_bias={top[0]: -100})),
        row(SamplingParams(temperature=0, logprobs=1, logit_bias={5: 100, 6: 100.0})),
        row(SamplingParams(temperature=0, logprobs=1)),
    ]
    out = sampler.sample(logits, rows)
    assert out.token_ids[0] == logits[0].topk(2).indices[1].item()  # the runner-up
    assert out.token_ids[1] == max((5, 6), key=lambda t: logits[1, t].item())
    assert out.token_ids[2] == top[2]
    raw = torch.log_softmax(logits, dim=-1)
    for i, logprobs in enumerate(out.logprobs):
        assert logprobs is not None
        assert math.isclose(logprobs.logprob, raw[i, out.token_ids[i]].item(), abs_tol=1e-5)
        assert logprobs.top[0][0] == top[i]


def test_logit_bias_bans_a_likely_token_from_random_rows(sampler: Sampler) -> None:
    logits = repeat_distribution([0.97, 0.01, 0.01, 0.01], 500)
    rows = [row(SamplingParams(logit_bias={0: -100}))] * 250 + [row(SamplingParams())] * 250
    tokens = sampler.sample(logits, rows).token_ids
    assert 0 not in tokens[:250]
    assert tokens[250:].count(0) > 200


def test_logit_bias_is_added_to_its_rows_only_and_never_lifts_a_mask() -> None:
    logits = random_logits(3)
    rows = [
        row(SamplingParams(logit_bias={1: 2.5, 10**6: 100})),
        row(SamplingParams()),
        row(SamplingParams(logit_bias={EOS: 100}, min_tokens=1)),
    ]
    assert apply_logit_bias(logits, rows[1:2]) is logits  # no bias anywhere: no work
    biased = apply_logit_bias(logits, rows)
    assert torch.equal(biased[1], logits[1])
    assert math.isclose(biased[0, 1], logits[0, 1] + 2.5, rel_tol=1e-6)
    assert torch.equal(biased[0, 2:], logits[0, 2:]) and biased[0, 0] == logits[0, 0]
    greedy = SamplingParams(temperature=0, logit_bias={EOS: 100}, min_tokens=1)
    assert Sampler().sample(logits[:1], [row(greedy)]).token_ids != [EOS]


def seeded_run(sampler: Sampler, steps: int, batch: list[tuple[SamplingParams, int]]) -> list:
    """Sample `steps` times with fresh per-row generators; rows given as (params, index)."""
    generators = [seeded_generator(p.seed, i) if p.seed is not None else None for p, i in batch]
    tokens = []
    for step in range(steps):
        logits = random_logits(1, seed=step, scale=0.3).repeat(len(batch), 1)
        rows = [row(p, generator=g) for (p, _), g in zip(batch, generators, strict=True)]
        tokens.append(sampler.sample(logits, rows).token_ids)
    return [list(column) for column in zip(*tokens, strict=True)]


def test_same_seed_gives_same_tokens_whatever_the_batch(sampler: Sampler) -> None:
    seeded = SamplingParams(seed=1234, top_k=40)
    alone = seeded_run(sampler, 8, [(seeded, 0)])[0]
    torch.manual_seed(99)
    mixed = seeded_run(
        sampler,
        8,
        [
            (SamplingParams(), 0),
            (SamplingParams(seed=5, top_p=0.9), 0),
            (SamplingParams(temperature=0), 0),
            (seeded, 0),
            (SamplingParams(seed=1234), 1),
        ],
    )
    assert mixed[3] == alone
    assert mixed[1] != alone and mixed[4] != alone


def test_n_samples_of_one_seed_differ(sampler: Sampler) -> None:
    params = SamplingParams(seed=7, n=4)
    samples = seeded_run(sampler, 8, [(params, i) for i in range(4)])
    assert len({tuple(s) for s in samples}) == 4
    assert seeded_run(sampler, 8, [(params, 2)])[0] == samples[2]


def test_seeded_generator_hashes_seed_and_index() -> None:
    def first_draws(seed: int, index: int) -> list[float]:
        return torch.rand(4, generator=seeded_generator(seed, index)).tolist()

    assert first_draws(3, 1) == first_draws(3, 1)
    assert first_draws(3, 1) != first_draws(4, 0)
    assert first_draws(3, 0) != first_draws(3, 1)


def test_logprobs_are_raw_log_softmax_with_sorted_top(sampler: Sampler) -> None:
    logits = random_logits(4, scale=2.0)
    rows = [
        row(SamplingParams(logprobs=5, temperature=0.5, presence_penalty=1.0), output=[0, 1]),
        row(SamplingParams()),
        row(SamplingParams(logprobs=0, temperature=0)),
        row(SamplingParams(logprobs=20, top_k=3)),
    ]
    out = sampler.sample(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i, k in [(0, 5), (2, 0), (3, 20)]:
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, expected[i, lp.token_id].item(), abs_tol=1e-5)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        top_values, top_ids = expected[i].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert torch.allclose(torch.tensor(values), top_values, atol=1e-5)


def test_rejects_mismatched_rows(sampler: Sampler) -> None:
    with pytest.raises(ValueError, match="rows"):
        sampler.sample(random_logits(2), [row(SamplingParams())])

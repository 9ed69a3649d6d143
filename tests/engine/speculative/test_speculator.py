"""The prompt-lookup proposer and the speculator's policy: drafts only where the context
repeats, as long as they have earned, and none in a busy batch."""

from __future__ import annotations

import random

from engine.speculative.config import SpeculativeConfig
from engine.speculative.speculator import NgramIndex, Speculator
from scheduler import Sequence


def seq_of(tokens: list[int], num_prompt: int | None = None) -> Sequence:
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    seq = Sequence("s", "s", tokens[:num_prompt], max_tokens=1000)
    seq.output_token_ids.extend(tokens[num_prompt:])
    return seq


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The reference: longest n first, latest earlier occurrence, by scanning."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


def test_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # "6 7" last occurred at 5..6 (followed by 9, 2), and the trigram "2 6 7" never before.
    assert index.propose(seq_of(tokens), 3) == [9, 2, 6]


def test_the_longest_ngram_wins_over_a_later_shorter_one() -> None:
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 4, 9, 3, 8, 1, 2, 3]
    # "1 2 3" occurred at 0..2 (then 4); "3" alone occurred later (then 8).
    assert index.propose(seq_of(tokens), 2) == [4, 9]


def test_nothing_without_a_match_or_below_the_minimum() -> None:
    assert NgramIndex(1, 3).propose(seq_of([1, 2, 3, 4]), 4) == []
    assert NgramIndex(3, 3).propose(seq_of([1, 2, 5, 1, 2]), 4) == []  # only "1 2" repeats


def test_incremental_lookups_equal_a_fresh_scan() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(30)]
    index = NgramIndex(2, 4)
    seq = seq_of(tokens[:5])
    for token in tokens[5:]:
        seq.output_token_ids.append(token)
        assert index.propose(seq, 3) == brute_force(seq.token_ids, 2, 4, 3)


class FakeSample:
    """What the speculator reads of a sample: its sequence and sampling row."""

    def __init__(self, seq: Sequence, stop_token_ids: frozenset[int] = frozenset()) -> None:
        self.seq = seq
        self.row = type("Row", (), {"stop_token_ids": stop_token_ids, "matcher": None})()


def decoding_sample(tokens: list[int], **kwargs: object) -> FakeSample:
    seq = seq_of(tokens)
    seq.num_computed_tokens = seq.num_tokens - 1
    return FakeSample(seq, **kwargs)  # type: ignore[arg-type]


CONFIG = SpeculativeConfig(
    method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2
)
REPEATING = [1, 2, 3, 4, 5, 6, 7, 1, 2]


def test_drafts_stop_before_an_ending_token_and_within_max_tokens() -> None:
    speculator = Speculator(CONFIG)
    sample = decoding_sample(REPEATING, stop_token_ids=frozenset({5}))
    assert speculator.propose([sample], 1) == {"s": [3, 4]}  # type: ignore[list-item]
    speculator.forget("s")
    sample = decoding_sample(REPEATING)
    sample.seq.max_tokens = 3  # room for 3 more outputs: the sampled one and 2 drafts
    assert speculator.propose([sample], 1) == {"s": [3, 4]}  # type: ignore[list-item]


def test_a_busy_batch_gets_no_drafts() -> None:
    config = CONFIG.model_copy(update={"disable_by_batch_size": 2})
    speculator = Speculator(config)
    sample = decoding_sample(REPEATING)
    assert speculator.propose([sample], 3) == {}  # type: ignore[list-item]
    assert speculator.propose([sample], 2) == {"s": [3, 4, 5, 6]}  # type: ignore[list-item]


def test_sequences_share_the_steps_rows() -> None:
    speculator = Speculator(CONFIG)
    samples = [decoding_sample(REPEATING) for _ in range(3)]
    for i, sample in enumerate(samples):
        sample.seq.seq_id = f"s{i}"
    # STEP_ROWS (8) over three sequences: their own rows and one draft token each.
    drafts = speculator.propose(samples, 3)  # type: ignore[arg-type]
    assert drafts == {"s0": [3], "s1": [3], "s2": [3]}
    assert speculator.propose(samples[:1], 1) == {"s0": [3, 4, 5, 6]}  # type: ignore[arg-type]


def test_a_miss_shrinks_the_next_draft_to_one_token_and_an_acceptance_restores_it() -> None:
    speculator = Speculator(CONFIG)
    sample = decoding_sample(REPEATING)
    propose = lambda: speculator.propose([sample], 1).get("s", [])  # type: ignore[list-item]  # noqa: E731
    assert len(propose()) == 4
    speculator.verified("s", 4, 0)  # refused at its first token: a single token next
    assert len(propose()) == 1
    speculator.verified("s", 1, 0)  # missed again: still one token, never paused
    assert len(propose()) == 1
    speculator.verified("s", 1, 1)  # accepted: whole again
    assert len(propose()) == 4
    speculator.verified("s", 4, 2)  # partly accepted: stays whole
    assert len(propose()) == 4
    stats = speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 10, 3)
    assert stats.accepted_per_position == [2, 1, 0, 0]

"""Exact speculative decoding by prompt lookup: who gets drafts this step and how long
(`Speculator`, where lookup has earned its place), the drafts themselves (`NgramIndex`:
the tokens that followed the latest earlier occurrence of the context's last n-gram,
vLLM's "ngram" method, llama.cpp's lookup decoding), and their verification.

Verification is exact: a draft token is taken only where the sample, at that position and
with that position's random draw, would have sampled it anyway. A sequence scheduled with
d draft tokens samples at d + 1 positions of one forward. Row j is sampled as the sequence
would be after its first j draft tokens: its penalties, `min_tokens` and grammar see those
tokens as output, and a seeded row's noise is the generator's next draw, so row j takes
draw number `num_output_tokens + j`, the draw that output position would take in a step of
its own. The forward is row-invariant, so row j's logits are the ones that position gets
without speculation. Draft j is taken while row j sampled it; the first row that sampled
something else gives the step's last token. A seeded generator then goes back to just
after the draws of the tokens kept, so the next step's draw is the one it would be
without speculation.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field, replace

import torch

from engine.request.state import SampleState
from engine.sampling.sampler import SamplingRow
from engine.speculative.config import SpeculativeConfig
from scheduler import ScheduledSequence, Sequence

# The rows of a step that drafts may fill, decoding sequences' own rows included: up to
# about 8, a step of the compiled int4 forward on the CPU costs about what a step of one
# row costs; beyond, each row adds to the step.
STEP_ROWS = 8


@dataclass(slots=True)
class SpeculationStats:
    """Totals since start, vLLM's `spec_decode` counters: verifications with drafts, the
    draft tokens proposed, those accepted, and accepted ones by their position in a draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def copy(self) -> SpeculationStats:
        return SpeculationStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )


@dataclass(slots=True)
class _SequenceDrafts:
    """One sequence's lookup index and the length of its next draft.

    Invariant: `length` is 1 (after a draft refused at its first token) or
    `num_speculative_tokens` (at first, and after a draft that was accepted at all).
    """

    index: NgramIndex
    length: int


class Speculator:
    """Proposes drafts for decoding sequences and learns from their verification.

    A sequence gets a draft only where its context's last n-gram occurred before (the
    lookup found something), only while at most `disable_by_batch_size` sequences run,
    within its share of the step's `STEP_ROWS` (one token at least), and one token long
    after a draft refused at its first token, whole again after one accepted at all: at
    one sequence a one-token draft costs nothing (a batch-1 step of the compiled forward
    computes a padding row anyway), and a context that repeats again earns its full length
    back in one step. A draft stops before the first token that would end the sample (EOS,
    a stop token id), within `max_tokens`, and, for a sample with a grammar, before the
    first token the grammar forbids.
    Not thread-safe: the engine thread owns it.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._sequences: dict[str, _SequenceDrafts] = {}

    def propose(self, running: Iterable[SampleState], num_running: int) -> dict[str, list[int]]:
        """Drafts by sequence id for the decoding samples among `running` (every running
        sample, `num_running` of them)."""
        if num_running > self.config.disable_by_batch_size:
            return {}
        # A prefill chunk, or a recompute after preemption, gets no draft.
        decoding = [s for s in running if s.seq.num_tokens - s.seq.num_computed_tokens == 1]
        # At least one draft token each while speculation runs at all (the batch is within
        # `disable_by_batch_size`).
        share = max(STEP_ROWS // max(len(decoding), 1) - 1, 1)
        drafts: dict[str, list[int]] = {}
        for sample in decoding:
            seq = sample.seq
            state = self._sequences.get(seq.seq_id)
            if state is None:
                config = self.config
                state = _SequenceDrafts(
                    NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max),
                    config.num_speculative_tokens,
                )
                self._sequences[seq.seq_id] = state
            room = min(seq.max_tokens - seq.num_output_tokens - 1, share, state.length)
            if room <= 0:
                continue
            draft = _usable(sample, state.index.propose(seq, room))
            if draft:
                drafts[seq.seq_id] = draft
        return drafts

    def verified(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        """Learn from a verification: `num_accepted` of `num_drafted` tokens were taken."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        state = self._sequences.get(seq_id)
        if state is not None:
            state.length = self.config.num_speculative_tokens if num_accepted else 1

    def forget(self, seq_id: str) -> None:
        self._sequences.pop(seq_id, None)


def _usable(sample: SampleState, draft: list[int]) -> list[int]:
    """`draft` cut before the first token that ends the sample or that its grammar forbids."""
    for position, token in enumerate(draft):
        if token in sample.row.stop_token_ids:
            draft = draft[:position]
            break
    matcher = sample.row.matcher
    if matcher is not None and draft:
        draft = draft[: matcher.validate_tokens(draft)]
    return draft


class NgramIndex:
    """Where each n-gram of one sequence's tokens, `min_n <= n <= max_n`, last ended.

    Invariant: `_latest[n - min_n]` maps every n-gram that ends (exclusive) at a position
    `e <= _indexed_end` to the largest such `e`. A sequence's tokens only grow (preemption
    keeps them), so each step indexes just the n-grams its new tokens end: O(new tokens x
    n range) a step, not O(context).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed_end = 0

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed, at its latest earlier occurrence, the
        longest of the context's last n-grams that occurred before; [] when none did."""
        length = seq.num_tokens
        self._index_up_to(seq, length - 1)  # every n-gram but the context's own last ones
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._latest[n - self.min_n].get(tuple(seq.get_token_ids(length - n, length)))
            if end is not None:
                return seq.get_token_ids(end, min(end + num_tokens, length))
        return []

    def _index_up_to(self, seq: Sequence, end: int) -> None:
        if end <= self._indexed_end:
            return
        start = max(self._indexed_end + 1 - self.max_n, 0)
        tokens = seq.get_token_ids(start, end)
        for n, latest in enumerate(self._latest, self.min_n):
            first = max(self._indexed_end + 1, n)  # the first new end with a whole n-gram
            for stop in range(first, end + 1):
                latest[tuple(tokens[stop - n - start : stop - start])] = stop
        self._indexed_end = end


def sampling_rows(
    scheduled: SequenceOf[ScheduledSequence], samples: SequenceOf[SampleState]
) -> list[SamplingRow]:
    """The sampler's rows for a step's sampling chunks, in the forward's logits order:
    one per chunk, plus one per draft token (see the module's docstring)."""
    rows: list[SamplingRow] = []
    for item, sample in zip(scheduled, samples, strict=True):
        rows.append(sample.row)
        if item.draft_token_ids:
            rows += _draft_rows(sample, item.draft_token_ids)
    return rows


def _draft_rows(sample: SampleState, draft: tuple[int, ...]) -> list[SamplingRow]:
    """The rows after each of `draft`'s tokens, as if the sample had output them."""
    row = sample.row
    output = list(sample.seq.output_token_ids)
    rows = []
    for j in range(1, len(draft) + 1):
        matcher = None
        if row.matcher is not None:
            matcher = row.matcher.deep_copy()
            matcher.consume_tokens(list(draft[:j]))
        rows.append(replace(row, output_token_ids=output + list(draft[:j]), matcher=matcher))
    return rows


def generator_states(
    scheduled: SequenceOf[ScheduledSequence], samples: SequenceOf[SampleState]
) -> dict[str, torch.Tensor]:
    """The state, before sampling, of each seeded random sample's generator that will
    draw for draft rows, by sequence id (for `rewind`)."""
    return {
        sample.seq.seq_id: sample.row.generator.get_state()
        for item, sample in zip(scheduled, samples, strict=True)
        if item.draft_token_ids
        and sample.row.generator is not None
        and not sample.row.params.greedy
    }


def rewind(generator: torch.Generator, state: torch.Tensor, num_draws: int, vocab: int) -> None:
    """Put `generator` back to `state`, then make `num_draws` row draws of `vocab` values,
    as the sampler does for each token (`_sample_random`): the state after the draws of
    the tokens that were kept."""
    generator.set_state(state)
    noise = torch.empty(vocab, device=generator.device)
    for _ in range(num_draws):
        noise.uniform_(generator=generator)

"""Who gets drafts this step, and how long: prompt lookup where it has earned its place."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.request.state import SampleState
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramIndex

# The rows of a step that drafts may fill, decoding sequences' own rows included: up to
# about 8, a step of the compiled int4 forward cost about what a step of one row costs on
# this project's 2-core CPU (a probe of one to four 400-token sequences with 0 to 8 drafts
# each: +10% at 1 x 7 rows, +25% at 2 x 4, 2x at 4 x 3, 2.3x at 1 x 9).
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

"""Exact verification: a draft token is taken only where the sample, at that position and
with that position's random draw, would have sampled it anyway.

A sequence scheduled with d draft tokens samples at d + 1 positions of one forward. Row j
is sampled as the sequence would be after its first j draft tokens: its penalties,
`min_tokens` and grammar see those tokens as output, and a seeded row's noise is the
generator's next draw, so row j takes draw number `num_output_tokens + j`, the draw that
output position would take in a step of its own. The forward is row-invariant, so row
j's logits are the ones that position gets without speculation. Draft j is taken while
row j sampled it; the first row that sampled something else gives the step's last token.
A seeded generator then goes back to just after the draws of the tokens kept, so the
next step's draw is the one it would be without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.request.state import SampleState
from engine.sampling.sampler import SamplingRow
from scheduler import ScheduledSequence


def sampling_rows(
    scheduled: Sequence[ScheduledSequence], samples: Sequence[SampleState]
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
    scheduled: Sequence[ScheduledSequence], samples: Sequence[SampleState]
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

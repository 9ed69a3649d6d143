"""Batched next-token sampling over one engine step.

Each row of the logits is processed in vLLM's order: min_tokens masking, logit_bias,
repetition / frequency / presence penalties, then (for non-greedy rows) temperature,
top-k, top-p, min-p and a draw. Greedy rows (temperature below `GREEDY_TEMPERATURE`)
take the argmax of the penalised logits; truncation never changes an argmax, so it is
skipped for them.

Reproducibility: a seeded non-greedy row draws its noise only from its own generator,
exactly one vocabulary-sized draw per sampled token, and every step of its processing is
row-wise, so its tokens depend on its logits and its seed and never on which other rows
share the batch. Unseeded rows share the sampler's generator, seeded by the engine's
`seed` setting, so a fresh engine given the same requests in the same order repeats itself.

Logprobs are "raw": the log_softmax of the model's logits as given, before logit_bias,
penalties, temperature and truncation (vLLM's default), so they describe the model, not
the sampler.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.outputs import TokenLogprobs
from engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from engine.sampling.logits_constraint import ConstraintCompiler, LogitsConstraint

# Top-p looks for a row's nucleus among this many most likely tokens, then among more,
# before sorting the whole vocabulary (see `_top_p`).
TOP_P_CANDIDATES = (256, 4096)
# Output ids the repetition penalty reads from the row's list each step before they join
# its history tensor (`SamplingRow.history`): one small op per row every HISTORY_FOLD steps.
HISTORY_FOLD = 16


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence that samples this step.

    `prompt_token_ids` and `output_token_ids` are read only when the params have a penalty
    or an unmet `min_tokens`, so passing the sequence's own lists costs nothing.
    `generator` is the sequence's own RNG when its request has a seed (see
    `seeded_generator`), else None. `stop_token_ids` are the tokens that would end the
    sequence, masked while it has fewer than `min_tokens` outputs; the sample that owns the
    row decides them (`engine.request.state.ending_token_ids`). `matcher`, for a request
    with structured outputs, is the sample's grammar constraint: tokens it forbids are
    masked. `history` is the repetition penalty's memo, kept by the sampler on the logits'
    device: the prompt's distinct ids, then the first `history_outputs` output ids, so a
    step converts only the outputs since (fewer than HISTORY_FOLD), not the whole context.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    stop_token_ids: Set[int] = field(default_factory=frozenset)
    matcher: LogitsConstraint | None = None
    history: torch.Tensor | None = None
    history_outputs: int = 0


@dataclass(slots=True)
class SamplerOutput:
    """One token per row, and its logprobs where the row's params asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def seeded_generator(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The RNG of sample `index` (0..n-1) of a request seeded with `seed`.

    Seeded with a hash of (seed, index) rather than seed + index, so that sample 1 of
    seed s and sample 0 of seed s + 1 do not produce the same tokens. Make it on the
    device the logits live on; keep it for the sequence's whole life.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little"))
    return generator


class Sampler:
    """Turns a step's last-position logits into next tokens.

    `seed` seeds the generator that unseeded non-greedy rows draw from; None leaves them
    to torch's global RNG. `constraints` masks the rows that have a grammar `matcher`: the
    compiler that made their matchers (required when a row has one).
    """

    def __init__(
        self,
        seed: int | None = None,
        device: torch.device | str = "cpu",
        constraints: ConstraintCompiler | None = None,
    ) -> None:
        self.constraints = constraints
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of `logits` [len(rows), vocab]; `logits` is not modified."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        raw = logits.float()
        processed = apply_penalties(apply_logit_bias(self._mask_min_tokens(raw, rows), rows), rows)
        constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
        if constrained:
            assert self.constraints is not None, "a row with a grammar needs its compiler"
            processed = processed.clone() if processed is raw else processed
            matchers = [rows[i].matcher for i in constrained]
            self.constraints.mask_logits(processed, constrained, matchers)  # type: ignore[arg-type]
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):
            token_ids = processed.argmax(dim=-1)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=raw.device)
            if greedy:
                index = _index(greedy, raw.device)
                token_ids[index] = processed[index].argmax(dim=-1)
            randoms = [i for i, row in enumerate(rows) if not row.params.greedy]
            index = _index(randoms, raw.device)
            token_ids[index] = _sample_random(
                processed[index], [rows[i] for i in randoms], self.generator
            )
        return SamplerOutput(token_ids.tolist(), _logprobs(raw, rows, token_ids))

    def _mask_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        vocab_size = logits.shape[1]
        row_index: list[int] = []
        token_index: list[int] = []
        for i, row in enumerate(rows):
            if len(row.output_token_ids) >= row.params.min_tokens:
                continue
            banned = [t for t in row.stop_token_ids if t < vocab_size]
            row_index += [i] * len(banned)
            token_index += banned
        if not row_index:
            return logits
        masked = logits.clone()
        masked[_index(row_index, logits.device), _index(token_index, logits.device)] = -torch.inf
        return masked


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return `logits` with each row's `logit_bias` added: a new tensor if any row has a
    bias, else `logits` itself, untouched and with no work done. Ids beyond the logits'
    width are skipped (the intake refuses them; this only guards the indexing)."""
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias.items():
            if token_id < vocab_size:
                row_index.append(i)
                token_index.append(token_id)
                values.append(bias)
    if not row_index:
        return logits
    device = logits.device
    index = (_index(row_index, device), _index(token_index, device))
    bias = torch.tensor(values, dtype=logits.dtype, device=device)
    # A row's ids are distinct (dict keys), so every (row, id) pair is added to once.
    return logits.clone().index_put_(index, bias, accumulate=True)


def _index(positions: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


def _flat_positions(
    row_ids: Sequence[tuple[int, Sequence[int]]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions in a flattened [rows, vocab] tensor of each (row, ids) pair's ids, and
    how many ids each pair has."""
    counts = _index([len(ids) for _, ids in row_ids], device)
    ids = _index(list(chain.from_iterable(ids for _, ids in row_ids)), device)
    starts = _index([row * vocab_size for row, _ in row_ids], device)
    return ids + starts.repeat_interleave(counts), counts


def _history_positions(
    rows: Sequence[SamplingRow], at: Sequence[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions in a flattened [rows, vocab] tensor, row `rows[k]` at row `at[k]`, of
    each row's prompt and output ids (repeats allowed), and the k of each: its `history`
    tensor (made or extended here), then the output ids since."""
    histories: list[torch.Tensor] = []
    recent: list[Sequence[int]] = []
    for row in rows:
        if row.history is None:
            distinct = np.unique(np.asarray(row.prompt_token_ids, dtype=np.int64))
            row.history = torch.from_numpy(distinct).to(device)
        since = row.output_token_ids[row.history_outputs :]
        if len(since) >= HISTORY_FOLD:
            row.history = torch.cat((row.history, _index(since, device)))
            row.history_outputs += len(since)
            since = ()
        histories.append(row.history)
        recent.append(since)
    batch = torch.arange(len(rows), device=device)
    row_of = torch.cat(
        (
            batch.repeat_interleave(_index([h.numel() for h in histories], device)),
            batch.repeat_interleave(_index([len(ids) for ids in recent], device)),
        )
    )
    ids = torch.cat((*histories, _index(list(chain.from_iterable(recent)), device)))
    return ids + _index(at, device)[row_of] * vocab_size, row_of


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return `logits` with each row's penalties applied (a new tensor if any applies).

    Repetition penalty over prompt + output, as transformers' RepetitionPenaltyLogitsProcessor
    (positive logits divided, negative multiplied); then presence (once per distinct token)
    and frequency (once per occurrence) penalties over the output only, as OpenAI's.
    """
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return logits
    device = logits.device
    vocab_size = logits.shape[1]
    params = [rows[i].params for i in penalised]
    # One copy of the logits, touched only at the ids' positions: O(ids), not O(vocab), per
    # row. Duplicate ids gather the same value and write the same result, so each applies
    # once; the frequency penalty adds once per occurrence.
    penalised_logits = logits.clone()
    flat = penalised_logits.view(-1)
    # Only the rows with a repetition penalty gather their ids (1.0 changes no bit).
    repeating = [i for i in penalised if rows[i].params.repetition_penalty != 1.0]
    if repeating:
        seen, row_of = _history_positions(
            [rows[i] for i in repeating], repeating, vocab_size, device
        )
        penalties = [rows[i].params.repetition_penalty for i in repeating]
        penalty = torch.tensor(penalties, device=device)[row_of]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        output, counts = _flat_positions(
            [(i, rows[i].output_token_ids) for i in penalised], vocab_size, device
        )
        if any(p.presence_penalty != 0.0 for p in params):
            presence = torch.tensor([p.presence_penalty for p in params], device=device)
            flat[output] = flat[output] - presence.repeat_interleave(counts)
        if any(p.frequency_penalty != 0.0 for p in params):
            frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
            flat.index_add_(0, output, -frequency.repeat_interleave(counts))
    return penalised_logits


def _sample_random(
    logits: torch.Tensor, rows: Sequence[SamplingRow], shared: torch.Generator | None
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row; rows without a generator
    of their own draw from `shared`."""
    device = logits.device
    temperature = torch.tensor([row.params.temperature for row in rows], device=device)
    logits = logits / temperature[:, None]
    _top_k(logits, [row.params.top_k for row in rows])
    _top_p(logits, [row.params.top_p for row in rows])
    _min_p(logits, [row.params.min_p for row in rows])
    # Exponential race in log space: argmax(logits - log E) with E = -log U ~ Exp(1) is a
    # draw from softmax(logits), needs no softmax, and lets every seeded row take its
    # noise from its own generator. (uniform_ and two logs are faster than exponential_
    # on the CPU; U = 0 gives E = inf, a token that cannot win, as Exp(1) allows.)
    noise = torch.empty_like(logits)
    unseeded = [i for i, row in enumerate(rows) if row.generator is None]
    if len(unseeded) == len(rows):
        noise.uniform_(generator=shared)
    else:
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].uniform_(generator=row.generator)
        if unseeded:
            index = _index(unseeded, device)
            noise[index] = torch.rand(
                len(unseeded), noise.shape[1], device=device, generator=shared
            )
    log_exponential = noise.log_().neg_().log_()
    return logits.sub_(log_exponential).argmax(dim=-1)


def _top_k(logits: torch.Tensor, top_ks: Sequence[int]) -> None:
    """Keep each row's k largest logits (ties with the k-th included), in place."""
    vocab_size = logits.shape[1]
    rows = [i for i, k in enumerate(top_ks) if 0 < k < vocab_size]
    if not rows:
        return
    index = _index(rows, logits.device)
    sub = logits[index]
    k = _index([top_ks[i] for i in rows], logits.device)
    # One topk at the largest k serves every row; each row reads its own k-th value.
    kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    logits[index] = sub.masked_fill(sub < kth, -torch.inf)


def _top_p(logits: torch.Tensor, top_ps: Sequence[float]) -> None:
    """Keep each row's smallest set of most likely tokens whose mass reaches p (ties with
    the least likely kept token included), in place."""
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return
    index = _index(rows, logits.device)
    top_p = torch.tensor([top_ps[i] for i in rows], device=logits.device)[:, None]
    sub = logits[index]
    vocab_size = sub.shape[1]
    # A full sort of the vocabulary is slow on CPU and nuclei are usually small: look for
    # each row's nucleus among its top candidates, widening only for the rows not found.
    floor = torch.empty_like(top_p)
    pending = torch.arange(len(rows), device=logits.device)
    for limit in (*TOP_P_CANDIDATES, vocab_size):
        candidates = min(limit, vocab_size)
        row_floor, found = _nucleus_floor(sub[pending], top_p[pending], candidates)
        floor[pending] = row_floor  # final for found rows; a wider pass redoes the others
        pending = pending[~found]
        if pending.numel() == 0:
            break
    logits[index] = sub.masked_fill(sub < floor, -torch.inf)


def _nucleus_floor(
    logits: torch.Tensor, top_p: torch.Tensor, candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the smallest logit in the top-p nucleus found among the `candidates` largest,
    and whether those candidates hold the whole nucleus."""
    sorted_logits = logits.topk(candidates, dim=-1).values
    probs = (sorted_logits - _logsumexp(logits)).exp()
    mass = probs.cumsum(dim=-1)
    # A token goes when the tokens before it already reach p; the first always stays (a p
    # that float32 rounds to 0 included).
    kept = (mass - probs < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    return sorted_logits.gather(1, kept - 1), mass[:, -1] >= top_p[:, 0]


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """`logits.logsumexp(dim=-1, keepdim=True)` with the same bits, without denormals.

    After a low temperature most of a row lies far below its maximum, and exp() of
    those differences gives floats below FLT_MIN, each one slow on x86 CPUs. Differences
    below -87 count as exp(-87), a normal float; the sum is at least 1 (the maximum's own
    term), so a change of at most vocab * 1.7e-38 in it leaves its bits as they were. A
    row of -inf stays -inf.
    """
    peak = logits.amax(dim=-1, keepdim=True)
    terms = (logits - peak).clamp_(min=-87.0).exp_()
    return torch.where(peak.isneginf(), peak, terms.sum(dim=-1, keepdim=True).log_() + peak)


def _min_p(logits: torch.Tensor, min_ps: Sequence[float]) -> None:
    """Drop tokens less likely than min_p times the row's most likely token, in place."""
    rows = [i for i, p in enumerate(min_ps) if p > 0.0]
    if not rows:
        return
    index = _index(rows, logits.device)
    log_min_p = torch.tensor([math.log(min_ps[i]) for i in rows], device=logits.device)
    sub = logits[index]
    # p < min_p * p_max  <=>  logit < max_logit + log(min_p): no softmax needed.
    threshold = sub.amax(dim=-1, keepdim=True) + log_min_p[:, None]
    logits[index] = sub.masked_fill(sub < threshold, -torch.inf)


def _logprobs(
    raw: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[TokenLogprobs | None]:
    result: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return result
    index = _index(wanted, raw.device)
    logprobs = torch.log_softmax(raw[index], dim=-1)
    chosen_ids = token_ids[index]
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    counts = [rows[i].params.logprobs or 0 for i in wanted]
    top_values, top_ids = logprobs.topk(min(max(counts), raw.shape[1]), dim=-1)
    top_value_lists, top_id_lists = top_values.tolist(), top_ids.tolist()
    for j, (i, token_id) in enumerate(zip(wanted, chosen_ids.tolist(), strict=True)):
        top = list(zip(top_id_lists[j][: counts[j]], top_value_lists[j][: counts[j]], strict=True))
        result[i] = TokenLogprobs(token_id, chosen[j], top)
    return result


@torch.inference_mode()
def prompt_logprobs(
    logits: torch.Tensor, targets: Sequence[int], counts: Sequence[int]
) -> list[TokenLogprobs]:
    """Row i's entry: `targets[i]` (the prompt token after row i's position), its logprob
    and rank under the raw distribution (log_softmax of the float32 logits, as `_logprobs`)
    and the `counts[i]` most likely tokens, most likely first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = _index(targets, logprobs.device)[:, None]
    chosen = logprobs.gather(1, target)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_values, top_ids = logprobs.topk(min(max(counts), logprobs.shape[1]), dim=-1)
    entries = []
    rows = zip(
        targets, chosen[:, 0].tolist(), ranks, top_ids.tolist(), top_values.tolist(), counts,
        strict=True,
    )  # fmt: skip
    for token_id, logprob, rank, ids, values, count in rows:
        top = list(zip(ids[:count], values[:count], strict=True))
        entries.append(TokenLogprobs(token_id, logprob, top, rank=rank))
    return entries

"""The engine's bookkeeping for one request: its samples and what it has reported."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from engine.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from engine.request.detokenizer import IncrementalDetokenizer, TokenTexts
from engine.request.intake import EngineRequest
from engine.request.sample import SampleState, StopChecker, ending_token_ids
from engine.sampling.logits_constraint import ConstraintCompiler
from engine.sampling.sampler import SamplingRow, seeded_generator
from scheduler import Sequence


@dataclass(slots=True)
class RequestState:
    """All samples of one request. A sample with n > 1 has seq_id f"{request_id}-{index}".

    With `prompt_logprobs` asked for, sample 0's sequence computes them (and takes no
    prefix-cache hits); the others may hit its blocks. Invariant: `prompt_logprobs[i]` is
    prompt token i's entry, the first None; the list is handed out once, when whole.
    """

    request_id: str
    request: EngineRequest
    samples: list[SampleState] = field(default_factory=list)
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False

    @classmethod
    def create(
        cls,
        request_id: str,
        request: EngineRequest,
        eos_token_ids: frozenset[int],
        tokenizer: PreTrainedTokenizerBase,
        token_texts: TokenTexts,
        device: torch.device,
        grammars: ConstraintCompiler | None = None,
        prompt_hashes: tuple[int, ...] = (),
    ) -> RequestState:
        """The request's samples, each with its own RNG (if seeded) and grammar matcher
        (if the request has a grammar: then `grammars` must be the compiler that made it),
        each starting from `prompt_hashes`, the chained hashes of the prompt's first full
        blocks at the engine's block size."""
        state = cls(request_id, request)
        params, prompt_ids = request.params, request.prompt_token_ids
        wants_prompt_logprobs = params.prompt_logprobs is not None
        if wants_prompt_logprobs:
            state.prompt_logprobs = [None]
        ending = ending_token_ids(params, eos_token_ids)
        for index in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}-{index}"
            seq = Sequence(
                seq_id, request_id, prompt_ids, request.max_tokens, index=index,
                priority=params.priority, prompt_logprobs=wants_prompt_logprobs and index == 0,
            )  # fmt: skip
            seq.block_hashes.extend(prompt_hashes)
            generator = (
                None if params.seed is None else seeded_generator(params.seed, index, device)
            )
            matcher = None
            if request.grammar is not None:
                assert grammars is not None, "a request with a grammar needs its compiler"
                matcher = grammars.matcher(request.grammar)
            row = SamplingRow(params, prompt_ids, seq.output_token_ids, generator, ending, matcher)
            state.samples.append(
                SampleState(
                    seq=seq,
                    row=row,
                    detokenizer=IncrementalDetokenizer(
                        tokenizer, prompt_ids, params.skip_special_tokens
                    ),
                    stop=StopChecker(params.stop, params.include_stop_str_in_output),
                    token_texts=token_texts,
                    pending_logprobs=[] if params.logprobs is not None else None,
                )
            )
        return state

    def add_prompt_logprobs(
        self, first: int, entries: list[TokenLogprobs], token_texts: TokenTexts
    ) -> None:
        """Record the entries of prompt tokens `first`, `first + 1`, ... (one chunk's, in
        order), decoding their texts; those already held (a chunk recomputed after a
        preemption) are skipped."""
        held = self.prompt_logprobs
        assert held is not None and 1 <= first <= len(held), "prompt chunks come in order"
        for entry in entries[len(held) - first :]:
            entry.token = token_texts.text(entry.token_id)
            entry.top_tokens = [token_texts.text(token) for token, _ in entry.top]
            held.append(entry)

    def _take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The whole prompt's logprobs the first time they are complete, else None."""
        held = self.prompt_logprobs
        if held is None or self.prompt_logprobs_sent:
            return None
        if len(held) < len(self.request.prompt_token_ids):
            return None
        self.prompt_logprobs_sent = True
        return held

    @property
    def finished(self) -> bool:
        return all(sample.seq.is_finished for sample in self.samples)

    def take_output(self) -> RequestOutput:
        """The request's output now: each sample's deltas since the last call."""
        seqs = [sample.seq for sample in self.samples]
        first_token_times = [s.first_token_time for s in seqs if s.first_token_time is not None]
        scheduled_times = [s.first_scheduled_time for s in seqs if s.first_scheduled_time]
        finished_times = [s.finished_time for s in seqs if s.finished_time is not None]
        metrics = RequestMetrics(
            arrival_time=seqs[0].arrival_time,
            first_scheduled_time=min(scheduled_times, default=None),
            first_token_time=min(first_token_times, default=None),
            finished_time=max(finished_times) if self.finished else None,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.request.prompt,
            prompt_token_ids=self.request.prompt_token_ids,
            outputs=[sample.take_output() for sample in self.samples],
            finished=self.finished,
            num_cached_tokens=seqs[0].num_cached_tokens,
            metrics=metrics,
            error=self.error,
            prompt_logprobs=self._take_prompt_logprobs(),
        )

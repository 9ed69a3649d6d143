"""The engine's bookkeeping for one request: its samples' text, stops and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from engine.request.detokenizer import IncrementalDetokenizer
from engine.request.stop_checker import StopChecker
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import SamplingRow, seeded_generator
from scheduler import FinishReason, Sequence


@dataclass(slots=True)
class SampleState:
    """One sample (sequence) of a request and what earlier outputs already carried.

    Invariants: `text` is the streamed text, a prefix of `stop.text` that never holds a
    partial stop string; `sent_tokens` and `sent_logprobs` count token ids and logprobs
    handed out, so each output's deltas are exactly what was added since the last one.
    """

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    row: SamplingRow
    logprobs: list[TokenLogprobs] | None
    stop_reason: int | str | None = None
    text: str = ""
    sent_tokens: int = 0
    sent_logprobs: int = 0

    def take_output(self) -> CompletionOutput:
        """This sample's cumulative output with the deltas since the previous call."""
        seq = self.seq
        delta_text = self.stop.stream(final=seq.is_finished)
        self.text += delta_text
        delta_tokens = seq.output_token_ids[self.sent_tokens :]
        self.sent_tokens = seq.num_output_tokens
        delta_logprobs = None
        if self.logprobs is not None:
            delta_logprobs = self.logprobs[self.sent_logprobs :]
            self.sent_logprobs = len(self.logprobs)
        return CompletionOutput(
            index=seq.index,
            text=self.text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
            delta_logprobs=delta_logprobs,
        )


@dataclass(slots=True)
class RequestState:
    """All samples of one request, and the conditions that end each of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    samples: list[SampleState] = field(default_factory=list)
    error: str | None = None

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
    ) -> RequestState:
        state = cls(request_id, prompt, prompt_token_ids, params, eos_token_ids)
        for index in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}-{index}"
            seq = Sequence(seq_id, request_id, prompt_token_ids, max_tokens, index=index)
            generator = (
                None if params.seed is None else seeded_generator(params.seed, index, device)
            )
            detokenizer = IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.skip_special_tokens
            )
            state.samples.append(
                SampleState(
                    seq=seq,
                    detokenizer=detokenizer,
                    stop=StopChecker(params.stop, params.include_stop_str_in_output),
                    row=SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids, generator),
                    logprobs=[] if params.logprobs is not None else None,
                )
            )
        return state

    @property
    def finished(self) -> bool:
        return all(sample.seq.is_finished for sample in self.samples)

    def on_token(
        self, sample: SampleState, token_id: int, logprobs: TokenLogprobs | None
    ) -> FinishReason | None:
        """Account for the token just appended to `sample.seq`; return why it ends, or None.

        EOS (unless `ignore_eos`) and `stop_token_ids` end a sample without adding their
        text (the sampler keeps them out before `min_tokens`); a stop string ends it with
        the text cut before the stop (kept with `include_stop_str_in_output`); reaching
        the sequence's `max_tokens` ends it with "length" (the engine sets it so that the
        sequence never outgrows `max_model_len`).
        """
        seq = sample.seq
        if sample.logprobs is not None and logprobs is not None:
            sample.logprobs.append(logprobs)
        reason: FinishReason | None = None
        if token_id in self.params.stop_token_ids:
            sample.stop_reason = token_id
            reason = "stop"
        elif not self.params.ignore_eos and token_id in self.eos_token_ids:
            reason = "stop"
        else:
            matched = sample.stop.append(sample.detokenizer.push([token_id]))
            if matched is not None:
                sample.stop_reason = matched
                return "stop"
            if seq.num_output_tokens >= seq.max_tokens:
                reason = "length"
        if reason is not None:
            # The detokenizer may hold back an incomplete character; the text ends here.
            matched = sample.stop.append(sample.detokenizer.flush())
            if matched is not None:
                sample.stop_reason = matched
                reason = "stop"
        return reason

    def take_output(self) -> RequestOutput:
        """The request's output now, with each sample's deltas since the last call."""
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
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[sample.take_output() for sample in self.samples],
            finished=self.finished,
            num_cached_tokens=seqs[0].num_cached_tokens,
            metrics=metrics,
            error=self.error,
        )

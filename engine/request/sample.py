"""One sample of a request: the single owner of when it stops and what text it made."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, TokenLogprobs
from engine.request.detokenizer import IncrementalDetokenizer
from engine.request.stop_checker import StopChecker
from engine.request.token_texts import TokenTexts
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import SamplingRow
from scheduler import FinishReason, Sequence


def ending_token_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The tokens that end a sample: its `stop_token_ids`, and EOS unless `ignore_eos`.

    The same set is masked at sampling time while the sample has fewer than `min_tokens`
    outputs, so a sample never ends before `min_tokens` by a token.
    """
    ending = frozenset(params.stop_token_ids)
    return ending if params.ignore_eos else ending | frozenset(eos_token_ids)


@dataclass(slots=True)
class SampleState:
    """Everything that decides when one sample (sequence) stops, and the text it produced.

    It applies each stop rule: the ending tokens (EOS, `stop_token_ids`; masked by the
    sampler before `min_tokens`, through `row.stop_token_ids`), stop strings, and
    `max_tokens` (`seq.max_tokens`, set so the sequence never outgrows `max_model_len`).
    Invariants: `stop` holds the sample's text, its only copy; `sent_tokens` counts the
    output token ids handed out and `pending_logprobs` holds the entries not yet handed
    out, so each output carries exactly what was added since the previous one.
    """

    seq: Sequence
    params: SamplingParams
    row: SamplingRow
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    token_texts: TokenTexts
    pending_logprobs: list[TokenLogprobs] | None
    stop_reason: int | str | None = None
    sent_tokens: int = field(default=0)

    def on_token(self, token_id: int, logprobs: TokenLogprobs | None) -> FinishReason | None:
        """Account for the token just appended to `seq`; return why the sample ends, or None.

        An ending token ends it without adding its text (a stop token id becomes the
        `stop_reason`); a stop string ends it with the text cut before the stop (kept with
        `include_stop_str_in_output`); the `max_tokens`-th output ends it with "length".
        """
        if self.pending_logprobs is not None and logprobs is not None:
            logprobs.token = self.token_texts.text(logprobs.token_id)
            logprobs.top_tokens = [self.token_texts.text(token) for token, _ in logprobs.top]
            self.pending_logprobs.append(logprobs)
        reason: FinishReason | None = None
        if token_id in self.row.stop_token_ids:
            if token_id in self.params.stop_token_ids:
                self.stop_reason = token_id
            reason = "stop"
        else:
            matched = self.stop.append(self.detokenizer.push([token_id]))
            if matched is not None:
                self.stop_reason = matched
                return "stop"
            if self.seq.num_output_tokens >= self.seq.max_tokens:
                reason = "length"
        if reason is not None:
            # The detokenizer may hold back an incomplete character; the text ends here.
            matched = self.stop.append(self.detokenizer.flush())
            if matched is not None:
                self.stop_reason = matched
                reason = "stop"
        return reason

    def take_output(self) -> CompletionOutput:
        """What this sample gained since the previous call, with its finish state."""
        seq = self.seq
        delta_tokens = seq.output_token_ids[self.sent_tokens :]
        self.sent_tokens = seq.num_output_tokens
        logprobs = self.pending_logprobs
        if logprobs is not None:
            self.pending_logprobs = []
        return CompletionOutput(
            index=seq.index,
            text=self.stop.stream(final=seq.is_finished),
            token_ids=delta_tokens,
            finish_reason=seq.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
        )

"""The engine's bookkeeping for one request: its samples, each the single owner of when it
stops and what text it made, and what the request has reported."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from cache import BlockHashes
from engine.adapters import ServedAdapter
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from engine.request.detokenizer import IncrementalDetokenizer, TokenTexts
from engine.request.intake import EngineRequest
from engine.sampling.logits_constraint import ConstraintCompiler
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import SamplingRow, seeded_generator
from scheduler import FinishReason, Sequence


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
        adapter: ServedAdapter | None = None,
    ) -> RequestState:
        """The request's samples, each with its own RNG (if seeded) and grammar matcher
        (if the request has a grammar: then `grammars` must be the compiler that made it),
        each starting from `prompt_hashes`, the chained hashes of the prompt's first full
        blocks at the engine's block size (onto `adapter`'s root: its samples run in its
        LoRA slot)."""
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
                checkpoint_positions=request.checkpoint_positions,
            )  # fmt: skip
            if adapter is not None:
                seq.lora_slot = adapter.slot
                seq.block_hashes = BlockHashes(adapter.root, adapter.name)
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


class StopChecker:
    """Holds one sample's output text, the only copy, and watches it for stop strings.

    Feed it the detokenizer's deltas with `append`; a stop string is found even when it
    spans several deltas. Invariants:
    - `text` never contains a stop string, except the matched one at its very end when
      `include_stop_str_in_output` is set; after a match `stopped` holds the stop string
      and the text no longer changes.
    - Text handed out by `stream()` is never taken back: while the text ends with the start
      of some stop string (e.g. "\\n" of "\\n\\n"), that suffix is held back.
    Each `append` searches only the new text plus the `max(len(stop)) - 1` characters
    before it, so checking costs O(len(delta)) per token, not O(len(text)).
    """

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = list(stop)
        if any(not s for s in self._stops):
            raise ValueError("stop strings must be non-empty")
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._streamed = 0
        self.stopped: str | None = None

    @property
    def text(self) -> str:
        """The output text so far, truncated at the stop string once one matched."""
        return self._text

    def append(self, delta: str) -> str | None:
        """Add text; return the stop string that now ends the output, else None.

        When several stop strings match, the one starting first wins (then the one listed
        first), so the output is cut as early as possible.
        """
        if self.stopped is not None:
            raise RuntimeError("append after a stop string matched")
        search_from = max(len(self._text) - self._max_len + 1, 0)
        self._text += delta
        if not self._stops or not delta:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            position = self._text.find(stop, search_from)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        if best is None:
            return None
        position, stop = best
        # Nothing streamed can lie inside the match: a stop's start is always held back.
        self._text = self._text[: position + len(stop) if self._include else position]
        self.stopped = stop
        return stop

    def stream(self, final: bool = False) -> str:
        """The text not yet streamed that is safe to send now.

        Holds back the longest suffix that is a proper prefix of a stop string, unless
        `final` (the sequence ended for another reason) or a stop string matched.
        """
        end = len(self._text)
        if not final and self.stopped is None:
            end -= self._held_back()
        delta = self._text[self._streamed : end]
        self._streamed = max(self._streamed, end)
        return delta

    def _held_back(self) -> int:
        tail_start = self._streamed
        for length in range(min(self._max_len - 1, len(self._text) - tail_start), 0, -1):
            suffix = self._text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0


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
    Invariants: `stop` holds the sample's text, its only copy, made from the first `texted`
    output tokens (an ending token counts, adding no text); `sent_tokens` counts the
    output token ids handed out and `pending_logprobs` holds the entries not yet handed
    out, so each output carries exactly what was added since the previous one.
    """

    seq: Sequence
    row: SamplingRow
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    token_texts: TokenTexts
    pending_logprobs: list[TokenLogprobs] | None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    texted: int = 0

    def on_token(self, token_id: int, logprobs: TokenLogprobs | None) -> FinishReason | None:
        """Account for the token just appended to `seq` by what its id alone decides; return
        why the sample ends, or None. Call `on_text` for it next, before the next token.

        An ending token ends it (a stop token id becomes the `stop_reason`); a token that
        completes the sample's grammar (when it has one: its matcher consumes every other
        token) ends it with "stop"; the `max_tokens`-th output ends it with "length". These
        need no text, so the engine can free the sequence before it schedules the next step
        and leave the text to `on_text` while that step runs.
        """
        if self.pending_logprobs is not None and logprobs is not None:
            logprobs.token = self.token_texts.text(logprobs.token_id)
            logprobs.top_tokens = [self.token_texts.text(token) for token, _ in logprobs.top]
            self.pending_logprobs.append(logprobs)
        if token_id in self.row.stop_token_ids:
            if token_id in self.row.params.stop_token_ids:
                self.stop_reason = token_id
            self.texted = self.seq.num_output_tokens  # an ending token adds no text
            return "stop"
        if self.row.matcher is not None:
            self.row.matcher.consume_token(token_id)
            if self.row.matcher.is_stopped():
                return "stop"  # the grammar allows nothing more
        if self.seq.num_output_tokens >= self.seq.max_tokens:
            return "length"
        return None

    def on_text(self, ended: bool) -> bool:
        """Add the text of the tokens `on_token` took since the last call and watch it for
        stop strings; `ended` says whether `on_token` ended the sample. Return True when a
        stop string ends it (the text cut before the stop, or kept with
        `include_stop_str_in_output`; the string becomes the `stop_reason`): the sample
        then ends with "stop", whatever `on_token` said.
        """
        tokens = self.seq.output_token_ids[self.texted :]
        self.texted = self.seq.num_output_tokens
        if tokens:
            matched = self.stop.append(self.detokenizer.push(tokens))
            if matched is not None:
                self.stop_reason = matched
                return True
        if ended:
            # The detokenizer may hold back an incomplete character; the text ends here.
            matched = self.stop.append(self.detokenizer.flush())
            if matched is not None:
                self.stop_reason = matched
                return True
        return False

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

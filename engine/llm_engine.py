"""LLMEngine: requests in, one scheduled and executed batch per `step()`, outputs out."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from cache import BlockHashes, extend_block_hashes
from engine import sleep
from engine.adapters import ServedAdapter
from engine.config import EngineConfig
from engine.engine_builder import EngineBuilder
from engine.errors import AdapterError
from engine.outputs import RequestOutput
from engine.request.detokenizer import TokenTexts
from engine.request.intake import EngineRequest
from engine.request.state import RequestState, SampleState
from engine.sampling.sampler import SamplerOutput, prompt_logprobs
from engine.sleep import SleepReport
from engine.snapshot import EngineSnapshot, EngineStats, SequenceSnapshot
from engine.speculative.speculator import generator_states, rewind, sampling_rows
from scheduler import FinishReason, ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Launched:
    """A scheduled batch whose forward has started; `logits` are its output (on CUDA,
    still being computed)."""

    batch: SchedulerOutput
    logits: torch.Tensor


def _rows_of_unfinished(
    items: list[ScheduledSequence], num_rows: list[int], device: torch.device
) -> torch.Tensor:
    """The indices of the rows of the `items` whose sequence is unfinished, where item i
    has `num_rows[i]` consecutive rows, in the items' order."""
    rows: list[int] = []
    offset = 0
    for item, count in zip(items, num_rows, strict=True):
        if not item.seq.is_finished:
            rows += range(offset, offset + count)
        offset += count
    return torch.tensor(rows, dtype=torch.long, device=device)


# How long a step with nothing to run waits for a tier's load, rather than spin.
LOAD_WAIT_SECONDS = 0.02


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and every unfinished request.

    Invariant: `_requests` holds exactly the requests with an unfinished sample; a request
    leaves it in the step that finishes its last sample (or when aborted), and the
    scheduler has freed all its blocks by then. Requests come in through `processor`
    (validated and tokenized once); outputs go out as deltas. Not thread-safe: one thread
    drives it. Its parts (model, runner, scheduler, sampler, ...) are built by
    `engine.engine_builder.EngineBuilder`.
    """

    def __init__(self, config: EngineConfig) -> None:
        parts = EngineBuilder(config)
        self.config = config
        self.device, self.dtype = parts.device, parts.dtype
        self.quantization = parts.quantization
        self.model, self.tokenizer = parts.model, parts.tokenizer
        self.model_name, self.mapped_bytes = parts.model_name, parts.mapped_bytes
        self.eos_token_ids, self.vocab_size = parts.eos_token_ids, parts.vocab_size
        self.default_sampling = parts.default_sampling
        self.kv_layout, self.attention = parts.kv_layout, parts.attention
        self.recurrent, self.num_state_slots = parts.recurrent, parts.num_state_slots
        self.adapters = parts.adapters
        self.compiled, self.decode_graphs = parts.compiled, parts.decode_graphs
        self.max_model_len = parts.max_model_len
        self.block_size, self.num_kv_blocks = parts.block_size, parts.num_kv_blocks
        self.runner, self.events, self.tier = parts.runner, parts.events, parts.tier
        self.scheduler = parts.scheduler
        self.grammars, self.sampler = parts.grammars, parts.sampler
        self.speculator, self.processor = parts.speculator, parts.processor
        self.async_scheduling = parts.async_scheduling
        self._token_texts = TokenTexts(self.tokenizer)
        self._requests: dict[str, RequestState] = {}
        self._samples: dict[str, SampleState] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._launched: _Launched | None = None
        self.sleep_level = 0  # 0: awake; else the level of the last `sleep`

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, request: EngineRequest) -> None:
        """Schedule a request that `processor` (or a processor of this engine) made."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = self._adapter(request.lora_name)
        state = RequestState.create(
            request_id, request, self.eos_token_ids, self.tokenizer, self._token_texts,
            self.device, self.grammars, self._prompt_hashes(request, adapter), adapter,
        )  # fmt: skip
        self._requests[request_id] = state
        self._prompt_tokens_total += len(request.prompt_token_ids) * request.params.n
        for sample in state.samples:
            self._samples[sample.seq.seq_id] = sample
            self.scheduler.add(sample.seq)

    def remove_lora(self, name: str) -> None:
        """Stop serving the LoRA adapter `name` (AdapterError if it is not served); its
        slot is freed once no unfinished sequence uses it, now if none does."""
        if self.adapters is None or self.adapters.get(name) is None:
            raise AdapterError(f"no LoRA adapter named '{name}' is loaded")
        self.adapters.remove(name)
        self._free_adapter_slots()

    def _free_adapter_slots(self) -> None:
        if self.adapters is not None and self.adapters.removing:
            self.adapters.free_unused(sample.seq.lora_slot for sample in self._samples.values())

    def _adapter(self, name: str | None) -> ServedAdapter | None:
        """The LoRA adapter named `name` (None: the base model); ValueError if it is not
        served (it was unloaded after the request was routed to it)."""
        if name is None:
            return None
        adapter = None if self.adapters is None else self.adapters.get(name)
        if adapter is None:
            raise ValueError(f"no LoRA adapter named '{name}' is loaded")
        return adapter

    def _prompt_hashes(
        self, request: EngineRequest, adapter: ServedAdapter | None
    ) -> tuple[int, ...]:
        """The prompt's block hashes that its samples start from: those it came with (the
        base model's), and for n > 1 all of them, hashed once here rather than once per
        sample (onto an adapter's root for its requests)."""
        given = request.block_hashes if adapter is None else ()
        if request.params.n == 1 or not self.config.enable_prefix_caching:
            return given
        hashes = BlockHashes(None if adapter is None else adapter.root)
        hashes.extend(given)
        extend_block_hashes(hashes, request.prompt_token_ids, self.block_size)
        return tuple(hashes)

    def abort_request(self, request_id: str) -> None:
        """Finish every sample of the request with "abort" and free its blocks now."""
        self.scheduler.abort(request_id)
        state = self._requests.get(request_id)
        if state is not None:
            self._forget(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, apply stops; return the changed requests'
        outputs (each the deltas since that request's previous output).

        With async scheduling (`async_scheduling`), the next step's batch is scheduled and
        its forward launched as soon as this step's tokens are known and have been checked
        by their ids (`SampleState.on_token`: ending tokens, grammar, `max_tokens`), before
        their text (`SampleState.on_text`: detokenization, stop strings) and the outputs
        are made: on CUDA the forward runs while the host does that work, and while the
        caller handles the outputs. That step's tokens are sampled at the next call. A
        sequence that a stop string (or an abort between calls) finishes while its row is
        in flight has that row dropped unsampled; its output ends where the stop says.

        A failure in the model or sampler fails the requests of this batch (finish reason
        "error") and leaves the engine serving; their cached block hashes are dropped,
        since their K/V may not have been written.

        With a KV tier, each step first copies in the tier's finished loads (their
        sequences run from this step on), hands it the blocks registered up to the sampled
        batch (their K/V is written) and starts the loads the schedule asks for; a step
        with nothing to run waits briefly for a load rather than spin.
        """
        touched: dict[str, RequestState] = {}
        if self.tier is not None:
            self._finish_loads(0.0)
        launched = self._launched or self._launch(touched)
        self._launched = None
        if launched is not None:
            taken = self._sample(launched, touched)
            self._store_blocks()  # before a launch registers blocks whose KV is unwritten
            if self.async_scheduling:
                self._launched = self._launch(touched)
            self._add_texts(taken)
        elif self.tier is not None:
            self._store_blocks()
            self._finish_loads(LOAD_WAIT_SECONDS)  # nothing else to run: wait, not spin
        if self.events is not None:
            self._publish_events()
        outputs = []
        for state in touched.values():
            outputs.append(state.take_output())
            if state.finished:
                self._forget(state)
        self._free_adapter_slots()
        return outputs

    def _finish_loads(self, wait: float) -> None:
        """Copy the tier's finished loads in and let their sequences run."""
        assert self.tier is not None
        for load, num_blocks in self.tier.finish_loads(wait):
            self.scheduler.loaded(load, num_blocks)

    def _store_blocks(self) -> None:
        """Hand the tier the blocks registered since the last call: their KV is written
        (the steps that write it have run, and failed steps' registrations are gone)."""
        if self.tier is not None:
            registered = self.scheduler.block_manager.take_registered()
            if registered:
                self.tier.store(registered)

    def _publish_events(self) -> None:
        assert self.events is not None
        events = self.scheduler.block_manager.take_events()
        if events:
            self.events.publish(events)

    def close(self) -> None:
        """Finish the tier's queued writes and stop its threads and the event publisher."""
        if self.tier is not None:
            self.tier.close()
        if self.events is not None:
            self.events.close()

    # -- sleep ------------------------------------------------------------------------

    def sleep_unsupported(self) -> str | None:
        """Why this engine cannot sleep, or None if it can."""
        if self.device.type != "cpu":
            return f"sleep mode runs on the CPU; this engine runs on {self.device.type}"
        if not sleep.supported():
            return "sleep mode needs Linux (madvise and /proc/self)"
        return None

    def sleep(self, level: int) -> SleepReport:
        """Give memory back while idle (see engine/sleep.py): level 1 the KV cache's pages
        (and a hybrid model's recurrent state slots'), level 2 also the file-mapped
        weights' pages. The prefix cache is forgotten first (its KV and checkpoints are
        gone; a disk tier keeps its own). Call it with no unfinished request; nothing needs
        undoing to serve again (`wake_up`)."""
        assert not self.has_unfinished_requests() and self.sleep_unsupported() is None
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} is none of 1 and 2")
        started, before = time.monotonic(), sleep.resident_bytes()
        self.scheduler.reset_prefix_cache()
        if self.events is not None:
            self._publish_events()
        states = self.runner.eager.states
        for tensor in (*self.runner.kv_caches, *(() if states is None else states.tensors())):
            sleep.release_tensor(tensor)
        if level == 2:
            sleep.release_mappings(sleep.weight_mappings(self.model))
        self.sleep_level = level
        return SleepReport(level, before - sleep.resident_bytes(), time.monotonic() - started)

    def wake_up(self) -> None:
        """Serve again after `sleep`: released pages come back as steps touch them."""
        self.sleep_level = 0

    def _launch(self, touched: dict[str, RequestState]) -> _Launched | None:
        """Schedule a batch and start its forward (on CUDA it runs on while the host goes
        on); None when nothing is scheduled or the forward failed at once."""
        drafts = None
        if self.speculator is not None:
            running = self.scheduler.running()
            drafts = self.speculator.propose(
                (self._samples[seq.seq_id] for seq in running), len(running)
            )
        batch = self.scheduler.schedule(drafts)
        if batch.loads:
            assert self.tier is not None
            self.tier.start_loads(batch.loads)
        self.runner.update_block_tables(batch)
        for seq in batch.rejected:
            state = self._requests[seq.request_id]
            state.error = seq.error
            touched[state.request_id] = state
        if not batch.scheduled:
            return None
        if self.adapters is not None:
            scheduled = batch.scheduled
            self.adapters.set_step(
                np.repeat([item.seq.lora_slot for item in scheduled],
                          [item.num_new_tokens for item in scheduled])
            )  # fmt: skip
        try:
            return _Launched(batch, self.runner.execute(batch.scheduled))
        except Exception as exc:
            self._fail(batch, exc, touched)
            return None

    def _sample(
        self, launched: _Launched, touched: dict[str, RequestState]
    ) -> list[tuple[SampleState, FinishReason | None]]:
        """Sample the launched batch's rows of the sequences still unfinished, append their
        tokens and check them by id (`_apply_tokens`)."""
        batch, logits = launched.batch, launched.logits
        every = batch.sampling
        items = [item for item in every if not item.seq.is_finished]
        sampling = [self._samples[item.seq.seq_id] for item in items]
        num_sampled = batch.num_sampled_rows
        try:
            sampled_logits = logits[:num_sampled]
            if len(items) < len(every):
                num_rows = [item.num_sampled_rows for item in every]
                sampled_logits = logits[_rows_of_unfinished(every, num_rows, logits.device)]
            if self.speculator is None:
                rows, generators = [sample.row for sample in sampling], {}
            else:  # draft tokens add rows
                rows, generators = sampling_rows(items, sampling), generator_states(items, sampling)
            sampled = self.sampler.sample(sampled_logits, rows)
            if len(logits) > num_sampled:
                self._add_prompt_logprobs(batch, logits[num_sampled:])
        except Exception as exc:
            self._fail(batch, exc, touched)
            return []
        return self._apply_tokens(batch, items, sampling, sampled, generators, touched)

    def _fail(
        self, batch: SchedulerOutput, exc: Exception, touched: dict[str, RequestState]
    ) -> None:
        logger.exception("engine step failed; failing its %d sequences", len(batch.scheduled))
        self._fail_batch(batch, f"{type(exc).__name__}: {exc}", touched)

    def _add_prompt_logprobs(self, batch: SchedulerOutput, logits: torch.Tensor) -> None:
        """Give each chunk's prompt-logprob rows (`logits`, in batch order after the
        sampled rows) to its request: row j of a chunk starting at position s holds the
        logprob of prompt token s + j + 1. The request hands them out with its next output
        after they are whole (the final chunk samples, so that is no later than its first
        token's). Rows of sequences finished since the batch was scheduled are skipped."""
        every = [item for item in batch.scheduled if item.num_prompt_logprob_rows]
        items = [item for item in every if not item.seq.is_finished]
        if not items:
            return
        if len(items) < len(every):
            every_rows = [item.num_prompt_logprob_rows for item in every]
            logits = logits[_rows_of_unfinished(every, every_rows, logits.device)]
        targets, counts = [], []
        for item in items:
            start, num_rows = item.num_computed_tokens, item.num_prompt_logprob_rows
            targets += item.seq.prompt_token_ids[start + 1 : start + 1 + num_rows]
            count = self._requests[item.seq.request_id].request.params.prompt_logprobs
            counts += [count or 0] * num_rows
        entries = prompt_logprobs(logits, targets, counts)
        offset = 0
        for item in items:
            state = self._requests[item.seq.request_id]
            num_rows = item.num_prompt_logprob_rows
            first = item.num_computed_tokens + 1
            state.add_prompt_logprobs(first, entries[offset : offset + num_rows], self._token_texts)
            offset += num_rows

    def _apply_tokens(
        self,
        batch: SchedulerOutput,
        items: list[ScheduledSequence],
        sampling: list[SampleState],
        sampled: SamplerOutput,
        generators: dict[str, torch.Tensor],
        touched: dict[str, RequestState],
    ) -> list[tuple[SampleState, FinishReason | None]]:
        """Append each sampling sequence's token (`items`, the batch's unfinished ones) and,
        for a sequence with draft tokens, the tokens its verification keeps
        (`engine.speculative.speculator`). A sample that its token ids end is finished
        now. With draft tokens each kept token's text is checked before the next is kept, so
        nothing past a stop string is kept; the others' text is left to `_add_texts` (after
        the next launch, with async scheduling): they are returned with what their ids
        decided."""
        firsts, offset = [], 0
        for item in items:
            firsts.append(offset)
            offset += item.num_sampled_rows
        self.scheduler.update(batch, [sampled.token_ids[first] for first in firsts])
        taken = []
        for item, sample, first in zip(items, sampling, firsts, strict=True):
            tokens = sampled.token_ids[first : first + item.num_sampled_rows]
            draft = item.draft_token_ids
            reason = sample.on_token(tokens[0], sampled.logprobs[first])
            kept = 1
            if draft:
                while True:  # each kept token's text before the next token is kept
                    if sample.on_text(reason is not None):
                        reason = "stop"
                        break
                    if reason is not None or kept > len(draft):
                        break
                    if tokens[kept - 1] != draft[kept - 1]:
                        break
                    self.scheduler.accept_draft(sample.seq, tokens[kept])
                    reason = sample.on_token(tokens[kept], sampled.logprobs[first + kept])
                    kept += 1
                self._verified(sample, len(draft), kept, generators)
            else:
                taken.append((sample, reason))
            self._generation_tokens_total += kept
            if reason is not None:
                self.scheduler.finish(sample.seq, reason)
            request_id = sample.seq.request_id
            if request_id not in touched:
                touched[request_id] = self._requests[request_id]
        return taken

    def _add_texts(self, taken: list[tuple[SampleState, FinishReason | None]]) -> None:
        """Detokenize the samples' new tokens and watch them for stop strings
        (`SampleState.on_text`); a stop string ends its sample with "stop"."""
        for sample, reason in taken:
            if sample.on_text(reason is not None):
                seq = sample.seq
                if seq.is_finished:
                    seq.finish_reason = "stop"  # the stop string wins over "length"
                else:
                    self.scheduler.finish(seq, "stop")

    def _verified(
        self,
        sample: SampleState,
        num_drafted: int,
        num_kept: int,
        generators: dict[str, torch.Tensor],
    ) -> None:
        """After a verification that kept `num_kept` tokens (the drafts taken and the one
        sampled after them): rewind a seeded generator past the kept tokens' draws only."""
        assert self.speculator is not None
        seq_id = sample.seq.seq_id
        self.speculator.verified(seq_id, num_drafted, num_kept - 1)
        state = generators.get(seq_id)
        if state is not None and num_kept < num_drafted + 1:
            assert sample.row.generator is not None
            rewind(sample.row.generator, state, num_kept, self.vocab_size)

    def _fail_batch(
        self, batch: SchedulerOutput, error: str, touched: dict[str, RequestState]
    ) -> None:
        for item in batch.scheduled:
            state = self._requests.get(item.seq.request_id)
            if state is None:
                continue  # aborted or finished while the batch was in flight
            state.error = error
            for sample in state.samples:
                if not sample.seq.is_finished:
                    self.scheduler.finish(sample.seq, "error", error)
            touched[state.request_id] = state
        self.scheduler.reset_prefix_cache()

    def _forget(self, state: RequestState) -> None:
        del self._requests[state.request_id]
        for sample in state.samples:
            del self._samples[sample.seq.seq_id]
            if self.speculator is not None:
                self.speculator.forget(sample.seq.seq_id)

    def stats(self) -> EngineStats:
        cache = self.scheduler.cache_stats()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=cache.num_blocks,
            used_kv_blocks=cache.used_blocks,
            cached_free_kv_blocks=cache.cached_blocks,
            kv_usage=cache.usage,
            prefix_cache_queries=cache.prefix_queries,
            prefix_cache_hits=cache.prefix_hits,
            prefix_cache_evictions=cache.evictions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_preemptions=self.scheduler.num_preemptions,
            speculation=None if self.speculator is None else self.speculator.stats.copy(),
            external_prefix_cache_queries=self.scheduler.tier_queries,
            external_prefix_cache_hits=self.scheduler.tier_hits,
            tier=None if self.tier is None else self.tier.stats(),
            sleep_level=self.sleep_level,
        )

    def sequences_by_priority(self) -> dict[str, dict[int, int]]:
        """How many unfinished sequences are "running" and "waiting", by priority (those
        with none are left out). Another thread may call it: the scheduler's lists are
        copied whole, in one C call each, under the GIL. O(sequences), so it is not a part
        of `stats()`, which admission reads on every request."""
        return {
            "running": dict(Counter(seq.priority for seq in self.scheduler.running())),
            "waiting": dict(Counter(seq.priority for seq in self.scheduler.waiting())),
        }

    def snapshot(self) -> EngineSnapshot:
        """The block map, the unfinished sequences and `stats()` as of now; call it between
        steps, on the thread that drives the engine. O(num_kv_blocks + sequences)."""
        now = time.monotonic()
        sequences = self.scheduler.running() + self.scheduler.waiting()
        return EngineSnapshot(
            stats=self.stats(),
            scheduling_policy=self.scheduler.policy,
            block_map=self.scheduler.block_map(),
            sequences=tuple(SequenceSnapshot.of(seq, now) for seq in sequences),
        )

"""Continuous batching: each engine step, pick which sequences run and how many tokens each
gets; the waiting queue under each scheduling policy orders their admission."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from typing import Literal

from cache import AllocStatus, BlockManager, CacheStats, PrefixTier, cdiv, extend_block_hashes
from scheduler.sequence import (
    FinishReason,
    ScheduledSequence,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
    StateStep,
    TierLoad,
)

# vLLM's policies (`--scheduling-policy`): first come, first served; or by each request's
# `priority`, a lower value first, then by arrival.
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


def priority_rank(seq: Sequence) -> tuple[int, float]:
    """The priority policy's order: a lower `priority` value first, then earlier arrival."""
    return seq.priority, seq.arrival_time


class _Queue:
    """What both policies' queues share: `_seqs`, the waiting sequences in admission order
    (a deque or a sorted list), read from the front."""

    _seqs: deque[Sequence] | list[Sequence]

    def peek(self) -> Sequence:
        return self._seqs[0]

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def __len__(self) -> int:
        return len(self._seqs)

    def sequences(self) -> list[Sequence]:
        """The queue in admission order: a new list, copied in one C call, so another
        thread may take it while the engine's changes the queue."""
        return list(self._seqs)


class FcfsQueue(_Queue):
    """Arrival order, except that a preempted sequence goes back to the front, so it is the
    next admitted (preempted newest first, the preempted ones keep admission order)."""

    def __init__(self) -> None:
        self._seqs: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._seqs.append(seq)

    def requeue(self, seq: Sequence) -> None:
        self._seqs.appendleft(seq)

    def pop(self) -> Sequence:
        return self._seqs.popleft()


class PriorityQueue(_Queue):
    """Ordered by `priority_rank`, a preempted sequence back in its place like any other;
    equal ranks keep the order they were queued in.

    Invariant: `_seqs` is sorted by `priority_rank`. A sorted list rather than a heap, so
    the dashboard reads the admission order as it is and removal (abort) stays O(n).
    """

    def __init__(self) -> None:
        self._seqs: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        bisect.insort_right(self._seqs, seq, key=priority_rank)

    def requeue(self, seq: Sequence) -> None:
        self.add(seq)

    def pop(self) -> Sequence:
        return self._seqs.pop(0)


WaitingQueue = FcfsQueue | PriorityQueue


def waiting_queue(policy: SchedulingPolicy) -> WaitingQueue:
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    choices = ", ".join(SCHEDULING_POLICIES)
    raise ValueError(f"scheduling policy must be one of {choices}, got {policy!r}")


class Scheduler:
    """Continuous batching with chunked prefill and preemption by recompute, under a
    scheduling policy (vLLM's): `fcfs`, first come first served, or `priority`, a lower
    `Sequence.priority` value first, then earlier arrival.

    Invariants:
    - Every unfinished sequence is in exactly one of `_waiting` (in admission order, see
      `waiting_queue`) and `_running` (admission order); only running ones hold
      blocks.
    - `len(_running) <= max_num_seqs`.
    - A step's batch never exceeds `max_num_batched_tokens` tokens or `max_num_seqs`
      sequences, and a sequence preempted in a step is not scheduled in that step.
    - Running sequences are served in rank order (`_ranked_running`: admission order under
      fcfs, priority then arrival under priority) and preempted from its far end (the
      newest admitted; the highest priority value, latest arrival), so a victim is never
      one the step already scheduled. Under priority, a waiting sequence that cannot be
      admitted for want of blocks or of a sequence slot also preempts running ones of a
      higher priority value (`_preempt_for_waiting`); equal priorities never preempt each
      other for admission, so they share the cache first come, first served.

    - With a KV tier below the block manager (`tier`), a prefix lookup that stops in
      memory goes on in the tier: an admitted sequence whose next blocks the tier holds
      takes fresh blocks for them and waits, LOADING (in `_running`, skipped by steps),
      until the engine has copied them in and calls `loaded()`; meanwhile every other
      sequence runs. Its block table reaches the runner (`new_block_ids`) in the step that
      first schedules it, and only then does `freed` name it.

    - With recurrent state (a hybrid model: the block manager holds a `StatePool`), every
      scheduled chunk says where its state comes from and goes (`StateStep`): from
      nothing at position 0, from the checkpoint a prefix hit resumed at in the step that
      admitted it, else from its own slot; and which checkpoints it writes (see
      `_state_step`). A sequence waits while no state slot is free, as for blocks, and
      the checkpoints a step writes are found from the next `schedule()` on.

    Call order per step: `schedule()`, run the model on its output, `update()` with the
    sampled tokens, `accept_draft()` for each verified draft token (speculative decoding),
    then `finish()` the sequences that stopped. The block manager is the
    scheduler's alone: what the model runner needs of it (new block ids, freed sequences)
    travels in each `SchedulerOutput`. `add()` and `abort()` belong between `schedule()`
    calls; a sequence finished while its step runs is skipped by `update()`. Its blocks
    are freed at once, and with them cached block hashes whose K/V that step writes: a
    later step reads them only after it (the device runs steps in order); a step that
    fails is followed by `reset_prefix_cache()`.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        sliding_window: int = 0,
        policy: SchedulingPolicy = "fcfs",
        tier: PrefixTier | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be 0 or positive, got {sliding_window}")
        self.block_manager = block_manager
        # Every layer attends to the last `sliding_window` positions only (0: some layer
        # attends to all): blocks behind the window are released as sequences advance.
        self.sliding_window = sliding_window
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self._waiting = waiting_queue(policy)
        # A dict keeps admission order and gives O(1) removal on finish and abort.
        self._running: dict[str, Sequence] = {}
        self._unfinished: dict[str, Sequence] = {}
        self._requests: dict[str, list[Sequence]] = {}
        self._freed: list[str] = []
        self._num_preemptions = 0
        self.tier = tier
        # Admitted (LOADING) sequences whose block table no step has handed the runner yet.
        self._unseen: set[str] = set()
        self.tier_queries = 0  # prompt tokens of admissions that looked in the tier
        self.tier_hits = 0  # tokens loaded from it

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_preemptions(self) -> int:
        """Total preemptions since start (a sequence preempted twice counts twice)."""
        return self._num_preemptions

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence: behind everything that arrived before it (fcfs), or behind
        everything of its priority or a lower value (priority)."""
        if seq.seq_id in self._unfinished:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id!r} is not a fresh waiting sequence")
        if not seq.prompt_token_ids:
            raise ValueError(f"sequence {seq.seq_id!r} has an empty prompt")
        self._waiting.add(seq)
        self._unfinished[seq.seq_id] = seq
        self._requests.setdefault(seq.request_id, []).append(seq)

    def schedule(self, drafts: Mapping[str, SequenceOf[int]] | None = None) -> SchedulerOutput:
        """Decide this step's batch: running sequences first, then waiting ones in the
        policy's order.

        `drafts` maps running sequences' ids to proposed next tokens (speculative
        decoding). A decoding sequence gets as many of its drafts as the token budget and
        the free blocks allow, after its own token: a draft never preempts anything and
        leaves every running sequence a block to grow by, beyond the watermark.
        """
        output = SchedulerOutput()
        if self.block_manager.state_pool is not None:
            self.block_manager.state_pool.next_step()
        if self.policy == "priority":
            self._preempt_for_waiting(output)
        token_budget = self._schedule_running(output, drafts or {})
        # After a preemption the blocks left belong to the running sequences' growth: admitting
        # now would run the victim in the step it was preempted from, or hand them to a
        # newcomer that the next step would preempt again. (A sequence that preempted for
        # admission is admitted in the next step.)
        if not output.preempted:
            self._admit_waiting(output, token_budget)
        output.freed, self._freed = self._freed, []
        return output

    def update(self, output: SchedulerOutput, token_ids: SequenceOf[int]) -> None:
        """Apply a finished model step: advance computed counts and append the sampled
        tokens, `token_ids[i]` to the i-th unfinished sequence of `output.sampling`. The
        engine then checks their stop conditions and calls `finish()`. Sequences finished
        since `schedule()` (aborted, or stopped by their text while the step ran, with
        async scheduling) are skipped: their freed blocks may take the step's K/V writes,
        which come before any later step's in the device's order."""
        now = time.monotonic()
        sampled = iter(token_ids)
        for scheduled in output.scheduled:
            seq = scheduled.seq
            if seq.is_finished:
                continue
            if seq.num_computed_tokens != scheduled.num_computed_tokens:
                raise RuntimeError(f"{seq.seq_id!r} changed since schedule(): update() twice?")
            seq.num_computed_tokens += scheduled.num_sequence_tokens
            if scheduled.samples:
                seq.output_token_ids.append(next(sampled))
                if seq.first_token_time is None:
                    seq.first_token_time = now
        if next(sampled, None) is not None:
            raise ValueError("more sampled tokens than sampling sequences")

    def accept_draft(self, seq: Sequence, token_id: int) -> None:
        """Count the draft token that `seq`'s last token turned out to be as computed (the
        step that verified it wrote its K/V), then append `token_id`, sampled after it.

        Call it after `update()`, once per verified draft in order, and only while the
        sequence's last token equals the next draft of its step. Full blocks the verified
        tokens complete are registered in the prefix cache now: the K/V is written, and
        only verified tokens are ever hashed.
        """
        if (
            seq.status is not SequenceStatus.RUNNING
            or seq.num_computed_tokens != seq.num_tokens - 1
        ):
            raise ValueError(f"sequence {seq.seq_id!r} has no verified draft to accept")
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(token_id)
        block_size = self.block_manager.block_size
        if seq.num_computed_tokens % block_size == 0:
            self.block_manager.cache_full_blocks(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.block_hashes
            )

    def loaded(self, load: TierLoad, num_blocks: int) -> None:
        """The first `num_blocks` blocks of `load` hold their KV now (the rest are computed):
        count them as computed and cached, register them, and let the sequence run. A load
        whose sequence was preempted or finished since is ignored."""
        if not load.current:
            return
        seq = load.seq
        seq.status = SequenceStatus.RUNNING
        if num_blocks:
            num_tokens = num_blocks * self.block_manager.block_size
            seq.num_computed_tokens += num_tokens
            seq.num_cached_tokens += num_tokens
            self.tier_hits += num_tokens
            self.block_manager.cache_full_blocks(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.block_hashes
            )

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Finish `seq` in any state and free its blocks at once."""
        if self._unfinished.get(seq.seq_id) is not seq:
            raise ValueError(f"sequence {seq.seq_id!r} is not an unfinished sequence here")
        if seq.seq_id in self._running:
            del self._running[seq.seq_id]
            self._free_blocks(seq)
        else:
            self._waiting.remove(seq)
        del self._unfinished[seq.seq_id]
        siblings = self._requests[seq.request_id]
        siblings.remove(seq)
        if not siblings:
            del self._requests[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finished_time = time.monotonic()

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of the request with reason "abort" and return
        them; an unknown or already finished request returns []."""
        aborted = list(self._requests.get(request_id, ()))
        for seq in aborted:
            self.finish(seq, "abort")
        return aborted

    def cache_stats(self) -> CacheStats:
        return self.block_manager.stats()

    def block_map(self) -> str:
        """Every KV block's state (see `cache.BlockState`), one character each."""
        return self.block_manager.block_map()

    def running(self) -> list[Sequence]:
        """The running sequences in admission order (a new list)."""
        return list(self._running.values())

    def waiting(self) -> list[Sequence]:
        """The waiting sequences in the order they will be admitted (a new list)."""
        return self._waiting.sequences()

    def _ranked_running(self) -> list[Sequence]:
        """The running sequences, the one preempted last first: admission order (fcfs), or
        by priority then arrival, admission order among equals (priority)."""
        running = list(self._running.values())
        if self.policy == "priority":
            running.sort(key=priority_rank)
        return running

    def _lowest_running(self) -> Sequence:
        """The running sequence preempted first: the last of `_ranked_running()`."""
        if self.policy == "priority":
            # max() keeps the first of equals: reversed, that is the newest admitted.
            return max(reversed(self._running.values()), key=priority_rank)
        return next(reversed(self._running.values()))

    def reset_prefix_cache(self) -> None:
        """Forget every prefix-cache registration (after a step whose K/V may be unwritten)."""
        self.block_manager.reset_prefix_cache()

    def _free_blocks(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        if seq.seq_id in self._unseen:
            self._unseen.discard(seq.seq_id)  # the runner never saw its table
        else:
            self._freed.append(seq.seq_id)

    def _schedule_running(
        self, output: SchedulerOutput, drafts: Mapping[str, SequenceOf[int]]
    ) -> int:
        """Give running sequences their tokens (and drafts) in rank order; return the
        budget left.

        Preemption victims are taken from the far end of that order, i.e. never a sequence
        this loop already scheduled, so the batch stays valid.
        """
        token_budget = self.max_num_batched_tokens
        for seq in self._ranked_running():
            if token_budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older one
            if self.sliding_window:
                # The step's first query sits at num_computed_tokens and sees back to
                # num_computed_tokens - window + 1; what lies before is read no more.
                first_seen = seq.num_computed_tokens - self.sliding_window + 1
                self.block_manager.release_before(seq.seq_id, first_seen)
            num_new_tokens = min(seq.num_tokens - seq.num_computed_tokens, token_budget)
            num_slots = seq.num_computed_tokens + num_new_tokens
            new_blocks = self._grow_or_preempt(seq, num_slots, output)
            if new_blocks is None:
                break  # seq preempted itself, so every newer one is gone too
            if seq.seq_id in self._unseen:  # loaded from a tier: its first step
                self._unseen.discard(seq.seq_id)
                new_blocks = self.block_manager.block_table(seq.seq_id)
            draft: tuple[int, ...] = ()
            if num_new_tokens == 1 == seq.num_tokens - seq.num_computed_tokens:
                draft = self._fit_draft(seq, drafts.get(seq.seq_id, ()), token_budget - 1)
                if draft:
                    grown = self.block_manager.grow(seq.seq_id, num_slots + len(draft))
                    if grown is None:  # `_fit_draft` counted the free blocks
                        raise RuntimeError(f"no blocks for the draft of {seq.seq_id!r}")
                    new_blocks += grown
            self._add_to_batch(seq, num_new_tokens, output, new_blocks, draft)
            token_budget -= num_new_tokens + len(draft)
        return token_budget

    def _fit_draft(
        self, seq: Sequence, draft: SequenceOf[int], token_budget: int
    ) -> tuple[int, ...]:
        """The part of `draft` that the budget and the free blocks allow after `seq`'s own
        token (whose slot is already held): blocks beyond the watermark and one for each
        running sequence to grow by, so a draft never causes a preemption."""
        draft = tuple(draft[:token_budget])
        if not draft:
            return ()
        manager = self.block_manager
        held = manager.num_held_blocks(seq.seq_id)
        spare = manager.num_free_blocks - manager.watermark_blocks - len(self._running)
        room = (held + max(spare, 0)) * manager.block_size - seq.num_tokens
        return draft[: max(room, 0)]

    def _grow_or_preempt(
        self, seq: Sequence, num_slots: int, output: SchedulerOutput
    ) -> list[int] | None:
        """Make `seq`'s block table hold `num_slots` tokens, preempting the lowest ranked
        running sequences until it fits; return the blocks added, or None if `seq` itself
        had to be preempted."""
        while (new_blocks := self.block_manager.grow(seq.seq_id, num_slots)) is None:
            victim = self._lowest_running()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is seq:
                return None
        return new_blocks

    def _preempt(self, seq: Sequence) -> None:
        # Recompute rather than swap: free everything, keep the output, and queue again
        # (under fcfs at the front, see `FcfsQueue.requeue`).
        del self._running[seq.seq_id]
        self._free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.requeue(seq)

    def _preempt_for_waiting(self, output: SchedulerOutput) -> None:
        """Priority policy: while the queue's head cannot be admitted for want of KV blocks
        or of a sequence slot, preempt the lowest ranked running sequence if its priority
        value is higher than the head's. The head is admitted in a later step (this one
        admits nothing, having preempted), unless running sequences grew into the freed
        blocks first; then it preempts again."""
        manager = self.block_manager
        while self._waiting and self._running:
            head = self._waiting.peek()
            victim = self._lowest_running()
            if victim.priority <= head.priority:
                return
            if not self.enable_chunked_prefill and head.num_tokens > self.max_num_batched_tokens:
                return  # admission rejects it
            if len(self._running) < self.max_num_seqs:
                status = manager.can_allocate(
                    head.token_ids, head.block_hashes, reuse=not head.prompt_logprobs
                )
                if status is not AllocStatus.LATER:
                    return  # it fits, or it never will (admission rejects it)
            self._preempt(victim)
            output.preempted.append(victim)

    def _admit_waiting(self, output: SchedulerOutput, token_budget: int) -> None:
        """Admit waiting sequences in queue order while both budgets and the cache allow.

        A head that must wait (LATER, or its whole prompt does not fit this step without
        chunked prefill) stops admission, so later arrivals cannot overtake it forever; a
        head that can never run is rejected so it cannot block the queue.
        """
        manager = self.block_manager
        while self._waiting and token_budget > 0 and len(self._running) < self.max_num_seqs:
            seq = self._waiting.peek()
            if not self.enable_chunked_prefill:
                if seq.num_tokens > self.max_num_batched_tokens:
                    self._reject(seq, self._too_long_for_batch(seq), output)
                    continue
                # The whole rest must fit. Prefix hits are only known after allocate() (which
                # cannot be undone cleanly), so count the sequence in full.
                if seq.num_tokens > token_budget:
                    break
            token_ids = seq.token_ids
            reuse = not seq.prompt_logprobs
            status = manager.can_allocate(token_ids, seq.block_hashes, reuse=reuse)
            if status is AllocStatus.NEVER:
                self._reject(seq, self._too_big_for_cache(seq), output)
                continue
            if status is AllocStatus.LATER:
                break
            self._waiting.pop()
            num_cached_tokens = manager.allocate(seq.seq_id, token_ids, seq.block_hashes, reuse)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached_tokens
            seq.num_cached_tokens = num_cached_tokens
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self._running[seq.seq_id] = seq
            if reuse and self._load_from_tier(seq, output):
                continue
            num_new_tokens = min(seq.num_tokens - num_cached_tokens, token_budget)
            self._add_to_batch(
                seq, num_new_tokens, output, manager.block_table(seq.seq_id), admitted=True
            )
            token_budget -= num_new_tokens

    def _load_from_tier(self, seq: Sequence, output: SchedulerOutput) -> bool:
        """Whether the just admitted `seq` waits for blocks from the tier: those after its
        memory hits that the tier holds (never the block of the last token, which is
        computed for its logits). If so it is LOADING and `output.loads` says what to load."""
        if self.tier is None:
            return False
        self.tier_queries += seq.num_tokens
        size = self.block_manager.block_size
        first, end = seq.num_computed_tokens // size, (seq.num_tokens - 1) // size
        if first >= end:
            return False
        extend_block_hashes(seq.block_hashes, seq.token_ids, size, end)
        hashes = seq.block_hashes[first:end]
        found = self.tier.lookup(hashes)
        if not found:
            return False
        block_ids = self.block_manager.block_table(seq.seq_id)[first : first + found]
        output.loads.append(
            TierLoad(seq, first, tuple(block_ids), tuple(hashes[:found]), seq.num_preemptions)
        )
        seq.status = SequenceStatus.LOADING
        self._unseen.add(seq.seq_id)
        return True

    def _reject(self, seq: Sequence, error: str, output: SchedulerOutput) -> None:
        self.finish(seq, "error", error)
        output.rejected.append(seq)

    def _too_long_for_batch(self, seq: Sequence) -> str:
        return (
            f"sequence of {seq.num_tokens} tokens exceeds max_num_batched_tokens="
            f"{self.max_num_batched_tokens} and chunked prefill is disabled; set "
            "enable_chunked_prefill or raise max_num_batched_tokens"
        )

    def _too_big_for_cache(self, seq: Sequence) -> str:
        manager = self.block_manager
        return (
            f"sequence of {seq.num_tokens} tokens needs "
            f"{cdiv(seq.num_tokens, manager.block_size)} KV-cache blocks but only "
            f"{manager.num_blocks} blocks of {manager.block_size} tokens exist (less a "
            "watermark reserve); raise kv_cache_memory or memory_utilization, or lower "
            "max_model_len"
        )

    def _add_to_batch(
        self,
        seq: Sequence,
        num_new_tokens: int,
        output: SchedulerOutput,
        new_block_ids: list[int],
        draft: tuple[int, ...] = (),
        admitted: bool = False,
    ) -> None:
        """Schedule `num_new_tokens` of `seq` (and `draft`) in this step; `admitted`: in
        the step that admitted it."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        samples = end == seq.num_tokens
        # Register blocks this chunk fills now, not after the step, so a sibling (n > 1) or a
        # same-prefix request admitted later in this step already hits them: their K/V is
        # written by this step's forward before attention reads it, layer by layer.
        # Blocks filled earlier are registered already, so only a crossed boundary needs it.
        block_size = self.block_manager.block_size
        if end // block_size > start // block_size:
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, end, seq.block_hashes)
        state = self._state_step(seq, start, end, admitted)
        output.scheduled.append(
            ScheduledSequence(
                seq, num_new_tokens + len(draft), start, samples, new_block_ids, draft, state
            )
        )

    def _state_step(self, seq: Sequence, start: int, end: int, admitted: bool) -> StateStep | None:
        """Where a hybrid model's chunk of positions `[start, end)` reads and leaves its
        recurrent state (None without recurrent layers), with the checkpoints it writes: at
        the block boundaries, within the chunk, at or before the prompt's turn starts and
        its last token, and where the prefix cache's blocks ran out for it at admission
        (another prompt parted from it there, so the next one that shares the prefix
        resumes from it); while generating, at the end of each block, replacing the one
        before (the conversation's next turn, which holds this reply, resumes from the
        last)."""
        manager = self.block_manager
        if manager.state_pool is None:
            return None
        slot, resume = manager.state_slots(seq.seq_id)
        source = -1 if start == 0 else resume if admitted else slot
        size = manager.block_size
        if start >= seq.num_prompt_tokens:  # generating: a checkpoint at each block's end
            boundary = end // size * size
            checkpoint = None
            if start < boundary:
                checkpoint = manager.add_checkpoint(seq.seq_id, boundary, latest=True)
            return StateStep(slot, source, () if checkpoint is None else ((boundary, checkpoint),))
        wanted = {
            *seq.checkpoint_positions,
            # The last full block before the prompt's last token: a hit on this prompt
            # again, or on one that extends it, ends there (a hit leaves the last token).
            seq.num_prompt_tokens - 1,
            min(manager.checkpoint_hint(seq.seq_id), seq.num_prompt_tokens),
        }
        checkpoints = []
        for position in sorted({p // size * size for p in wanted}):
            if start < position <= end:
                checkpoint = manager.add_checkpoint(seq.seq_id, position)
                if checkpoint is not None:
                    checkpoints.append((position, checkpoint))
        return StateStep(slot, source, tuple(checkpoints))

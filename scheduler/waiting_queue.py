"""The waiting queue under each scheduling policy: the order sequences are admitted in."""

from __future__ import annotations

import bisect
from collections import deque
from typing import Literal

from scheduler.sequence import Sequence

# vLLM's policies (`--scheduling-policy`): first come, first served; or by each request's
# `priority`, a lower value first, then by arrival.
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


def priority_rank(seq: Sequence) -> tuple[int, float]:
    """The priority policy's order: a lower `priority` value first, then earlier arrival."""
    return seq.priority, seq.arrival_time


class FcfsQueue:
    """Arrival order, except that a preempted sequence goes back to the front, so it is the
    next admitted (preempted newest first, the preempted ones keep admission order)."""

    def __init__(self) -> None:
        self._seqs: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._seqs.append(seq)

    def requeue(self, seq: Sequence) -> None:
        self._seqs.appendleft(seq)

    def peek(self) -> Sequence:
        return self._seqs[0]

    def pop(self) -> Sequence:
        return self._seqs.popleft()

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def __len__(self) -> int:
        return len(self._seqs)

    def sequences(self) -> list[Sequence]:
        """The queue in admission order: a new list, copied in one C call, so another
        thread may take it while the engine's changes the queue."""
        return list(self._seqs)


class PriorityQueue:
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

    def peek(self) -> Sequence:
        return self._seqs[0]

    def pop(self) -> Sequence:
        return self._seqs.pop(0)

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def __len__(self) -> int:
        return len(self._seqs)

    def sequences(self) -> list[Sequence]:
        """The queue in admission order: a new list, copied in one C call, so another
        thread may take it while the engine's changes the queue."""
        return list(self._seqs)


WaitingQueue = FcfsQueue | PriorityQueue


def waiting_queue(policy: SchedulingPolicy) -> WaitingQueue:
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    choices = ", ".join(SCHEDULING_POLICIES)
    raise ValueError(f"scheduling policy must be one of {choices}, got {policy!r}")

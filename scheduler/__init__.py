"""Continuous-batching scheduler over request state and the KV block manager."""

from scheduler.scheduler import SCHEDULING_POLICIES, Scheduler, SchedulingPolicy
from scheduler.sequence import (
    ExpectedBlock,
    FinishReason,
    ScheduledSequence,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
    StateStep,
    TierLoad,
)

__all__ = [
    "SCHEDULING_POLICIES",
    "ExpectedBlock",
    "FinishReason",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "SchedulingPolicy",
    "Sequence",
    "SequenceStatus",
    "StateStep",
    "TierLoad",
]

"""Continuous-batching scheduler over request state and the KV block manager."""

from scheduler.scheduler import Scheduler
from scheduler.scheduler_output import ScheduledSequence, SchedulerOutput
from scheduler.sequence import FinishReason, Sequence, SequenceStatus

__all__ = [
    "FinishReason",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
]

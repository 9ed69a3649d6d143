"""Continuous-batching scheduler over request state and the KV block manager."""

from scheduler.scheduler import Scheduler
from scheduler.scheduler_output import ScheduledSequence, SchedulerOutput
from scheduler.sequence import FinishReason, Sequence, SequenceStatus
from scheduler.waiting_queue import SCHEDULING_POLICIES, SchedulingPolicy

__all__ = [
    "SCHEDULING_POLICIES",
    "FinishReason",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "SchedulingPolicy",
    "Sequence",
    "SequenceStatus",
]

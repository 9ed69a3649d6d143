"""Admission control: a bound on queued work, and per-request deadlines.

Work is counted in engine sequences, the scheduler's unit: a request with p prompts and
n samples is p·n sequences, each taking a running slot (`max_num_seqs`) and KV blocks
of its own. A sequence is *queued* while it is admitted but not running; a new
completion or chat request is refused with a 429 (and a Retry-After from the recent
drain rate) while `max_queued_requests` or more sequences are queued.

A deadline runs from a request's arrival: the server's `request_timeout`, shortened (never
lengthened) by the client's `X-Request-Timeout` header. When it passes, the request's
engine requests are aborted like a disconnected client's (see `server.generation`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from server.config import ServeConfig
from server.errors import OpenAIError, invalid_request

TIMEOUT_HEADER = "X-Request-Timeout"
# The default bound, in running slots' worth: a queued sequence waits for about this many
# sequences ahead of it per slot to finish, i.e. a few requests' durations.
DEFAULT_QUEUE_PER_SLOT = 4
# The drain rate is measured over the finishes of the last RATE_WINDOW seconds, and over
# no less than MIN_RATE_SPAN seconds so that two finishes a moment apart do not read as
# a torrent.
RATE_WINDOW = 60.0
MIN_RATE_SPAN = 1.0
# Retry-After without a finish to measure by (a server that just started, or requests
# slower than RATE_WINDOW), and its cap: a client told to wait longer still learns more
# by asking again than by waiting on a stale estimate.
FALLBACK_RETRY_AFTER = 5
MAX_RETRY_AFTER = 60


class Admission:
    """Counts the sequences of admitted requests and refuses new ones while too many wait.

    Invariants: `load` is the total size of the tickets not yet released, so it is never
    negative and is 0 once every admitted request has ended. `queued()` never counts more
    than truly wait (it is the larger of two lower bounds), so a refusal is never caused by
    a sequence that could run. A request is refused only while `queued() >=
    max_queued`, so the queue exceeds the bound by less than one request's size.
    """

    def __init__(
        self,
        max_queued: int,
        capacity: int,
        engine_waiting: Callable[[], int],
        on_reject: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`capacity`: the most sequences the engine runs at once; `engine_waiting`: the
        sequences its scheduler holds waiting now (preempted ones included)."""
        self.max_queued = max_queued
        self.capacity = capacity
        self.load = 0
        self._engine_waiting = engine_waiting
        self._on_reject = on_reject
        self._clock = clock
        self._finished: deque[tuple[float, int]] = deque()

    def queued(self) -> int:
        """Sequences admitted and not running. Beyond `capacity` the load must wait; below
        it the scheduler's count covers waiting for KV blocks (it lags the load by the
        requests not yet handed to the engine thread, hence the larger of the two)."""
        return max(self.load - self.capacity, self._engine_waiting())

    def admit(self, size: int) -> Ticket:
        """A ticket for a request of `size` sequences, or a 429 if the queue is full."""
        queued = self.queued()
        if queued >= self.max_queued:
            self._on_reject()
            retry_after = self.retry_after(queued)
            raise OpenAIError(
                429,
                f"the server is at capacity: {queued} sequences are queued (limit "
                f"{self.max_queued}); retry in {retry_after} s",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry_after)},
            )
        self.load += size
        return Ticket(self, size)

    def record_finished(self, size: int) -> None:
        """Note that `size` sequences ran to their end (aborted ones are not counted)."""
        now = self._clock()
        self._finished.append((now, size))
        self._forget_before(now - RATE_WINDOW)

    def drain_rate(self) -> float | None:
        """Sequences finished per second over the recent window; None with no finish."""
        now = self._clock()
        self._forget_before(now - RATE_WINDOW)
        if not self._finished:
            return None
        span = max(now - self._finished[0][0], MIN_RATE_SPAN)
        return sum(size for _, size in self._finished) / span

    def retry_after(self, queued: int) -> int:
        """Whole seconds, 1 to MAX_RETRY_AFTER, until the `queued` sequences have drained at
        the recent rate: by then there is room for a full queue of newcomers, so the
        refused clients need not all come back at the same moment."""
        rate = self.drain_rate()
        if rate is None:
            return FALLBACK_RETRY_AFTER
        return min(max(math.ceil(queued / rate), 1), MAX_RETRY_AFTER)

    def _forget_before(self, start: float) -> None:
        while self._finished and self._finished[0][0] < start:
            self._finished.popleft()


class Ticket:
    """An admitted request's share of the load, given back exactly once by `release`
    (later calls do nothing); as a context manager it is released on exit."""

    def __init__(self, admission: Admission, size: int) -> None:
        self._admission = admission
        self._size = size

    def release(self) -> None:
        self._admission.load -= self._size
        self._size = 0

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def max_queued(config: ServeConfig) -> int:
    """The `max_queued_requests` setting, or its default of DEFAULT_QUEUE_PER_SLOT times
    `max_num_seqs`."""
    if config.max_queued_requests is not None:
        return config.max_queued_requests
    return DEFAULT_QUEUE_PER_SLOT * config.max_num_seqs


@dataclass(frozen=True, slots=True)
class Deadline:
    """`timeout` seconds after a request's arrival, as `time.monotonic()` reads `at`."""

    timeout: float
    at: float

    def remaining(self) -> float:
        return self.at - time.monotonic()


def request_deadline(config: ServeConfig, request: Request) -> Deadline | None:
    """The deadline of a request arriving now: the shorter of `request_timeout` and the
    client's header; None when neither is set. A header that is not a positive number of
    seconds is a 400."""
    timeouts = [] if config.request_timeout is None else [config.request_timeout]
    header = request.headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            seconds = float(header)
        except ValueError:
            seconds = math.nan
        if not (0 < seconds < math.inf):
            raise invalid_request(
                f"{TIMEOUT_HEADER} must be a positive number of seconds, got {header!r}",
                TIMEOUT_HEADER,
            )
        timeouts.append(seconds)
    if not timeouts:
        return None
    timeout = min(timeouts)
    return Deadline(timeout, time.monotonic() + timeout)

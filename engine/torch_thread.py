"""The one thread of a process that runs the engines' torch work, its time shared fairly.

libgomp, the OpenMP runtime of torch's CPU builds, gives each thread that starts a
parallel region a pool of workers of its own, and while the pools' threads outnumber the
cores it stops spin-waiting between regions: each of a step's many small regions then
waits for its workers to wake up. A second engine thread that had stepped once, then sat
idle, made SmolLM2's decode steps 3.5x slower on a 2-core CPU (`docs/multi-model.md`).
So every engine of a process, generating or pooling, runs its work here.

An engine's thread hands over `turns` (a step, or a pooling batch, each at most one step's
token budget) and waits while they last; of the engines with a turn to take, the one that
has used the least time goes next, so two busy models share the thread's time evenly
whatever their steps cost. An engine that comes back from idle starts level with the
others (no credit for the time it did not use).

Loading a model is long (seconds to minutes) and would stall the models being served, so
it runs `apart`: on a thread of its own that ends with the load, and its workers with it.

Invariants: after start-up, torch runs only on the torch thread (a load's thread has
ended); a caller's turns run one at a time, in its order; turns asked for on the torch
thread run at once (nothing waits on itself).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_changed = threading.Condition()
# The callers with turns to take (a caller's thread waits meanwhile): its turn, its answer.
_ready: dict[threading.Thread, tuple[Callable[[], bool], Future[None]]] = {}
# Seconds of the torch thread's time each caller has used, counted from a common start.
_used: weakref.WeakKeyDictionary[threading.Thread, float] = weakref.WeakKeyDictionary()
_level = 0.0  # the least time used among the callers with turns, at the last pick
_thread: threading.Thread | None = None


def turns(turn: Callable[[], bool]) -> None:
    """Run `turn` on the torch thread again and again while it returns True, taking turns
    with the other callers; blocks until it returns False, or raises what it raised."""
    if threading.current_thread() is _thread:
        while turn():
            pass
        return
    caller = threading.current_thread()
    done: Future[None] = Future()
    with _changed:
        _start()
        _used[caller] = max(_used.get(caller, 0.0), _level)
        _ready[caller] = (turn, done)
        _changed.notify()
    done.result()


def call(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`function(*args, **kwargs)` run as one turn on the torch thread; blocks until it has
    run and returns its result or raises what it raised."""
    results: list[T] = []

    def once() -> bool:
        results.append(function(*args, **kwargs))
        return False

    turns(once)
    return results[0]


def apart(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`function(*args, **kwargs)` run on a new thread that ends when it returns (its
    OpenMP workers end with it); blocks until then."""
    results: list[T] = []
    failures: list[BaseException] = []

    def run() -> None:
        try:
            results.append(function(*args, **kwargs))
        except BaseException as exc:  # the caller's to handle, on its own thread
            failures.append(exc)

    thread = threading.Thread(target=run, name="pagedserve-load")
    thread.start()
    thread.join()
    if failures:
        raise failures[0]
    return results[0]


def _start() -> None:
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_serve, name="pagedserve-torch", daemon=True)
        _thread.start()


def _serve() -> None:
    while True:
        _take_turn()


def _take_turn() -> None:
    """One turn of the caller that has used the least time (waiting for one); what it
    holds is let go on return (an unloaded engine must not outlive its last turn)."""
    global _level
    with _changed:
        while not _ready:
            _changed.wait()
        caller = min(_ready, key=_used.__getitem__)
        turn, done = _ready[caller]
        _level = _used[caller]
    started = time.perf_counter()
    try:
        again = turn()
    except BaseException as exc:
        again = exc
    with _changed:
        _used[caller] += time.perf_counter() - started
        if again is True:
            return
        del _ready[caller]
    if isinstance(again, BaseException):
        done.set_exception(again)
    else:
        done.set_result(None)

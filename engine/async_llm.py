"""AsyncLLM: the engine behind the server, stepped from a background thread.

Four threads share the work of a request. The event loop's coroutines only await: the
intake thread renders, tokenizes and validates prompts with a tokenizer of its own, at a
lowered CPU priority; the engine thread owns the engine, and runs its work in turns on
the process's one torch thread (`torch_thread`: each turn applies the queued commands and
takes one step). A 100k-character prompt takes the intake about 0.1 s of CPU, and streams
keep flowing meanwhile. The event loop never touches engine state: `generate` posts
commands on a queue that each turn drains before its step, and the turn posts each
request's outputs back to that request's asyncio queue; a `snapshot` is a command too,
answered between two steps. While no request is unfinished the engine thread sleeps on
the command queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Concatenate, Generic, ParamSpec, TypeVar

from engine import torch_thread
from engine.config import EngineConfig
from engine.errors import AdapterError, EngineError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request.intake import (
    EngineRequest,
    RenderedPrompt,
    RequestProcessor,
    SpecialTokens,
)
from engine.sampling.params import SamplingParams
from engine.sleep import SleepReport
from engine.snapshot import EngineSnapshot, EngineStats

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")


# The intake thread's nice value. A busy intake at normal priority slows the engine beyond
# its share of the CPU (each OpenMP region of a step waits for the worker it took the core
# from); at the lowest it waits for idle CPU, which a busy engine rarely leaves. 10 keeps
# the engine's steps near their length and the intake's time under a second
# (`python -m bench.intake`; docs/benchmarks.md has the figures).
INTAKE_NICE = 10


def _yield_the_cpu() -> None:
    """Lower the calling thread's scheduling priority to INTAKE_NICE (Linux: per thread)."""
    with contextlib.suppress(AttributeError, OSError):  # no per-thread priorities here
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), INTAKE_NICE)


@dataclass(slots=True)
class _Add:
    request_id: str
    request: EngineRequest


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Snapshot:
    reply: Future[EngineSnapshot]


@dataclass(slots=True)
class _Sleep:
    level: int
    reply: Future[SleepReport]


@dataclass(slots=True)
class _Wake:
    reply: Future[None]


@dataclass(slots=True)
class _Adapter:
    """Serve `adapter` (what `Adapters.read` returned), or with None stop serving `name`."""

    adapter: object | None
    name: str
    reply: Future[None]


class _Stop:
    pass


_Command = _Add | _Abort | _Snapshot | _Sleep | _Wake | _Adapter | _Stop
_Replied = _Snapshot | _Sleep | _Wake | _Adapter


class _OnIntake(Generic[P, T]):
    """A `RequestProcessor` method as a coroutine method of `AsyncLLM` that runs it on the
    intake thread, on the intake's own processor: the same arguments and the same result."""

    def __init__(self, method: Callable[Concatenate[RequestProcessor, P], T]) -> None:
        self.method = method
        self.__doc__ = method.__doc__

    def __get__(self, llm: AsyncLLM | None, owner: type) -> Callable[P, Awaitable[T]]:
        if llm is None:
            return self  # type: ignore[return-value]  # the class's attribute: this
        method = self.method

        async def on_intake(*args: P.args, **kwargs: P.kwargs) -> T:
            return await llm._on_intake(partial(method, llm._processor, *args, **kwargs))

        return on_intake


class AsyncLLM:
    """Serves many concurrent `generate` calls from one `LLMEngine`.

    Invariants: every request id in `_streams` has been or will be added to the engine, and
    its stream is removed when its consumer stops, which aborts it if it is unfinished.
    Every stream and every `_Snapshot` command gets its answer: registered or queued before
    the engine loop ends, it is answered or failed; after, `_answering` is False and none
    is registered or queued. So a request never waits on a dead engine.
    """

    engine: LLMEngine  # set by the engine thread before it reports the engine loaded
    sleep_unsupported: str | None  # why the engine cannot sleep; set with `engine`

    def __init__(self, config: EngineConfig) -> None:
        """Start the engine thread, let it load the model, and return once it is serving.

        Raises what loading raised. The model loads `torch_thread.apart`, and every later
        torch operation of the engine runs on the torch thread (see there why); the
        intake thread runs no torch (an adapter is read apart).
        """
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._arrived = threading.Event()  # set by each command posted (`_post`)
        self._stopped = False  # told to stop: the engine takes no more turns
        # Sleeps asked for while requests ran: applied once the engine is idle.
        self._pending_sleeps: list[_Sleep] = []
        self._sleep_idle_seconds = config.sleep_idle_seconds
        self._last_active = time.monotonic()
        self._answering = True
        self._answering_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._failure: BaseException | None = None
        # The engine loop's end: what killed it, or None once it was stopped.
        self._ended: Future[BaseException | None] = Future()
        loaded: queue.SimpleQueue[LLMEngine | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(config, loaded), name="pagedserve-engine", daemon=True
        )
        self._thread.start()
        engine = loaded.get()
        if isinstance(engine, BaseException):
            self._thread.join()
            raise engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.num_kv_blocks = engine.num_kv_blocks
        self.block_size = engine.block_size
        self.dtype = engine.dtype
        self.device = engine.device
        self.chat_template: str | None = engine.tokenizer.chat_template
        # Sampling defaults for the fields a request leaves out (engine/sampling/params.py).
        self.default_sampling = engine.default_sampling
        # The engine thread decodes with the engine's tokenizer; the intake gets its own.
        self._processor = RequestProcessor(
            copy.deepcopy(engine.tokenizer),
            engine.vocab_size,
            engine.max_model_len,
            engine.grammars,
            engine.processor.limits,
            engine.processor.scheduling_policy,
            engine.processor.turn_checkpoints,
        )
        # The ids grammars match only as tokens (Qwen's <tool_call> and <think> among them).
        self.special_tokens = SpecialTokens.of(engine.tokenizer, engine.vocab_size)
        self._intake = ThreadPoolExecutor(
            1, thread_name_prefix="pagedserve-intake", initializer=_yield_the_cpu
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        """Load the model and start serving (blocking: call it off the event loop)."""
        return cls(config)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self._failure is None

    async def wait_ended(self) -> BaseException | None:
        """Wait for the engine loop to end: the exception that killed it, or None when it
        was shut down. Cancelling the wait leaves the engine alone."""
        return await asyncio.shield(asyncio.wrap_future(self._ended))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def sequences_by_priority(self) -> dict[str, dict[int, int]]:
        """`LLMEngine.sequences_by_priority`, read from this thread."""
        return self.engine.sequences_by_priority()

    async def snapshot(self) -> EngineSnapshot:
        """The engine's state between two steps (`LLMEngine.snapshot`), taken on the engine
        thread before its next step, or at once when it is idle; the event loop waits.

        Consistent because the one thread that changes the engine takes it, and it costs
        that thread O(num_kv_blocks). Raises EngineError once the engine loop has ended.
        """
        reply: Future[EngineSnapshot] = Future()
        self._post_with_reply(_Snapshot(reply))
        return await asyncio.wrap_future(reply)

    # The intake's calls: each is the `RequestProcessor` method of the same arguments and
    # result, run on the intake thread with the intake's own processor (ValueError for what
    # it refuses; a `ChatTemplateError` when the chat template refuses a conversation).
    process = _OnIntake(RequestProcessor.from_prompt)
    process_chat = _OnIntake(RequestProcessor.from_chat)
    render_chat = _OnIntake(RequestProcessor.render_chat)
    encode = _OnIntake(RequestProcessor.encode)
    decode = _OnIntake(RequestProcessor.decode)
    token_strs = _OnIntake(RequestProcessor.token_strs)

    async def process_rendered(
        self, rendered: RenderedPrompt, params: SamplingParams
    ) -> EngineRequest:
        """Validate a prompt rendered ahead (`RenderedPrompt`) on the intake thread, without
        rendering, tokenizing or hashing it again (its hashes are kept when they were made
        at the engine's block size); ValueError if invalid."""
        return await self._on_intake(
            self._processor.from_rendered, rendered, params, self.engine.block_size
        )

    async def generate(
        self, request: EngineRequest, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they grow, each with the deltas since the one
        before; the last has `finished` set.

        Raises EngineError if the engine failed the request. Leaving the loop early aborts
        the request.
        """
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # Under the lock, so that a loop ending meanwhile either sees this stream (and
        # fails it) or has already refused it: a stream never waits on a dead engine.
        with self._answering_lock:
            if not self._answering or not self.is_healthy:
                raise EngineError("the engine is not running")
            self._streams[request_id] = (asyncio.get_running_loop(), outputs)
            self._post(_Add(request_id, request))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise EngineError(f"the engine failed: {item}") from item
                if item.error is not None:
                    raise EngineError(item.error)
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(_Abort(request_id))

    @property
    def sleep_level(self) -> int:
        """0 while awake, else the level the engine sleeps at (read from any thread)."""
        return self.engine.sleep_level

    async def sleep(self, level: int) -> SleepReport:
        """Sleep at `level` (engine/sleep.py) once the requests in flight have finished;
        a request that arrives later wakes the engine. Check `sleep_unsupported` first."""
        reply: Future[SleepReport] = Future()
        self._post_with_reply(_Sleep(level, reply))
        return await asyncio.wrap_future(reply)

    async def wake_up(self) -> None:
        """Wake the engine if it sleeps."""
        reply: Future[None] = Future()
        self._post_with_reply(_Wake(reply))
        await asyncio.wrap_future(reply)

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the LoRA adapter in folder `path` as `name` (read on the intake thread,
        put in its slot between steps); AdapterError naming what is wrong with it."""
        adapters = self.engine.adapters
        if adapters is None:
            raise AdapterError(f"adapter '{name}': this engine serves no LoRA adapters")
        adapter = await self._on_intake(torch_thread.apart, adapters.read, name, path)
        reply: Future[None] = Future()
        self._post_with_reply(_Adapter(adapter, name, reply))
        await asyncio.wrap_future(reply)

    async def unload_lora(self, name: str) -> None:
        """Stop serving the adapter `name`: requests naming it are refused from now on; its
        requests in flight finish with it. AdapterError if it is not served."""
        reply: Future[None] = Future()
        self._post_with_reply(_Adapter(None, name, reply))
        await asyncio.wrap_future(reply)

    def _post_with_reply(self, command: _Replied) -> None:
        """Queue a command whose reply the loop answers, or fail it if the loop has ended."""
        with self._answering_lock:
            if not self._answering:
                raise EngineError("the engine is not running")
            self._post(command)

    async def shutdown(self) -> None:
        self._post(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._intake.shutdown(wait=False, cancel_futures=True)

    async def _on_intake(self, function: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._intake, function, *args)

    def _post(self, command: _Command) -> None:
        self._commands.put(command)
        self._arrived.set()

    def _run(self, config: EngineConfig, loaded: queue.SimpleQueue) -> None:
        try:
            self.engine = torch_thread.apart(LLMEngine, config)
        except BaseException as exc:
            loaded.put(exc)
            return
        self.sleep_unsupported = self.engine.sleep_unsupported()
        loaded.put(self.engine)
        try:
            while self._await_work():
                torch_thread.turns(self._turn)
        except BaseException as exc:
            logger.exception(
                "the engine loop died; failing the %d requests in flight, and every later "
                "one, with an error",
                len(self._streams),
            )
            self._failure = exc
        finally:
            torch_thread.call(self.engine.close)
            self._stop_answering()
            # No stream is registered from now on; fail those left (all of them when the
            # loop died, those a shutdown cut short when it was stopped).
            failure = self._failure or EngineError("the engine has shut down")
            for request_id in list(self._streams):
                self._deliver(request_id, failure)
            self._ended.set_result(self._failure)

    def _await_work(self) -> bool:
        """Wait until the engine has turns to take: at once while it has work or sleeps
        pending, else until a command is posted (queuing a level-2 sleep once
        `sleep_idle_seconds` have passed since the last activity); False once told to
        stop. Runs on this engine's thread, between its turns: it touches no tensor."""
        if self._stopped:
            return False
        idle = not (self.engine.has_unfinished_requests() or self._pending_sleeps)
        if idle and not self._arrived.wait(self._idle_timeout()):  # the idle time is up
            self._pending_sleeps.append(_Sleep(2, Future()))
        self._arrived.clear()  # the turn takes every command posted before this
        return True

    def _turn(self) -> bool:
        """The engine's turn on the torch thread: the queued commands applied, then one
        step, or, while idle, the pending sleeps; True while it has work."""
        if not self._apply_commands():
            self._stopped = True
            return False
        if not self.engine.has_unfinished_requests():
            if self._pending_sleeps:
                self._sleep_now()
            return False
        self._last_active = time.monotonic()
        for output in self.engine.step():
            self._deliver(output.request_id, output)
        return True

    def _apply_commands(self) -> bool:
        """Apply the queued commands; False once told to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            elif isinstance(command, _Snapshot):
                self._answer(command.reply)
            elif isinstance(command, _Sleep):
                self._pending_sleeps.append(command)
            elif isinstance(command, _Wake):
                self._wake()
                if command.reply.set_running_or_notify_cancel():
                    command.reply.set_result(None)
            elif isinstance(command, _Adapter):
                self._change_adapter(command)
            elif command.request_id in self._streams:
                self._wake()
                try:
                    self.engine.add_request(command.request_id, command.request)
                except ValueError as exc:  # its adapter was unloaded since it was routed
                    self._deliver(command.request_id, exc)

    def _change_adapter(self, command: _Adapter) -> None:
        if not command.reply.set_running_or_notify_cancel():
            return
        adapters = self.engine.adapters
        try:
            if command.adapter is None:
                self.engine.remove_lora(command.name)
            else:
                assert adapters is not None, "an adapter was read by this engine's adapters"
                adapters.add(command.adapter)
        except AdapterError as exc:
            command.reply.set_exception(exc)
        else:
            command.reply.set_result(None)

    def _wake(self) -> None:
        """Wake the engine (if it sleeps) and restart the idle clock."""
        self.engine.wake_up()
        self._last_active = time.monotonic()

    def _idle_timeout(self) -> float | None:
        """How long a wait for a command may last before the engine sleeps; None: no limit
        (no idle sleep, or asleep already)."""
        if not self._sleep_idle_seconds or self.engine.sleep_level or self.sleep_unsupported:
            return None
        return max(0.0, self._last_active + self._sleep_idle_seconds - time.monotonic())

    def _sleep_now(self) -> None:
        """Apply the pending sleeps (the engine is idle): the deepest level asked for."""
        pending, self._pending_sleeps = self._pending_sleeps, []
        replies = [item.reply for item in pending if item.reply.set_running_or_notify_cancel()]
        try:
            report = self.engine.sleep(max(item.level for item in pending))
        except Exception as exc:
            logger.exception("the engine could not sleep")
            for reply in replies:
                reply.set_exception(exc)
            return
        logger.info(
            "asleep at level %d: %.0f MiB given back in %.3f s",
            report.level, report.released_bytes / 2**20, report.seconds,
        )  # fmt: skip
        for reply in replies:
            reply.set_result(report)

    def _answer(self, reply: Future[EngineSnapshot]) -> None:
        # A caller that went away has cancelled its reply. A snapshot is only a view: its
        # failure fails its caller, not the engine loop.
        if not reply.set_running_or_notify_cancel():
            return
        try:
            snapshot = self.engine.snapshot()
        except Exception as exc:
            reply.set_exception(exc)
        else:
            reply.set_result(snapshot)

    def _stop_answering(self) -> None:
        """Refuse commands that await a reply from now on, and fail those still queued or
        pending (the loop has ended)."""
        with self._answering_lock:
            self._answering = False
        waiting: list[_Replied] = list(self._pending_sleeps)
        self._pending_sleeps = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Replied):
                waiting.append(command)
        for command in waiting:
            if command.reply.set_running_or_notify_cancel():
                command.reply.set_exception(EngineError("the engine is not running"))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            # A loop closed in the meantime has no consumer left; its abort is queued.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outputs.put_nowait, item)

"""AsyncLLM: the engine behind the server, stepping in a background thread.

The event loop never touches engine state directly: `generate` and `abort` post
commands on a queue that the engine thread drains before each step, and the thread
posts each request's outputs back to that request's asyncio queue. While no request is
unfinished the thread sleeps on the command queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import RequestOutput
from engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed a request (a bug or a device error, not the user's input)."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncLLM:
    """Serves many concurrent `generate` calls from one `LLMEngine`.

    Invariant: every request id in `_streams` has been or will be added to the engine, and
    its stream is removed when its consumer stops, which aborts it if it is unfinished.
    """

    engine: LLMEngine  # set by the engine thread before it reports the engine loaded

    def __init__(self, config: EngineConfig) -> None:
        """Start the engine thread, let it load the model, and return once it is serving.

        Raises what loading raised. Every torch operation of the engine, loading included,
        runs on that one thread: libgomp gives each thread that starts a parallel region
        its own pool of workers, and once the pools' threads outnumber the cores it stops
        spin-waiting between regions, so each of a step's many small regions waits for
        its workers to wake up (a 2-core decode step took 1.3-1.6x as long).
        """
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._failure: BaseException | None = None
        loaded: queue.SimpleQueue[LLMEngine | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(config, loaded), name="pagedserve-engine", daemon=True
        )
        self._thread.start()
        engine = loaded.get()
        if isinstance(engine, BaseException):
            self._thread.join()
            raise engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.num_kv_blocks = engine.num_kv_blocks
        self.block_size = engine.block_size
        self.dtype = engine.dtype
        self.device = engine.device

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        """Load the model and start serving (blocking: call it off the event loop)."""
        return cls(config)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self._failure is None

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenize(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they grow; the last has `finished` set.

        Raises ValueError for invalid input before anything is queued, and EngineError if the
        engine failed the request. Leaving the loop early aborts the request.
        """
        if not self.is_healthy:
            raise EngineError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt)
        self.engine.validate(token_ids, params)
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(_Add(request_id, text, token_ids, params))
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
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def shutdown(self) -> None:
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    def _run(self, config: EngineConfig, loaded: queue.SimpleQueue) -> None:
        try:
            self.engine = LLMEngine(config)
        except BaseException as exc:
            loaded.put(exc)
            return
        loaded.put(self.engine)
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._apply_commands(block=idle):
                    return
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._deliver(output.request_id, output)
        except BaseException as exc:
            logger.exception("the engine loop died")
            self._failure = exc
            for request_id in list(self._streams):
                self._deliver(request_id, exc)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once told to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            elif command.request_id in self._streams:
                self.engine.add_request(
                    command.request_id, command.prompt_token_ids, command.params, command.prompt
                )

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            # A loop closed in the meantime has no consumer left; its abort is queued.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outputs.put_nowait, item)

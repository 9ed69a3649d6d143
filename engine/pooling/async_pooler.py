"""The engine of a pooling model: texts from many requests batched together.

Each text is a job; each of the engine's turns on the torch thread takes every waiting
job up to the token budget (`max_num_batched_tokens`, at least one window), runs them in
one packed forward and answers each; the engine's own thread waits for jobs. A text's
result does not depend on its batch (`model.py`).

Invariants: every job put before the loop ends gets its answer or an exception (after,
`run` raises at once); the loop outlives a failing batch (its jobs get the error); the
model loads `torch_thread.apart`, and each batch's forward runs on the torch thread, in
turns with the other models' steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from engine import capabilities, torch_thread
from engine.config import ConfigError, EngineConfig
from engine.errors import EngineError, ModelLoadError
from engine.model.loader import resolve_model_folder, resolve_model_source
from engine.pooling.model import PoolingModel, Text
from engine.pooling.spec import PoolingSpec, pooling_spec
from engine.snapshot import EngineStats

logger = logging.getLogger(__name__)
_STOP = None


@dataclass(eq=False)
class _Job:
    text: Text
    result: Future[torch.Tensor] = field(default_factory=Future)


def pooling_model(config: EngineConfig) -> PoolingSpec | None:
    """The pooling spec of the configured model (a GGUF's from its metadata folder), or None
    for a model to generate with."""
    folder = Path(resolve_model_folder(config.model)[0])
    pooler = config.pooler_config
    spec = pooling_spec(folder, config.hf_overrides, pooler) if folder.is_dir() else None
    if spec is None and pooler is not None:
        raise ConfigError(
            f"pooler_config: {config.model} is not a model that can embed (a local transformers "
            "or sentence-transformers folder, or a GGUF file)"
        )
    if spec is None and config.hf_overrides:
        raise ConfigError(
            "hf_overrides: read for pooling models only (a decoder reranker); "
            f"{config.model} is a model to generate with"
        )
    return spec


class InputTooLong(ValueError):
    """An input longer than the model's window, with no truncation asked for."""


class AsyncPooler:
    """Serves the `run` calls of many requests from one `PoolingModel`: each text's embedding,
    or its logits for a cross-encoder."""

    sleep_level = 0
    sleep_unsupported = (
        "a pooling model does not sleep (it holds no KV cache): unload it instead "
        "(POST /models/unload)"
    )

    def __init__(self, config: EngineConfig, spec: PoolingSpec) -> None:
        """Load the model (`torch_thread.apart`) and return once it serves; raises what
        loading raised."""
        if config.device == "cuda" or config.dtype == "float16" or config.quantization == "int4":
            raise ConfigError(
                "a pooling model runs on the CPU in fp32 or bf16, unquantized, int8 or in a "
                "GGUF's own types: device, dtype and quantization must be auto (or cpu, "
                "float32 or bfloat16, none, int8 or gguf)"
            )
        if config.enable_lora or config.lora_modules:
            raise ConfigError("enable_lora, lora_modules: LoRA adapters apply to generating models")
        self.spec = spec
        source, self.model_name = resolve_model_source(config.model)
        folder = Path(resolve_model_folder(config.model)[0])
        gguf = Path(source) if source.endswith(".gguf") else None
        self.dtype = capabilities.pooling_dtype(config.dtype)
        self.device = torch.device("cpu")
        mode = capabilities.quantization_mode(config, self.device, self.dtype, every_row_count=True)
        self.quantization = None if mode == "none" else mode
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._ended: Future[BaseException | None] = Future()
        self._failure: BaseException | None = None
        self._open, self._open_lock = True, threading.Lock()  # whether jobs may be put
        self._counts = {"running": 0, "prompt_tokens": 0}
        # Jobs taken from the queue, not yet in a batch (the engine's turns' alone).
        self._pending: deque[_Job] = deque()
        self._stopped = False  # a _STOP was taken: no more batches
        self._forward: Callable[[list[Text]], list[torch.Tensor]]  # set once loaded
        loaded: queue.SimpleQueue[PoolingModel | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(folder, gguf, loaded), name="pagedserve-pooler", daemon=True
        )
        self._thread.start()
        model = loaded.get()
        if isinstance(model, BaseException):
            self._thread.join()
            raise model
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        except BaseException:
            self._jobs.put(_STOP)
            self._thread.join()
            raise
        window = model.max_length
        if config.max_model_len is not None and config.max_model_len > window:
            # A server's shared setting (several models) may pass a pooling model's window.
            logger.warning(
                "max_model_len %d is beyond %s's window of %d tokens: it takes %d",
                config.max_model_len, self.model_name, window, window,
            )  # fmt: skip
        self.max_model_len = min(config.max_model_len or window, window)
        self._budget = max(config.max_num_batched_tokens, self.max_model_len)
        self.embedding_size = model.embedding_size
        self.vocab_size = model.config.vocab_size
        self.num_labels = 0
        if spec.task == "classify":
            self.num_labels = 1 if spec.causal else getattr(model.config, "num_labels", 0)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self._failure is None

    async def wait_ended(self) -> BaseException | None:
        """Wait for the engine loop to end: what killed it, or None once shut down."""
        return await asyncio.shield(asyncio.wrap_future(self._ended))

    async def run(self, texts: list[Text]) -> list[torch.Tensor]:
        """Each text's embedding (`embed` models) or logits (`classify` models). Cancelling
        the call takes its texts that have not started out of the queue."""
        jobs = [_Job(text) for text in texts]
        with self._open_lock:
            if not self._open:
                raise EngineError("the engine has shut down")
            for job in jobs:
                self._jobs.put(job)
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(job.result) for job in jobs)))
        finally:
            for job in jobs:
                job.result.cancel()  # its texts not started leave the queue (a no-op once run)

    def encode(
        self, inputs: list[str] | list[list[int]] | list[tuple[str, str]], truncate: int | None
    ) -> list[Text]:
        """The texts (or text pairs, or token ids as given) as the model's inputs, within its
        window: cut to `truncate` tokens (-1: the window; text keeps its special tokens, ids
        their first ones), else an input past the window raises InputTooLong. Blocking."""
        window = self.max_model_len
        if truncate is not None and truncate > window:
            raise InputTooLong(
                f"truncate_prompt_tokens {truncate} exceeds the model's window of {window} tokens"
            )
        limit = window if truncate in (None, -1) else truncate
        texts = []
        for index, item in enumerate(inputs):
            if isinstance(item, list):
                if not all(0 <= token < self.vocab_size for token in item):
                    raise ValueError(
                        f"input {index} holds a token id outside 0..{self.vocab_size - 1}"
                    )
                text = Text(item[:limit] if truncate is not None else item)
            else:
                pair = (item,) if isinstance(item, str) else item
                encoded = self.tokenizer(
                    *pair, truncation="longest_first" if truncate is not None else False,
                    max_length=limit if truncate is not None else None,
                )  # fmt: skip
                types = encoded.get("token_type_ids") if len(pair) == 2 else None
                text = Text(encoded["input_ids"], types)
            if len(text.token_ids) > window:
                raise InputTooLong(
                    f"input {index} is {len(text.token_ids)} tokens, more than the model's "
                    f"window of {window}; set truncate_prompt_tokens to cut it"
                )
            texts.append(text)
        return texts

    def stats(self) -> EngineStats:
        waiting = self._jobs.qsize() + len(self._pending)
        return EngineStats(
            num_running=self._counts["running"], num_waiting=waiting, num_kv_blocks=0,
            used_kv_blocks=0, cached_free_kv_blocks=0, kv_usage=0.0, prefix_cache_queries=0,
            prefix_cache_hits=0, prefix_cache_evictions=0,
            prompt_tokens_total=self._counts["prompt_tokens"], generation_tokens_total=0,
            num_preemptions=0,
        )  # fmt: skip

    def sequences_by_priority(self) -> dict[str, dict[int, int]]:
        """Texts "running" and "waiting", all of priority 0 (pooling has no priorities)."""
        stats = self.stats()
        counts = {"running": stats.num_running, "waiting": stats.num_waiting}
        return {status: {0: count} if count else {} for status, count in counts.items()}

    async def wake_up(self) -> None:
        """Nothing to wake: a pooling model never sleeps."""

    async def shutdown(self) -> None:
        self._jobs.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    def _run(self, folder: Path, gguf: Path | None, loaded: queue.SimpleQueue) -> None:
        try:
            model = torch_thread.apart(
                PoolingModel, folder, self.spec, self.dtype, self.quantization, gguf
            )
        except BaseException as exc:
            loaded.put(
                exc
                if isinstance(exc, (ModelLoadError, ConfigError))
                else ModelLoadError(f"{gguf or folder}: {exc}")
            )
            return
        loaded.put(model)
        self._forward = model.classify if self.spec.task == "classify" else model.embed
        try:
            while self._take(block=True):
                torch_thread.turns(self._turn)
        except BaseException as exc:
            logger.exception("the pooling loop died")
            self._failure = exc
        finally:
            failure = self._failure or EngineError("the engine has shut down")
            with self._open_lock:
                self._open = False
            for left in [*self._pending, *_drain(self._jobs)]:
                if left is not None and not left.result.done():
                    left.result.set_exception(failure)
            self._ended.set_result(self._failure)

    def _take(self, block: bool) -> bool:
        """Move the queued jobs to `_pending`, waiting for one if `block` and none is
        pending; False once stopped (the jobs left are failed as the loop ends)."""
        if self._stopped:
            return False
        waiting = _drain(self._jobs)
        if block and not waiting and not self._pending:
            waiting = [self._jobs.get(), *_drain(self._jobs)]
        self._stopped = self._stopped or any(job is _STOP for job in waiting)
        self._pending.extend(job for job in waiting if job is not _STOP)
        return not self._stopped

    def _turn(self) -> bool:
        """A batch on the torch thread: the pending jobs up to the token budget, in arrival
        order (those cancelled dropped); True while more are pending."""
        if not self._take(block=False):
            return False
        batch: list[_Job] = []
        tokens = 0
        pending = self._pending
        while pending and (not batch or tokens + len(pending[0].text.token_ids) <= self._budget):
            job = pending.popleft()
            if job.result.set_running_or_notify_cancel():  # False: its request was cancelled
                tokens += len(job.text.token_ids)
                batch.append(job)
        if batch:
            self._pool(batch, tokens)
        return bool(pending)

    def _pool(self, batch: list[_Job], tokens: int) -> None:
        """Answer each job of `batch` with its result, or all with the batch's error."""
        self._counts["running"] = len(batch)
        started = time.monotonic()
        try:
            results = self._forward([job.text for job in batch])
        except Exception as exc:  # a bad batch fails its jobs, not the engine
            logger.exception("a pooling batch of %d texts failed", len(batch))
            for job in batch:
                job.result.set_exception(exc)
        else:
            for job, result in zip(batch, results, strict=True):
                job.result.set_result(result)
        self._counts["running"] = 0
        self._counts["prompt_tokens"] += tokens
        logger.debug("pooled %d texts in %.1f ms", len(batch), 1e3 * (time.monotonic() - started))


def _drain(jobs: queue.SimpleQueue[_Job | None]) -> list[_Job | None]:
    out = []
    while True:
        try:
            out.append(jobs.get_nowait())
        except queue.Empty:
            return out

"""The engine a model setting gets: a pooling model's `AsyncPooler` (an encoder to embed
or score with, engine/pooling/spec.py says which folders hold one), else an `AsyncLLM`."""

from __future__ import annotations

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.heap import keep_freed_memory, trim_heap
from engine.pooling.async_pooler import AsyncPooler, pooling_model


def start_engine(config: EngineConfig) -> AsyncLLM | AsyncPooler:
    """Load the configured model and start serving it (blocking: call it off the loop); the
    process's heap keeps the memory its steps free (`heap.py`), and what loading freed is
    handed back."""
    keep_freed_memory()
    spec = pooling_model(config)
    engine = AsyncLLM.from_config(config) if spec is None else AsyncPooler(config, spec)
    trim_heap()
    return engine

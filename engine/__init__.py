"""pagedserve's engine: model loading, paged model runner, sampler and the engines.

The offline API mirrors vLLM's: `from engine import LLM, SamplingParams`. The names are
imported on first use, so `import engine.config` stays light (no torch, no transformers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
    from engine.sampling.params import SamplingParams

_EXPORTS = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "TokenLogprobs": "engine.outputs",
    "SamplingParams": "engine.sampling.params",
}
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "TokenLogprobs"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

"""The engine's errors, importable without torch: the server tells them apart.

`SETTINGS_ERRORS` are the failures to build an engine that the settings caused (a bad
value, a model that cannot be found or paged, a KV cache that does not fit); anything
else that escapes a load is a bug or an environment fault and is logged with its traceback.
"""

from __future__ import annotations

from cache import InsufficientKVCacheError
from engine.config import ConfigError


class EngineError(RuntimeError):
    """The engine failed a request (a bug or a device error, not the user's input)."""


class ModelLoadError(RuntimeError):
    """The model setting could not be resolved; the message says what to do."""


class UnsupportedModelError(ValueError):
    """The model cannot run on paged attention; the message says why."""


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served; the message names the adapter and the reason."""


SETTINGS_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    ModelLoadError,
    UnsupportedModelError,
    InsufficientKVCacheError,
    AdapterError,
)

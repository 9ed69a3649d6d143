"""The settings every test that runs the default model shares."""

from __future__ import annotations

from typing import Any

# The shipped defaults, except that the KV cache does not claim 90% of the test machine's
# RAM. One setting for every engine and server of the default model, because the compiled
# forward's key holds the KV cache's shape: the first one compiles, the others load.
DEFAULT_MODEL_SETTINGS: dict[str, Any] = {"kv_cache_memory": "512MiB"}

"""Settings of the KV-cache events for external routers, with vLLM's keys and meanings."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class KVEventsConfig(BaseModel):
    """vLLM's `--kv-events-config`: publish every block a cache tier stores or removes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, gt=0)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, gt=0)
    topic: str = ""

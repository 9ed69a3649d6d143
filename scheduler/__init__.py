"""Continuous-batching scheduler over request state and the KV block manager."""

"""KV-cache events for external routers over ZMQ, in vLLM's wire format (an optional component)."""

"""KV-cache block manager: block pool, free queue, prefix cache, profiling."""

"""pagedserve HTTP server: OpenAI-compatible API over the async engine."""

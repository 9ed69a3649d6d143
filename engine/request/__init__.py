"""A request's life in the engine: intake (validation, tokenization), stops and text."""

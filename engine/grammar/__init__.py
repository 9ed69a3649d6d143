"""Structured outputs through llguidance (an optional room: the core reaches it only
through `engine.capabilities`)."""

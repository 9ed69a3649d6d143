"""Structured outputs through llguidance (an optional component: the core reaches it only
through `engine.capabilities`)."""

"""A prompt rendered ahead of the server, handed to a request in its ASGI scope's state.

The scale-out ingress renders, tokenizes and hashes each prompt with the replica's own
tokenizer to route it; the replica's app then takes that `RenderedPrompt` from the scope
(`scale_out.forwarding.ForwardedRequest.scope`) instead of doing the work again. Only
code in the same process can put it there: no HTTP request can set a scope's state.
"""

from __future__ import annotations

from fastapi import Request

from engine.request.intake import RenderedPrompt

# The scope-state key the forwarded prompt is stored under.
RENDERED_PROMPT = "pagedserve.rendered_prompt"


def rendered_prompt(request: Request) -> RenderedPrompt | None:
    """The prompt rendered ahead for `request`, if one came with it."""
    prompt = request.scope.get("state", {}).get(RENDERED_PROMPT)
    return prompt if isinstance(prompt, RenderedPrompt) else None

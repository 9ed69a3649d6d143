"""A request's prompt rendered, tokenized and hashed at the ingress, for the router and
the replica.

The ingress renders and tokenizes the prompt exactly as a replica would (the same
tokenizer, `RequestProcessor.render_chat` / `encode`, and the server's own
`render` of a conversation for chats), then hashes its full blocks with the cache's own chained
hash (`cache.block.extend_block_hashes`). So block i of a request here is block i of
that request in any replica's prefix cache, and two requests share their first k hashes
exactly when a replica could serve the second one's first k blocks from the first's. The
replica takes the token ids and hashes as they are (`server.generation`).
"""

from __future__ import annotations

from collections.abc import Callable

from cache.block import extend_block_hashes
from engine.request.intake import RenderedPrompt, RequestProcessor
from server.chat_protocol import ChatCompletionRequest
from server.conversation import ToolCalling, ToolRequest, render
from server.openai.protocol import CompletionRequest

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


class PromptHasher:
    """Maps a request body to its prompt, rendered and hashed. Not thread-safe (it owns the
    processor's tokenizer): the ingress calls it from one worker thread. `tool_calling`
    gives the tools component's `ToolCalling`, called only for a chat that offers tools or holds
    earlier calls; where it gives None (the component cannot be imported) such a chat has no
    prompt here, and the replica refuses it."""

    def __init__(
        self,
        processor: RequestProcessor,
        tool_calling: Callable[[], ToolCalling | None],
        block_size: int,
    ) -> None:
        self.processor = processor
        self.tool_calling = tool_calling
        self.block_size = block_size

    def render(self, path: str, body: bytes) -> RenderedPrompt | None:
        """The prompt that `body` runs at `path`, rendered and hashed (for a completion of
        several prompts, the first one's). None for other paths and for a body the server
        will refuse (the replica then reports why)."""
        token_ids = self._token_ids(path, body)
        if not token_ids:
            return None
        hashes: list[int] = []
        extend_block_hashes(hashes, token_ids, self.block_size)
        return RenderedPrompt(tuple(token_ids), tuple(hashes), self.block_size)

    def _token_ids(self, path: str, body: bytes) -> list[int] | None:
        try:
            if path == COMPLETIONS:
                prompt = CompletionRequest.model_validate_json(body).prompt[0]
                return self.processor.encode(prompt) if isinstance(prompt, str) else prompt
            if path == CHAT_COMPLETIONS:
                chat = ChatCompletionRequest.model_validate_json(body)
                rendered = render(
                    chat.messages,
                    ToolRequest.of(chat),
                    chat.chat_template_kwargs,
                    self.tool_calling,
                )
                return self.processor.render_chat(
                    rendered.messages,
                    tools=rendered.template_tools,
                    template_kwargs=rendered.variables,
                )
        except ValueError:  # pydantic's ValidationError, or the chat template's refusal
            return None
        return None

"""The steps every generating endpoint shares: its prologue and its epilogue.

Chat completions, completions, Anthropic's messages and the Responses API differ in their
request and reply shapes only. Each begins with `Handling.begin` (the engine, or a 503;
the model, or a 404; the request's deadline), checks the tools' count, builds a
chat-shaped prompt from its `Conversation` (server/conversation.py) with `chat_prompt`
(the grammar of tool calls or structured outputs held to the answer after any reasoning,
the prompt rendered by the chat template or forwarded by the scale-out ingress), and
ends with `stream` or `run` (admission, then a stream or the whole reply, aborted when
the client goes away).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request, Response
from pydantic import BaseModel

from engine.request.intake import ChatTemplateError
from server.admission import Deadline, request_deadline
from server.disconnect import cancel_on_disconnect
from server.errors import invalid_request
from server.errors import request_id as http_request_id
from server.reasoning import ReasoningSyntax, answer_only
from server.rendered_prompt import rendered_prompt
from server.state import ServerState, server_state
from server.streaming import SSEResponse

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.request.intake import EngineRequest
    from engine.sampling.params import SamplingParams
    from server.conversation import Conversation

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Handling:
    """One request being handled: the server's state, its ready engine, its deadline."""

    request: Request
    state: ServerState
    llm: AsyncLLM
    deadline: Deadline | None

    @classmethod
    def begin(cls, request: Request, model: str) -> Handling:
        """A 503 while the engine is not ready, a 404 for another model's name."""
        state = server_state(request)
        llm = state.ready_llm()
        state.check_model(model)
        return cls(request, state, llm, request_deadline(state.config, request))

    def check_tool_count(self, count: int) -> None:
        """A 400 naming `tools` past the server's `max_tools`."""
        limit = self.state.config.max_tools
        if count > limit:
            raise invalid_request(
                f"tools must hold at most {limit} functions (the server's max_tools "
                f"setting), got {count}",
                "tools",
            )

    async def chat_prompt(
        self,
        params: SamplingParams,
        conversation: Conversation,
        reasoning: ReasoningSyntax | None,
        aliases: dict[str, str],
        messages_param: str = "messages",
    ) -> EngineRequest:
        """The engine request of a chat-shaped prompt, under the grammar of its structured
        output or its tools' calls (unless the request constrains the reply itself: `auto`
        tools cannot come with a format), which holds the answer only, after the reasoning
        (`auto` leaves all before a call free). Raises ValueError (for `user_errors`;
        grammar errors then name `tools` through `aliases`) or a 400 naming
        `messages_param` when the chat template refuses the conversation."""
        spec = answer_only(params.structured_outputs, reasoning)
        tools = conversation.tools
        if tools is not None and spec is None:
            aliases["structured_outputs"] = "tools"  # errors of the grammar name `tools`
            spec = tools.structured_outputs()
            if tools.forced:
                spec = answer_only(spec, reasoning)
        params = dataclasses.replace(params, structured_outputs=spec)
        rendered = rendered_prompt(self.request)
        if rendered is not None:
            return await self.llm.process_rendered(rendered, params)
        try:
            return await self.llm.process_chat(
                conversation.messages, params, conversation.template_tools, conversation.variables
            )
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), messages_param) from exc

    def stream(self, samples: int, events: Callable[[str], AsyncGenerator[str, None]]) -> Response:
        """The reply as server-sent events from `events(request id)`, once admitted."""
        ticket = self.state.admission.admit(samples)
        return SSEResponse(events(http_request_id(self.request)), on_close=ticket.release)

    async def run(self, samples: int, generation: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """The whole of `generation()`, once admitted; the client's leaving aborts it."""
        with self.state.admission.admit(samples):
            return await cancel_on_disconnect(self.request, generation())


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")

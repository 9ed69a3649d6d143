"""POST /tokenize and POST /detokenize, in vLLM's shapes.

Both use the engine's own tokenizer on its intake thread, and /tokenize renders messages
with the same conversion and chat template as /v1/chat/completions, so the ids it returns
are the ids a request would be charged for. Nothing is checked against `max_model_len`:
the response carries it, for the client to compare.
"""

from __future__ import annotations

from fastapi import Request, Response

from engine.request.intake import ChatTemplateError
from server.auth import keyed_router
from server.conversation import render
from server.errors import invalid_request, user_errors
from server.generation import Handling
from server.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from server.openapi import INVALID, MODEL, documented
from server.state import server_state

router = keyed_router()


@router.post(
    "/tokenize", response_model=None, responses=documented(TokenizeResponse, *INVALID, *MODEL)
)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    handling = await _begin(request, body.model)
    llm = handling.llm
    if body.messages is not None:
        add_generation_prompt = body.add_generation_prompt is not False
        with user_errors({"messages"}):
            rendered = render(
                body.messages, None, body.chat_template_kwargs, handling.model.tool_calling
            )
        try:
            tokens = await llm.render_chat(
                rendered.messages, add_generation_prompt, template_kwargs=rendered.variables
            )
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), "messages") from exc
    else:
        assert body.prompt is not None, "TokenizeRequest holds a prompt or messages"
        tokens = await llm.encode(body.prompt, body.add_special_tokens is not False)
    token_strs = await llm.token_strs(tokens) if body.return_token_strs else None
    response = TokenizeResponse(
        count=len(tokens), max_model_len=llm.max_model_len, tokens=tokens, token_strs=token_strs
    )
    return Response(response.model_dump_json(exclude_none=True), media_type="application/json")


@router.post(
    "/detokenize", response_model=None, responses=documented(DetokenizeResponse, *INVALID, *MODEL)
)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    handling = await _begin(request, body.model)
    with user_errors({"tokens"}):
        text = await handling.llm.decode(body.tokens)
    return Response(
        DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json"
    )


async def _begin(request: Request, model: str | None) -> Handling:
    """`Handling.begin` for `model`, by default the server's first model."""
    return await Handling.begin(request, model or server_state(request).models.first.name)

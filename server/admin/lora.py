"""vLLM's runtime LoRA endpoints: `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (`{"lora_name", "lora_path"}`), served when
`allow_runtime_lora_updating` is on. An adapter loads onto the server's first model, or
the one a `model` field names; a request then selects it by naming it as its `model`.

A load answers once the adapter serves (a 400 naming what is wrong with a bad one, as at
start-up); an unload once no new request can select it (its requests in flight finish
with it). Adapters loaded at run time stay with their model when it unloads and loads
again (`keep_alive`), not across restarts.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from engine.errors import AdapterError
from server.auth import keyed_router
from server.errors import OpenAIError
from server.openapi import INVALID, documented
from server.protocol import RequestBody
from server.state import ServerState, server_state

router = keyed_router()
# A load's or an unload's answer: one line of text, as vLLM's.
_ANSWERS = documented(None, *INVALID, 404, 503, media_type="text/plain")


class LoadLoRARequest(RequestBody):
    """POST /v1/load_lora_adapter (vLLM's); `model`: the base model, default the first."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    model: str | None = None


class UnloadLoRARequest(RequestBody):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_path: str | None = None


def _state(request: Request) -> ServerState:
    state = server_state(request)
    if not state.config.allow_runtime_lora_updating:
        raise OpenAIError(
            400,
            "loading and unloading LoRA adapters at run time is off: start the server with "
            "allow_runtime_lora_updating",
        )
    return state


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ANSWERS)
async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> PlainTextResponse:
    models = _state(request).models
    model = models.find(body.model or models.first.name)
    taken = models.resolve(body.lora_name)
    if taken is not None:
        raise OpenAIError(
            400, f"the name '{body.lora_name}' is taken by a model or an adapter", param="lora_name"
        )
    try:
        await models.add_adapter(model, body.lora_name, body.lora_path)
    except AdapterError as exc:
        raise OpenAIError(400, str(exc), param="lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ANSWERS)
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> PlainTextResponse:
    models = _state(request).models
    found = models.resolve(body.lora_name)
    if found is None or found[1] is None:
        raise OpenAIError(
            404, f"no LoRA adapter named '{body.lora_name}' is loaded", param="lora_name",
            code="lora_not_found",
        )  # fmt: skip
    await models.remove_adapter(found[0], body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

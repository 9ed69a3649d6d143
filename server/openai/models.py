"""The model endpoints: GET /v1/models (every configured model with its state, and its
LoRA adapters with their `parent`), and llama-server's POST /models/load and POST
/models/unload (`{"model": NAME}`)."""

from __future__ import annotations

from fastapi import Request

from engine.pooling.async_pooler import AsyncPooler
from server.auth import keyed_router
from server.openai.protocol import ModelAction, ModelCard, ModelList
from server.openapi import INVALID, documented
from server.protocol import ResponseModel
from server.served_model import ServedModel
from server.state import server_state

router = keyed_router()


class ModelLoaded(ResponseModel):
    model: str
    state: str
    load_seconds: float


class ModelUnloaded(ResponseModel):
    model: str
    state: str
    unload_seconds: float


@router.get("/v1/models", responses=documented(ModelList, 503))
async def list_models(request: Request) -> ModelList:
    """A single model's server: its model once loaded (a 503 before); a server of several
    models: each of them, loaded or not."""
    state = server_state(request)
    models = state.models
    if models.single and models.first.llm is None and models.first.state != "unloaded":
        models.first.ready_llm()  # raises the 503 of a model still loading or failed
    cards = []
    for model in models.models.values():
        cards.append(_card(model, state.started_at, model.name, model.root))
        for name, path in model.adapters.items():
            cards.append(_card(model, state.started_at, name, path, parent=model.name))
    return ModelList(data=cards)


def _card(
    model: ServedModel, created: int, name: str, root: str, parent: str | None = None
) -> ModelCard:
    """The card of `model` (or of its LoRA adapter `name`, whose `root` is its folder)."""
    llm = model.llm
    return ModelCard(
        id=name,
        created=created,
        root=root,
        state=model.state,
        parent=parent,
        max_model_len=None if llm is None else llm.max_model_len,
        default_sampling_params=None
        if llm is None or isinstance(llm, AsyncPooler)
        else llm.default_sampling,
    )


@router.post("/models/load", responses=documented(ModelLoaded, *INVALID, 404, 503))
async def load(body: ModelAction, request: Request) -> ModelLoaded:
    """Load the model (a no-op if it is loaded); answers once it is, with the seconds its
    load took."""
    models = server_state(request).models
    model = models.find(body.model)
    await models.load(model)
    return ModelLoaded(
        model=model.name, state=model.state, load_seconds=round(model.load_seconds, 3)
    )


@router.post("/models/unload", responses=documented(ModelUnloaded, *INVALID, 404, 503))
async def unload(body: ModelAction, request: Request) -> ModelUnloaded:
    """Unload the model once its requests in flight have finished; its memory goes back to
    the machine. A request for it afterwards loads it again (under `autoload`)."""
    models = server_state(request).models
    model = models.find(body.model)
    seconds = await models.unload(model)
    return ModelUnloaded(model=model.name, state=model.state, unload_seconds=round(seconds, 3))

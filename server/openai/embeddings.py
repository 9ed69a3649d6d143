"""The pooling endpoints: OpenAI's POST /v1/embeddings, vLLM's POST /score, and POST
/rerank and /v1/rerank (Jina/Cohere's shape, as vLLM serves it).

An embedding model embeds; /score and /rerank rank by the cosine of embeddings. A
cross-encoder (a sequence classifier of one label) scores each (query, document) pair with
its head, the sigmoid of its logit, as sentence-transformers' CrossEncoder does (the logit
itself with vLLM's `use_activation: false`). A model
that generates text serves none of these (a 400 naming the model), as a pooling model
serves no generation endpoint (`Handling.begin`).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import torch
import torch.nn.functional as F
from fastapi import Request, Response

from engine.pooling.async_pooler import AsyncPooler, InputTooLong
from engine.pooling.model import Text
from server.admission import Deadline, request_deadline
from server.auth import keyed_router
from server.disconnect import cancel_on_disconnect
from server.errors import deadline_exceeded, invalid_request
from server.generation import json_response
from server.openai.pooling_protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    Score,
    ScoreRequest,
    ScoreResponse,
)
from server.openapi import ADMITTED, INVALID, MODEL, documented
from server.state import server_state

router = keyed_router()
# The errors of every pooling endpoint.
_ERRORS = (*INVALID, *MODEL, *ADMITTED)


async def _pooler(request: Request, model: str | None) -> tuple[str, AsyncPooler, Deadline | None]:
    """The named (or first) model's pooling engine, held until the response is sent."""
    state = server_state(request)
    deadline = request_deadline(state.config, request)
    served, adapter = await state.models.lease(
        request, model or state.models.first.name, None, deadline
    )
    pooler = served.pooler(request.url.path)
    if adapter is not None:
        raise invalid_request("LoRA adapters apply to generation, not to pooling", "model")
    return served.name, pooler, deadline


async def _run(
    request: Request, pooler: AsyncPooler, deadline: Deadline | None, texts: list[Text]
) -> list[torch.Tensor]:
    """The texts' results, within the request's deadline and its admission; the deadline
    passing or the client leaving takes its texts that have not started off the queue."""
    with server_state(request).admission.admit(1):
        try:
            async with asyncio.timeout(None if deadline is None else deadline.remaining()):
                return await cancel_on_disconnect(request, pooler.run(texts))
        except TimeoutError:
            assert deadline is not None
            raise deadline_exceeded(deadline.timeout, 0) from None


async def _encode(
    pooler: AsyncPooler, inputs: list, truncate: int | None, param: str
) -> list[Text]:
    try:
        return await asyncio.to_thread(pooler.encode, inputs, truncate)
    except InputTooLong as exc:
        raise invalid_request(str(exc), "truncate_prompt_tokens" if truncate else param) from None
    except ValueError as exc:
        raise invalid_request(str(exc), param) from None


def _usage(texts: list[Text]) -> PoolingUsage:
    tokens = sum(len(text.token_ids) for text in texts)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _check_dimensions(pooler: AsyncPooler, dimensions: int | None) -> None:
    """A 400 for `dimensions` the model's embeddings cannot be cut to (Matryoshka)."""
    width, spec = pooler.embedding_size, pooler.spec
    if dimensions is None or dimensions == width:
        return
    if not spec.is_matryoshka:
        allowed = "none: it is not a Matryoshka model"
    elif spec.matryoshka:
        allowed = ", ".join(map(str, spec.matryoshka))
        if dimensions in spec.matryoshka:
            return
    else:
        allowed = "any size below it"
        if dimensions < width:
            return
    raise invalid_request(
        f"dimensions {dimensions}: the model's embeddings are {width} wide and can be cut "
        f"to {allowed}",
        "dimensions",
    )


def _cut(pooler: AsyncPooler, vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The embedding's first `dimensions` values, normalized again where the model's are."""
    if dimensions is None or dimensions == vector.numel():
        return vector
    cut = vector[:dimensions]
    return F.normalize(cut, dim=0) if pooler.spec.normalize else cut


def _encoded(vector: torch.Tensor, encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


@router.post(
    "/v1/embeddings", response_model=None, responses=documented(EmbeddingResponse, *_ERRORS)
)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    name, pooler, deadline = await _pooler(request, body.model)
    if pooler.spec.task != "embed":
        raise invalid_request(
            f"the model '{name}' is a cross-encoder: it scores pairs (/score, /rerank)", "model"
        )
    _check_dimensions(pooler, body.dimensions)
    texts = await _encode(pooler, body.texts(), body.truncate_prompt_tokens, "input")
    vectors = await _run(request, pooler, deadline, texts)
    data = [
        Embedding(
            index=i,
            embedding=_encoded(_cut(pooler, vector, body.dimensions), body.encoding_format),
        )
        for i, vector in enumerate(vectors)
    ]
    return json_response(
        EmbeddingResponse(
            id=f"embd-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=name,
            data=data,
            usage=_usage(texts),
        )
    )


async def _scores(
    request: Request,
    model: str | None,
    pairs: list[tuple[str, str]],
    truncate: int | None,
    param: str,
    activation: bool,
) -> tuple[str, list[float], PoolingUsage]:
    """Each pair's score under the model: a cross-encoder's (its logit's sigmoid, or the
    logit where not `activation`), else its embeddings' cosine."""
    name, pooler, deadline = await _pooler(request, model)
    if pooler.spec.task == "classify":
        if pooler.num_labels != 1:
            raise invalid_request(
                f"the model '{name}' classifies into {pooler.num_labels} labels: scores need one",
                "model",
            )
        texts = await _encode(pooler, pairs, truncate, param)
        logits = await _run(request, pooler, deadline, texts)
        scores = [(torch.sigmoid(x[0]) if activation else x[0]).item() for x in logits]
        return name, scores, _usage(texts)
    unique = list(dict.fromkeys(text for pair in pairs for text in pair))
    texts = await _encode(pooler, unique, truncate, param)
    vectors = dict(zip(unique, await _run(request, pooler, deadline, texts), strict=True))
    scores = [F.cosine_similarity(vectors[a], vectors[b], dim=0).item() for a, b in pairs]
    return name, scores, _usage(texts)


_SCORED = documented(ScoreResponse, *_ERRORS)
_RERANKED = documented(RerankResponse, *_ERRORS)


@router.post("/score", response_model=None, responses=_SCORED)
@router.post("/v1/score", response_model=None, responses=_SCORED)
async def score(body: ScoreRequest, request: Request) -> Response:
    name, scores, usage = await _scores(
        request, body.model, body.pairs(), body.truncate_prompt_tokens, "text_2",
        body.use_activation is not False,
    )  # fmt: skip
    return json_response(
        ScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=name,
            usage=usage,
            data=[Score(index=i, score=s) for i, s in enumerate(scores)],
        )
    )


@router.post("/rerank", response_model=None, responses=_RERANKED)
@router.post("/v1/rerank", response_model=None, responses=_RERANKED)
@router.post("/v2/rerank", response_model=None, responses=_RERANKED)
async def rerank(body: RerankRequest, request: Request) -> Response:
    documents = body.texts()
    name, scores, usage = await _scores(
        request, body.model, [(body.query, d) for d in documents], body.truncate_prompt_tokens,
        "documents", body.use_activation is not False,
    )  # fmt: skip
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            document=RerankDocument(text=documents[i]) if body.return_documents else None,
        )
        for i in order
    ]
    response = RerankResponse(
        id=f"rerank-{uuid.uuid4().hex}", model=name,
        usage=RerankUsage(total_tokens=usage.total_tokens), results=results,
    )  # fmt: skip
    # A result without its document leaves the field out, as Cohere's and Jina's do.
    return Response(response.model_dump_json(exclude_none=True), media_type="application/json")

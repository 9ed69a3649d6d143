"""Request and response bodies of the pooling endpoints, the requests strict and closed as
every request model: OpenAI's /v1/embeddings, vLLM's /score, and /rerank in the
Jina/Cohere shape vLLM takes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from server.protocol import RequestBody, RequestModel, ResponseModel, field_error


def _truncation(value: int | None) -> int | None:
    if value is not None and value != -1 and value <= 0:
        raise ValueError("must be -1 (the model's window) or a positive count of tokens")
    return value


# vLLM's field: -1 truncates to the model's window, k > 0 to k tokens; None (the default)
# refuses an input longer than the window.
Truncate = Annotated[int | None, AfterValidator(_truncation)]


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, gt=0)
    user: str | None = None
    truncate_prompt_tokens: Truncate = None

    @model_validator(mode="after")
    def _some_input(self) -> EmbeddingRequest:
        if isinstance(self.input, list) and not self.input:
            raise field_error("input", "must hold at least one input")
        if isinstance(self.input, list) and any(isinstance(i, list) and not i for i in self.input):
            raise field_error("input", "token id lists must not be empty")
        return self

    def texts(self) -> list[str] | list[list[int]]:
        """The inputs as a list: strings, or lists of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [self.input]  # type: ignore[list-item]
        return self.input  # type: ignore[return-value]


class ScoreRequest(RequestBody):
    """vLLM's /score: `text_1` against `text_2`, one against many, or pair by pair."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Truncate = None
    # vLLM's: a cross-encoder's score is the sigmoid of its logit unless False (the logit);
    # a cosine has none.
    use_activation: bool | None = None

    @model_validator(mode="after")
    def _pairs(self) -> ScoreRequest:
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not firsts or not seconds:
            raise field_error("text_2" if firsts else "text_1", "must hold at least one text")
        if len(firsts) not in (1, len(seconds)):
            raise field_error(
                "text_1", f"holds {len(firsts)} texts: one, or as many as text_2 ({len(seconds)})"
            )
        return self

    def pairs(self) -> list[tuple[str, str]]:
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        return list(
            zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds, strict=True)
        )


class DocumentText(RequestModel):
    """A document given as an object, as Jina's and Cohere's clients may send it."""

    text: str


class RerankRequest(RequestBody):
    """/rerank and /v1/rerank: `documents` by relevance to `query`, the best first."""

    model: str | None = None
    query: str
    documents: list[str | DocumentText] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: Truncate = None
    use_activation: bool | None = None  # as ScoreRequest's

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class PoolingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of float32 LE")


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: PoolingUsage


class Score(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Score]
    usage: PoolingUsage


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None  # with return_documents


class RerankUsage(ResponseModel):
    total_tokens: int


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]

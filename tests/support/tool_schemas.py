"""Pydantic tool schemas as instructor and pydantic-ai send them (`$defs` and `$ref`s for
enums and nested models, a second `$defs/Color`, draft-7 `definitions`), one valid call of
each, and the checks the tool-calling tests share: a reply's calls, a call's validity, and
a walk of a grammar byte by byte."""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any, Literal

import jsonschema
import llguidance
from pydantic import BaseModel, ConfigDict, Field

from server.conversation import Function


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int = Field(ge=0, le=99)
    y: int = Field(ge=0, le=99)


class Circle(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["circle"]
    center: Point
    radius: int = Field(ge=1, le=9)


class Square(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["square"]
    corner: Point


class Paint(BaseModel):
    """Paint a shape."""

    model_config = ConfigDict(extra="forbid")
    color: Color  # $ref to an enum
    shape: Annotated[Circle | Square, Field(discriminator="kind")]  # oneOf of $refs
    path: list[Point] = Field(max_length=3)  # a list of models
    anchor: Point | Square  # anyOf of $refs
    label: str | None = Field(default=None, max_length=8)  # optional


class Ink:
    class Color(enum.Enum):  # a second `$defs/Color`, of other values
        CYAN = "cyan"
        MAGENTA = "magenta"


class Refill(BaseModel):
    """Refill an ink."""

    model_config = ConfigDict(extra="forbid")
    color: Ink.Color
    amount: int = Field(ge=1, le=5)


MODELS: dict[str, type[BaseModel]] = {"paint": Paint, "refill": Refill}
PAINT = Function("paint", Paint.__doc__, Paint.model_json_schema())
REFILL = Function("refill", Refill.__doc__, Refill.model_json_schema())
# Pointers Pydantic does not write: draft-7 `definitions`, and into `properties`.
MOVE = Function(
    "move",
    None,
    {
        "definitions": {"Step": {"type": "integer", "minimum": 1, "maximum": 3}},
        "type": "object",
        "properties": {
            "first": {"$ref": "#/definitions/Step"},
            "then": {"type": "array", "items": {"$ref": "#/properties/first"}, "maxItems": 2},
        },
        "required": ["first", "then"],
        "additionalProperties": False,
    },
)
A_PAINT = Paint(
    color=Color.GREEN,
    shape=Circle(kind="circle", center=Point(x=1, y=2), radius=3),
    path=[Point(x=0, y=0), Point(x=4, y=5)],
    anchor=Square(kind="square", corner=Point(x=9, y=9)),
).model_dump(mode="json")
A_REFILL = {"color": "cyan", "amount": 2}
A_MOVE = {"first": 2, "then": [1, 3]}

ASK_PAINT = [{"role": "user", "content": "Paint a green circle, then refill the cyan ink."}]
TOOLS = [PAINT.as_openai(), REFILL.as_openai()]


def calls_and_finish_reason(reply: Any, stream: bool) -> tuple[list[Any], str]:
    """The tool calls and the finish reason of a one-choice reply, streamed or not."""
    if stream:
        chunks = [chunk for chunk in reply if chunk.choices]
        calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        return calls, chunks[-1].choices[0].finish_reason
    return reply.choices[0].message.tool_calls or [], reply.choices[0].finish_reason


def valid_call(name: str, arguments: str) -> None:
    """`arguments` validate against the schema the client sent, and parse as its model."""
    jsonschema.validate(json.loads(arguments), {"paint": PAINT, "refill": REFILL}[name].parameters)
    MODELS[name].model_validate_json(arguments)


def walks(grammar: str, text: str) -> bool:
    """Whether `text`, byte by byte, is a complete sentence of `grammar`."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    for byte in text.encode():
        if not matcher.consume_token(byte):
            return False
    return matcher.is_accepting()


def _byte_tokenizer() -> llguidance.LLTokenizer:
    """A tokenizer of one token per byte, to walk a grammar byte by byte."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


class _Bytes:
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)

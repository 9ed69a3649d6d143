"""Tool-call formats: how a model writes function calls, and how to read them back.

A format is chosen per server (`tool_call_parser`; `auto` reads the chat template) and
does five things: render the tools into the prompt when the chat template itself ignores
them, render an earlier assistant call back into text for such a template, give the Lark
grammar (llguidance's dialect, with `%json` for arguments) that forces a call when the
request's `tool_choice` is `required` or names a function, give the grammar of `auto`
(free text, but a call once begun is held to the tools' schemas), and parse calls out of
the model's text, also while it streams.

- `hermes` (Hermes, Qwen 2.5/3 and many others): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, one block per call, after optional text.
- `llama3_json` (Llama 3.1-3.3): the whole message is `{"name": ..., "parameters": {...}}`,
  possibly after `<|python_tag|>`, several separated by `;`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from server.conversation import Function


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallFormat(ABC):
    """The shared parts of a format; subclasses give the syntax."""

    name = ""
    arguments_key = "arguments"
    markers: tuple[str, ...] = ()  # the format's fixed strings, which may be tokens

    @abstractmethod
    def instructions(self, functions: list[Function]) -> str:
        """A system message that describes the tools, for templates that ignore them."""

    @abstractmethod
    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """An earlier call as the model would have written it."""

    @abstractmethod
    def call_grammar(self, functions: list[Function], parallel: bool) -> str:
        """A Lark grammar of one call (several if `parallel`) of one of `functions`."""

    @abstractmethod
    def auto_grammar(
        self,
        functions: list[Function],
        parallel: bool,
        tokens: Mapping[str, int] | None = None,
        special_ids: Collection[int] = (),
    ) -> str:
        """A Lark grammar of `tool_choice: auto`: any text, or calls of `functions` (one
        only unless `parallel`) whose arguments match their schemas. Nothing is constrained
        until the format's opener is written; from there on the rest of the reply is calls.

        `tokens` are the format's markers (`<tool_call>`...) that the tokenizer holds as
        tokens of their own which decode as text (Qwen's), with their ids; `special_ids`
        every id the grammar engine counts as a special token (engine/request/intake.py:
        `SpecialTokens`), which no text lexeme matches. The grammar allows each marker
        spelt either way, and before a call every other special token too."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """The text before the calls (None if blank) and the calls; text without a
        well-formed call is all content."""

    @abstractmethod
    def calls_start(self, text: str) -> int | None:
        """Where tool-call text begins in `text`, if it has begun."""

    @abstractmethod
    def undecided_suffix(self, text: str) -> int:
        """How many characters at the end of `text` might begin a call (hold them back)."""

    def _call_rules(self, functions: list[Function]) -> str:
        """Lark rules whose `call_object` is one call object: the name of one of `functions`
        and its arguments, as `{"name": ..., "<arguments_key>": {...}}`.

        Each function's arguments are a `%json` of their own, not a property of one schema
        of the whole call: a schema keeps its own root, so its local `$ref` pointers
        (`#/$defs/...`, `#/definitions/...`, `#/properties/...`) resolve as in the caller's
        schema, and two functions' `$defs` of the same name cannot collide.
        """
        rules = [f"call_object: {' | '.join(f'call_{i}' for i in range(len(functions)))}"]
        for i, function in enumerate(functions):
            head = json.dumps(f'{{"name": {json.dumps(function.name)}, "{self.arguments_key}": ')
            schema = json.dumps(_arguments_schema(function.parameters))
            rules.append(f'call_{i}: {head} %json {schema} "}}"')
        return "\n".join(rules) + "\n"

    def _call(self, data: object) -> ParsedToolCall | None:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get(self.arguments_key, data.get("arguments", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


class HermesFormat(ToolCallFormat):
    name = "hermes"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"
    markers = (_OPEN, _CLOSE)
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def instructions(self, functions: list[Function]) -> str:
        signatures = "\n".join(json.dumps(f.as_openai(), ensure_ascii=False) for f in functions)
        return (
            "You can call functions to help with the user's request. Their signatures, as "
            f"JSON, are inside <tools></tools>:\n<tools>\n{signatures}\n</tools>\n\n"
            "To call a function, answer with a JSON object holding its name and arguments "
            f"inside {self._OPEN}{self._CLOSE} tags, one block per call:\n"
            f'{self._OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON '
            f"object>}}\n{self._CLOSE}"
        )

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self._OPEN}\n{call}\n{self._CLOSE}"

    def call_grammar(self, functions: list[Function], parallel: bool) -> str:
        call = f'"{self._OPEN}\\n" call_object "\\n{self._CLOSE}"'
        start = 'call ("\\n" call)*' if parallel else "call"
        return f"start: {start}\ncall: {call}\n{self._call_rules(functions)}"

    def auto_grammar(
        self,
        functions: list[Function],
        parallel: bool,
        tokens: Mapping[str, int] | None = None,
        special_ids: Collection[int] = (),
    ) -> str:
        # `opener` is a lazy lexeme: the shortest text that ends in `<tool_call>`, so it
        # ends at the first opener the model writes, and from there only a call of one of
        # `functions` continues; the other branch, free text alone, cannot hold an opener.
        tokens = tokens or {}
        close = self._marker(self._CLOSE, tokens)
        more = ""
        if parallel:
            more = f' ("\\n" {self._marker(self._OPEN, tokens)} "\\n" call_object "\\n" {close})*'
        calls = f'"\\n" call_object "\\n" {close}{more}'
        if self._OPEN not in tokens:
            # Nothing is constrained before the opener: TEXT is any bytes (valid UTF-8 or
            # not, a token spelling part of a character included), and these also match
            # the special tokens (`<think>`, `<|im_end|>`: 0xFF and the id, to the grammar
            # engine).
            return (
                "%llguidance {}\n"
                f"start: TEXT | opener {calls}\n"
                "TEXT: /(?s:.*)/ | ~/(?s:.*)/\n"
                f'opener[lazy]: TEXT "{self._OPEN}"\n'
                f"{self._call_rules(functions)}"
            )
        # `<tool_call>` is a token of its own (Qwen's). Any-bytes text would match it too,
        # and as text, so the token would open nothing: here TEXT is valid text, which
        # ends where a special token begins, and each special token but the opener is
        # allowed between pieces of text, so the free part is what the model would write
        # without the grammar (but bytes that are no text); the opener token begins a
        # call, as its spelling does.
        others = _token_ranges(set(special_ids) - {tokens[self._OPEN]})
        free, free_rule = ("free ", f"free: (TEXT? {others})*\n") if others else ("", "")
        return (
            "%llguidance {}\n"
            f"start: {free}TEXT? | {free}opener {calls}\n"
            f"{free_rule}"
            "TEXT: /(?s:.+)/\n"
            f"opener: opener_text | TEXT? {self._OPEN}\n"
            f'opener_text[lazy]: /(?s:.*)/ "{self._OPEN}"\n'
            f"{self._call_rules(functions)}"
        )

    @staticmethod
    def _marker(text: str, tokens: Mapping[str, int]) -> str:
        """`text` as a Lark literal, or also as the token of that name if it is one."""
        return f"({json.dumps(text)} | {text})" if text in tokens else json.dumps(text)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = self.calls_start(text)
        if start is None:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text, start):
            try:
                call = self._call(json.loads(block))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls

    def calls_start(self, text: str) -> int | None:
        position = text.find(self._OPEN)
        return None if position == -1 else position

    def undecided_suffix(self, text: str) -> int:
        for length in range(min(len(self._OPEN) - 1, len(text)), 0, -1):
            if self._OPEN.startswith(text[-length:]):
                return length
        return 0


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    _TAG = "<|python_tag|>"

    def instructions(self, functions: list[Function]) -> str:
        signatures = "\n\n".join(
            json.dumps(f.as_openai(), indent=4, ensure_ascii=False) for f in functions
        )
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\nRespond in the "
            'format {"name": function name, "parameters": dictionary of argument name and '
            f"its value}}. Do not use variables.\n\n{signatures}"
        )

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def call_grammar(self, functions: list[Function], parallel: bool) -> str:
        start = 'call_object ("; " call_object)*' if parallel else "call_object"
        return f"start: {start}\n{self._call_rules(functions)}"

    def auto_grammar(
        self,
        functions: list[Function],
        parallel: bool,
        tokens: Mapping[str, int] | None = None,
        special_ids: Collection[int] = (),
    ) -> str:
        # This format has no opener in text: a reply is calls when it opens with `{` (after
        # whitespace), as `parse` reads it. So the choice is made at the first character:
        # text that opens otherwise is free, one that opens with `{` is calls.
        # `<|python_tag|>` is a special token where Llama 3 has it: no text lexeme can
        # write it, so under this grammar calls are the bare JSON that Llama 3.1-3.3 write
        # for custom tools.
        more = ' ("; " call_object)*' if parallel else ""
        return (
            "%llguidance {}\n"
            f"start: TEXT | LEAD call_object{more}\n"
            "TEXT: /\\s*([^{\\s](.|\\n)*)?/\n"
            "LEAD: /\\s*/\n"
            f"{self._call_rules(functions)}"
        )

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = self.calls_start(text)
        if start is None:
            return text, []
        body = text[start:].removeprefix(self._TAG).strip()
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                data, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = self._call(data)
            if call is None:
                return text, []
            calls.append(call)
            position = len(body) - len(body[position:].lstrip().removeprefix(";").lstrip())
        return (text[:start].strip() or None), calls

    def calls_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self._TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def undecided_suffix(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self._TAG.startswith(stripped):
            return len(text)  # nothing but whitespace, or a tag still being written
        return 0


def _token_ranges(token_ids: Collection[int]) -> str:
    """A Lark token range of `token_ids` (`<[0-2,385-391]>`), or "" for none."""
    spans: list[list[int]] = []
    for token_id in sorted(token_ids):
        if spans and spans[-1][1] == token_id - 1:
            spans[-1][1] = token_id
        else:
            spans.append([token_id, token_id])
    if not spans:
        return ""
    return "<[" + ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) + "]>"


def _arguments_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The schema a forced call's arguments must match: `parameters`, an object when it
    names no type (arguments are always a JSON object), written as `json.dumps` writes
    (`render_call`'s text) unless the schema's own `x-guidance` options say otherwise.
    Only the root gains keys, so every pointer into the schema still resolves."""
    own = parameters.get("x-guidance", {})
    schema = {**parameters, "x-guidance": _ARGUMENTS_JSON | own if isinstance(own, dict) else own}
    if "type" not in schema:
        schema["type"] = "object"
    return schema


# No optional whitespace, as in structured outputs (engine/grammar/grammar.py): a small
# model free to add whitespace inside a call can spend its whole budget on newlines.
_ARGUMENTS_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}


def choose_format(setting: str, chat_template: str | None) -> ToolCallFormat:
    """The format `setting` names; `auto` picks the one the chat template writes (Hermes's
    `<tool_call>` or Llama 3's `<|python_tag|>`/`parameters`), else Hermes."""
    if setting != "auto":
        return _FORMATS[setting]
    template = chat_template or ""
    if "<tool_call>" not in template and (
        "<|python_tag|>" in template or '"parameters"' in template
    ):
        return _FORMATS["llama3_json"]
    return _FORMATS["hermes"]


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether the chat template renders a `tools` list (else tools are described in a
    system message, in the format's own words)."""
    return chat_template is not None and "tools" in chat_template


class ToolCallStream:
    """One streamed choice's text, split into content to send now and call text to hold.

    Invariant: `feed` returns only text that can no longer turn out to be part of a tool
    call; everything else waits for `finish`, which parses it. With `all_calls` (the
    request forces a call), all of the text is held.
    """

    def __init__(self, tool_format: ToolCallFormat, all_calls: bool) -> None:
        self._format = tool_format
        self._all_calls = all_calls
        self._text = ""
        self._sent = 0

    def feed(self, delta: str) -> str:
        self._text += delta
        if self._all_calls:
            return ""
        start = self._format.calls_start(self._text)
        if start is None:
            end = len(self._text) - self._format.undecided_suffix(self._text)
        else:  # the content ends where the calls begin, without the space before them
            end = len(self._text[:start].rstrip())
        end = max(end, self._sent)
        content, self._sent = self._text[self._sent : end], end
        return content

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The content not yet sent, and the calls in the whole text."""
        _, calls = self._format.parse(self._text)
        start = self._format.calls_start(self._text) if calls else None
        end = len(self._text) if start is None else start
        rest, self._sent = self._text[self._sent : end], len(self._text)
        return (rest.rstrip() if calls else rest), calls

"""Request intake: prompts in (text, token ids or a chat), validated engine requests out.

Every path into the engine, the offline `LLM` and the server alike, goes through a
`RequestProcessor`, so a prompt is rendered, tokenized and checked exactly once, and the
result is what the engine schedules. It needs no torch: the server runs it on a worker
thread of its own, off the event loop and off the engine thread.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from engine.sampling.params import DEFAULT_LIMITS, RequestLimits, SamplingParams
from scheduler import SchedulingPolicy

if TYPE_CHECKING:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from engine.sampling.logits_constraint import ConstraintCompiler

# One prompt: text, or token ids.
Prompt = str | list[int]
# One chat message as the tokenizer's chat template reads it: {"role": ..., "content": ...}.
Message = dict[str, Any]
# A message's content no real one begins with (`RequestProcessor.turn_starts`).
_ANOTHER_TEXT = "\x1f"


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (say, roles that do not alternate)."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A prompt and its sampling settings, ready for `LLMEngine.add_request`.

    Invariants (a `RequestProcessor` made it): `prompt_token_ids` is not empty and every id
    in it and in the params' `logit_bias` is in the model's vocabulary; `max_tokens` is the
    request's limit on output tokens (its own `max_tokens`, else the room left in the
    context), and the prompt plus `max_tokens` fit in `max_model_len`. `prompt` is the
    prompt's text when it came as text. `grammar` is the compiled, validated grammar of the
    params' `structured_outputs`, if any.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    prompt: str | None = None
    grammar: str | None = None
    # The chained prefix-cache hashes of the prompt's first full blocks at the engine's
    # block size, when they came with it (`RenderedPrompt`); the engine hashes the rest.
    block_hashes: tuple[int, ...] = ()
    # The LoRA adapter it runs with (engine/adapters.py); None: the base model.
    lora_name: str | None = None
    # Where a conversation's turns begin in the prompt, in tokens, for a model with
    # recurrent layers (`Sequence.checkpoint_positions`); empty otherwise.
    checkpoint_positions: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A prompt rendered and tokenized ahead of the engine with the engine's own tokenizer
    and chat template (the scale-out ingress does it to route a request), and the chained
    hashes of its full blocks at `block_size` (`cache.extend_block_hashes`).

    An engine takes the hashes only at its own block size. A wrong hash costs a prefix
    cache miss, never wrong KV: the block manager confirms every hit by its tokens.
    """

    token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """The token ids a grammar can match only as tokens, never as text.

    llguidance counts every added token of a Hugging Face tokenizer as special, also those
    that decoding keeps as text (Qwen's `<tool_call>` and `<think>`), and every id past
    the tokenizer's end (rows that pad the model's vocabulary): `ids` are all of these.
    (So is a token whose bytes begin with 0xFF, llguidance's marker of special tokens:
    the byte 0xFF itself, which is no text; it is left out.) `text` maps the added tokens
    that decode as text to their ids.
    """

    ids: frozenset[int]
    text: Mapping[str, int]

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> SpecialTokens:
        added = {i: t for i, t in tokenizer.added_tokens_decoder.items() if i < vocab_size}
        ids = frozenset(added) | frozenset(range(len(tokenizer), vocab_size))
        return cls(ids, {token.content: i for i, token in added.items() if not token.special})


class RequestProcessor:
    """Renders, tokenizes and validates prompts for one engine.

    Not thread-safe: it owns `tokenizer`, and a Hugging Face fast tokenizer keeps mutable
    truncation and padding state, so a processor used on another thread than the engine's
    gets a tokenizer of its own. `limits` are the engine's settings that every request's
    params are checked against (`EngineConfig.request_limits()`); under the engine's
    `scheduling_policy` fcfs, which orders by arrival alone, a `priority` other than 0 is
    refused rather than ignored (as vLLM documents it, and as its V0 engine did). With
    `turn_checkpoints` (a model with recurrent layers) a conversation's request also says
    where its first and last user messages begin (`turn_starts`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        grammars: ConstraintCompiler | None = None,
        limits: RequestLimits = DEFAULT_LIMITS,
        scheduling_policy: SchedulingPolicy = "fcfs",
        turn_checkpoints: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.limits = limits
        self.scheduling_policy = scheduling_policy
        self.turn_checkpoints = turn_checkpoints

    def from_prompt(self, prompt: Prompt, params: SamplingParams) -> EngineRequest:
        """Raises ValueError, with the numbers, for a prompt the engine can never serve."""
        if isinstance(prompt, str):
            return self._checked(self.tokenizer.encode(prompt), params, prompt)
        return self._checked(list(prompt), params, None)

    def from_rendered(
        self, rendered: RenderedPrompt, params: SamplingParams, block_size: int
    ) -> EngineRequest:
        """A prompt rendered ahead (see `RenderedPrompt`), checked like any other; its
        hashes are kept when they were made at `block_size`."""
        request = self._checked(list(rendered.token_ids), params, None)
        if rendered.block_size != block_size:
            return request
        return dataclasses.replace(request, block_hashes=rendered.block_hashes)

    def from_chat(
        self,
        messages: list[Message],
        params: SamplingParams,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> EngineRequest:
        """The conversation through the tokenizer's chat template, assistant turn opened."""
        prompt = self.render_chat(messages, tools=tools, template_kwargs=template_kwargs)
        request = self._checked(prompt, params, None)
        if not self.turn_checkpoints:
            return request
        starts = self.turn_starts(messages, prompt, tools, template_kwargs)
        return dataclasses.replace(request, checkpoint_positions=starts)

    def turn_starts(
        self,
        messages: list[Message],
        prompt: list[int],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[int, ...]:
        """Where, in `prompt` (its tokens), the content of the conversation's first and of
        its last user message begin, and where the assistant's turn opens, ascending: a
        later request that shares this conversation up to one of them (another question
        after the same system prompt; the same conversation asked again; its next turn,
        whose template may write this turn's opening otherwise) parts from this one
        there. Found by rendering the conversation again, with that message's content
        changed or without the assistant's opening, whatever the template does around
        them; a rendering the template refuses gives no position."""
        users = [i for i, message in enumerate(messages) if message.get("role") == "user"]
        variants = [(messages, False)]
        for index in {users[0], users[-1]} if users else set():
            changed = list(messages)
            changed[index] = {**messages[index], "content": _ANOTHER_TEXT}
            variants.append((changed, True))
        starts = set()
        for variant, opened in variants:
            try:
                other = self.render_chat(variant, opened, tools, template_kwargs)
            except ChatTemplateError:
                continue
            pairs = enumerate(zip(prompt, other, strict=False))
            starts.add(next((i for i, (a, b) in pairs if a != b), min(len(prompt), len(other))))
        return tuple(sorted(starts))

    def render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of the conversation through the tokenizer's chat template, as chat
        requests see it (`add_generation_prompt` opens the assistant's turn; `tools`, in
        OpenAI's shape, go to the template as transformers passes them; `template_kwargs`
        are more variables for the template, as vLLM's `chat_template_kwargs`, such as
        Qwen3's `enable_thinking`); unchecked. Raises ChatTemplateError if the template
        refuses the conversation."""
        try:
            token_ids: list[int] = self.tokenizer.apply_chat_template(  # type: ignore[assignment]
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **(template_kwargs or {}),
            )
        except (TemplateError, ValueError) as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
        return list(token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`, as a text prompt gets them by default; unchecked."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (`Ġthe`, not ` the`)."""
        self._check_vocabulary("tokens", token_ids)
        return [str(token) for token in self.tokenizer.convert_ids_to_tokens(list(token_ids))]

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`; ValueError naming `tokens` for an id outside the
        vocabulary."""
        self._check_vocabulary("tokens", token_ids)
        return str(self.tokenizer.decode(list(token_ids)))

    def _check_vocabulary(self, name: str, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name} out of range [0, {self.vocab_size}): {bad[:5]}")

    def _checked(
        self, token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> EngineRequest:
        self.limits.check(params)
        if params.priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority {params.priority} needs the priority scheduling policy, but the "
                f"engine's scheduling_policy is {self.scheduling_policy!r}: send priority 0 "
                "(or none), or serve with --scheduling-policy priority"
            )
        if not token_ids:
            raise ValueError("the prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        self._check_vocabulary("logit_bias token ids", list(params.logit_bias))
        if len(token_ids) + (params.max_tokens or 1) > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"request asks for {len(token_ids)} prompt tokens plus max_tokens="
                f"{params.max_tokens}; shorten the prompt or lower max_tokens"
            )
        max_tokens = params.max_tokens or self.max_model_len - len(token_ids)
        grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError(
                    "structured_outputs: this engine has no grammar engine (engine.grammar "
                    "could not be imported at start-up)"
                )
            grammar = self.grammars.compile(params.structured_outputs, token_ids)
        return EngineRequest(token_ids, params, max_tokens, prompt, grammar)


def as_prompt_list(value: object, *, mixed: bool = False) -> list[Prompt]:
    """Accept a string, token ids, or a non-empty list of prompts: all strings or all
    token-id lists (OpenAI's shapes), or either kind in any order when `mixed`."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple) and value:
        if _is_token_ids(value):
            return [list(value)]
        is_text = [isinstance(item, str) for item in value]
        is_ids = [isinstance(item, list | tuple) and _is_token_ids(item) for item in value]
        if all(is_text) or all(is_ids) or (mixed and all(map(operator.or_, is_text, is_ids))):
            return [item if isinstance(item, str) else list(item) for item in value]
    kinds = "a list of strings and token-id lists" if mixed else "a list of token-id lists"
    raise ValueError(
        f"prompt must be a string, a list of strings, a list of token ids or {kinds}, and not empty"
    )


def _is_token_ids(items: Sequence[Any]) -> bool:
    # bool is an int subclass, but `true` is not a token id.
    return all(isinstance(i, int) and not isinstance(i, bool) for i in items)

"""Per-request sampling settings, validated once when the request is built, and the
defaults that fill the fields a request leaves out, taken from a generation config as vLLM
takes them (its `--generation-config` and `--override-generation-config`).

Invariant: a request's own value always wins. A default fills only a field that the
request left out or sent as null; it never changes a value the request gave.

The defaults in force are the model's generation config (`generation_config: auto`), none
(`vllm`: the neutral defaults of `SamplingParams`), or the generation_config.json of a
folder (a path), each then updated by `override_generation_config`. Of a generation config
only the keys in `GENERATION_CONFIG_KEYS` count, and only as written in it (transformers'
`to_diff_dict()`, as vLLM reads it: no class default of transformers' `GenerationConfig`
leaks in). `do_sample` is ignored, as vLLM ignores it: a temperature written beside
`do_sample: false` still applies, and only a temperature of 0 is greedy.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)

MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what multiplies per-step work: every stop string is searched for in every
    sample's new text at every step, and every logit_bias entry and stop token id is
    applied or checked at every step. Each is the engine setting of the same name
    (engine/config.py), so an engine whose users need more can allow more: the engine's
    request intake checks every request against its own (engine/request/intake.py), the
    offline `LLM`'s and the server's alike."""

    max_stop_sequences: int = 64
    max_stop_length: int = 1000  # characters
    max_stop_token_ids: int = 1024
    max_logit_bias_entries: int = 1024

    def check(self, params: SamplingParams) -> None:
        """Raises ValueError, naming the field and the setting, where `params` go past one."""
        counts = {
            "max_stop_sequences": ("stop", len(params.stop)),
            "max_stop_length": ("stop", max(map(len, params.stop), default=0)),
            "max_stop_token_ids": ("stop_token_ids", len(params.stop_token_ids)),
            "max_logit_bias_entries": ("logit_bias", len(params.logit_bias)),
        }
        for setting, (name, count) in counts.items():
            limit = getattr(self, setting)
            if count > limit:
                raise ValueError(
                    f"{name} must hold at most {limit} {_UNITS[setting]} (the {setting} "
                    f"setting), got {count}"
                )


DEFAULT_LIMITS = RequestLimits()
# What each limit counts, in its error.
_UNITS = {
    "max_stop_sequences": "strings",
    "max_stop_length": "characters in a string",
    "max_stop_token_ids": "ids",
    "max_logit_bias_entries": "entries",
}
# A seed seeds a torch generator, which takes 64 bits (negative ones as two's complement).
SEED_RANGE = (-(2**63), 2**64 - 1)
# Below this a temperature is treated as greedy: dividing logits by it would overflow
# float32 without changing which token wins.
GREEDY_TEMPERATURE = 1e-5


# How near the prompt's end a `<think>` or `</think>` token decides where the reply
# begins: the token and the newline or two a template writes after it.
_REASONING_TAIL = 3


@dataclass(frozen=True, slots=True)
class ReasoningBlock:
    """A reasoning model's thinking, `<think>` ... `</think>` before its answer, which a
    structured output leaves free: the constraint holds the answer after it.

    Where a reply begins (`opening`): "inside" the thinking when `always_open`
    (DeepSeek-R1's templates open it) or when the prompt's last tokens opened `<think>`
    without closing it, so free text up to `</think>` comes first; "after" it when they
    closed it (Qwen3's template with thinking off), so the answer comes at once; else
    "either": a `<think>` ... `</think>` block, or none. `start_id` and `end_id` are the
    markers' ids where the tokenizer holds them as tokens of their own; a grammar then
    takes each marker as its token or as its spelling.
    """

    START = "<think>"
    END = "</think>"

    always_open: bool
    start_id: int | None = None
    end_id: int | None = None

    def opening(self, prompt_token_ids: Sequence[int]) -> Literal["inside", "after", "either"]:
        if self.always_open:
            return "inside"
        tail = list(prompt_token_ids[-_REASONING_TAIL:])
        if self.start_id is not None and self.start_id in tail:
            opened = len(tail) - 1 - tail[::-1].index(self.start_id)
            return "after" if self.end_id in tail[opened:] else "inside"
        if self.end_id is not None and self.end_id in tail:
            return "after"
        return "either"


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What every sample's text must match, as vLLM's `structured_outputs` says it.

    Exactly one of: `json`, a JSON schema (a dict, or its text); `json_object`, any JSON
    object; `regex`; `choice`, one of these strings; `grammar`, a Lark or GBNF grammar.
    `engine.grammar.grammar` compiles it; the sampler then masks every token that would
    leave the language, and the sample ends when the language allows nothing more. With
    `reasoning`, the language is that of the answer after a reasoning model's thinking,
    which is left free (see `ReasoningBlock`), as vLLM applies structured outputs to the
    content and not to the reasoning.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning: ReasoningBlock | None = None

    def __post_init__(self) -> None:
        given = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}, "
                f"got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs: choice must be a list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next tokens of one request; ranges follow OpenAI and vLLM.

    Invariants after construction: `stop` is a list of non-empty strings, `stop_token_ids`
    a list of non-negative ints, `top_k` is 0 when disabled (-1 is accepted and mapped to
    0), `logit_bias` maps non-negative int token ids to finite biases in [-100, 100] (the
    engine's intake checks the ids against the vocabulary), and every field is in range;
    otherwise `__post_init__` raises `ValueError` whose
    message starts with the parameter's name. `priority` is not a sampling setting but the
    request's place under the priority scheduling policy (vLLM's `priority`: a lower value
    first); an engine under the fcfs policy refuses any but 0 at intake.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: until the model's max_model_len
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # a single str is accepted
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # number of top alternatives to report; 0: chosen token only
    # The same for every prompt token but the first (vLLM's): computed in the prefill, so
    # the request takes no prefix-cache hits (see `Sequence.prompt_logprobs`).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        _check_int("n", self.n, low=1, high=MAX_N)
        _check_int("priority", self.priority)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p, high=1.0)
        if not self.top_p > 0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        self.top_k = max(self.top_k, 0)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=SEED_RANGE[0], high=SEED_RANGE[1])
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        self.logit_bias = dict(self.logit_bias)
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias token id", token_id, low=0)
            _check_float("logit_bias value", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is None:
                continue
            _check_int(name, count, low=0)
            if count > MAX_LOGPROBS:
                raise ValueError(
                    f"{name} must be <= {MAX_LOGPROBS}: more alternatives are not "
                    f"supported, got {count}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    # bool is an int subclass, but `n=True` is a caller bug, not a count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high)


def _check_float(
    name: str, value: object, low: float | None = None, high: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    _check_range(name, value, low, high)


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return _normalise_stop([stop])
    if not isinstance(stop, list | tuple):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    stops = list(stop)
    for item in stops:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must hold non-empty strings, got {item!r}")
    return stops


# A generation config's key -> the SamplingParams field it sets the default of.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
GENERATION_CONFIG_FILE = "generation_config.json"


class GenerationConfigLike(Protocol):
    """transformers' GenerationConfig, as far as it is read here."""

    def to_diff_dict(self) -> dict[str, Any]: ...


def check_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`overrides` unchanged if every key is a generation-config key in
    `GENERATION_CONFIG_KEYS` and every value valid; else ValueError naming the key."""
    for key in overrides:
        if key not in GENERATION_CONFIG_KEYS:
            raise ValueError(
                f"unknown key '{key}': the keys taken are {', '.join(GENERATION_CONFIG_KEYS)}"
            )
    sampling_defaults(overrides)
    return dict(overrides)


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The SamplingParams defaults that `generation_config` (what a generation config
    writes) sets: its keys in `GENERATION_CONFIG_KEYS` with a value, under SamplingParams'
    names. Raises ValueError naming the key when a value is not a valid default."""
    defaults = {}
    for key, name in GENERATION_CONFIG_KEYS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except ValueError as exc:
            raise ValueError(f"{key}={value!r}: {exc}") from None
        defaults[name] = value
    return defaults


def resolve_defaults(
    generation_config: str,
    overrides: Mapping[str, Any],
    model_generation_config: GenerationConfigLike | None,
) -> tuple[dict[str, Any], str]:
    """The sampling defaults that the `generation_config` and `override_generation_config`
    settings put in force for a model whose generation config transformers loaded as
    `model_generation_config`, and where they come from (for the start-up log). Raises
    ValueError naming the source and the key of an invalid value."""
    sources = []
    written: dict[str, Any] = {}
    if generation_config == "auto":
        if model_generation_config is not None:
            written = model_generation_config.to_diff_dict()
        sources.append("the model's generation config")
    elif generation_config != "vllm":
        from transformers import GenerationConfig  # here: engine.config imports this module

        try:
            written = GenerationConfig.from_pretrained(generation_config).to_diff_dict()
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cannot read the generation config in {generation_config}: {exc}"
            ) from None
        sources.append(f"the generation config in {generation_config}")
    if overrides:
        sources.append("override_generation_config")
    source = " and ".join(sources)
    try:
        return sampling_defaults({**written, **overrides}), source
    except ValueError as exc:
        raise ValueError(f"invalid sampling default from {source}: {exc}") from None


def with_defaults(requested: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments: `defaults`, then every requested value that is not
    None over them (None is a field the request left out, or sent as null)."""
    return {**defaults, **{name: value for name, value in requested.items() if value is not None}}


def ensure_generation_config(folder: Path, values: Mapping[str, Any]) -> None:
    """Make `folder`'s generation_config.json hold `values` (its other keys kept).

    For the default model (engine/model/loader.py), whose folder pagedserve converts and
    owns: called on every load rather than once in the conversion, so that a folder
    converted before its defaults existed (a file of token ids only) gets them too and
    the cache key needs no converter version. The file is written beside itself and
    renamed over it, so a process starting alongside reads the old file or the new one,
    never half of one. A folder that cannot be written (a read-only cache) keeps its
    file, with a warning."""
    path = folder / GENERATION_CONFIG_FILE
    written = json.loads(path.read_text()) if path.is_file() else {}
    if written.items() >= values.items():
        return
    # The file no longer only mirrors config.json, as transformers' marker would say.
    written.pop("_from_model_config", None)
    try:
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as tmp:
            json.dump({**written, **values}, tmp, indent=2)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, path)
    except OSError as exc:
        logger.warning("cannot write the sampling defaults %s to %s: %s", dict(values), path, exc)

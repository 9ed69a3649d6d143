"""Sampling defaults for the fields a request leaves out, taken from a generation config as
vLLM takes them (its `--generation-config` and `--override-generation-config`).

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
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

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

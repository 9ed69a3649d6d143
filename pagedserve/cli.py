"""`pagedserve serve` and `pagedserve ray-serve`: the command line, generated from
ServeConfig's fields.

Every setting is a flag (`max_num_seqs` is `--max-num-seqs`, booleans also have a
`--no-` form), so the flags cannot drift from the settings. Bad settings end the
process with exit code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn, get_args, get_origin

import uvicorn

from engine.config import ConfigError
from server.config import (
    DEFAULT_PRESET,
    LOG_FORMAT,
    ServeConfig,
    ServedModelConfig,
    resolve_serve_config,
)
from server.responses.store import ResponseStoreError, connect

USAGE_ERROR = 2

logger = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like the other start-up errors, instead of argparse's usage block.
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--max-num-seq` must be an error, not a silent `--max-num-seqs`.
    parser = _Parser(
        prog="pagedserve", description="A small LLM inference server.", allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    preset = ", ".join(f"{key}={value}" for key, value in DEFAULT_PRESET.items())
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API. Settings come from "
        "--config, then PAGEDSERVE_<SETTING> environment variables, then these flags.",
        epilog=f"Without --config and --model the default preset applies: {preset}.",
        allow_abbrev=False,
    )
    _add_settings(serve)
    ray_serve = commands.add_parser(
        "ray-serve",
        help="serve the model from several engine replicas on Ray Serve",
        description="Serve the model from several engine replicas behind one "
        "OpenAI-compatible HTTP endpoint, on Ray Serve: a local Ray cluster, or the one "
        "RAY_ADDRESS names. Needs Ray (pip install 'pagedserve[ray]'). Each replica gets "
        "the settings below.",
        epilog=f"Without --config and --model the default preset applies: {preset}.",
        allow_abbrev=False,
    )
    _add_settings(ray_serve)
    ray_serve.add_argument(
        "--replicas", type=_number(int, positive=True), default=2, help="default: 2"
    )
    ray_serve.add_argument(
        "--replica-cpus",
        type=_number(float, positive=True),
        metavar="CPUS",
        help="CPUs (and torch threads) per replica; default: the cluster's CPUs / replicas",
    )
    ray_serve.add_argument(
        "--replica-gpus",
        type=_number(float, positive=False),
        metavar="GPUS",
        help="GPUs per replica; default: 1 with device cuda, else 0",
    )
    ray_serve.add_argument(
        "--routing",
        choices=("prefix", "pow2"),
        default="prefix",
        help="prefix: to the replica holding the prompt's prefix blocks, unless load is "
        "unbalanced; pow2: Ray Serve's power of two choices; default: prefix",
    )
    return parser


def _add_settings(parser: argparse.ArgumentParser) -> None:
    """--config and one flag per ServeConfig setting."""
    parser.add_argument("--config", metavar="FILE", help="a YAML file of settings")
    for name, info in ServeConfig.model_fields.items():
        if name == "models":  # given as --model NAME=SOURCE, repeated
            continue
        flag = "--" + name.replace("_", "-")
        help_text = info.description or ""
        if info.default is not None and "default" not in help_text:
            help_text = f"{help_text}; default: {info.default}".lstrip("; ")
        if info.annotation in (bool, bool | None):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        options: dict[str, Any] = {"default": None, "help": help_text}
        if name == "lora_modules":
            options["action"] = "append"
        if name == "model":
            options["action"] = "append"
            options["help"] = (
                "the model: 'default', a folder, a .gguf file or a hub id; repeated as "
                "NAME=SOURCE, several models served by name"
            )
        if get_origin(info.annotation) is Literal:
            options["choices"] = get_args(info.annotation)
        else:
            options["metavar"] = name.upper()
        # Values stay strings; ServeConfig validates and converts them, like YAML values.
        parser.add_argument(flag, **options)


def _number(kind: Callable[[str], float], *, positive: bool) -> Callable[[str], float]:
    """An argparse type: `kind` of the text, above 0 if `positive`, else at least 0."""

    def convert(text: str) -> float:
        value = kind(text)
        if value < 0 or (positive and value == 0):
            raise ValueError(text)
        return value

    convert.__name__ = getattr(kind, "__name__", "number")  # argparse names it in errors
    return convert


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {name: getattr(args, name, None) for name in ServeConfig.model_fields}
    try:
        overrides |= models_from_flags(args.model or [])
        config = resolve_serve_config(args.config, overrides, os.environ)
    except ConfigError as exc:
        return _usage_error(exc)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    # torch and transformers load only once the settings are known good, so that a bad
    # setting is reported at once.
    from engine.errors import ModelLoadError, UnsupportedModelError
    from engine.model.loader import resolve_model_folder

    try:
        # Fail before the server starts for the common mistake of a wrong model path; the
        # background load reports anything found later (the server then exits, code 2).
        entries: list[ServedModelConfig | None] = [*(config.models or [])] or [None]
        for entry in entries:
            resolve_model_folder(config.engine_config(entry).model)
    except (ModelLoadError, UnsupportedModelError) as exc:  # a GGUF's architecture, say
        return _usage_error(exc)
    try:
        connect(config.response_store_path()).close()  # an unusable store path, at once
    except ResponseStoreError as exc:
        return _usage_error(exc)
    if args.command == "ray-serve":
        if config.models is not None or math.isfinite(config.keep_alive):
            return _usage_error(
                ConfigError("ray-serve's replicas serve one model each, loaded for good: "
                            "models and keep_alive are for pagedserve serve")
            )  # fmt: skip
        # The one place the server reaches up into the scale-out layer: its command line.
        try:
            from scale_out.launch import ScaleOut, serve_replicas
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            return _usage_error(ImportError("ray-serve needs Ray: pip install 'pagedserve[ray]'"))

        scale_out = ScaleOut(args.replicas, args.replica_cpus, args.replica_gpus, args.routing)
        return serve_replicas(config, scale_out)
    return serve(config)


def models_from_flags(values: list[str]) -> dict[str, Any]:
    """The `--model` flags as settings: one SOURCE is `model`; NAME=SOURCE ones (a NAME
    holds no '/') are the entries of `models`."""
    named = [value.partition("=") for value in values]
    entries = [(name, source) for name, eq, source in named if eq and name and "/" not in name]
    if not entries:
        if len(values) > 1:
            raise ConfigError("--model is given more than once: name each model, NAME=SOURCE")
        return {"model": values[0]} if values else {}
    if len(entries) < len(values):
        raise ConfigError("--model: name every model (NAME=SOURCE) when serving several")
    return {"model": None, "models": [{"name": name, "model": source} for name, source in entries]}


def _usage_error(exc: Exception) -> int:
    print(f"pagedserve: error: {exc}", file=sys.stderr)
    return USAGE_ERROR


def serve(config: ServeConfig) -> int:
    """Run the server until interrupted; 2 if the engine could not be built from `config`,
    1 if it could not be built otherwise or its engine died."""
    from engine.errors import SETTINGS_ERRORS
    from server.app import build_app

    failures: list[BaseException] = []

    def stop_on_load_error(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    def stop_on_engine_death(exc: BaseException) -> None:
        # As vLLM's server does: a dead engine ends the process (after the requests in
        # flight got their errors), so that a supervisor restarts it.
        logger.error("the server shuts down (exit code 1) since its engine died")
        failures.append(exc)
        server.should_exit = True

    app = build_app(config, on_load_error=stop_on_load_error, on_engine_death=stop_on_engine_death)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_config=None, log_level=config.log_level
        )
    )
    # uvicorn re-raises Ctrl-C after its graceful shutdown, which is all Ctrl-C asks for.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if failures:
        return USAGE_ERROR if isinstance(failures[0], SETTINGS_ERRORS) else 1
    return 0

"""Server settings: the engine's settings plus where and how to serve them.

`resolve_serve_config` layers, lowest to highest: field defaults, the default preset
(only when neither a config file nor a model is given), the YAML file, `PAGEDSERVE_*`
environment variables, the command line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.config import ENV_PREFIX, EngineConfig, cache_root, from_json, load_config

# The settings of configs/default.yaml, embedded so that `pagedserve serve` with no config
# and no model serves the embedded model the same way wherever the package is installed
# (configs/ is not part of the wheel). tests/server/test_config.py keeps the two equal.
DEFAULT_PRESET: dict[str, Any] = {
    "model": "default",
    "device": "cpu",
    "max_model_len": 4096,
    "kv_cache_memory": "2GiB",
    "kv_disk_size": "2GiB",
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 7,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
        "disable_by_batch_size": 4,
    },
}


_DURATION = re.compile(r"(\d+(?:\.\d*)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: object) -> float:
    """Ollama's `keep_alive` in seconds: a number of seconds or a duration such as '5m',
    '1h30m' or '500ms'; a negative one is for ever (`math.inf`), 0 unloads at once."""
    if isinstance(value, bool):
        raise ValueError("a number of seconds or a duration such as '5m'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        sign, text = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
        try:
            seconds = sign * float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if "".join(number + unit for number, unit in parts) != text:
                raise ValueError(
                    f"'{value}' is neither seconds nor a duration such as '5m' or '1h30m'"
                ) from None
            seconds = sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    else:
        raise ValueError("a number of seconds or a duration such as '5m'")
    if math.isnan(seconds):
        raise ValueError("not a number")
    return math.inf if seconds < 0 else seconds


KeepAlive = Annotated[float, BeforeValidator(keep_alive_seconds)]


class ServedModelConfig(BaseModel):
    """One entry of `models`: the name requests use, the model (as the `model` setting
    takes it), how long it stays loaded idle, and any engine setting it sets apart from
    the server's (`kv_cache_memory`, `quantization`, ...)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[^=\s]+$")
    model: str = Field(min_length=1)
    keep_alive: KeepAlive | None = None

    @model_validator(mode="after")
    def _engine_settings_only(self) -> ServedModelConfig:
        settings = set(EngineConfig.model_fields) - {"model"}
        unknown = sorted(set(self.model_extra or {}) - settings)
        if unknown:
            raise ValueError(f"'{unknown[0]}' is not an engine setting a model may set")
        return self


# The log lines of a server process and of each Ray Serve replica.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ServeConfig(EngineConfig):
    """EngineConfig plus the HTTP settings; frozen and closed to unknown keys like its base."""

    host: str = Field("127.0.0.1", min_length=1, description="the address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="the port to listen on")
    api_key: SecretStr | list[SecretStr] | None = Field(
        None,
        description="require the key on /v1, as 'Authorization: Bearer KEY' or 'x-api-key: "
        "KEY' (env PAGEDSERVE_API_KEY); a "
        "list of keys in a config file lets several users share the server, each seeing only "
        "the stored responses it created",
    )
    api_key_file: Path | None = Field(
        None,
        description="a file of API keys, one a line (blank lines and lines starting with # "
        "are skipped), accepted beside api_key's",
    )
    response_store: Path | None = Field(
        None,
        description="the SQLite file that keeps the stored /v1/responses (store: true) "
        "across restarts; default: $PAGEDSERVE_CACHE/responses.sqlite3",
    )
    served_model_name: str | None = Field(
        None, min_length=1, description="the name clients use; default: the model's name"
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="the server log's level"
    )
    # How the model writes tool calls (server/tools/call_formats.py); auto reads the chat template.
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = "auto"
    reasoning_parser: Literal["auto", "qwen3", "deepseek_r1", "none"] = Field(
        "auto",
        description="how the model's reasoning is told from its answer (server/reasoning.py): "
        "qwen3 (a reply that opens with <think> reasons until </think>), deepseek_r1 (every "
        "reply opens in reasoning, until </think>), none (all of a reply is its answer); "
        "auto: qwen3 when the chat template writes <think>, else none",
    )
    # Overload and deadlines (server/admission.py).
    max_queued_requests: int | None = Field(
        None,
        gt=0,
        description="sequences (prompts x n) that may wait for a running slot before new "
        "requests get a 429; default: 4 x max_num_seqs",
    )
    request_timeout: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="seconds from arrival after which a request fails with a 504; a client "
        "may shorten it with X-Request-Timeout; default: none",
    )

    # Several models in one server (server/model_pool.py, docs/models.md).
    models: list[ServedModelConfig] | None = Field(
        None,
        description="several models, each {name, model, keep_alive, engine settings}, "
        "routed by a request's `model` (docs/models.md); on the command line --model "
        "NAME=SOURCE, repeated; in the environment a JSON list",
    )
    keep_alive: KeepAlive = Field(
        math.inf,
        description="how long a model stays loaded after its last request: seconds or a "
        "duration such as '5m'; 0: unloaded after each request; default: -1, for ever",
    )
    max_loaded_models: int | None = Field(
        None,
        gt=0,
        description="models loaded at once, at most; loading one more unloads the least "
        "recently used idle one; default: no limit but memory",
    )
    autoload: bool = Field(
        True, description="load a model on its first request (else only by /models/load)"
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's); "
        "turns enable_lora on",
    )

    max_tools: int = Field(
        128,
        gt=0,
        description="tools a chat request may offer (each is a part of the "
        "grammar of its calls); default: 128",
    )

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_no_key(cls, value: object) -> object:
        # `PAGEDSERVE_API_KEY=` conventionally unsets the key rather than requiring "".
        return None if value == "" else value

    @field_validator("api_key")
    @classmethod
    def _no_empty_key_in_a_list(
        cls, value: SecretStr | list[SecretStr] | None
    ) -> SecretStr | list[SecretStr] | None:
        # An empty list would leave the server open while looking locked.
        if isinstance(value, list) and not (value and all(k.get_secret_value() for k in value)):
            raise ValueError("a list of keys must hold at least one key, and no empty one")
        return value

    @field_validator("api_key_file")
    @classmethod
    def _key_file_holds_keys(cls, value: Path | None) -> Path | None:
        if value is not None and not read_key_file(value):
            raise ValueError(f"{value} holds no key")
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _models_from_json(cls, value: object) -> object:
        # The environment gives a JSON list as text.
        return from_json(value, "a JSON list")

    @model_validator(mode="after")
    def _models_are_distinct_and_valid(self) -> ServeConfig:
        if self.models is None:
            return self
        if not self.models:
            raise ValueError("models must name at least one model")
        if {"model", "served_model_name", "lora_modules"} & self.model_fields_set:
            raise ValueError(
                "models names each model: give model or models, not both (and lora_modules "
                "in each model's entry)"
            )
        names = [entry.name for entry in self.models]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"models names '{repeated[0]}' twice")
        for entry in self.models:
            try:
                self.engine_config(entry)
            except ValidationError as exc:
                error = exc.errors()[0]
                key = ".".join(str(part) for part in error["loc"])
                raise ValueError(f"model '{entry.name}': '{key}': {error['msg']}") from None
        return self

    def api_keys(self) -> list[str]:
        """Every accepted API key (reads `api_key_file`); none: the API is open."""
        keys = [self.api_key] if isinstance(self.api_key, SecretStr) else self.api_key or []
        from_file = [] if self.api_key_file is None else read_key_file(self.api_key_file)
        return [key.get_secret_value() for key in keys] + from_file

    def response_store_path(self) -> Path:
        """Where stored responses are kept (`response_store`, else under the cache)."""
        return self.response_store or cache_root() / "responses.sqlite3"

    def engine_config(self, entry: ServedModelConfig | None = None) -> EngineConfig:
        """The engine's share of the settings, as the engine's own type; for an entry of
        `models`, the server's with the entry's model and settings over them."""
        values = {key: getattr(self, key) for key in EngineConfig.model_fields}
        if entry is not None:
            values |= (entry.model_extra or {}) | {"model": entry.model}
        values["enable_lora"] = values["enable_lora"] or self.allow_runtime_lora_updating
        return EngineConfig(**values)


def read_key_file(path: Path) -> list[str]:
    """The keys in a file of keys, one a line; ValueError when it cannot be read."""
    try:
        lines = path.expanduser().read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def resolve_serve_config(
    config_path: str | Path | None,
    overrides: Mapping[str, Any],
    environ: Mapping[str, str],
) -> ServeConfig:
    """Build the ServeConfig for `pagedserve serve`; raises ConfigError naming a bad key."""
    layered: dict[str, Any] = {}
    named = any(
        overrides.get(key) is not None or ENV_PREFIX + key.upper() in environ
        for key in ("model", "models")
    )
    if config_path is None and not named:
        # The preset sits where a config file would: below the environment.
        layered.update(
            (key, value)
            for key, value in DEFAULT_PRESET.items()
            if ENV_PREFIX + key.upper() not in environ
        )
    layered.update((key, value) for key, value in overrides.items() if value is not None)
    return load_config(ServeConfig, config_path, layered, dict(environ))

"""Engine settings: one pydantic model, loaded from YAML, the environment and the CLI.

Precedence, lowest to highest: field defaults, the YAML file, `PAGEDSERVE_<KEY>`
environment variables, explicit overrides (the command line). Unknown keys and
invalid values raise `ConfigError` with a one-line message that names the key.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.kv_events_config import KVEventsConfig
from engine.sampling.params import (
    GENERATION_CONFIG_FILE,
    GENERATION_CONFIG_KEYS,
    RequestLimits,
    check_overrides,
)
from engine.speculative.config import SpeculativeConfig
from scheduler import SchedulingPolicy

logger = logging.getLogger(__name__)

ENV_PREFIX = "PAGEDSERVE_"
# The `PAGEDSERVE_*` variables that are not settings, each read where it is used.
NON_SETTING_VARIABLES = frozenset({"PAGEDSERVE_CACHE"})


class ConfigError(ValueError):
    """A setting a user gave is unknown or invalid; the message names it."""


class EngineConfig(BaseModel):
    """Everything the engine needs to load a model and size its KV cache."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # 'default', a local folder, a .gguf file or a hub id
    model: str = Field("default", min_length=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="compute dtype; auto: bf16 where the device computes it fast (CUDA "
        "that supports it, CPUs with AVX512-BF16 or AMX-BF16; for a pooling model, CPUs "
        "with AMX-BF16), else fp16 on CUDA, fp32 on the CPU",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA where present, else the CPU"
    )
    block_size: int = Field(16, gt=0, le=1024, description="tokens per KV-cache block")
    max_model_len: int | None = Field(None, gt=0, description="default: the model's, at most 8192")
    max_num_seqs: int = Field(128, gt=0, description="sequences in one step's batch, at most")
    max_num_batched_tokens: int = Field(
        1024, gt=0, description="tokens in one step (decode rows plus prefill chunks), at most"
    )
    memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="share of memory the KV cache may take: of a GPU's total less the "
        "model's peak use; of the CPU's available memory, at most 2 GiB unless "
        "kv_cache_memory is set",
    )
    kv_cache_memory: ByteSize | None = Field(None, gt=0, description="e.g. '2GiB'; caps profiling")
    # A hybrid model's recurrent layers (Gated DeltaNet, Mamba-2, short convolutions) keep a
    # fixed-size state per sequence, in slots drawn from the KV cache's budget: this share
    # of it (SGLang's split), at most two slots per max_num_seqs (running sequences and
    # prefix checkpoints); the KV blocks of its attention layers get the rest.
    state_share: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="share of the KV cache's budget that a hybrid model's recurrent state "
        "slots take (running sequences and prefix checkpoints)",
    )
    watermark: float = Field(
        0.01, ge=0, lt=1, description="share of the KV blocks a new request must leave free"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV blocks of prompt prefixes seen before"
    )
    enable_chunked_prefill: bool = Field(
        True, description="split long prompts into chunks that share steps with decodes"
    )
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs",
        description="the order waiting requests are admitted in, as vLLM's: fcfs (first "
        "come, first served; a request's priority other than 0 is refused) or priority (a "
        "lower request priority first, then arrival; when the KV cache is full, the running "
        "request of the highest priority value, latest arrival, is preempted first, also to "
        "admit a waiting request of a lower value); default: fcfs",
    )
    # The attention backend, chosen once at start-up (engine/model/attention_backend.py):
    # 'cpp' is the C++ kernel that reads KV blocks in place (CPU only; fp32 or bf16, head
    # sizes 32 to 256); 'torch' runs anywhere; 'triton' is the Triton kernels (CUDA).
    # 'auto' takes the first that can run the model: on the CPU cpp, then torch; on CUDA
    # triton, then torch; elsewhere torch. A named backend that cannot run stops start-up.
    attention_backend: Literal["auto", "torch", "cpp", "triton"] = "auto"
    # Whether steps run eagerly. null (the default): compiled wherever it can be, eager
    # with one warning that says why where it cannot. false on the CPU: every step runs
    # one forward compiled by Inductor around the C++ attention kernel, compiled once per
    # machine, model and settings and loaded from $PAGEDSERVE_CACHE/compiled after that
    # (engine/compiled/compiled_forward.py); start-up fails where it cannot. false on CUDA:
    # decode steps replay CUDA graphs captured per batch-size bucket (needs
    # attention_backend 'triton'); null on CUDA does the same when the backend is Triton
    # (auto's choice there). true: eager, what the tests compare against.
    enforce_eager: bool | None = Field(
        None, description="default: compiled where it can be (a compiler is found), else eager"
    )
    # Whether each step schedules the next batch and starts its forward before it makes
    # this step's text and outputs (engine/llm_engine.py, `LLMEngine.step`), so that on
    # CUDA the GPU computes while the host detokenizes, checks stop strings and hands out
    # outputs (vLLM's async scheduling). null (the default): on CUDA only; on the CPU the
    # forward has ended before the host goes on. Off with speculative decoding.
    async_scheduling: bool | None = Field(
        None, description="default: on CUDA; the next step starts before this one's text"
    )
    # Weight-only quantization of the linear layers (CPU only; engine/linears/quantized_linear.py).
    # 'auto' (the default) follows the checkpoint, as llama.cpp serves a GGUF: a GGUF with
    # quantized tensors runs 'gguf', its tensors in their own GGML types (Q4_K, Q6_K, ...,
    # the default model's Q4_1); anything else (and any device or dtype the kernel does not
    # take) stays unquantized. 'int8' and 'int4' quantize the weights again, to pagedserve's
    # own groups. See docs/quantization.md.
    quantization: Literal["auto", "none", "gguf", "int8", "int4"] = "auto"
    # Seeds the generator that sampled requests without a `seed` of their own draw from,
    # so a restarted engine given the same requests in the same order repeats itself;
    # null (the default) leaves them to torch's global RNG, different in every process.
    seed: int | None = None
    # Sampling defaults for the fields a request leaves out, as vLLM's settings of the same
    # names (engine/sampling/params.py): 'auto' takes them from the model's generation
    # config, 'vllm' ignores it (the neutral defaults: temperature 1, top_p 1, ...), or a
    # folder holding a generation_config.json; override_generation_config's keys win.
    generation_config: str = Field(
        "auto",
        min_length=1,
        description="auto (the model's generation config), vllm (none: neutral "
        "defaults), or a folder holding a generation_config.json; default: auto",
    )
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict,
        description="JSON object of sampling defaults over generation_config's, e.g. "
        "'{\"temperature\": 0.5}'; keys: " + ", ".join(GENERATION_CONFIG_KEYS),
    )

    # Speculative decoding by prompt lookup, as vLLM's setting of the same name
    # (engine/speculative/): the tokens that followed the context's last n-gram where it
    # occurred before are proposed, and verified in the step's one forward; a request's
    # tokens and logprobs are those it gets without speculation, greedy or seeded. Keys:
    # method ("ngram"), num_speculative_tokens, prompt_lookup_max, prompt_lookup_min
    # (vLLM's: one sets the other, neither means 5), disable_by_batch_size (steps aside
    # while more sequences run; default 4). {} or null: off. See docs/speculative.md.
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description='JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": '
        '4, "prompt_lookup_max": 3}\'; {} turns it off',
    )

    # The disk tier under the prefix cache (engine/kv_tiers/, docs/kv-tiers.md): full
    # prefix blocks are written to files as their KV is computed, and a prefix lookup
    # that stops in memory goes on there, also after a restart. A budget such as '4GiB',
    # least recently used blocks dropped beyond it; 0: off. Files live under kv_disk_path
    # (default $PAGEDSERVE_CACHE/kv), in a folder per model and setting that change a
    # block's bits, so several servers may share it.
    kv_disk_size: ByteSize = Field(
        0, ge=0, description="budget of the disk tier under the prefix cache, e.g. '4GiB'; 0: off"
    )
    kv_disk_path: str | None = Field(
        None, min_length=1, description="folder of the disk tier; default: $PAGEDSERVE_CACHE/kv"
    )
    # vLLM's setting: a pool of pinned host memory that evicted GPU blocks are copied to
    # and back from on a hit. Refused on the CPU, where the KV cache already is host RAM.
    kv_offloading_size: ByteSize = Field(
        0, ge=0, description="host RAM for KV blocks evicted from a GPU, e.g. '8GiB'; 0: off"
    )
    # KV-cache events for external routers, vLLM's `--kv-events-config` (its keys and wire
    # format): every block the KV tensor or a tier stores or drops, published over ZMQ.
    kv_events_config: KVEventsConfig | None = Field(
        None,
        description="JSON object with vLLM's keys, e.g. '{\"enable_kv_cache_events\": true, "
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'',
    )

    # Sleep (engine/sleep.py, docs/sleep.md): after this many seconds without a request the
    # engine sleeps at level 2 (the KV cache's and the file-mapped weights' pages given
    # back); the next request wakes it, /health does not. 0: never.
    sleep_idle_seconds: float = Field(
        0, ge=0, description="seconds without a request before the engine sleeps; 0: never"
    )

    # LoRA adapters (engine/lora/, docs/lora.md): PEFT folders served beside the model, a
    # request selecting one by name; up to max_loras at once, in slots made at start-up.
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (on by itself when lora_modules names any)"
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters loaded at start-up, NAME=PATH (a PEFT adapter folder); "
        "repeat the flag for more",
    )
    max_loras: int = Field(4, gt=0, description="LoRA adapters loaded at once; default: 4")
    max_lora_rank: int = Field(
        16, gt=0, le=512, description="the largest rank a LoRA adapter may have; default: 16"
    )

    # vLLM's setting: keys laid over the model's config.json. pagedserve reads them for
    # pooling models only (engine/pooling/spec.py): a decoder reranker is served as vLLM
    # serves Qwen3-Reranker, `{"architectures": ["Qwen3ForSequenceClassification"],
    # "classifier_from_token": ["no", "yes"]}`; a generating model refuses them.
    hf_overrides: dict[str, Any] | None = Field(
        None, description="a JSON object laid over the model's config.json (pooling models)"
    )
    # vLLM's pooler config: serve the model as an embedding model that pools its token
    # states by `pooling_type` (LAST, MEAN or CLS), normalized unless `normalize` is false
    # (engine/pooling/spec.py). It makes a decoder folder without sentence-transformers'
    # modules (a chat model) an embedder, and overrides such a folder's Pooling and
    # Normalize modules. Any other key is refused by name.
    pooler_config: dict[str, Any] | None = Field(
        None,
        description='serve as an embedding model pooling as it says: {"pooling_type": '
        '"LAST" | "MEAN" | "CLS", "normalize": true}',
    )

    # Bounds on what one request may carry where its size multiplies per-step work
    # (engine/sampling/params.py: RequestLimits); past one, the request gets a 400 naming
    # the field and the setting.
    max_stop_sequences: int = Field(
        64, gt=0, description="stop strings a request may give; default: 64"
    )
    max_stop_length: int = Field(
        1000, gt=0, description="characters in one stop string; default: 1000"
    )
    max_stop_token_ids: int = Field(
        1024, gt=0, description="stop_token_ids a request may give; default: 1024"
    )
    max_logit_bias_entries: int = Field(
        1024, gt=0, description="logit_bias entries a request may give; default: 1024"
    )

    def request_limits(self) -> RequestLimits:
        """The bounds requests are checked against (`RequestLimits.check`, at intake)."""
        return RequestLimits(
            max_stop_sequences=self.max_stop_sequences,
            max_stop_length=self.max_stop_length,
            max_stop_token_ids=self.max_stop_token_ids,
            max_logit_bias_entries=self.max_logit_bias_entries,
        )

    @field_validator("generation_config")
    @classmethod
    def _generation_config_source(cls, value: str) -> str:
        if value in ("auto", "vllm"):
            return value
        folder = Path(value).expanduser()
        if not (folder / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(f"'auto', 'vllm' or a folder holding {GENERATION_CONFIG_FILE}")
        return str(folder)

    @field_validator("override_generation_config", "hf_overrides", "pooler_config", mode="before")
    @classmethod
    def _override_from_json(cls, value: object) -> object:
        # The command line and the environment give a JSON object as text.
        return from_json(value, "a JSON object")

    @field_validator("speculative_config", "kv_events_config", mode="before")
    @classmethod
    def _object_from_json(cls, value: object) -> object:
        # The command line and the environment give a JSON object as text; {} means off.
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object: {exc}") from None
        return None if value == {} else value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _adapters_by_name(cls, value: object) -> object:
        # NAME=PATH texts (the command line's, repeated), a JSON object (the environment),
        # or vLLM's JSON form {"name": ..., "path": ...}.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = [value]
        if isinstance(value, dict) and set(value) >= {"name", "path"}:
            value = [value]
        if isinstance(value, list):
            return dict(_adapter_entry(entry) for entry in value)
        return value

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @field_validator("override_generation_config")
    @classmethod
    def _override_keys_and_values(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_overrides(value)

    @model_validator(mode="after")
    def _quantization_is_cpu_only(self) -> EngineConfig:
        if self.quantization not in ("auto", "none") and self.device == "cuda":
            raise ValueError(
                f"quantization '{self.quantization}' runs on the CPU only: its kernel "
                "is C++ for the CPU"
            )
        return self


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def from_json(value: object, what: str) -> object:
    """`value` parsed as JSON if it is text (a setting's value from the command line or the
    environment), else `value`; ValueError saying it is not `what`."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not {what}: {exc}") from None


def _adapter_entry(entry: object) -> tuple[str, str]:
    """(name, path) of one `lora_modules` entry: 'NAME=PATH' or {"name", "path"}."""
    if isinstance(entry, dict) and isinstance(entry.get("name"), str):
        return entry["name"], str(entry.get("path", ""))
    if isinstance(entry, str) and "=" in entry:
        name, _, path = entry.partition("=")
        if name and path:
            return name, path
    raise ValueError(f"{entry!r} is not NAME=PATH")


def cache_root() -> Path:
    """Where converted models and built kernels are kept: `$PAGEDSERVE_CACHE`, by default
    `~/.cache/pagedserve`."""
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def load_config(
    cls: type[ConfigT],
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    strict_environment: bool = True,
) -> ConfigT:
    """Build `cls` from a YAML file, `PAGEDSERVE_*` variables and explicit overrides.

    A `PAGEDSERVE_*` variable that is neither a setting of `cls` nor one of
    `NON_SETTING_VARIABLES` (a misspelt one, most likely) raises `ConfigError` naming it,
    as an unknown YAML key does; with `strict_environment=False` (a config that is a part
    of another one's settings) it is logged as a warning instead.
    """
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_read_yaml(Path(path)))
    env: Mapping[str, str] = os.environ if environ is None else environ
    known = {ENV_PREFIX + key.upper() for key in cls.model_fields} | NON_SETTING_VARIABLES
    unknown = sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known)
    if unknown:
        message = f"unknown environment variable {', '.join(unknown)}: not a pagedserve setting"
        if strict_environment:
            raise ConfigError(message)
        logger.warning("%s of %s; ignored", message, cls.__name__)
    for key in cls.model_fields:
        env_value = env.get(ENV_PREFIX + key.upper())
        if env_value is not None:
            # Kept a string: pydantic converts "16", "false" or "1GiB" by the field's type,
            # and a string setting such as an API key "007" stays exactly as written.
            values[key] = env_value
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return data


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        key = ".".join(str(p) for p in error["loc"]) or "<root>"
        if error["type"] == "extra_forbidden":
            parts.append(f"unknown setting '{key}'")
        else:
            parts.append(f"invalid setting '{key}': {error['msg']} (got {error.get('input')!r})")
    return "; ".join(parts)

"""Building an engine from its settings: the parts an `LLMEngine` is made of, in the order
they depend on each other.

The model is loaded first (transformers' eager attention, replaced by the probe's and then
the chosen attention backend's function), then quantized and packed; the step path is
chosen from the device, the backend and `enforce_eager` (compiled forward, decode graphs or
eager); the KV cache is sized from the memory the model leaves (a profiling forward on
CUDA), allocated, and the step path warmed up over it; the KV tier, the block manager and
the scheduler come next, then sampling and intake. A setting that cannot be served here
raises `ConfigError` saying why; one left unset that cannot be honoured here is logged
once with the reason.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from cache import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockManager,
    CacheSize,
    KVSizing,
    StatePool,
    cdiv,
    profile_num_blocks,
)
from engine import capabilities
from engine.adapters import Adapters
from engine.capabilities import StepPath
from engine.config import ConfigError, EngineConfig, cache_root
from engine.kv_tier import KVTier
from engine.model.attention import bind_attention
from engine.model.attention_backend import choose_backend
from engine.model.device import resolve_device, resolve_dtype
from engine.model.kv_cache import KVLayout, allocate_kv_cache
from engine.model.loader import load_model
from engine.model.recurrent import RecurrentStates, bind_recurrent
from engine.model.runner import ModelRunner
from engine.model.support import probe_attention
from engine.request.intake import RequestProcessor
from engine.sampling.params import resolve_defaults
from engine.sampling.sampler import Sampler
from engine.speculative.speculator import Speculator
from scheduler import ScheduledSequence, Scheduler, SchedulerOutput, Sequence, StateStep

logger = logging.getLogger(__name__)

# A model's own limit is often far beyond what a CPU serves usefully; cap the default.
DEFAULT_MAX_MODEL_LEN = 8192


class EngineBuilder:
    """The parts of an engine, built from `config` on construction: each is an attribute,
    which `LLMEngine` takes over. The builder holds nothing the engine does not."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        source = self._load_model(config)
        self.adapters = self._adapters(config)
        self.compiled = self._compiles(config)
        self.decode_graphs = self._captures_decode(config)
        self.max_model_len = self._max_model_len(config)
        self.block_size = config.block_size
        self._build_kv_cache(config, source)
        self.grammars = capabilities.grammar_compiler(
            self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        self.sampler = Sampler(config.seed, self.device, self.grammars)
        self.speculator = self._speculator(config)
        self.processor = RequestProcessor(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.grammars,
            config.request_limits(),
            config.scheduling_policy,
            turn_checkpoints=self.recurrent is not None,
        )
        self.async_scheduling = self._schedules_ahead(config)
        logger.info(
            "model %s (%s on %s): %d KV blocks of %d tokens (%d tokens), max_model_len %d, "
            "attention %s, %s steps, async scheduling %s",
            self.model_name, self.dtype, self.device, self.num_kv_blocks, self.block_size,
            self.num_kv_blocks * self.block_size, self.max_model_len,
            self.attention.backend.name, self._step_path(),
            "on" if self.async_scheduling else "off",
        )  # fmt: skip

    def _load_model(self, config: EngineConfig) -> str:
        """Load the model in the quantization it runs in, bind the chosen attention backend
        and pack its linears; return the folder or file it was loaded from."""
        self.quantization = mode = capabilities.quantization_mode(config, self.device, self.dtype)
        # Loaded with transformers' eager attention, which the probe's and then the chosen
        # backend's function replace: the backend takes the KV head size the probe finds.
        loaded = load_model(
            config.model, dtype=self.dtype, device=self.device, attn_implementation="eager",
            install=capabilities.gguf_install(self.dtype) if mode == "gguf" else None,
        )  # fmt: skip
        # Before the linears below are packed: the probe runs the model as loaded.
        self.kv_layout = probe_attention(loaded.model)
        self.recurrent = bind_recurrent(loaded.model)
        self.recurrent_kernels = self._recurrent_kernels()
        self.attention = choose_backend(
            config.attention_backend, self.device, self.dtype, self.kv_layout.head_sizes,
            config.block_size,
        )  # fmt: skip
        bind_attention(loaded.model, self.attention.backend, self.kv_layout.layers)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.eos_token_ids = loaded.eos_token_ids
        self.mapped_bytes = loaded.mapped_bytes
        self.default_sampling = self._sampling_defaults(config)
        self.vocab_size = self.model.get_output_embeddings().out_features
        if mode in ("int8", "int4"):
            # The packing below takes plain `nn.Linear`s only: it leaves these alone.
            folder = Path(loaded.source)
            capabilities.quantize(self.model, mode, self.dtype, folder if folder.is_dir() else None)
        capabilities.pack(self.model, self.device, self.dtype)
        return loaded.source

    def _recurrent_kernels(self) -> bool:
        """Whether a hybrid model's recurrent layers run their C++ kernels (else their torch
        reference, with one line saying why)."""
        if self.recurrent is None:
            return False
        reason = capabilities.recurrent_kernels(self.device)
        if reason is not None:
            logger.warning("recurrent layers on torch, not their C++ kernels: %s", reason)
        return reason is None

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        """Prompt lookup as `speculative_config` asks; off for a hybrid model, with one
        warning: its recurrent state cannot be taken back past a rejected draft."""
        if not config.speculative_config:
            return None
        if self.recurrent is not None:
            logger.warning(
                "speculative decoding off: %s keeps recurrent state, which a rejected draft "
                "token would have advanced", self.model_name,
            )  # fmt: skip
            return None
        return Speculator(config.speculative_config)

    def _max_model_len(self, config: EngineConfig) -> int:
        """`max_model_len`, or when unset the model's own limit capped at
        `DEFAULT_MAX_MODEL_LEN`; without chunked prefill a step must fit a whole prompt."""
        model_limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        max_model_len = config.max_model_len or min(
            model_limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN
        )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens})"
                f" must be at least max_model_len ({max_model_len}) so any prompt fits a step"
            )
        return max_model_len

    def _build_kv_cache(self, config: EngineConfig, source: str) -> None:
        """Size and allocate the KV cache, the runner over it (warmed up), the KV events'
        publisher and tier, and the block manager and scheduler that hand its blocks out."""
        size = self._profile_num_blocks(self.kv_layout)
        self.num_kv_blocks, self.num_state_slots = size.num_blocks, size.num_state_slots
        kv_caches = allocate_kv_cache(
            self.kv_layout, self.num_kv_blocks, self.block_size, self.dtype, self.device
        )
        self.states = None
        if self.recurrent is not None:
            self.states = RecurrentStates.allocate(
                self.recurrent, self.num_state_slots, self.device
            )
        self.runner = self._runner(kv_caches, self.states)
        self._warm_up(config)
        self.events = capabilities.kv_event_publisher(config.kv_events_config)
        self.tier = self._kv_tier(config, source, kv_caches)
        block_manager = BlockManager(
            self.num_kv_blocks,
            self.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark=config.watermark,
            record_events=self.events is not None,
            record_registered=self.tier is not None,
            medium=MEDIUM_GPU if self.device.type == "cuda" else MEDIUM_CPU,
            state_pool=StatePool(self.num_state_slots) if self.num_state_slots else None,
        )
        self.scheduler = Scheduler(
            block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            sliding_window=self.kv_layout.sliding_window,
            policy=config.scheduling_policy,
            tier=self.tier,
        )

    def _runner(
        self, kv_caches: tuple[torch.Tensor, ...], states: RecurrentStates | None = None
    ) -> ModelRunner:
        """A runner over the KV tensors (and a hybrid model's recurrent `states`) whose
        steps take the step path chosen now."""
        return ModelRunner(
            self.model,
            kv_caches,
            self.block_size,
            self.config.max_num_seqs,
            self.max_model_len,
            step_path=capabilities.step_executor(self._step_path(), self.config.max_num_seqs),
            states=states,
            recurrent_kernels=self.recurrent_kernels,
        )

    def _schedules_ahead(self, config: EngineConfig) -> bool:
        """Whether `step` launches the next batch before this one's text (see `step`): as
        `async_scheduling` says, or when unset, on CUDA (where the forward runs while the
        host works; on the CPU the forward has ended before the host goes on, so
        scheduling ahead would only delay new requests by a step). Never with speculative
        decoding, whose kept tokens depend on each one's text (a stop string ends them)."""
        if self.speculator is not None:
            if config.async_scheduling:
                raise ConfigError("async_scheduling does not combine with speculative decoding")
            return False
        if config.async_scheduling is None:
            return self.device.type == "cuda"
        return config.async_scheduling

    def _sampling_defaults(self, config: EngineConfig) -> dict[str, Any]:
        """The defaults for sampling fields a request leaves out (see
        `engine.sampling.params`), logged once when they are not the neutral ones."""
        try:
            defaults, source = resolve_defaults(
                config.generation_config,
                config.override_generation_config,
                self.model.generation_config,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if defaults:
            logger.info(
                "Default sampling parameters have been overridden by %s: %s", source, defaults
            )
        return defaults

    def _compiles(self, config: EngineConfig) -> bool:
        """Whether steps run through a compiled forward: on the CPU, with an attention
        backend that `compiles`, with `enforce_eager` false (else a `ConfigError` says why
        it cannot) or unset (else a warning says why it runs eager). With a backend that
        only `captures` (Triton), and on CUDA, steps are never compiled: decode graphs
        instead (`_captures_decode`)."""
        if config.enforce_eager:
            return False
        backend = self.attention.backend
        if self.device.type == "cuda" or (backend.captures and not backend.compiles):
            if config.enforce_eager is False and not backend.captures:
                raise ConfigError(
                    "enforce_eager false on CUDA (decode graphs) needs an attention backend "
                    f"that reads only device tensors ('triton'), not '{backend.name}'"
                )
            return False
        reason = self._cannot_compile_reason(config)
        if reason is None:
            return True
        if config.enforce_eager is None:
            logger.warning("serving eager, not compiled: %s", reason)
            return False
        raise ConfigError(
            "enforce_eager false on the CPU compiles the forward, which this engine cannot: "
            f"{reason}"
        )

    def _captures_decode(self, config: EngineConfig) -> bool:
        """Whether decode steps replay CUDA graphs: wherever the forward is not compiled,
        with `enforce_eager` false (CUDA, which `_compiles` held to a backend that
        captures, or Triton's interpreter on the CPU, which runs the same padded steps
        uncaptured), or unset on CUDA with a backend that captures (Triton, `auto`'s first
        choice there). Unset on CUDA otherwise stays eager, with one warning that says why."""
        if self.compiled or config.enforce_eager:
            return False
        if self.adapters is not None:
            # A captured graph would replay the LoRA rows of the step it was captured in.
            logger.warning("decode steps eager, not captured: LoRA adapters are enabled")
            return False
        if self.recurrent is not None:
            # The recurrent layers' torch path reads the step's host arrays.
            if self.device.type == "cuda":
                logger.warning("decode steps eager, not captured: the model has recurrent layers")
            return False
        if config.enforce_eager is False:
            return True
        if self.device.type != "cuda":
            return False
        backend = self.attention.backend
        reason = (
            capabilities.decode_graphs_unavailable()
            if backend.captures
            else f"attention backend '{backend.name}' cannot be captured in CUDA graphs"
        )
        if reason is not None:
            logger.warning("decode steps eager, not captured: %s", reason)
            return False
        return True

    def _adapters(self, config: EngineConfig) -> Adapters | None:
        """The LoRA component's adapters over the model's projections, with `lora_modules`
        loaded (an AdapterError names a bad one); None without LoRA."""
        if not config.lora_enabled:
            return None
        adapters = capabilities.lora_adapters(self.model, self.device, config)
        for name, path in config.lora_modules.items():
            adapters.add(adapters.read(name, path))
        return adapters

    def _step_path(self) -> StepPath:
        """The path every step takes (see `_compiles` and `decode_graphs`)."""
        if self.compiled:
            return "compiled"
        return "graphs" if self.decode_graphs else "eager"

    def _cannot_compile_reason(self, config: EngineConfig) -> str | None:
        if os.environ.get("TORCHDYNAMO_DISABLE") == "1":
            return "TORCHDYNAMO_DISABLE=1 is set"
        if self.recurrent is not None and not self.recurrent_kernels:
            return "the recurrent layers' C++ kernels cannot run here"
        missing = capabilities.compiled_unavailable()
        if missing is not None:
            return missing
        if self.attention.backend.compiles:
            return None
        if config.attention_backend != "auto":
            return f"attention_backend is '{config.attention_backend}'"
        # Only the CPU gets here, where auto takes torch only after passing over cpp.
        return "; ".join(
            f"attention backend '{name}' cannot run here: {reason}"
            for name, reason in self.attention.passed_over.items()
        )

    def _warm_up(self, config: EngineConfig) -> None:
        """Capture the decode graphs or compile (or load) the forward. With `enforce_eager`
        unset, a forward that cannot be compiled here leaves the engine eager, with one
        warning that says why."""
        if self.device.type != "cuda" and not self.compiled:
            return
        try:
            self.runner.warm_up()
        except ConfigError as exc:
            if not self.compiled or config.enforce_eager is not None:
                raise
            logger.warning("serving eager, not compiled: %s", exc)
            self.runner.executor = self.runner.eager
            self.compiled = False

    def _kv_tier(
        self, config: EngineConfig, source: str, kv_caches: tuple[torch.Tensor, ...]
    ) -> KVTier | None:
        """The KV tier the settings ask for, logged: host RAM beside a GPU
        (`kv_offloading_size`, refused on the CPU), or the disk tier (`kv_disk_size`),
        keyed by everything that changes a block's bits here; None when both are 0 (or
        prefix caching, above either, is off)."""
        if config.kv_offloading_size:
            if self.device.type != "cuda":
                raise ConfigError(
                    "kv_offloading_size is host RAM for a GPU's KV blocks; on the CPU the KV "
                    "cache is in RAM already: raise kv_cache_memory instead"
                )
            if config.kv_disk_size:
                raise ConfigError(
                    "kv_offloading_size and kv_disk_size: this version runs one KV tier at a "
                    "time; set one of them to 0"
                )
        if not (config.kv_disk_size or config.kv_offloading_size):
            return None
        if not config.enable_prefix_caching:
            logger.warning("KV tier off: it sits under the prefix cache, which is off")
            return None
        if self.recurrent is not None:
            logger.warning(
                "KV tier off: %s keeps recurrent state, whose prefix checkpoints the tier "
                "does not hold (a hit on its blocks alone could not resume)", self.model_name,
            )  # fmt: skip
            return None
        publish = None if self.events is None else self.events.publish
        if config.kv_offloading_size:
            tier = capabilities.host_kv_tier(
                kv_caches, int(config.kv_offloading_size), self.block_size, publish
            )
            logger.info(
                "KV host tier: %.1f MiB of pinned host memory", tier.stats().capacity / 2**20
            )
            return tier
        root = Path(config.kv_disk_path) if config.kv_disk_path else cache_root() / "kv"
        settings = {
            "quantization": self.quantization, "dtype": str(self.dtype),
            "device": self.device.type, "block_size": str(self.block_size),
            "kv_layout": self.kv_layout.describe(), "kv_dtype": str(kv_caches[0].dtype),
            "step_path": self._step_path(), "attention": self.attention.backend.name,
        }  # fmt: skip
        tier = capabilities.kv_tier(
            kv_caches, int(config.kv_disk_size), root, Path(source), settings, self.block_size,
            publish,
        )  # fmt: skip
        stats = tier.stats()
        logger.info(
            "KV disk tier: %.1f MiB of %.1f MiB used (%d blocks), at %s",
            stats.bytes_used / 2**20, stats.capacity / 2**20, stats.num_blocks, stats.path,
        )  # fmt: skip
        return tier

    def _profile_num_blocks(self, layout: KVLayout) -> CacheSize:
        """Size the KV cache from the memory the model leaves free.

        On CUDA the largest batch the scheduler can form runs once first, so the peak
        includes its activations; with decode graphs, they are captured over that scratch
        cache and held while the free memory is read, so their memory pool is left out of
        the KV cache (they are captured again over the real one). On the CPU there is no
        peak to read (psutil's available memory is the figure, and `1 - memory_utilization`
        of it stays for activations), so the forward is skipped.
        """
        runner = None
        if self.device.type == "cuda":
            tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
            blocks = cdiv(tokens, self.block_size)
            scratch = allocate_kv_cache(layout, blocks, self.block_size, self.dtype, self.device)
            states = state = None
            if self.recurrent is not None:  # one sequence's state, from nothing
                states = RecurrentStates.allocate(self.recurrent, 1, self.device)
                state = StateStep(0, -1)
            torch.cuda.reset_peak_memory_stats(self.device)
            runner = self._runner(scratch, states)  # on CUDA never compiled: graphs or eager
            seq = Sequence("profile", "profile", [0] * tokens, max_tokens=1)
            item = ScheduledSequence(seq, tokens, 0, True, list(range(blocks)), state=state)
            runner.update_block_tables(SchedulerOutput([item]))
            runner.execute([item])
            runner.warm_up()
            del scratch
            torch.cuda.empty_cache()
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        sizing = KVSizing(
            block_bytes=layout.bytes_per_block(self.block_size, itemsize),
            device_type=self.device.type,
            memory_utilization=self.config.memory_utilization,
            kv_cache_memory=self.config.kv_cache_memory,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            watermark=self.config.watermark,
            max_num_seqs=self.config.max_num_seqs,
            cpu_reserved=self.mapped_bytes,
            state_bytes=0 if self.recurrent is None else self.recurrent.bytes_per_slot,
            state_share=self.config.state_share,
        )
        size = profile_num_blocks(
            sizing,
            cuda_mem_get_info=lambda: torch.cuda.mem_get_info(self.device),
            cuda_memory_stats=lambda: torch.cuda.memory_stats(self.device),
        )
        del runner  # and with it the scratch cache and any graphs captured over it
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return size

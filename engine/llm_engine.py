"""LLMEngine: requests in, one scheduled and executed batch per `step()`, outputs out."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cache import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockHashes,
    BlockManager,
    KVSizing,
    bytes_per_block,
    cdiv,
    extend_block_hashes,
    profile_num_blocks,
)
from engine import capabilities, sleep
from engine.adapters import Adapters, ServedAdapter
from engine.capabilities import StepPath
from engine.config import ConfigError, EngineConfig, cache_root
from engine.errors import AdapterError
from engine.kv_tier import KVTier
from engine.model.attention import bind_attention
from engine.model.attention_backend import choose_backend
from engine.model.device import resolve_device, resolve_dtype
from engine.model.kv_cache import KVLayout, allocate_kv_cache
from engine.model.loader import checkpoint_quantization, load_model
from engine.model.runner import ModelRunner
from engine.model.support import probe_attention
from engine.outputs import RequestOutput
from engine.request.detokenizer import TokenTexts
from engine.request.intake import EngineRequest, RequestProcessor
from engine.request.state import RequestState, SampleState
from engine.sampling.params import resolve_defaults
from engine.sampling.sampler import Sampler, SamplerOutput, prompt_logprobs
from engine.sleep import SleepReport
from engine.snapshot import EngineSnapshot, EngineStats, SequenceSnapshot
from engine.speculative.speculator import Speculator, generator_states, rewind, sampling_rows
from scheduler import FinishReason, ScheduledSequence, Scheduler, SchedulerOutput, Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Launched:
    """A scheduled batch whose forward has started; `logits` are its output (on CUDA,
    still being computed)."""

    batch: SchedulerOutput
    logits: torch.Tensor


def _rows_of_unfinished(
    items: list[ScheduledSequence], num_rows: list[int], device: torch.device
) -> torch.Tensor:
    """The indices of the rows of the `items` whose sequence is unfinished, where item i
    has `num_rows[i]` consecutive rows, in the items' order."""
    rows: list[int] = []
    offset = 0
    for item, count in zip(items, num_rows, strict=True):
        if not item.seq.is_finished:
            rows += range(offset, offset + count)
        offset += count
    return torch.tensor(rows, dtype=torch.long, device=device)


# A model's own limit is often far beyond what a CPU serves usefully; cap the default.
DEFAULT_MAX_MODEL_LEN = 8192
# How long a step with nothing to run waits for a tier's load, rather than spin.
LOAD_WAIT_SECONDS = 0.02


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and every unfinished request.

    Invariant: `_requests` holds exactly the requests with an unfinished sample; a request
    leaves it in the step that finishes its last sample (or when aborted), and the
    scheduler has freed all its blocks by then. Requests come in through `processor`
    (validated and tokenized once); outputs go out as deltas. Not thread-safe: one thread
    drives it.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.quantization not in ("auto", "none"):
            reason = capabilities.quantization_unavailable(
                self.device, self.dtype, config.quantization
            )
            if reason is not None:
                raise ConfigError(
                    f"quantization '{config.quantization}' cannot run in this engine "
                    f"({self.dtype} on {self.device}): {reason}"
                )
        self.quantization = mode = self._quantization(config, checkpoint_quantization(config.model))
        # Loaded with transformers' eager attention, which the probe's and then the chosen
        # backend's function replace: the backend takes the KV head size the probe finds.
        loaded = load_model(
            config.model, dtype=self.dtype, device=self.device, attn_implementation="eager",
            install=capabilities.gguf_install(self.dtype) if mode == "gguf" else None,
        )  # fmt: skip
        # Before the linears below are packed: the probe runs the model as loaded.
        self.kv_layout = probe_attention(loaded.model)
        self.attention = choose_backend(
            config.attention_backend, self.device, self.dtype, self.kv_layout.head_dim,
            config.block_size,
        )  # fmt: skip
        bind_attention(loaded.model, self.attention.backend)
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
        self.adapters = self._adapters(config)
        self.compiled = self._compiles(config)
        self.decode_graphs = self._captures_decode(config)
        model_limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.max_model_len = config.max_model_len or min(
            model_limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN
        )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens})"
                f" must be at least max_model_len ({self.max_model_len}) so any prompt fits a step"
            )
        self.block_size = config.block_size
        layout = self.kv_layout
        self.num_kv_blocks = self._profile_num_blocks(layout)
        kv_cache = allocate_kv_cache(
            layout, self.num_kv_blocks, self.block_size, self.dtype, self.device
        )
        self.runner = ModelRunner(
            self.model,
            kv_cache,
            self.block_size,
            config.max_num_seqs,
            self.max_model_len,
            step_path=capabilities.step_executor(self._step_path(), config.max_num_seqs),
        )
        self._warm_up(config)
        self.events = capabilities.kv_event_publisher(config.kv_events_config)
        self.tier = self._kv_tier(config, loaded.source, kv_cache)
        block_manager = BlockManager(
            self.num_kv_blocks,
            self.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark=config.watermark,
            record_events=self.events is not None,
            record_registered=self.tier is not None,
            medium=MEDIUM_GPU if self.device.type == "cuda" else MEDIUM_CPU,
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
        self.grammars = capabilities.grammar_compiler(
            self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        self.sampler = Sampler(config.seed, self.device, self.grammars)
        self.speculator = (
            Speculator(config.speculative_config) if config.speculative_config else None
        )
        self.processor = RequestProcessor(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.grammars,
            config.request_limits(),
            config.scheduling_policy,
        )
        self._token_texts = TokenTexts(self.tokenizer)
        self._requests: dict[str, RequestState] = {}
        self._samples: dict[str, SampleState] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self.async_scheduling = self._schedules_ahead(config)
        self._launched: _Launched | None = None
        self.sleep_level = 0  # 0: awake; else the level of the last `sleep`
        logger.info(
            "model %s (%s on %s): %d KV blocks of %d tokens (%d tokens), max_model_len %d, "
            "attention %s, %s steps, async scheduling %s",
            self.model_name, self.dtype, self.device, self.num_kv_blocks, self.block_size,
            self.num_kv_blocks * self.block_size, self.max_model_len,
            self.attention.backend.name, self._step_path(),
            "on" if self.async_scheduling else "off",
        )  # fmt: skip

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

    def _quantization(self, config: EngineConfig, checkpoint: str) -> str:
        """The quantization mode this engine runs: the setting, or with 'auto' the one the
        checkpoint ships in ("gguf": a GGUF's own types) where the kernel can run it here
        (else none, with a warning)."""
        if config.quantization == "gguf" and checkpoint != "gguf":
            raise ConfigError(
                f"quantization 'gguf' serves a GGUF file's own quantized types, and model "
                f"'{config.model}' is not such a file"
            )
        if config.quantization != "auto":
            return config.quantization
        if checkpoint != "none":
            reason = capabilities.quantization_unavailable(self.device, self.dtype, checkpoint)
            if reason is not None:
                logger.warning(
                    "the checkpoint's tensors are quantized, but the kernel cannot run here "
                    "(%s): serving them dequantized to %s",
                    reason, self.dtype,
                )  # fmt: skip
                return "none"
            logger.info("quantization gguf: the checkpoint's own types (quantization: auto)")
        return checkpoint

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

    def _kv_tier(self, config: EngineConfig, source: str, kv_cache: torch.Tensor) -> KVTier | None:
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
        publish = None if self.events is None else self.events.publish
        if config.kv_offloading_size:
            tier = capabilities.host_kv_tier(
                kv_cache, int(config.kv_offloading_size), self.block_size, publish
            )
            logger.info(
                "KV host tier: %.1f MiB of pinned host memory", tier.stats().capacity / 2**20
            )
            return tier
        root = Path(config.kv_disk_path) if config.kv_disk_path else cache_root() / "kv"
        settings = {
            "quantization": self.quantization, "dtype": str(self.dtype),
            "device": self.device.type, "block_size": str(self.block_size),
            "kv_layout": repr(self.kv_layout), "kv_dtype": str(kv_cache.dtype),
            "step_path": self._step_path(), "attention": self.attention.backend.name,
        }  # fmt: skip
        tier = capabilities.kv_tier(
            kv_cache, int(config.kv_disk_size), root, Path(source), settings, self.block_size,
            publish,
        )  # fmt: skip
        stats = tier.stats()
        logger.info(
            "KV disk tier: %.1f MiB of %.1f MiB used (%d blocks), at %s",
            stats.bytes_used / 2**20, stats.capacity / 2**20, stats.num_blocks, stats.path,
        )  # fmt: skip
        return tier

    def _profile_num_blocks(self, layout: KVLayout) -> int:
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
            torch.cuda.reset_peak_memory_stats(self.device)
            runner = ModelRunner(
                self.model,
                scratch,
                self.block_size,
                self.config.max_num_seqs,
                self.max_model_len,
                step_path=capabilities.step_executor(
                    "graphs" if self.decode_graphs else "eager", self.config.max_num_seqs
                ),
            )
            seq = Sequence("profile", "profile", [0] * tokens, max_tokens=1)
            item = ScheduledSequence(seq, tokens, 0, True, list(range(blocks)))
            runner.update_block_tables(SchedulerOutput([item]))
            runner.execute([item])
            runner.warm_up()
            del scratch
            torch.cuda.empty_cache()
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        sizing = KVSizing(
            block_bytes=bytes_per_block(
                layout.num_layers, self.block_size, layout.num_kv_heads, layout.head_dim, itemsize
            ),
            device_type=self.device.type,
            memory_utilization=self.config.memory_utilization,
            kv_cache_memory=self.config.kv_cache_memory,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            watermark=self.config.watermark,
            max_num_seqs=self.config.max_num_seqs,
            cpu_reserved=self.mapped_bytes,
        )
        num_blocks = profile_num_blocks(
            sizing,
            cuda_mem_get_info=lambda: torch.cuda.mem_get_info(self.device),
            cuda_memory_stats=lambda: torch.cuda.memory_stats(self.device),
        )
        del runner  # and with it the scratch cache and any graphs captured over it
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return num_blocks

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, request: EngineRequest) -> None:
        """Schedule a request that `processor` (or a processor of this engine) made."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = self._adapter(request.lora_name)
        state = RequestState.create(
            request_id, request, self.eos_token_ids, self.tokenizer, self._token_texts,
            self.device, self.grammars, self._prompt_hashes(request, adapter), adapter,
        )  # fmt: skip
        self._requests[request_id] = state
        self._prompt_tokens_total += len(request.prompt_token_ids) * request.params.n
        for sample in state.samples:
            self._samples[sample.seq.seq_id] = sample
            self.scheduler.add(sample.seq)

    def remove_lora(self, name: str) -> None:
        """Stop serving the LoRA adapter `name` (AdapterError if it is not served); its
        slot is freed once no unfinished sequence uses it, now if none does."""
        if self.adapters is None or self.adapters.get(name) is None:
            raise AdapterError(f"no LoRA adapter named '{name}' is loaded")
        self.adapters.remove(name)
        self._free_adapter_slots()

    def _free_adapter_slots(self) -> None:
        if self.adapters is not None and self.adapters.removing:
            self.adapters.free_unused(sample.seq.lora_slot for sample in self._samples.values())

    def _adapter(self, name: str | None) -> ServedAdapter | None:
        """The LoRA adapter named `name` (None: the base model); ValueError if it is not
        served (it was unloaded after the request was routed to it)."""
        if name is None:
            return None
        adapter = None if self.adapters is None else self.adapters.get(name)
        if adapter is None:
            raise ValueError(f"no LoRA adapter named '{name}' is loaded")
        return adapter

    def _prompt_hashes(
        self, request: EngineRequest, adapter: ServedAdapter | None
    ) -> tuple[int, ...]:
        """The prompt's block hashes that its samples start from: those it came with (the
        base model's), and for n > 1 all of them, hashed once here rather than once per
        sample (onto an adapter's root for its requests)."""
        given = request.block_hashes if adapter is None else ()
        if request.params.n == 1 or not self.config.enable_prefix_caching:
            return given
        hashes = BlockHashes(None if adapter is None else adapter.root)
        hashes.extend(given)
        extend_block_hashes(hashes, request.prompt_token_ids, self.block_size)
        return tuple(hashes)

    def abort_request(self, request_id: str) -> None:
        """Finish every sample of the request with "abort" and free its blocks now."""
        self.scheduler.abort(request_id)
        state = self._requests.get(request_id)
        if state is not None:
            self._forget(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, apply stops; return the changed requests'
        outputs (each the deltas since that request's previous output).

        With async scheduling (`async_scheduling`), the next step's batch is scheduled and
        its forward launched as soon as this step's tokens are known and have been checked
        by their ids (`SampleState.on_token`: ending tokens, grammar, `max_tokens`), before
        their text (`SampleState.on_text`: detokenization, stop strings) and the outputs
        are made: on CUDA the forward runs while the host does that work, and while the
        caller handles the outputs. That step's tokens are sampled at the next call. A
        sequence that a stop string (or an abort between calls) finishes while its row is
        in flight has that row dropped unsampled; its output ends where the stop says.

        A failure in the model or sampler fails the requests of this batch (finish reason
        "error") and leaves the engine serving; their cached block hashes are dropped,
        since their K/V may not have been written.

        With a KV tier, each step first copies in the tier's finished loads (their
        sequences run from this step on), hands it the blocks registered up to the sampled
        batch (their K/V is written) and starts the loads the schedule asks for; a step
        with nothing to run waits briefly for a load rather than spin.
        """
        touched: dict[str, RequestState] = {}
        if self.tier is not None:
            self._finish_loads(0.0)
        launched = self._launched or self._launch(touched)
        self._launched = None
        if launched is not None:
            taken = self._sample(launched, touched)
            self._store_blocks()  # before a launch registers blocks whose KV is unwritten
            if self.async_scheduling:
                self._launched = self._launch(touched)
            self._add_texts(taken)
        elif self.tier is not None:
            self._store_blocks()
            self._finish_loads(LOAD_WAIT_SECONDS)  # nothing else to run: wait, not spin
        if self.events is not None:
            self._publish_events()
        outputs = []
        for state in touched.values():
            outputs.append(state.take_output())
            if state.finished:
                self._forget(state)
        self._free_adapter_slots()
        return outputs

    def _finish_loads(self, wait: float) -> None:
        """Copy the tier's finished loads in and let their sequences run."""
        assert self.tier is not None
        for load, num_blocks in self.tier.finish_loads(wait):
            self.scheduler.loaded(load, num_blocks)

    def _store_blocks(self) -> None:
        """Hand the tier the blocks registered since the last call: their KV is written
        (the steps that write it have run, and failed steps' registrations are gone)."""
        if self.tier is not None:
            registered = self.scheduler.block_manager.take_registered()
            if registered:
                self.tier.store(registered)

    def _publish_events(self) -> None:
        assert self.events is not None
        events = self.scheduler.block_manager.take_events()
        if events:
            self.events.publish(events)

    def close(self) -> None:
        """Finish the tier's queued writes and stop its threads and the event publisher."""
        if self.tier is not None:
            self.tier.close()
        if self.events is not None:
            self.events.close()

    # -- sleep ------------------------------------------------------------------------

    def sleep_unsupported(self) -> str | None:
        """Why this engine cannot sleep, or None if it can."""
        if self.device.type != "cpu":
            return f"sleep mode runs on the CPU; this engine runs on {self.device.type}"
        if not sleep.supported():
            return "sleep mode needs Linux (madvise and /proc/self)"
        return None

    def sleep(self, level: int) -> SleepReport:
        """Give memory back while idle (see engine/sleep.py): level 1 the KV cache's pages,
        level 2 also the file-mapped weights' pages. The prefix cache is forgotten first
        (its KV is gone; a disk tier keeps its own). Call it with no unfinished request;
        nothing needs undoing to serve again (`wake_up`)."""
        assert not self.has_unfinished_requests() and self.sleep_unsupported() is None
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} is none of 1 and 2")
        started, before = time.monotonic(), sleep.resident_bytes()
        self.scheduler.reset_prefix_cache()
        if self.events is not None:
            self._publish_events()
        sleep.release_tensor(self.runner.kv_cache)
        if level == 2:
            sleep.release_mappings(sleep.weight_mappings(self.model))
        self.sleep_level = level
        return SleepReport(level, before - sleep.resident_bytes(), time.monotonic() - started)

    def wake_up(self) -> None:
        """Serve again after `sleep`: released pages come back as steps touch them."""
        self.sleep_level = 0

    def _launch(self, touched: dict[str, RequestState]) -> _Launched | None:
        """Schedule a batch and start its forward (on CUDA it runs on while the host goes
        on); None when nothing is scheduled or the forward failed at once."""
        drafts = None
        if self.speculator is not None:
            running = self.scheduler.running()
            drafts = self.speculator.propose(
                (self._samples[seq.seq_id] for seq in running), len(running)
            )
        batch = self.scheduler.schedule(drafts)
        if batch.loads:
            assert self.tier is not None
            self.tier.start_loads(batch.loads)
        self.runner.update_block_tables(batch)
        for seq in batch.rejected:
            state = self._requests[seq.request_id]
            state.error = seq.error
            touched[state.request_id] = state
        if not batch.scheduled:
            return None
        if self.adapters is not None:
            scheduled = batch.scheduled
            self.adapters.set_step(
                np.repeat([item.seq.lora_slot for item in scheduled],
                          [item.num_new_tokens for item in scheduled])
            )  # fmt: skip
        try:
            return _Launched(batch, self.runner.execute(batch.scheduled))
        except Exception as exc:
            self._fail(batch, exc, touched)
            return None

    def _sample(
        self, launched: _Launched, touched: dict[str, RequestState]
    ) -> list[tuple[SampleState, FinishReason | None]]:
        """Sample the launched batch's rows of the sequences still unfinished, append their
        tokens and check them by id (`_apply_tokens`)."""
        batch, logits = launched.batch, launched.logits
        every = batch.sampling
        items = [item for item in every if not item.seq.is_finished]
        sampling = [self._samples[item.seq.seq_id] for item in items]
        num_sampled = batch.num_sampled_rows
        try:
            sampled_logits = logits[:num_sampled]
            if len(items) < len(every):
                num_rows = [item.num_sampled_rows for item in every]
                sampled_logits = logits[_rows_of_unfinished(every, num_rows, logits.device)]
            if self.speculator is None:
                rows, generators = [sample.row for sample in sampling], {}
            else:  # draft tokens add rows
                rows, generators = sampling_rows(items, sampling), generator_states(items, sampling)
            sampled = self.sampler.sample(sampled_logits, rows)
            if len(logits) > num_sampled:
                self._add_prompt_logprobs(batch, logits[num_sampled:])
        except Exception as exc:
            self._fail(batch, exc, touched)
            return []
        return self._apply_tokens(batch, items, sampling, sampled, generators, touched)

    def _fail(
        self, batch: SchedulerOutput, exc: Exception, touched: dict[str, RequestState]
    ) -> None:
        logger.exception("engine step failed; failing its %d sequences", len(batch.scheduled))
        self._fail_batch(batch, f"{type(exc).__name__}: {exc}", touched)

    def _add_prompt_logprobs(self, batch: SchedulerOutput, logits: torch.Tensor) -> None:
        """Give each chunk's prompt-logprob rows (`logits`, in batch order after the
        sampled rows) to its request: row j of a chunk starting at position s holds the
        logprob of prompt token s + j + 1. The request hands them out with its next output
        after they are whole (the final chunk samples, so that is no later than its first
        token's). Rows of sequences finished since the batch was scheduled are skipped."""
        every = [item for item in batch.scheduled if item.num_prompt_logprob_rows]
        items = [item for item in every if not item.seq.is_finished]
        if not items:
            return
        if len(items) < len(every):
            every_rows = [item.num_prompt_logprob_rows for item in every]
            logits = logits[_rows_of_unfinished(every, every_rows, logits.device)]
        targets, counts = [], []
        for item in items:
            start, num_rows = item.num_computed_tokens, item.num_prompt_logprob_rows
            targets += item.seq.prompt_token_ids[start + 1 : start + 1 + num_rows]
            count = self._requests[item.seq.request_id].request.params.prompt_logprobs
            counts += [count or 0] * num_rows
        entries = prompt_logprobs(logits, targets, counts)
        offset = 0
        for item in items:
            state = self._requests[item.seq.request_id]
            num_rows = item.num_prompt_logprob_rows
            first = item.num_computed_tokens + 1
            state.add_prompt_logprobs(first, entries[offset : offset + num_rows], self._token_texts)
            offset += num_rows

    def _apply_tokens(
        self,
        batch: SchedulerOutput,
        items: list[ScheduledSequence],
        sampling: list[SampleState],
        sampled: SamplerOutput,
        generators: dict[str, torch.Tensor],
        touched: dict[str, RequestState],
    ) -> list[tuple[SampleState, FinishReason | None]]:
        """Append each sampling sequence's token (`items`, the batch's unfinished ones) and,
        for a sequence with draft tokens, the tokens its verification keeps
        (`engine.speculative.speculator`). A sample that its token ids end is finished
        now. With draft tokens each kept token's text is checked before the next is kept, so
        nothing past a stop string is kept; the others' text is left to `_add_texts` (after
        the next launch, with async scheduling): they are returned with what their ids
        decided."""
        firsts, offset = [], 0
        for item in items:
            firsts.append(offset)
            offset += item.num_sampled_rows
        self.scheduler.update(batch, [sampled.token_ids[first] for first in firsts])
        taken = []
        for item, sample, first in zip(items, sampling, firsts, strict=True):
            tokens = sampled.token_ids[first : first + item.num_sampled_rows]
            draft = item.draft_token_ids
            reason = sample.on_token(tokens[0], sampled.logprobs[first])
            kept = 1
            if draft:
                while True:  # each kept token's text before the next token is kept
                    if sample.on_text(reason is not None):
                        reason = "stop"
                        break
                    if reason is not None or kept > len(draft):
                        break
                    if tokens[kept - 1] != draft[kept - 1]:
                        break
                    self.scheduler.accept_draft(sample.seq, tokens[kept])
                    reason = sample.on_token(tokens[kept], sampled.logprobs[first + kept])
                    kept += 1
                self._verified(sample, len(draft), kept, generators)
            else:
                taken.append((sample, reason))
            self._generation_tokens_total += kept
            if reason is not None:
                self.scheduler.finish(sample.seq, reason)
            request_id = sample.seq.request_id
            if request_id not in touched:
                touched[request_id] = self._requests[request_id]
        return taken

    def _add_texts(self, taken: list[tuple[SampleState, FinishReason | None]]) -> None:
        """Detokenize the samples' new tokens and watch them for stop strings
        (`SampleState.on_text`); a stop string ends its sample with "stop"."""
        for sample, reason in taken:
            if sample.on_text(reason is not None):
                seq = sample.seq
                if seq.is_finished:
                    seq.finish_reason = "stop"  # the stop string wins over "length"
                else:
                    self.scheduler.finish(seq, "stop")

    def _verified(
        self,
        sample: SampleState,
        num_drafted: int,
        num_kept: int,
        generators: dict[str, torch.Tensor],
    ) -> None:
        """After a verification that kept `num_kept` tokens (the drafts taken and the one
        sampled after them): rewind a seeded generator past the kept tokens' draws only."""
        assert self.speculator is not None
        seq_id = sample.seq.seq_id
        self.speculator.verified(seq_id, num_drafted, num_kept - 1)
        state = generators.get(seq_id)
        if state is not None and num_kept < num_drafted + 1:
            assert sample.row.generator is not None
            rewind(sample.row.generator, state, num_kept, self.vocab_size)

    def _fail_batch(
        self, batch: SchedulerOutput, error: str, touched: dict[str, RequestState]
    ) -> None:
        for item in batch.scheduled:
            state = self._requests.get(item.seq.request_id)
            if state is None:
                continue  # aborted or finished while the batch was in flight
            state.error = error
            for sample in state.samples:
                if not sample.seq.is_finished:
                    self.scheduler.finish(sample.seq, "error", error)
            touched[state.request_id] = state
        self.scheduler.reset_prefix_cache()

    def _forget(self, state: RequestState) -> None:
        del self._requests[state.request_id]
        for sample in state.samples:
            del self._samples[sample.seq.seq_id]
            if self.speculator is not None:
                self.speculator.forget(sample.seq.seq_id)

    def stats(self) -> EngineStats:
        cache = self.scheduler.cache_stats()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=cache.num_blocks,
            used_kv_blocks=cache.used_blocks,
            cached_free_kv_blocks=cache.cached_blocks,
            kv_usage=cache.usage,
            prefix_cache_queries=cache.prefix_queries,
            prefix_cache_hits=cache.prefix_hits,
            prefix_cache_evictions=cache.evictions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_preemptions=self.scheduler.num_preemptions,
            speculation=None if self.speculator is None else self.speculator.stats.copy(),
            external_prefix_cache_queries=self.scheduler.tier_queries,
            external_prefix_cache_hits=self.scheduler.tier_hits,
            tier=None if self.tier is None else self.tier.stats(),
            sleep_level=self.sleep_level,
        )

    def sequences_by_priority(self) -> dict[str, dict[int, int]]:
        """How many unfinished sequences are "running" and "waiting", by priority (those
        with none are left out). Another thread may call it: the scheduler's lists are
        copied whole, in one C call each, under the GIL. O(sequences), so it is not a part
        of `stats()`, which admission reads on every request."""
        return {
            "running": dict(Counter(seq.priority for seq in self.scheduler.running())),
            "waiting": dict(Counter(seq.priority for seq in self.scheduler.waiting())),
        }

    def snapshot(self) -> EngineSnapshot:
        """The block map, the unfinished sequences and `stats()` as of now; call it between
        steps, on the thread that drives the engine. O(num_kv_blocks + sequences): about
        0.2 µs a block."""
        now = time.monotonic()
        sequences = self.scheduler.running() + self.scheduler.waiting()
        return EngineSnapshot(
            stats=self.stats(),
            scheduling_policy=self.scheduler.policy,
            block_map=self.scheduler.block_map(),
            sequences=tuple(SequenceSnapshot.of(seq, now) for seq in sequences),
        )

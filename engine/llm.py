"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from engine.config import EngineConfig, load_config
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request.intake import EngineRequest, Message, Prompt, as_prompt_list
from engine.sampling.params import SamplingParams


class LLM:
    """Batch generation without a server; settings are `EngineConfig` fields, over the
    `PAGEDSERVE_<SETTING>` environment variables, as the server's are."""

    def __init__(self, model: str = "default", **settings: Any) -> None:
        # Not strict: a server's variables (PAGEDSERVE_PORT, ...) may be set in the shell.
        config = load_config(
            EngineConfig, overrides={"model": model, **settings}, strict_environment=False
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished `RequestOutput` per prompt, in the order given, with the whole text,
        token ids and logprobs of each sample.

        `prompts` is a string, a list of token ids, or a list of either; `sampling_params`
        one for all prompts or one per prompt (default: `SamplingParams` with the sampling
        defaults in force, see `engine.sampling.params`). Every prompt is
        checked before any runs: one invalid prompt raises ValueError and runs nothing. A
        request the engine fails (a step's error, a prompt the KV cache cannot hold) raises
        `EngineError` with the reason, and the other requests are aborted. `lora` names the
        LoRA adapter of every prompt, or of each (None: the base model).
        """
        batch = as_prompt_list(prompts, mixed=True)
        params_list = self._params_per_prompt(sampling_params, len(batch))
        processor = self.engine.processor
        requests = [
            processor.from_prompt(prompt, params)
            for prompt, params in zip(batch, params_list, strict=True)
        ]
        if lora is not None:
            names = [lora] * len(batch) if isinstance(lora, str) else list(lora)
            if len(names) != len(batch):
                raise ValueError(f"lora names {len(names)} adapters for {len(batch)} prompts")
            requests = [
                dataclasses.replace(request, lora_name=name)
                for request, name in zip(requests, names, strict=True)
            ]
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params_list = self._params_per_prompt(sampling_params, len(conversations))
        processor = self.engine.processor
        requests = [
            processor.from_chat(conversation, params)  # type: ignore[arg-type]
            for conversation, params in zip(conversations, params_list, strict=True)
        ]
        return self._run(requests, use_tqdm)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            # As vLLM's LLM: the defaults in force (generation_config), else SamplingParams'.
            sampling_params = SamplingParams(**self.engine.default_sampling)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params_list = list(sampling_params)
        if len(params_list) != count:
            raise ValueError(f"got {len(params_list)} sampling params for {count} prompts")
        return params_list

    def _run(self, requests: list[EngineRequest], use_tqdm: bool) -> list[RequestOutput]:
        request_ids = [str(next(self._ids)) for _ in requests]
        for request_id, request in zip(request_ids, requests, strict=True):
            self.engine.add_request(request_id, request)
        try:
            outputs = self._step_until_done(len(request_ids), use_tqdm)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return [outputs[request_id] for request_id in request_ids]

    def _step_until_done(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step the engine until no request is unfinished: each request's whole output, by
        request id; EngineError at the first failed request."""
        outputs: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    whole = outputs.setdefault(output.request_id, output)
                    if whole is not output:
                        whole.add(output)
                    if output.error is not None:
                        raise EngineError(f"the engine failed a request: {output.error}")
                    if output.finished:
                        bar.update()
        return outputs

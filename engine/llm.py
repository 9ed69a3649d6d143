"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from engine.config import EngineConfig, load_config
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling.params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Batch generation without a server; settings are `EngineConfig` fields."""

    def __init__(self, model: str = "default", **settings: Any) -> None:
        config = load_config(EngineConfig, overrides={"model": model, **settings}, environ={})
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished `RequestOutput` per prompt, in the order given.

        `prompts` is a string, a list of token ids, or a list of either; `sampling_params`
        one for all prompts or one per prompt (default: `SamplingParams()`).
        """
        batch = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(batch)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise ValueError(f"got {len(params_list)} sampling params for {len(batch)} prompts")
        request_ids = []
        for prompt, params in zip(batch, params_list, strict=True):
            request_id = str(next(self._ids))
            token_ids = self.engine.tokenize(prompt)
            self.engine.add_request(
                request_id, token_ids, params, prompt if isinstance(prompt, str) else None
            )
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            list(
                self.engine.tokenizer.apply_chat_template(
                    conversation, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update()
            except BaseException:
                for request_id in request_ids:
                    self.engine.abort_request(request_id)
                raise
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(token, int) for token in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]

"""Greedy decoding, the engine's and transformers' `generate()`, on random prompts."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from engine import LLM, SamplingParams

PROMPT_LENGTHS = (1, 3, 7, 16, 31, 64, 100, 250)


MAX_TOKENS = 12


def random_prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def reference_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    # Neutral generation settings: generate() fills what a call leaves at its default from
    # the model's own generation config, whose sampling defaults (the default model's
    # repetition penalty among them) would change greedy choices.
    saved, model.generation_config = model.generation_config, GenerationConfig()
    outputs = []
    try:
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    finally:
        model.generation_config = saved
    return outputs


def engine_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


# A tiny-model block of 4 tokens takes 2 layers x K,V x 4 tokens x 2 heads x 32 x 4 bytes.
TINY_BLOCK_BYTES = 4096

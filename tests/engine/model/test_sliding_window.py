"""A model whose every layer slides holds a window's worth of KV blocks, however long a
sequence grows, and still gives `generate()`'s tokens; a model with a full-attention
layer keeps every block."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.support.architectures import HALF_SLIDING, WINDOW, build, reference

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
PROMPT = list(range(3, 103))  # 100 tokens
NEW_TOKENS = 1000


def _generate_watching_blocks(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    """The greedy tokens of `prompt` and the most KV blocks in use at any step."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = llm.engine
    engine.add_request("r", engine.processor.from_prompt(prompt, params))
    tokens: list[int] = []
    most = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(output.outputs[0].token_ids)
        most = max(most, engine.scheduler.cache_stats().used_blocks)
    return tokens, most


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_an_all_sliding_model_holds_a_window_of_blocks(tmp_path: Path, backend: str):
    folder = build(tmp_path / "mistral", "mistral", {"sliding_window": WINDOW})
    llm = LLM(
        str(folder), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK_SIZE,
        max_model_len=2048, attention_backend=backend,
    )  # fmt: skip
    assert llm.engine.scheduler.sliding_window == WINDOW
    tokens, most = _generate_watching_blocks(llm, PROMPT)
    assert tokens == reference(folder, [PROMPT], NEW_TOKENS)[0]
    # The prompt's blocks at admission, then the window's plus the one being written.
    assert most <= len(PROMPT) // BLOCK_SIZE + 1
    assert llm.engine.scheduler.cache_stats().used_blocks == 0


def test_a_model_with_a_full_attention_layer_keeps_every_block(tmp_path: Path):
    folder = build(tmp_path / "gemma3", "gemma3_text", HALF_SLIDING)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK_SIZE)
    assert llm.engine.scheduler.sliding_window == 0
    _, most = _generate_watching_blocks(llm, PROMPT[:20])
    assert most == -(-(20 + NEW_TOKENS - 1) // BLOCK_SIZE)

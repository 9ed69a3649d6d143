"""Which architectures pagedserve serves right, and which it refuses: the coverage matrix.

Each architecture is a tiny random-weight model built from its transformers config in a
second (hidden 128, 2 layers, 4 heads, 2 KV heads), with sliding windows (16), logit
softcaps and attention sinks set small enough to change tokens. Served ones must give
`generate()`'s greedy tokens (eager attention, fp32) for six prompts of 5-100 tokens (two
sharing a 40-token prefix) under the default settings, chunked prefill, the torch
attention backend and (some) a KV cache small enough to preempt, and in bf16 each prompt alone
must give what it gives in the batch. Refused ones must say what they lack, before their
weights load. The README's "Supported models" lists this matrix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from engine import LLM
from engine.errors import UnsupportedModelError
from tests.support.architectures import (
    HYBRID,
    OMIT,
    SERVED,
    build,
    greedy,
    prompts,
    reference,
    tiny_config,
)
from tests.support.tiny_models import build_tokenizer

pytestmark = pytest.mark.slow

# model type, config fields, what the refusal must name.
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "falcon": ("falcon", {"head_dim": OMIT}, "attention interface"),
    "bloom": ("bloom", {}, "attention interface"),
    # Mamba-1's selective scan (one state per channel) is not a kind pagedserve runs.
    "mamba": ("mamba", {}, "MambaMixer layers, which keep recurrent state"),
    "jamba": ("jamba", {}, "JambaMambaMixer layers, which keep recurrent state"),
    "falcon_mamba": ("falcon_mamba", {}, "FalconMambaMixer layers, which keep recurrent state"),
    "llama4-chunked": ("llama4_text", {"attention_chunk_size": 32}, "chunked"),
    "deepseek_v32": ("deepseek_v32", {}, "sparse attention \\(DeepseekV32Indexer"),
}

# Run again with preemption (it doubles a case's time): the features' and MLA's models, and
# a hybrid of each recurrent kind.
PREEMPTED = {
    "qwen2-sliding", "gemma2", "gemma3", "gpt_oss", "deepseek_v3-mla", "gemma4", "qwen3_5",
    "lfm2", "granitemoehybrid",
}  # fmt: skip
MODELS = {**SERVED, **HYBRID}
SETTINGS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 20},
    "torch-attention": {"attention_backend": "torch"},
}


@pytest.mark.parametrize("name", list(MODELS))
def test_served_architectures_match_generate(tmp_path: Path, name: str):
    model_type, fields = MODELS[name]
    folder = build(tmp_path / name, model_type, fields)
    batch = prompts(AutoConfig.from_pretrained(folder).get_text_config().vocab_size)
    expected = reference(folder, batch)
    for setting, overrides in SETTINGS.items():
        llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", **overrides)
        assert greedy(llm, batch) == expected, f"{name} under {setting} settings"
    bf16 = LLM(str(folder), dtype="bfloat16", kv_cache_memory="16MiB")
    together = greedy(bf16, batch)
    alone = [greedy(bf16, [prompt])[0] for prompt in batch]
    assert alone == together, f"{name} in bf16: a prompt alone differs from it in the batch"
    if name not in PREEMPTED:
        return
    # 14 blocks of 16 tokens for 23 prompt blocks: sequences wait, grow and are preempted.
    block_bytes = llm.engine.kv_layout.bytes_per_block(16, 4)
    budget, hybrid = 14 * block_bytes, {}
    if llm.engine.recurrent is not None:  # and 8 state slots beside them
        state_bytes = 8 * llm.engine.recurrent.bytes_per_slot
        budget += state_bytes
        hybrid = {"state_share": (state_bytes + 1) / budget, "max_num_seqs": 4}
    small = LLM(
        str(folder), dtype="float32", kv_cache_memory=budget, max_model_len=128, watermark=0,
        **hybrid,
    )  # fmt: skip
    assert greedy(small, batch) == expected, f"{name} with preemption"
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.num_kv_blocks == 14


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_architectures_say_what_they_lack_before_loading(tmp_path: Path, name: str):
    model_type, fields, missing = REFUSED[name]
    tokenizer = build_tokenizer(tmp_path)
    # Only the config and the tokenizer: a refusal that needed the weights would fail to
    # load instead.
    tiny_config(model_type, fields, tokenizer).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=missing) as refusal:
        LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB")
    assert model_type in str(refusal.value)

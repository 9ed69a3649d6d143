"""Tiny random-weight models of each architecture the coverage matrix serves, built from
their transformers configs, and their greedy tokens from the engine and from `generate()`
(tests/engine/model/test_model_coverage.py; the sliding window's and the compiled
forward's tests build from them too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from engine import LLM, SamplingParams
from tests.support.tiny_models import build_tokenizer

WINDOW = 16
MAX_TOKENS = 24
SLIDING = {"sliding_window": WINDOW}
HALF_SLIDING = {**SLIDING, "layer_types": ["sliding_attention", "full_attention"]}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
# query_pre_attn_scalar 1: scores large enough for a softcap of 1 to change tokens.
SOFTCAPPED = {**HALF_SLIDING, "attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 1}
OMIT = object()  # a common field this config does not take

# model type, config fields over the common tiny ones.
SERVED: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-sliding": ("qwen2", {**SLIDING, "use_sliding_window": True, "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-sliding": ("mistral", SLIDING),
    "mixtral-sliding": ("mixtral", {**SLIDING, **MOE}),
    "phi3-sliding": ("phi3", SLIDING),
    "starcoder2-sliding": ("starcoder2", SLIDING),
    "gemma": ("gemma", {}),
    "gemma2": (
        "gemma2",
        {**HALF_SLIDING, "attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 1},
    ),
    "gemma3": ("gemma3_text", HALF_SLIDING),
    "gpt_oss": ("gpt_oss", {**HALF_SLIDING, **MOE}),
    "exaone4": ("exaone4", HALF_SLIDING),
    "cohere2": ("cohere2", HALF_SLIDING),
    "olmo3": ("olmo3", HALF_SLIDING),
    "phi": ("phi", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "gpt_neox": ("gpt_neox", {}),
    "gpt2": ("gpt2", {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 2048}),
    "cohere": ("cohere", {}),
    "glm4": ("glm4", {}),
    "smollm3": ("smollm3", {}),
    # Sliding and global layers of two KV shapes (head sizes 32 and 64, 2 and 1 KV heads,
    # K as V in the global ones), the last two layers reading the first two's KV, and
    # per-layer inputs.
    "gemma4": (
        "gemma4_text",
        {
            "num_hidden_layers": 4,
            "sliding_window": WINDOW,
            "global_head_dim": 64,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 16,
        },
    ),
    "deepseek_v3-mla": (
        "deepseek_v3",
        {
            "kv_lora_rank": 32,
            "q_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "head_dim": 16,
            "v_head_dim": 32,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
}
# Hybrid models: recurrent layers (Gated DeltaNet, Mamba-2, short convolutions) beside
# attention, one of each kind of layer.
DELTA_NET = {
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
}  # fmt: skip
MOE_QWEN = {
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}  # fmt: skip
MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 2}
HYBRID: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_5": (
        "qwen3_5_text",
        {"layer_types": ["linear_attention", "full_attention"], **DELTA_NET},
    ),
    "qwen3_5_moe": (
        "qwen3_5_moe_text",
        {"layer_types": ["linear_attention", "full_attention"], **DELTA_NET, **MOE_QWEN},
    ),
    "qwen3_next": (
        "qwen3_next",
        {"layer_types": ["linear_attention", "full_attention"], **DELTA_NET, **MOE_QWEN},
    ),
    "olmo_hybrid": (
        "olmo_hybrid",
        {"layer_types": ["linear_attention", "full_attention"], **DELTA_NET},
    ),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"], "head_dim": OMIT}),
    "lfm2_moe": (
        "lfm2_moe",
        {
            "layer_types": ["conv", "full_attention"],
            "head_dim": OMIT,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "num_dense_layers": 1,
        },
    ),
    "granitemoehybrid": (
        "granitemoehybrid",
        {
            "layer_types": ["mamba", "attention"],
            **MAMBA,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
        },
    ),
    # Mamba, attention, MLP: Nemotron-H's MLP blocks mix no tokens.
    "nemotron_h": (
        "nemotron_h",
        {
            "hybrid_override_pattern": "M*-",
            "num_hidden_layers": 3,
            "mamba_num_heads": 8,
            "mamba_head_dim": 32,
            "ssm_state_size": 16,
            "n_groups": 2,
        },
    ),
    # Every layer has attention and a Mamba-2 mixer side by side.
    "falcon_h1": ("falcon_h1", {**MAMBA, "mamba_d_ssm": 256}),
    "bamba": ("bamba", {**MAMBA, "attn_layer_indices": [1]}),
    # Granite 4.0's attention-only models: a hybrid's config, mamba fields unused.
    "granitemoehybrid-attention": (
        "granitemoehybrid",
        {"layer_types": ["attention", "attention"], **MAMBA},
    ),
}


def tiny_config(model_type: str, fields: dict[str, Any], tokenizer) -> Any:
    common = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    fields = {key: value for key, value in {**common, **fields}.items() if value is not OMIT}
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    return config


def build(folder: Path, model_type: str, fields: dict) -> Path:
    tokenizer = build_tokenizer(folder)
    config = tiny_config(model_type, fields, tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Decisive greedy choices (fp32 rounding does not pick tokens); attention scores,
        # outputs and sinks large enough that the window, the softcap and the sinks change
        # tokens.
        model.get_input_embeddings().weight.normal_(0, 1.0)
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
                parameter.mul_(4.0)
            elif name.endswith("sinks"):
                parameter.normal_(0, 1.0)
    model.save_pretrained(folder)
    return folder


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(3, vocab_size, (n,), generator=generator).tolist()  # noqa: E731
    prefix = draw(40)
    return [draw(5), draw(100), prefix + draw(10), draw(17), prefix + draw(30), draw(64)]


def reference(
    folder: Path, batch: list[list[int]], max_tokens: int = MAX_TOKENS
) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config = GenerationConfig()
    out = []
    for prompt in batch:
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        out.append(generated[0, len(prompt) :].tolist())
    return out


def greedy(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]

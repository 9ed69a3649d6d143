"""Hybrid models' GGUFs written from a transformers folder with `gguf`'s own writer, laid out
as llama.cpp's converter (convert_hf_to_gguf.py) lays them out: its metadata keys, tensor
names and types, and its transforms, written here forward, as the converter writes them
(engine/model/gguf_hybrid.py undoes them):

- Qwen3.5 and Qwen3-Next: norms stored `w + 1` (not the linear attention's gated norm);
  `ssm_a = -exp(A_log)`; conv1d squeezed; Qwen3.5's value heads reordered from grouped to
  tiled (the rows of the value part of `attn_qkv`, `attn_gate`, `ssm_alpha`, `ssm_beta`,
  `ssm_conv1d`, `ssm_a`, `ssm_dt`; the columns of `ssm_out`); Qwen3-Next's `in_proj_qkvz`
  split into `attn_qkv` (all q, all k, all v) and `attn_gate` (all z), its experts'
  `gate_up_proj` into `ffn_gate_exps` and `ffn_up_exps`;
- Mamba-2 layers (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1): `ssm_a = -exp(A_log)` and
  `ssm_d` as `[heads, 1]`, conv1d squeezed, the norm as `[groups, width / groups]`;
  Granite's, Bamba's and Nemotron-H's q and k rows permuted as a Llama's; Granite's shared
  MLP `input_linear` split into `ffn_gate` and `ffn_up`;
- Falcon-H1: every multiplier multiplied into the weight it scales, none in the metadata;
- Gemma 4 (`gemma4`, not a hybrid, read by the same tables): stored as it is (no norm
  shifted), its per-layer shapes and sharing in the metadata (`head_count_kv` per layer
  where the global layers have their own count, `sliding_window_pattern`, the `_swa`
  head sizes, `shared_kv_layers`, `embedding_length_per_layer_input`), the global layers'
  proportional rope as `rope_freqs` (factors 1 on the rotated pairs, 1e30 on the others),
  the tokenizer as `gemma4` (`gemma_tokenizer`'s BPE with byte fallback: its merges, every
  score -1000, byte tokens typed BYTE); llama-quantize keeps `per_layer_model_proj` and a
  matrix whose rows are no whole blocks (`proj`, 16 columns in the tiny model) in F16.

Vectors, norms, `ssm_a`/`ssm_d`, convolutions and routers are F32, the other matrices
`ggml_type` (F16, F32, or a block type quantized by gguf's own code, with the leading
dimensions of 1 dropped as llama-quantize writes them; Q4_K, which gguf's code does not
quantize, by `q4_k_blocks`; random blocks of the other K types).

Checked against llama.cpp's converter (convert_hf_to_gguf.py, llama-cpp-python 0.3.36's
tree) on the folders tests/engine/model/test_gguf_hybrid.py builds (Qwen3.5, tied or not,
with and without its draft head; Qwen3-Next; LFM2; Granite 4.0-H dense and with experts;
Bamba; Nemotron-H; Falcon-H1) and test_gguf_gemma4.py's (Gemma 4 with two KV shapes,
shared KV, K as V and per-layer inputs; tied with a softcap; without any of those): the
same metadata (but `general.name`, `size_label`, `file_type`), tensor names, shapes and
types, and the same bytes in F32 and F16 (Q8_0: llama-quantize's names, shapes and
types). The converter needs a tokenizer it knows
(its `get_vocab_base_pre` was answered with the names above) and, for Granite 4.0-H and
Nemotron-H, the layer names of the checkpoints' own config.json ("mamba", "attention";
`hybrid_override_pattern`): transformers 5 writes others, which the converter misreads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize
from tokenizers import Tokenizer, models, normalizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GemmaTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from tests.support.architectures import build
from tests.support.gguf_files import _add_tokenizer, random_blocks
from tests.support.tiny_models import _CORPUS

# transformers model type -> (GGUF architecture, `tokenizer.ggml.pre` as the converter
# names the real model's).
ARCHITECTURES = {
    "qwen3_5_text": ("qwen35", "qwen35"),
    "qwen3_next": ("qwen3next", "qwen2"),
    "lfm2": ("lfm2", "lfm2"),
    "granitemoehybrid": ("granitehybrid", "default"),
    "bamba": ("granitehybrid", "default"),
    "nemotron_h": ("nemotron_h", "default"),
    "falcon_h1": ("falcon-h1", "falcon-h1"),
    "gemma4_text": ("gemma4", None),  # its tokenizer has no `tokenizer.ggml.pre`
}
# Stored in F32 whatever the file's type (with vectors and names not ending ".weight").
F32_LEAVES = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d", "shortconv.conv")
NOPE_CONTEXT = 2**20  # the context length the converter writes for a Mamba-2 model
# Kept in F16 by llama-quantize in a file of a block type.
F16_KEPT = ("per_layer_model_proj.weight",)


def write_hybrid_gguf(
    folder: Path,
    path: Path,
    ggml_type: str = "F32",
    *,
    types: dict[str, str] | None = None,
    draft_head: bool = False,
    extra_tensors: dict[str, np.ndarray] | None = None,
    legacy: bool = False,
) -> Path:
    """`folder`'s model as the converter writes it (see the module docstring), its
    matrices in `ggml_type` (`types` overrides it by GGUF name, as llama-quantize's mixes
    do); with a multi-token-prediction block after the layers (a copy of the last), as the
    converter writes a Qwen checkpoint's, where `draft_head`; and `extra_tensors`. Where
    `legacy`, Qwen3-Next's in_proj_qkvz is stored whole, as `ssm_in` (as the converter
    wrote it before it split it; llama.cpp still reads such files)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = model.config
    architecture, pre = ARCHITECTURES[config.model_type]
    weights = {name: value.numpy() for name, value in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    writer = GGUFWriter(path, architecture)
    writer.add_type("model")
    writer.add_name(path.stem)
    METADATA[config.model_type](writer, config, int(draft_head))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if architecture == "gemma4":
        _add_gemma_tokenizer(writer, tokenizer)
    else:
        _add_tokenizer(writer, tokenizer, pre)
    tensors = dict(TENSORS[config.model_type](weights, config))
    if legacy:
        tensors = _unsplit_qkvz(tensors, weights, config)
    if draft_head:
        tensors |= _draft_head(tensors, config)
    tensors |= extra_tensors or {}
    squeeze = ggml_type not in ("F32", "F16")
    for name, value in tensors.items():
        _add(writer, name, value, (types or {}).get(name, ggml_type), squeeze)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: GGUFWriter, name: str, value: np.ndarray, ggml_type: str, squeeze: bool) -> None:
    """A tensor in the converter's type for it (see the module docstring); without its
    outer dimensions of 1 where `squeeze`, as llama-quantize writes every tensor."""
    leaf = name.split(".", 2)[-1].rpartition(".")[0] if name.startswith("blk.") else name
    f32 = (
        value.ndim <= 1
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")
        or leaf in F32_LEAVES
    )
    kind = "F32" if f32 or ggml_type == "F32" else ggml_type
    if kind not in ("F32", "F16") and (
        name in F16_KEPT or value.shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    ):
        kind = "F16"  # as llama-quantize keeps or falls back
    value = value.astype(np.float32)
    while squeeze and value.ndim > 1 and value.shape[0] == 1:
        value = value[0]
    if kind == "F32":
        writer.add_tensor(name, value)
    elif kind == "F16":
        writer.add_tensor(name, value.astype(np.float16))
    else:
        qtype = GGMLQuantizationType[kind]
        try:
            blocks = q4_k_blocks(value) if kind == "Q4_K" else quantize(value, qtype)
        except NotImplementedError:  # another K type: gguf's code only reads them
            blocks = random_blocks(kind, *value.shape, np.random.default_rng(0))
        writer.add_tensor(name, blocks, raw_dtype=qtype)


def q4_k_blocks(values: np.ndarray) -> np.ndarray:
    """`values [rows, columns]` (columns a multiple of 256) as Q4_K blocks `[rows, columns /
    256 * 144]`, laid out as llama.cpp's `quantize_row_q4_K_ref` lays them (fp16 `d` and
    `dmin`, 12 bytes of 6-bit scales and minimums per 32, then the nibbles), each 32's
    scale and minimum taken from its range rather than by llama.cpp's search; gguf's
    `dequantize` reads them back within about half a step."""
    rows = values.shape[0]
    x = values.astype(np.float32).reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks
    low = np.minimum(x.min(axis=-1), 0)
    scales, mins = (x.max(axis=-1) - low) / 15, -low
    largest_scale, largest_min = scales.max(axis=-1), mins.max(axis=-1)
    ls = np.round(63 * scales / np.where(largest_scale > 0, largest_scale, 1)[:, None])
    lm = np.round(63 * mins / np.where(largest_min > 0, largest_min, 1)[:, None])
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    d, dmin = (largest_scale / 63).astype(np.float16), (largest_min / 63).astype(np.float16)
    packed = np.zeros((len(x), 12), np.uint8)  # ggml's get_scale_min_k4, inverted
    packed[:, :4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    step = d.astype(np.float32)[:, None, None] * ls[..., None]
    offset = dmin.astype(np.float32)[:, None, None] * lm[..., None]
    q = np.round((x + offset) / np.where(step > 0, step, 1)) * (step > 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # sub-blocks 2p, 2p + 1
    halves = [d[:, None].view(np.uint8), dmin[:, None].view(np.uint8)]
    return np.concatenate([*halves, packed, nibbles], axis=1).reshape(rows, -1)


# Metadata, as each converter class writes it.


def _shape(
    writer: GGUFWriter, config: PretrainedConfig, context: int, ff, kv, draft: int = 0
) -> None:
    """The keys every converter writes: block count (with `draft` blocks), context, widths,
    heads."""
    writer.add_block_count(config.num_hidden_layers + draft)
    writer.add_context_length(context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(kv)


def _per_layer(config: PretrainedConfig, kinds: tuple[str, ...], value: int) -> list[int]:
    return [value if kind in kinds else 0 for kind in config.layer_types]


def _delta_net_metadata(writer: GGUFWriter, config: PretrainedConfig, draft: int) -> None:
    """Qwen3-Next's (and Qwen3.5's) linear attention keys (and the draft blocks')."""
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    recurrent = [kind == "linear_attention" for kind in config.layer_types] + [False] * draft
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", recurrent)
    writer.add_full_attention_interval(getattr(config, "full_attention_interval", 4))
    if draft:
        writer.add_nextn_predict_layers(draft)
    rope = config.rope_parameters
    writer.add_rope_dimension_count(int(config.head_dim * rope.get("partial_rotary_factor", 0.25)))


def _qwen35_metadata(writer: GGUFWriter, config: PretrainedConfig, draft: int) -> None:
    _shape(writer, config, config.max_position_embeddings, config.intermediate_size,
           config.num_key_value_heads, draft)  # fmt: skip
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    _delta_net_metadata(writer, config, draft)
    writer.add_rope_dimension_sections([11, 11, 10, 0])  # the default, when the config has none


def _qwen3_next_metadata(writer: GGUFWriter, config: PretrainedConfig, draft: int) -> None:
    _shape(writer, config, config.max_position_embeddings, config.intermediate_size,
           config.num_key_value_heads, draft)  # fmt: skip
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    _delta_net_metadata(writer, config, draft)


def _lfm2_metadata(writer: GGUFWriter, config: PretrainedConfig, draft: int) -> None:
    kv = _per_layer(config, ("full_attention",), config.num_key_value_heads)
    _shape(writer, config, config.max_position_embeddings, _lfm2_feed_forward(config), kv)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_shortconv_l_cache(config.conv_L_cache)


def _lfm2_feed_forward(config: PretrainedConfig) -> int:
    """LFM2Model._add_feed_forward_length: the MLP's width as the config adjusts it."""
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        width = int(config.block_ffn_dim_multiplier * int(2 * width / 3))
        multiple = config.block_multiple_of
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def _mamba2_metadata(writer: GGUFWriter, config: PretrainedConfig, inner: int, heads: int,
                     state: int, groups: int, conv: int) -> None:  # fmt: skip
    writer.add_ssm_conv_kernel(conv)
    writer.add_ssm_state_size(state)
    writer.add_ssm_group_count(groups)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(heads)


def _granite_metadata(writer: GGUFWriter, config: PretrainedConfig, draft: int) -> None:
    """Granite 4.0-H (no rotary positions: an unbounded context) or Bamba (rotary)."""
    bamba = config.model_type == "bamba"
    kinds = ("full_attention", "attention")
    layer_types = config.layers_block_type if not bamba else [
        "full_attention" if i in config.attn_layer_indices else "mamba"
        for i in range(config.num_hidden_layers)
    ]  # fmt: skip
    kv = [config.num_key_value_heads if kind in kinds else 0 for kind in layer_types]
    context = config.max_position_embeddings if bamba else NOPE_CONTEXT
    _shape(writer, config, context, config.intermediate_size, kv)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = config.hidden_size // config.num_attention_heads
    if not bamba:
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_vocab_size(config.vocab_size)
    rotary = config.rope_parameters.get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(head_dim * rotary))
    if not bamba:
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    inner = config.mamba_expand * config.hidden_size
    _mamba2_metadata(writer, config, inner, config.mamba_n_heads, config.mamba_d_state,
                     config.mamba_n_groups, config.mamba_d_conv)  # fmt: skip
    writer.add_rope_scaling_finetuned(bamba)


def _nemotron_h_metadata(writer: GGUFWriter, config: PretrainedConfig, draft: int) -> None:
    kinds = config.layers_block_type
    ff = [config.intermediate_size if kind == "mlp" else 0 for kind in kinds]
    kv = [config.num_key_value_heads if kind == "full_attention" else 0 for kind in kinds]
    _shape(writer, config, NOPE_CONTEXT, ff, kv)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    inner = config.mamba_num_heads * config.mamba_head_dim
    _mamba2_metadata(writer, config, inner, config.mamba_num_heads, config.ssm_state_size,
                     config.n_groups, config.conv_kernel)  # fmt: skip
    writer.add_rope_scaling_finetuned(False)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)


def _falcon_h1_metadata(writer: GGUFWriter, config: PretrainedConfig, draft: int) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_block_count(config.num_hidden_layers)
    _mamba2_metadata(writer, config, config.mamba_d_ssm, config.mamba_n_heads,
                     config.mamba_d_state, config.mamba_n_groups, config.mamba_d_conv)  # fmt: skip
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])


def _gemma4_metadata(writer: GGUFWriter, config: PretrainedConfig, draft: int) -> None:
    """Gemma4Model.set_gguf_parameters (over Gemma3Model's): per-layer KV head counts where
    the global layers have their own (`per_layer_config`), the MLP's width per layer where
    the shared layers' is doubled."""
    kinds = config.layer_types
    overrides = config.to_dict().get("per_layer_config") or {}
    full = [int(i) for i, fields in overrides.items() if "num_key_value_heads" in fields]
    kv = [config.per_layer_config[i].num_key_value_heads for i in range(len(kinds))]
    layers, shared = config.num_hidden_layers, config.num_kv_shared_layers
    ff = config.intermediate_size
    widths = [ff * (2 if i >= layers - shared else 1) for i in range(layers)]
    _shape(writer, config, config.max_position_embeddings,
           widths if config.use_double_wide_mlp else ff,
           kv if full else config.num_key_value_heads)  # fmt: skip
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head = {kind: config.per_layer_config[kinds.index(kind)].head_dim for kind in set(kinds)}
    writer.add_key_length(head["full_attention"])
    writer.add_value_length(head["full_attention"])
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])
    writer.add_key_length_swa(head["sliding_attention"])
    writer.add_value_length_swa(head["sliding_attention"])
    writer.add_rope_dimension_count(head["full_attention"])
    swa_rotated = rope["sliding_attention"].get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count_swa(int(head["sliding_attention"] * swa_rotated))


METADATA: dict[str, Callable[..., None]] = {
    "qwen3_5_text": _qwen35_metadata,
    "qwen3_next": _qwen3_next_metadata,
    "lfm2": _lfm2_metadata,
    "granitemoehybrid": _granite_metadata,
    "bamba": _granite_metadata,
    "nemotron_h": _nemotron_h_metadata,
    "falcon_h1": _falcon_h1_metadata,
    "gemma4_text": _gemma4_metadata,
}


# Tensors, as each converter class writes them: name by name, HF module -> GGUF leaf.

TOP = {"embed_tokens": "token_embd", "embeddings": "token_embd", "lm_head": "output",
       "norm": "output_norm", "norm_f": "output_norm", "final_layernorm": "output_norm",
       "embedding_norm": "token_embd_norm"}  # fmt: skip
LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.conv1d": "ssm_conv1d", "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}  # fmt: skip
LFM2_LAYER = {
    "operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
    "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj",
    "conv.out_proj": "shortconv.out_proj", "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
}  # fmt: skip
MAMBA2_LAYER = {
    "in_proj": "ssm_in", "conv1d": "ssm_conv1d", "dt_bias": "ssm_dt.bias", "A_log": "ssm_a",
    "D": "ssm_d", "norm": "ssm_norm", "out_proj": "ssm_out",
}  # fmt: skip
GRANITE_LAYER = {
    "post_attention_layernorm": "ffn_norm", "pre_ff_layernorm": "ffn_norm",
    "block_sparse_moe.router": "ffn_gate_inp",
    "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight",
    "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down",
    **{f"mamba.{module}": leaf for module, leaf in MAMBA2_LAYER.items()},
}  # fmt: skip
NEMOTRON_H_LAYER = {
    "norm": "attn_norm", "mixer.up_proj": "ffn_up", "mixer.down_proj": "ffn_down",
    **{f"mixer.{m}": leaf for m, leaf in MAMBA2_LAYER.items()},
    **{f"mixer.{m}_proj": f"attn_{m}" for m in "qkv"}, "mixer.o_proj": "attn_output",
}  # fmt: skip
FALCON_H1_LAYER = {
    "pre_ff_layernorm": "ffn_norm", "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down",
    **{f"mamba.{module}": leaf for module, leaf in MAMBA2_LAYER.items()},
}  # fmt: skip


def _named(name: str, layer: dict[str, str]) -> str:
    """The GGUF name of a parameter (`.weight`/`.bias` kept; a leaf with its own suffix,
    such as `ssm_dt.bias`, as it is; `ssm_a`, `ssm_d` bare)."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        base, suffix = name, ""
    if not base.startswith("model.layers."):
        return f"{TOP[base.removeprefix('model.')]}.{suffix}"
    _, _, bid, module = base.split(".", 3)
    leaf = {**LAYER, **layer}[module]
    if leaf.endswith((".weight", ".bias")) or leaf in ("ssm_a", "ssm_d"):
        return f"blk.{bid}.{leaf}"
    return f"blk.{bid}.{leaf}.{suffix}"


def _negative_exp(values: np.ndarray) -> np.ndarray:
    """`A = -exp(A_log)`, by torch as the converter computes it (to the bit)."""
    return (-torch.exp(torch.from_numpy(values))).numpy()


def _tiled(values: np.ndarray, config: PretrainedConfig, width: int, axis: int = 0) -> np.ndarray:
    """The converter's `_reorder_v_heads`: value heads grouped by key head -> tiled."""
    keys = config.linear_num_key_heads
    per_key = config.linear_num_value_heads // keys
    values = np.moveaxis(values, axis, 0)
    shape = values.shape
    tiled = values.reshape(keys, per_key, width, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(tiled, 0, axis)


def _llama_permute(values: np.ndarray, heads: int) -> np.ndarray:
    """The converter's `LlamaModel.permute` of q or k rows for llama.cpp's rotary layout."""
    return (
        values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:])
        .swapaxes(1, 2)
        .reshape(values.shape)
    )


def _qwen_tensors(
    weights: dict, config: PretrainedConfig, tiled: bool
) -> Iterator[tuple[str, np.ndarray]]:
    """Qwen3.5's (`tiled` value heads) and Qwen3-Next's tensors."""
    keys, key_width = config.linear_num_key_heads, config.linear_key_head_dim
    value_width = config.linear_value_head_dim
    qk = 2 * keys * key_width
    for name, value in weights.items():
        if name.endswith("A_log"):
            value = _negative_exp(value)
        elif "conv1d" in name:
            value = value.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            value = value + 1
        if tiled and ".linear_attn." in name:
            if "in_proj_qkv" in name or "conv1d" in name:
                value = np.concatenate([value[:qk], _tiled(value[qk:], config, value_width)])
            elif "in_proj_z" in name:
                value = _tiled(value, config, value_width)
            elif any(part in name for part in ("in_proj_a", "in_proj_b", "A_log", "dt_bias")):
                value = _tiled(value, config, 1)
            elif "out_proj" in name:
                value = _tiled(value, config, value_width, axis=1)
        bid = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("in_proj_qkvz.weight"):  # q, k, v, z per key head -> all q, k, v; all z
            per_value = config.linear_num_value_heads // keys * value_width
            parts = np.split(value.T.reshape(-1, keys, 2 * key_width + 2 * per_value),
                             np.cumsum([key_width, key_width, per_value]), axis=-1)  # fmt: skip
            q, k, v, z = (part.reshape(value.shape[1], -1) for part in parts)
            yield f"blk.{bid}.attn_qkv.weight", np.concatenate([q, k, v], axis=1).T
            yield f"blk.{bid}.attn_gate.weight", z.T
        elif name.endswith("experts.gate_up_proj"):
            gate, up = np.split(value, 2, axis=1)
            yield f"blk.{bid}.ffn_gate_exps.weight", gate
            yield f"blk.{bid}.ffn_up_exps.weight", up
        else:
            yield _named(name, {}), value


def _lfm2_tensors(weights: dict, config: PretrainedConfig) -> Iterator[tuple[str, np.ndarray]]:
    for name, value in weights.items():
        yield _named(name, LFM2_LAYER), value.squeeze(1) if "conv.conv" in name else value


def _mamba2(name: str, value: np.ndarray, groups: int) -> np.ndarray:
    """Mamba2Model.modify_tensors: conv1d squeezed, A and D `[heads, 1]`, norm `[groups, -1]`."""
    if name.endswith("conv1d.weight"):
        return value.squeeze()
    if name.endswith(("A_log", ".D")):
        return (_negative_exp(value) if name.endswith("A_log") else value).reshape(-1, 1)
    if name.endswith(("mamba.norm.weight", "mixer.norm.weight")):
        return value.reshape(groups, -1)
    return value


def _granite_tensors(weights: dict, config: PretrainedConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Granite 4.0-H (its shared MLP as ffn_gate/ffn_up/ffn_down, or ffn_*_shexp beside
    experts, whose `gate_up_proj` is split in ffn_gate_exps and ffn_up_exps) and Bamba."""
    shared = "_shexp" if getattr(config, "num_local_experts", 0) else ""
    for name, value in weights.items():
        value = _mamba2(name, value, config.mamba_n_groups)
        bid = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("shared_mlp.input_linear.weight"):
            gate, up = np.split(value, 2)
            yield f"blk.{bid}.ffn_gate{shared}.weight", gate
            yield f"blk.{bid}.ffn_up{shared}.weight", up
        elif name.endswith("experts.gate_up_proj"):
            gate, up = np.split(value, 2, axis=1)
            yield f"blk.{bid}.ffn_gate_exps.weight", gate
            yield f"blk.{bid}.ffn_up_exps.weight", up
        elif name.endswith("shared_mlp.output_linear.weight"):
            yield f"blk.{bid}.ffn_down{shared}.weight", value
        else:
            yield _named(name, GRANITE_LAYER), _rotary_permuted(name, value, config)


def _rotary_permuted(name: str, value: np.ndarray, config: PretrainedConfig) -> np.ndarray:
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return _llama_permute(value, config.num_attention_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return _llama_permute(value, config.num_key_value_heads)
    return value


def _nemotron_h_tensors(
    weights: dict, config: PretrainedConfig
) -> Iterator[tuple[str, np.ndarray]]:
    for name, value in weights.items():
        value = _rotary_permuted(name, _mamba2(name, value, config.n_groups), config)
        yield _named(name, NEMOTRON_H_LAYER), value


def _falcon_h1_tensors(weights: dict, config: PretrainedConfig) -> Iterator[tuple[str, np.ndarray]]:
    """FalconH1Model.modify_tensors: each multiplier into the weight it scales (in turn,
    in F32, as torch multiplies); the pre-MLP norm named `ffn_norm`, without `.weight`."""
    scales = {
        "gate_proj": [config.mlp_multipliers[0]], "down_proj": [config.mlp_multipliers[1]],
        "k_proj": [config.key_multiplier, config.attention_in_multiplier],
        "q_proj": [config.attention_in_multiplier], "v_proj": [config.attention_in_multiplier],
        "o_proj": [config.attention_out_multiplier], "out_proj": [config.ssm_out_multiplier],
        "lm_head": [config.lm_head_multiplier], "embed_tokens": [config.embedding_multiplier],
        "in_proj": [config.ssm_in_multiplier],
    }  # fmt: skip
    inner, groups = config.mamba_d_ssm, config.mamba_n_groups * config.mamba_d_state
    for name, value in weights.items():
        value = _mamba2(name, value, config.mamba_n_groups)
        module = name.rpartition(".")[0].rpartition(".")[2]
        for multiplier in scales.get(module, ()):
            value = value * np.float32(multiplier)
        if module == "in_proj":  # z, x, B, C and dt's rows, each by its own multiplier
            bounds = [*np.cumsum([0, inner, inner, groups, groups]), len(value)]
            for multiplier, start, stop in zip(
                config.ssm_multipliers, bounds[:-1], bounds[1:], strict=True
            ):
                value[start:stop] *= np.float32(multiplier)
        stored = _named(name, FALCON_H1_LAYER)
        yield stored.removesuffix(".weight") if "ffn_norm" in stored else stored, value


GEMMA4_TOP = {
    "embed_tokens_per_layer": "per_layer_token_embd",
    "per_layer_model_projection": "per_layer_model_proj",
    "per_layer_projection_norm": "per_layer_proj_norm",
}
GEMMA4_LAYER = {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "post_per_layer_input_norm": "post_norm",
    "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj",
    "layer_scalar": "layer_output_scale.weight",
}  # fmt: skip


def _gemma4_tensors(weights: dict, config: PretrainedConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Gemma4Model's tensors: `rope_freqs` (generate_extra_tensors), then every weight as it
    is (Gemma4Model.norm_shift is 0)."""
    head_dim = config.per_layer_config[config.layer_types.index("full_attention")].head_dim
    rotated = int(head_dim * config.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    factors = [1.0] * rotated + [1e30] * (head_dim // 2 - rotated)
    yield "rope_freqs.weight", np.array(factors, dtype=np.float32)
    for name, value in weights.items():
        base, _, suffix = name.rpartition(".")
        if base.removeprefix("model.") in GEMMA4_TOP:
            yield f"{GEMMA4_TOP[base.removeprefix('model.')]}.{suffix}", value
        else:
            yield _named(name, GEMMA4_LAYER), value


TENSORS: dict[str, Callable[[dict, PretrainedConfig], Iterator[tuple[str, np.ndarray]]]] = {
    "qwen3_5_text": lambda weights, config: _qwen_tensors(weights, config, tiled=True),
    "qwen3_next": lambda weights, config: _qwen_tensors(weights, config, tiled=False),
    "lfm2": _lfm2_tensors,
    "granitemoehybrid": _granite_tensors,
    "bamba": _granite_tensors,
    "nemotron_h": _nemotron_h_tensors,
    "falcon_h1": _falcon_h1_tensors,
    "gemma4_text": _gemma4_tensors,
}


# Gemma's tokenizer: a BPE with byte fallback over text whose spaces are "▁".

GEMMA_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>{{ message['role'] }}\n"
    "{{ message['content'] }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def build_gemma4(folder: Path, fields: dict) -> Path:
    """A tiny Gemma 4 (`tests.support.architectures.build` of `fields`) with `gemma_tokenizer`
    and weights that tell its parts apart: every norm's weight drawn around 1 and each
    layer's scalar its own (they are made all 1)."""
    build(folder, "gemma4_text", fields)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("layer_scalar"):
                tensor.fill_(0.5 + torch.rand(1, generator=generator).item())
    model.save_pretrained(folder)
    gemma_tokenizer(folder, model.config.vocab_size)
    return folder


def gemma_tokenizer(folder: Path, vocab_size: int = 384) -> GemmaTokenizer:
    """Give `folder` (a tiny model's, its vocabulary `vocab_size`) a tokenizer as Gemma 4's
    is made, which llama.cpp's converter takes (its `LlamaHfVocab`): transformers'
    `GemmaTokenizer`, its vocabulary the special tokens, the 256 byte tokens (`<0x00>`...)
    and pieces learned as a BPE over the tiny corpus, adding no BOS (the chat template
    writes it); the config's token ids set to its own."""
    learner = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    learner.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 256, special_tokens=GEMMA_SPECIAL_TOKENS, show_progress=False
    )
    learner.train_from_iterator(_CORPUS, trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    pieces = sorted(learned["vocab"], key=learned["vocab"].get)[len(GEMMA_SPECIAL_TOKENS) :]
    bytes_ = [f"<0x{byte:02X}>" for byte in range(256)]
    vocab = {token: i for i, token in enumerate([*GEMMA_SPECIAL_TOKENS, *bytes_, *pieces])}
    tokenizer = GemmaTokenizer(
        vocab=vocab, merges=[tuple(merge) for merge in learned["merges"]], add_bos_token=False,
        extra_special_tokens=GEMMA_SPECIAL_TOKENS[5:], chat_template=GEMMA_CHAT_TEMPLATE,
    )  # fmt: skip
    tokenizer.save_pretrained(folder)
    ids = {
        f"{kind}_token_id": getattr(tokenizer, f"{kind}_token_id") for kind in ("bos", "eos", "pad")
    }
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **ids}, indent=2) + "\n")
    return tokenizer


def _add_gemma_tokenizer(writer: GGUFWriter, tokenizer: PreTrainedTokenizerBase) -> None:
    """Gemma4Model.set_vocab: `LlamaHfVocab`'s tokens (every score -1000; byte tokens BYTE,
    special ones CONTROL), the merges and special ids (`SpecialVocab`), BOS added."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * len(tokens))
    writer.add_token_types(
        [
            TokenType.BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", token)
            else TokenType.CONTROL if token in special else TokenType.NORMAL
            for token in tokens
        ]
    )  # fmt: skip
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(merge) for merge in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_mask_token_id(tokenizer.mask_token_id)
    writer.add_add_bos_token(True)
    writer.add_chat_template(tokenizer.chat_template)
    writer.add_add_space_prefix(False)


def _unsplit_qkvz(tensors: dict, weights: dict, config: PretrainedConfig) -> dict:
    """Qwen3-Next's `attn_qkv` and `attn_gate` replaced by `ssm_in`: in_proj_qkvz whole."""
    out = {
        n: v for n, v in tensors.items() if not n.endswith(("attn_qkv.weight", "attn_gate.weight"))
    }
    for name, value in weights.items():
        if name.endswith("in_proj_qkvz.weight"):
            out[f"blk.{name.split('.')[2]}.ssm_in.weight"] = value
    return out


def _draft_head(tensors: dict[str, np.ndarray], config: PretrainedConfig) -> dict[str, np.ndarray]:
    """A Qwen multi-token-prediction block as the converter appends it (`blk.{layers}`: a
    copy of the last layer and its `nextn` tensors)."""
    last, head = config.num_hidden_layers - 1, config.num_hidden_layers
    block = {
        name.replace(f"blk.{last}.", f"blk.{head}."): value
        for name, value in tensors.items()
        if name.startswith(f"blk.{last}.")
    }
    hidden = config.hidden_size
    nextn = {"eh_proj.weight": np.zeros((hidden, 2 * hidden), np.float32)} | {
        f"{norm}.weight": np.ones(hidden, np.float32)
        for norm in ("enorm", "hnorm", "shared_head_norm")
    }
    return block | {f"blk.{head}.nextn.{name}": value for name, value in nextn.items()}

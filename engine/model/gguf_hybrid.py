"""Hybrid models' GGUFs (recurrent layers beside attention), as llama.cpp's converter writes
them, read as the transformers models they were converted from.

transformers' GGUF mapping knows few of these (and its Qwen3.5 config ignores the file's
`recurrent_layers`), so each architecture has here a config function (its metadata -> the
transformers config, `CONFIGS`) and a table (`RULES`: each parameter -> the stored tensors
it is made of and how the converter changed them). What the converter does, undone here:

- zero-centred RMSNorms (Qwen3.5's and Qwen3-Next's, `(1 + w) * x`) are stored `w + 1`,
  in F32 (`fl(w + 1) - 1` comes back exactly); the linear attention's gated norm
  (`ssm_norm`) is stored as it is;
- a Mamba-2 or Gated DeltaNet `A_log` is stored as `A = -exp(A_log)` (`ssm_a`): `log(-A)`
  gives it back to an ulp;
- squeezes and unsqueezes (a conv1d `[channels, 1, kernel]` as `[channels, kernel]`, `A`
  and `D` as `[heads, 1]`, a Mamba-2 norm as `[groups, width / groups]`, a shared expert's
  gate `[1, hidden]` as `[hidden]` by llama-quantize) move no value: every tensor is
  reshaped to its parameter's shape;
- Qwen3.5's value heads are stored tiled (`v0k0 v0k1 v1k0 v1k1`) rather than grouped by
  key head (`v0k0 v1k0 v0k1 v1k1`), for ggml's broadcast: the rows of `attn_qkv` (its
  value part), `attn_gate`, `ssm_alpha`, `ssm_beta`, `ssm_conv1d` (its value channels),
  `ssm_a` and `ssm_dt`, and the columns of `ssm_out`, are taken back in grouped order;
- Qwen3-Next's `in_proj_qkvz` (per key head: q, k, v, z) is stored split and regrouped as
  `attn_qkv` (all q, all k, all v) and `attn_gate` (all z): joined, rows put back (an
  older converter's `ssm_in`, the matrix as it is, is read too);
- Granite 4.0-H's shared MLP `input_linear` (gate rows, then up rows) is stored as
  `ffn_gate` and `ffn_up`, Qwen3-Next's experts' `gate_up_proj` as `ffn_gate_exps` and
  `ffn_up_exps`: joined again;
- Granite 4.0-H's, Bamba's and Nemotron-H's q and k rows are permuted as a Llama's for
  llama.cpp's rotary embedding (though only Bamba has one): put back;
- Falcon-H1's multipliers (embedding, LM head, attention in and out, key, SSM in and out,
  the five over the SSM in-projection's parts, the MLP's two) are multiplied into the
  weights and not written to the metadata: the file holds the model whose multipliers are
  all 1, which computes what the checkpoint did (each scales a linear map or its input),
  and is served as that model.

Gemma 4's files (`gemma4`) are read by the same tables, though it is no hybrid:
transformers' GGUF mapping reads its config in part (not its per-layer head sizes, KV
head counts, sharing or rope). Its converter stores every tensor as it is (no norm plus
one), the per-layer inputs' tables and projections under their own names, each layer's
scalar (a buffer, `layer_scalar`) as `layer_output_scale`, and the global layers'
proportional rope as `rope_freqs` (factors 1 on the rotated pairs, 1e30 on the others),
which the config holds (`_gemma4`); its tokenizer (`gemma4`: a BPE with byte fallback over
text whose spaces are "▁") is transformers' `GemmaTokenizer` from the file's tokens and
merges, adding no BOS (its chat template writes it) as transformers' does.

A `granitehybrid` file with rotary positions is Bamba's (the converter writes both so).
`placements(config)` names, for each parameter, its `Placement`; reading it is
`engine/model/gguf.py`'s (a permutation of rows or columns leaves a quantized weight as
stored, for the kernel: its rows read in order, its input gathered in the inverse of the
column order, as `ssm_out`'s must be in a K-quant file, whose 256-wide super-blocks span
several value heads).

Mixture-of-experts files (`MOE_ARCHITECTURES`, a `granitehybrid` or `gemma4` file with
experts) are refused by name: another change serves them. Qwen3-Next has experts in every
layer (llama.cpp's `qwen3next` has no other form): they are read, dequantized, into
transformers' fused expert parameters. The multi-token-prediction block of a Qwen3.5 or
Qwen3-Next file (`nextn_predict_layers`: the blocks past the model's layers) is not read;
pagedserve does not draft with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerFast

from engine.errors import UnsupportedModelError
from engine.model.gguf_encoder import metadata_field

# Mixture-of-experts hybrids, refused by name.
MOE_ARCHITECTURES = ("qwen35moe", "lfm2moe", "nemotron_h_moe")
MOE_REFUSAL = "a mixture of experts: MoE GGUFs are not served yet"
Order = Callable[[PretrainedConfig], np.ndarray]
Undo = Callable[[np.ndarray], np.ndarray]
BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class Placement:
    """One parameter made of stored tensors: `sources` joined in order (along the rows,
    `axis` 0; or each expert's rows after the same expert's of the one before, `axis` 1),
    `undo` applied to the values, the rows taken in `rows` order (`parameter[i] =
    joined[rows[i]]`) and the columns in `columns` order, then reshaped to the parameter's
    shape."""

    sources: tuple[str, ...]
    undo: Undo | None = None
    rows: np.ndarray | None = None
    columns: np.ndarray | None = None
    axis: int = 0


@dataclass(frozen=True)
class Rule:
    """How the converter stores one parameter: `stored` (GGUF names; in a layer's rule,
    below `blk.{bid}.`), the value transform it undoes, the orders (made from the config)
    that put its rows and columns back, the axis its parts join on; and `legacy`, how an
    older converter stored it, read where a file lacks `stored`."""

    stored: str | tuple[str, ...]
    undo: Undo | None = None
    rows: Order | None = None
    columns: Order | None = None
    axis: int = 0
    legacy: Rule | None = None

    def names(self) -> tuple[str, ...]:
        return (self.stored,) if isinstance(self.stored, str) else self.stored

    def below(self, prefix: str) -> Rule:
        """This rule with its stored names (and its legacy one's) below `prefix`."""
        return replace(
            self,
            stored=tuple(f"{prefix}{name}" for name in self.names()),
            legacy=None if self.legacy is None else self.legacy.below(prefix),
        )

    def placements(self, config: PretrainedConfig, bid: int) -> tuple[Placement, ...]:
        """Its placement in layer `bid`, then its legacy one's."""
        placement = Placement(
            tuple(name.format(bid=bid) for name in self.names()),
            self.undo,
            None if self.rows is None else self.rows(config),
            None if self.columns is None else self.columns(config),
            self.axis,
        )
        return (placement, *(() if self.legacy is None else self.legacy.placements(config, bid)))


def _minus_one(values: np.ndarray) -> np.ndarray:
    """A zero-centred RMSNorm's weight from the stored `w + 1` (in F32: exact)."""
    return values - np.float32(1)


def _a_log(values: np.ndarray) -> np.ndarray:
    """`A_log` from the stored `A = -exp(A_log)`."""
    return np.log(-values)


def _grouped(keys: int, per_key: int, width: int) -> np.ndarray:
    """Where each value head's rows (`width` each; grouped by key head: head (k, j) at
    k * per_key + j) are stored tiled (head (k, j) at j * keys + k)."""
    tiled = np.arange(keys * per_key * width).reshape(per_key, keys, width)
    return tiled.transpose(1, 0, 2).reshape(-1)


def _value_heads(config: PretrainedConfig, width: int = 1, offset: int = 0) -> np.ndarray:
    """Qwen3.5's order of `offset` rows kept as stored, then of the value heads' rows
    (`width` a head) put back from tiled to grouped."""
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    return np.concatenate([np.arange(offset), offset + _grouped(keys, values // keys, width)])


def _value_rows(config: PretrainedConfig) -> np.ndarray:
    """Qwen3.5's value heads' rows (or columns: out_proj's), tiled to grouped."""
    return _value_heads(config, config.linear_value_head_dim)


def _qkv_rows(config: PretrainedConfig) -> np.ndarray:
    """q's and k's rows as stored, then v's grouped (in_proj_qkv, and conv1d's channels)."""
    qk = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    return _value_heads(config, config.linear_value_head_dim, qk)


def _qkvz_rows(config: PretrainedConfig) -> np.ndarray:
    """Qwen3-Next's in_proj_qkvz (per key head: its q, k, v and z rows) from attn_qkv's
    rows (every head's q, then k, then v) followed by attn_gate's (every head's z)."""
    keys, key_width = config.linear_num_key_heads, config.linear_key_head_dim
    value_width = config.linear_num_value_heads // keys * config.linear_value_head_dim
    widths = (key_width, key_width, value_width, value_width)
    starts = np.cumsum((0, *(keys * width for width in widths[:-1])))
    return np.concatenate(
        [
            start + head * width + np.arange(width)
            for head in range(keys)
            for start, width in zip(starts, widths, strict=True)
        ]
    )


def _rotary(heads: int, head_dim: int) -> np.ndarray:
    """Rows of q or k stored as llama.cpp's converter permutes a Llama's (each head's two
    rotary halves interleaved), in transformers' order."""
    rows = np.arange(heads * head_dim).reshape(heads, head_dim // 2, 2)
    return rows.transpose(0, 2, 1).reshape(-1)


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _q_rows(config: PretrainedConfig) -> np.ndarray:
    return _rotary(config.num_attention_heads, _head_dim(config))


def _k_rows(config: PretrainedConfig) -> np.ndarray:
    return _rotary(config.num_key_value_heads, _head_dim(config))


def _weights(names: dict[str, str], **options: Any) -> dict[str, Rule]:
    """Rules of `module: stored` weights (and their biases, where a file has them)."""
    return {
        f"{module}.{suffix}": Rule(f"{stored}.{suffix}", **options)
        for module, stored in names.items()
        for suffix in ("weight", "bias")
    }


def _below(prefix: str, rules: dict[str, Rule]) -> dict[str, Rule]:
    """Rules of a submodule's parameters, named from its parent."""
    return {f"{prefix}.{name}": rule for name, rule in rules.items()}


def _layers(rules: dict[str, Rule]) -> dict[str, Rule]:
    """A layer's rules as the model's (`model.layers.{bid}.`, stored below `blk.{bid}.`)."""
    return {
        f"model.layers.{{bid}}.{name}": rule.below("blk.{bid}.") for name, rule in rules.items()
    }


def _model(
    embedding: str, norm: str, layers: dict[str, Rule], final: Rule = Rule("output_norm.weight")
) -> dict[str, Rule]:
    """A model's rules: its embedding, its final norm (`model.{norm}`, stored as `final`),
    its head and its layers'."""
    return {
        f"model.{embedding}.weight": Rule("token_embd.weight"),
        f"model.{norm}.weight": final,
        "lm_head.weight": Rule("output.weight"),
        **_layers(layers),
    }


ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
ROTARY_PERMUTED = {
    **_weights(ATTENTION),
    **_weights({"q_proj": "attn_q"}, rows=_q_rows),
    **_weights({"k_proj": "attn_k"}, rows=_k_rows),
}
MLP = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
MAMBA2 = {
    **_weights({"in_proj": "ssm_in", "conv1d": "ssm_conv1d", "out_proj": "ssm_out"}),
    "dt_bias": Rule("ssm_dt.bias"),
    "A_log": Rule("ssm_a", _a_log),
    "D": Rule("ssm_d"),
    "norm.weight": Rule("ssm_norm.weight"),
}
QWEN_NORMS = {
    "input_layernorm.weight": Rule("attn_norm.weight", _minus_one),
    "post_attention_layernorm.weight": Rule("post_attention_norm.weight", _minus_one),
    "self_attn.q_norm.weight": Rule("attn_q_norm.weight", _minus_one),
    "self_attn.k_norm.weight": Rule("attn_k_norm.weight", _minus_one),
    **_below("self_attn", _weights(ATTENTION)),
}
QWEN35_LAYER = {
    **QWEN_NORMS,
    **_below("mlp", _weights(MLP)),
    **_below(
        "linear_attn",
        {
            "in_proj_qkv.weight": Rule("attn_qkv.weight", rows=_qkv_rows),
            "in_proj_z.weight": Rule("attn_gate.weight", rows=_value_rows),
            "in_proj_a.weight": Rule("ssm_alpha.weight", rows=_value_heads),
            "in_proj_b.weight": Rule("ssm_beta.weight", rows=_value_heads),
            "conv1d.weight": Rule("ssm_conv1d.weight", rows=_qkv_rows),
            "A_log": Rule("ssm_a", _a_log, rows=_value_heads),
            "dt_bias": Rule("ssm_dt.bias", rows=_value_heads),
            "norm.weight": Rule("ssm_norm.weight"),
            "out_proj.weight": Rule("ssm_out.weight", columns=_value_rows),
        },
    ),
}
QWEN3_NEXT_LAYER = {
    **QWEN_NORMS,
    **_below(
        "linear_attn",
        {
            "in_proj_qkvz.weight": Rule(
                ("attn_qkv.weight", "attn_gate.weight"),
                rows=_qkvz_rows,
                legacy=Rule("ssm_in.weight"),  # in transformers' order, before the split
            ),
            "in_proj_ba.weight": Rule("ssm_ba.weight"),
            "conv1d.weight": Rule("ssm_conv1d.weight"),
            "A_log": Rule("ssm_a", _a_log),
            "dt_bias": Rule("ssm_dt.bias"),
            "norm.weight": Rule("ssm_norm.weight"),
            "out_proj.weight": Rule("ssm_out.weight"),
        },
    ),
    **_below(
        "mlp",
        {
            "gate.weight": Rule("ffn_gate_inp.weight"),
            "experts.gate_up_proj": Rule(("ffn_gate_exps.weight", "ffn_up_exps.weight"), axis=1),
            "experts.down_proj": Rule("ffn_down_exps.weight"),
            "shared_expert_gate.weight": Rule("ffn_gate_inp_shexp.weight"),
            **_weights({f"shared_expert.{m}": f"{s}_shexp" for m, s in MLP.items()}),
            **_weights(MLP),  # a dense layer's (`mlp_only_layers`)
        },
    ),
}
LFM2_LAYER = {
    "operator_norm.weight": Rule("attn_norm.weight"),
    "ffn_norm.weight": Rule("ffn_norm.weight"),
    **_below(
        "self_attn",
        _weights(
            {
                **ATTENTION,
                "out_proj": "attn_output",
                "q_layernorm": "attn_q_norm",
                "k_layernorm": "attn_k_norm",
            }
        ),
    ),
    **_below("conv", _weights({m: f"shortconv.{m}" for m in ("conv", "in_proj", "out_proj")})),
    **_below("feed_forward", _weights({"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"})),
}
# Granite 4.0-H: shared MLP (ffn_*, or ffn_*_shexp beside experts, which are refused).
GRANITE_LAYER = {
    "input_layernorm.weight": Rule("attn_norm.weight"),
    "post_attention_layernorm.weight": Rule("ffn_norm.weight"),
    **_below("self_attn", ROTARY_PERMUTED),
    **_below("mamba", MAMBA2),
    "shared_mlp.input_linear.weight": Rule(("ffn_gate.weight", "ffn_up.weight")),
    "shared_mlp.output_linear.weight": Rule("ffn_down.weight"),
}
NEMOTRON_H_LAYER = {
    "norm.weight": Rule("attn_norm.weight"),
    **_below(
        "mixer",
        {**ROTARY_PERMUTED, **MAMBA2, **_weights({"up_proj": "ffn_up", "down_proj": "ffn_down"})},
    ),
}
FALCON_H1_LAYER = {
    "input_layernorm.weight": Rule("attn_norm.weight"),
    "pre_ff_layernorm.weight": Rule("ffn_norm"),  # named so by the converter, no ".weight"
    **_below("self_attn", _weights(ATTENTION)),
    **_below("mamba", MAMBA2),
    **_below("feed_forward", _weights(MLP)),
}
BAMBA_LAYER = {
    "input_layernorm.weight": Rule("attn_norm.weight"),
    "pre_ff_layernorm.weight": Rule("ffn_norm.weight"),
    **_below("self_attn", ROTARY_PERMUTED),
    **_below("mamba", MAMBA2),
    **_below("feed_forward", _weights(MLP)),
}
GEMMA4_LAYER = {
    "input_layernorm.weight": Rule("attn_norm.weight"),
    "post_attention_layernorm.weight": Rule("post_attention_norm.weight"),
    "pre_feedforward_layernorm.weight": Rule("ffn_norm.weight"),
    "post_feedforward_layernorm.weight": Rule("post_ffw_norm.weight"),
    "post_per_layer_input_norm.weight": Rule("post_norm.weight"),
    "per_layer_input_gate.weight": Rule("inp_gate.weight"),
    "per_layer_projection.weight": Rule("proj.weight"),
    "layer_scalar": Rule("layer_output_scale.weight"),  # a buffer, [1]
    **_below(
        "self_attn",
        {
            **_weights(ATTENTION),
            "q_norm.weight": Rule("attn_q_norm.weight"),
            "k_norm.weight": Rule("attn_k_norm.weight"),
        },
    ),
    **_below("mlp", _weights(MLP)),
}
# transformers model type -> its parameters' rules.
RULES: dict[str, dict[str, Rule]] = {
    "qwen3_5_text": _model(
        "embed_tokens", "norm", QWEN35_LAYER, final=Rule("output_norm.weight", _minus_one)
    ),
    "qwen3_next": _model(
        "embed_tokens", "norm", QWEN3_NEXT_LAYER, final=Rule("output_norm.weight", _minus_one)
    ),
    "lfm2": _model(
        "embed_tokens", "embedding_norm", LFM2_LAYER, final=Rule("token_embd_norm.weight")
    ),
    "granitemoehybrid": _model("embed_tokens", "norm", GRANITE_LAYER),
    "bamba": _model("embed_tokens", "final_layernorm", BAMBA_LAYER),
    "nemotron_h": _model("embeddings", "norm_f", NEMOTRON_H_LAYER),
    "falcon_h1": _model("embed_tokens", "final_layernorm", FALCON_H1_LAYER),
    "gemma4_text": {
        **_model("embed_tokens", "norm", GEMMA4_LAYER),
        "model.embed_tokens_per_layer.weight": Rule("per_layer_token_embd.weight"),
        "model.per_layer_model_projection.weight": Rule("per_layer_model_proj.weight"),
        "model.per_layer_projection_norm.weight": Rule("per_layer_proj_norm.weight"),
    },
}
# Model types whose files may hold a multi-token-prediction block past their layers.
DRAFT_HEADS = ("qwen3_5_text", "qwen3_next")
# Llama 3's rotary factors, a tensor: Gemma 4's are its config's proportional rope.
ROPE_FREQS = "rope_freqs.weight"


def placements(config: PretrainedConfig) -> dict[str, tuple[Placement, ...]]:
    """Every parameter name `RULES` gives for `config`'s layers -> its placements, the
    first a file holds the tensors of standing (a model lacks some names: an attention
    layer has no `linear_attn`; a file lacks some tensors: biases)."""
    placed = {}
    for name, rule in RULES[config.model_type].items():
        for bid in range(config.num_hidden_layers) if "{bid}" in name else (0,):
            placed[name.format(bid=bid)] = rule.placements(config, bid)
    return placed


def unread(config: PretrainedConfig, name: str) -> bool:
    """Whether the stored tensor `name` is left unread: a block past the model's layers
    (the multi-token-prediction head of a Qwen3.5 or Qwen3-Next file), or Gemma 4's
    `rope_freqs`, which its config holds (`_gemma4`)."""
    if name == ROPE_FREQS and config.model_type == "gemma4_text":
        return True
    block = BLOCK.match(name)
    return (
        config.model_type in DRAFT_HEADS
        and block is not None
        and int(block.group(1)) >= config.num_hidden_layers
    )


class _Metadata:
    """A file's metadata fields (under its architecture's prefix: `self("block_count")`)
    and its tensors' shapes."""

    def __init__(self, reader: GGUFReader, path: Path, architecture: str) -> None:
        self.reader, self.path, self.architecture = reader, path, architecture
        self.shapes = {
            t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors
        }

    def __call__(self, key: str, default: Any = None) -> Any:
        return metadata_field(self.reader, self.path, f"{self.architecture}.{key}", default)

    def optional(self, key: str) -> Any:
        entry = self.reader.fields.get(key)
        return None if entry is None else entry.contents()

    def has(self, leaf: str) -> bool:
        """Whether any tensor's name ends with `leaf` (a layer's bias, an expert table)."""
        return any(name.endswith(leaf) for name in self.shapes)

    def per_layer(self, key: str, layers: int) -> list[int]:
        """A count the converter writes per layer (a list) or once for all."""
        value = self(key)
        return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers


def _common(meta: _Metadata) -> dict[str, Any]:
    """What every config takes from the file: its shape, vocabulary and tokens' ids."""
    embedding = meta.shapes.get("token_embd.weight")
    if embedding is None:
        raise UnsupportedModelError(f"{meta.path.name} lacks the tensor 'token_embd.weight'")
    return {
        "vocab_size": embedding[0],
        "hidden_size": meta("embedding_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": meta("attention.head_count"),
        "max_position_embeddings": meta("context_length"),
        "tie_word_embeddings": "output.weight" not in meta.shapes,
        **{
            f"{kind}_token_id": meta.optional(f"tokenizer.ggml.{kind}_token_id")
            for kind in ("bos", "eos")
        },
        "pad_token_id": meta.optional("tokenizer.ggml.padding_token_id"),
    }


def _rope(meta: _Metadata, head_dim: int) -> dict[str, Any]:
    """The rotary embedding's parameters (the rotated width: a fraction of the head)."""
    scaling = meta("rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedModelError(f"{meta.path.name}: rope scaling '{scaling}' is not read")
    rope = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    rotated = int(meta("rope.dimension_count", head_dim))
    if rotated != head_dim:
        rope["partial_rotary_factor"] = rotated / head_dim
    return rope


def _qwen35(meta: _Metadata) -> dict[str, Any]:
    """Qwen3.5's (and Qwen3-Next's) Gated DeltaNet and attention: the layers are the blocks
    but the draft head's; which is linear from `recurrent_layers` (else every
    `full_attention_interval`-th layer attends)."""
    layers = meta("block_count") - int(meta("nextn_predict_layers", 0))
    recurrent = meta("attention.recurrent_layers", [])[:layers] or [
        (i + 1) % int(meta("full_attention_interval", 4)) != 0 for i in range(layers)
    ]
    head_dim, value_heads = meta("attention.key_length"), meta("ssm.time_step_rank")
    return {
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "num_key_value_heads": meta("attention.head_count_kv"),
        "head_dim": head_dim,
        "intermediate_size": meta("feed_forward_length", 0),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "linear_conv_kernel_dim": meta("ssm.conv_kernel"),
        "linear_key_head_dim": meta("ssm.state_size"),
        "linear_num_key_heads": meta("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": meta("ssm.inner_size") // value_heads,
        "rope_parameters": _rope(meta, head_dim),
    }


def _qwen3_next(meta: _Metadata) -> dict[str, Any]:
    """Qwen3.5's fields, and experts in every layer but those with a dense MLP (llama.cpp
    normalizes the chosen experts' weights, and so does transformers by `norm_topk_prob`)."""
    fields = _qwen35(meta)
    dense = [
        i
        for i in range(fields["num_hidden_layers"])
        if f"blk.{i}.ffn_gate_inp.weight" not in meta.shapes
    ]
    return {
        **fields,
        "num_experts": meta("expert_count"),
        "num_experts_per_tok": meta("expert_used_count"),
        "moe_intermediate_size": meta("expert_feed_forward_length"),
        "shared_expert_intermediate_size": meta("expert_shared_feed_forward_length"),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _lfm2(meta: _Metadata) -> dict[str, Any]:
    """LFM2: a layer attends where its key-value head count is not 0, else convolves."""
    kv = meta.per_layer("attention.head_count_kv", meta("block_count"))
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    return {
        "num_key_value_heads": max(kv),
        "layer_types": ["full_attention" if n else "conv" for n in kv],
        "intermediate_size": meta("feed_forward_length"),
        "block_auto_adjust_ff_dim": False,  # the file's width is the final one
        "norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "conv_L_cache": meta("shortconv.l_cache"),
        "conv_bias": meta.has("shortconv.in_proj.bias"),
        "rope_parameters": _rope(meta, hidden // heads),
    }


def _mamba2(meta: _Metadata) -> dict[str, int]:
    """A Mamba-2 mixer's shape: heads (`time_step_rank`), their width, state, groups."""
    inner, heads = meta("ssm.inner_size"), meta("ssm.time_step_rank")
    return {"inner": inner, "heads": heads, "head_dim": inner // heads,
            "state": meta("ssm.state_size"), "groups": meta("ssm.group_count"),
            "conv": meta("ssm.conv_kernel")}  # fmt: skip


def _granite(meta: _Metadata) -> dict[str, Any]:
    """Granite 4.0-H: a layer attends where its key-value head count is not 0, without
    rotary positions; llama.cpp's attention scale where the file names none. A file with
    rotary positions (`rope.scaling.finetuned`, which the converter sets for Bamba alone)
    is Bamba's."""
    if meta("expert_count", 0) or meta.has("ffn_gate_exps.weight"):
        raise UnsupportedModelError(
            f"{meta.path.name}: GGUF architecture 'granitehybrid' with experts is {MOE_REFUSAL}"
        )
    if meta("rope.scaling.finetuned", False):
        return _bamba(meta)
    kv = meta.per_layer("attention.head_count_kv", meta("block_count"))
    head_dim = meta("embedding_length") // meta("attention.head_count")
    return {
        "model_type": "granitemoehybrid",
        **_granite_mamba(meta),
        "layer_types": ["full_attention" if n else "linear_attention" for n in kv],
        "num_key_value_heads": max(kv),
        "intermediate_size": meta("feed_forward_length"),
        "shared_intermediate_size": meta(
            "expert_shared_feed_forward_length", meta("feed_forward_length")
        ),
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "attention_bias": meta.has("attn_q.bias"),
        "embedding_multiplier": meta("embedding_scale", 1.0),
        "residual_multiplier": meta("residual_scale", 1.0),
        "attention_multiplier": meta("attention.scale", 1 / math.sqrt(head_dim)),
        "logits_scaling": meta("logit_scale", 1.0),
        "position_embedding_type": "nope",
    }


def _bamba(meta: _Metadata) -> dict[str, Any]:
    """Bamba: attention (rotary, over `rope.dimension_count` of each head) where a layer's
    key-value head count is not 0, else Mamba-2; a gated MLP in every layer."""
    kv = meta.per_layer("attention.head_count_kv", meta("block_count"))
    return {
        "model_type": "bamba",
        **_granite_mamba(meta),
        "attn_layer_indices": [i for i, n in enumerate(kv) if n],
        "num_key_value_heads": max(kv),
        "intermediate_size": meta("feed_forward_length"),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "attention_bias": meta.has("attn_q.bias"),
        "mlp_bias": meta.has("ffn_up.bias"),
        "rope_parameters": _rope(meta, meta("embedding_length") // meta("attention.head_count")),
    }


def _granite_mamba(meta: _Metadata) -> dict[str, Any]:
    """Granite's and Bamba's Mamba-2 fields."""
    mamba = _mamba2(meta)
    return {
        "mamba_n_heads": mamba["heads"],
        "mamba_d_head": mamba["head_dim"],
        "mamba_d_state": mamba["state"],
        "mamba_n_groups": mamba["groups"],
        "mamba_d_conv": mamba["conv"],
        "mamba_expand": _expand(meta, mamba["inner"], meta("embedding_length")),
        "mamba_conv_bias": meta.has("ssm_conv1d.bias"),
        "mamba_proj_bias": meta.has("ssm_in.bias"),
    }


def _expand(meta: _Metadata, inner: int, hidden: int) -> int:
    if inner % hidden:
        raise UnsupportedModelError(
            f"{meta.path.name}: an SSM width of {inner} is not a multiple of the hidden {hidden}"
        )
    return inner // hidden


def _nemotron_h(meta: _Metadata) -> dict[str, Any]:
    """Nemotron-H: a layer attends where its key-value head count is not 0, is an MLP
    where its feed-forward width is not, else a Mamba-2 mixer; no rotary positions."""
    layers, mamba = meta("block_count"), _mamba2(meta)
    kv = meta.per_layer("attention.head_count_kv", layers)
    ff = meta.per_layer("feed_forward_length", layers)
    pattern = "".join("*" if k else "-" if f else "M" for k, f in zip(kv, ff, strict=True))
    return {
        "hybrid_override_pattern": pattern,
        "num_key_value_heads": max(kv),
        "head_dim": meta("attention.key_length"),
        "intermediate_size": max(ff),
        "layer_norm_epsilon": meta("attention.layer_norm_epsilon"),
        "attention_bias": meta.has("attn_q.bias"),
        "mlp_bias": meta.has("ffn_up.bias"),
        "mamba_num_heads": mamba["heads"],
        "mamba_head_dim": mamba["head_dim"],
        "ssm_state_size": mamba["state"],
        "n_groups": mamba["groups"],
        "conv_kernel": mamba["conv"],
        "use_conv_bias": meta.has("ssm_conv1d.bias"),
        "mamba_proj_bias": meta.has("ssm_in.bias"),
    }


def _falcon_h1(meta: _Metadata) -> dict[str, Any]:
    """Falcon-H1: attention and a Mamba-2 mixer in every layer; the multipliers 1 (the
    file's weights hold them); llama.cpp gates before the optional grouped norm."""
    mamba, head_dim = _mamba2(meta), meta("attention.key_length")
    return {
        "num_key_value_heads": meta("attention.head_count_kv"),
        "head_dim": head_dim,
        "intermediate_size": meta("feed_forward_length"),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "attention_bias": meta.has("attn_q.bias"),
        "mlp_bias": meta.has("ffn_up.bias"),
        "rope_parameters": _rope(meta, head_dim),
        "mamba_d_ssm": mamba["inner"],
        "mamba_n_heads": mamba["heads"],
        "mamba_d_head": mamba["head_dim"],
        "mamba_d_state": mamba["state"],
        "mamba_n_groups": mamba["groups"],
        "mamba_d_conv": mamba["conv"],
        "mamba_rms_norm": meta.has("ssm_norm.weight"),
        "mamba_norm_before_gate": False,
        "mamba_conv_bias": meta.has("ssm_conv1d.bias"),
        "mamba_proj_bias": meta.has("ssm_in.bias"),
        **dict.fromkeys(FALCON_H1_MULTIPLIERS, 1.0),
        "ssm_multipliers": [1.0] * 5,
        "mlp_multipliers": [1.0, 1.0],
    }


def _gemma4(meta: _Metadata) -> dict[str, Any]:
    """Gemma 4: sliding and global layers (`sliding_window_pattern`) of their own head
    sizes (`key_length_swa`, `key_length`) and KV head counts (`head_count_kv`, once or per
    layer), the last `shared_kv_layers` reading earlier layers' KV, K as V where a global
    layer that holds KV has no `attn_v`, per-layer inputs (`embedding_length_per_layer_input`
    wide, from a table of `per_layer_token_embd`'s rows), the shared layers' MLPs twice as
    wide where `feed_forward_length` says so; the sliding layers' rope over whole heads
    (`freq_base_swa`), the global layers' proportional (`freq_base`, the rotated share
    from `rope_freqs`: factors 1, then 1e30 on the pairs left unrotated)."""
    name = meta.path.name
    if meta("expert_count", 0) or meta.has("ffn_gate_inp.weight"):
        raise UnsupportedModelError(
            f"{name}: GGUF architecture 'gemma4' with experts is {MOE_REFUSAL}"
        )
    layers, shared = meta("block_count"), int(meta("attention.shared_kv_layers", 0))
    kinds = [
        "sliding_attention" if s else "full_attention"
        for s in meta("attention.sliding_window_pattern")
    ]
    if len(kinds) != layers or kinds[-1] != "full_attention":
        raise UnsupportedModelError(f"{name}: a Gemma 4 sliding window pattern {kinds} is not read")
    widths = {
        kind: (meta(f"attention.key_length{suffix}"), meta(f"attention.value_length{suffix}"))
        for kind, suffix in (("sliding_attention", "_swa"), ("full_attention", ""))
    }
    if any(k != v for k, v in widths.values()):
        raise UnsupportedModelError(f"{name}: Gemma 4 heads whose K and V differ in size")
    dims = {kind: k for kind, (k, _) in widths.items()}
    kv = meta.per_layer("attention.head_count_kv", layers)
    first = kinds.index("sliding_attention") if "sliding_attention" in kinds else 0
    base = (dims[kinds[first]], kv[first])  # the config's own; other layers' by index
    per_layer = {
        i: {"head_dim": dims[kind], "num_key_value_heads": kv[i]}
        for i, kind in enumerate(kinds)
        if (dims[kind], kv[i]) != base
    }
    owners = [i for i, kind in enumerate(kinds[: layers - shared]) if kind == "full_attention"]
    ff = meta.per_layer("feed_forward_length", layers)
    double = [ff[0] * (2 if i >= layers - shared else 1) for i in range(layers)]
    if ff != [ff[0]] * layers and ff != double:
        raise UnsupportedModelError(f"{name}: Gemma 4 feed-forward widths {ff} are not read")
    table = meta.shapes.get("per_layer_token_embd.weight")
    return {
        "layer_types": kinds,
        "head_dim": base[0],
        "num_key_value_heads": base[1],
        "per_layer_config": per_layer,
        "attention_k_eq_v": any(f"blk.{i}.attn_v.weight" not in meta.shapes for i in owners),
        "num_kv_shared_layers": shared,
        "sliding_window": meta("attention.sliding_window"),
        "intermediate_size": ff[0],
        "use_double_wide_mlp": ff != [ff[0]] * layers,
        "hidden_size_per_layer_input": int(meta("embedding_length_per_layer_input", 0)),
        "vocab_size_per_layer_input": table[0] if table else meta.shapes["token_embd.weight"][0],
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "final_logit_softcapping": meta.optional("gemma4.final_logit_softcapping"),
        "rope_parameters": _gemma4_rope(meta, dims),
    }


def _gemma4_rope(meta: _Metadata, dims: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Gemma 4's rope by layer type (see `_gemma4`); any other is refused."""
    name, full = meta.path.name, dims["full_attention"]
    scaling = meta("rope.scaling.type", "none")
    rotated = (meta("rope.dimension_count", full), meta("rope.dimension_count_swa", 0))
    if scaling != "none" or rotated != (full, dims["sliding_attention"]):
        raise UnsupportedModelError(
            f"{name}: Gemma 4 rope (scaling '{scaling}', rotating {rotated[0]} of {full} and "
            f"{rotated[1]} of {dims['sliding_attention']}) is not read"
        )
    stored = next((t for t in meta.reader.tensors if t.name == ROPE_FREQS), None)
    factors = np.ones(full // 2) if stored is None else np.asarray(stored.data, np.float64)
    pairs = int(np.count_nonzero(factors == 1))
    if len(factors) != full // 2 or not np.all(factors[pairs:] == np.float32(1e30)):
        raise UnsupportedModelError(f"{name}: Gemma 4's '{ROPE_FREQS}' is not proportional rope")
    return {
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 2 * pairs / full,
            "rope_theta": float(meta("rope.freq_base")),
        },
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": float(meta("rope.freq_base_swa")),
        },
    }


FALCON_H1_MULTIPLIERS = (
    "embedding_multiplier",
    "lm_head_multiplier",
    "attention_in_multiplier",
    "attention_out_multiplier",
    "key_multiplier",
    "ssm_in_multiplier",
    "ssm_out_multiplier",
)
# GGUF architecture -> its config's fields (`model_type` among them where it may vary).
CONFIGS: dict[str, Callable[[_Metadata], dict[str, Any]]] = {
    "qwen35": lambda meta: {"model_type": "qwen3_5_text", **_qwen35(meta)},
    "qwen3next": lambda meta: {"model_type": "qwen3_next", **_qwen3_next(meta)},
    "lfm2": lambda meta: {"model_type": "lfm2", **_lfm2(meta)},
    "granitehybrid": _granite,
    "nemotron_h": lambda meta: {"model_type": "nemotron_h", **_nemotron_h(meta)},
    "falcon-h1": lambda meta: {"model_type": "falcon_h1", **_falcon_h1(meta)},
    "gemma4": lambda meta: {"model_type": "gemma4_text", **_gemma4(meta)},
}
HYBRID_ARCHITECTURES = tuple(CONFIGS)
# transformers model type -> its causal LM's class.
CAUSAL_LM = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "bamba": "BambaForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
}


def hybrid_config(reader: GGUFReader, path: Path, architecture: str) -> PretrainedConfig:
    """The transformers config of a hybrid's file (see the module docstring)."""
    meta = _Metadata(reader, path, architecture)
    fields = CONFIGS[architecture](meta)  # first: it refuses a file of experts
    fields = {**_common(meta), **fields}
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [CAUSAL_LM[model_type]]
    return config


def write_hybrid_folder(reader: GGUFReader, path: Path, staging: Path, architecture: str) -> None:
    """Write a hybrid's config and tokenizer into `staging`: the tokenizer the file
    describes (transformers' GGUF tokenizer: its vocabulary, merges and the split of its
    `tokenizer.ggml.pre`), whatever the architecture."""
    hybrid_config(reader, path, architecture).save_pretrained(staging)
    PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(
        staging
    )

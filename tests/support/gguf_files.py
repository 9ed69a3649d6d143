"""Tiny GGUF files written with `gguf`'s own writer, laid out as llama.cpp's converter lays
them out: its metadata keys and tensor names, Llama's q and k rows permuted for its rotary
embedding, norms in F32, and the linears (and the token embedding) in any GGML type.

The quantized tensors hold random blocks: every byte random, the fp16 scales of each block
set to a size that keeps the weights near those of a trained model (|w| up to about 0.1).
Any block is a valid one, so a file exercises every bit of the type's format. The tokenizer
is the tiny models' byte-level BPE (384 tokens, tests/support/tiny_models.py).
`write_bert_gguf` writes a real BERT folder's own weights, as the converter writes a BERT.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch
from gguf import (
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFWriter,
    PoolingType,
    TokenType,
    get_tensor_name_map,
)
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize
from sentencepiece import sentencepiece_model_pb2
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertModel,
    NomicBertModel,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)

from engine import LLM
from engine.model import loader
from engine.model.gguf_encoder import write_pooling_modules
from tests.support.tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

# The types pagedserve's kernel computes as stored.
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K")
# Each type's d (its block scale): the byte offset of the fp16 and its size. Types with a
# minimum get it at `MINIMUM` (offset, multiple of d) so that each block's weights centre
# on zero, as a trained model's do: offsets of the same sign in every block made a random
# model answer one token whatever it was given.
SCALE = {
    "Q4_0": (0, 0.01), "Q4_1": (0, 0.01), "Q5_0": (0, 0.005), "Q5_1": (0, 0.005),
    "Q8_0": (0, 0.0006), "IQ4_NL": (0, 0.0006), "Q4_K": (0, 0.0003), "Q5_K": (0, 0.00015),
    "Q6_K": (208, 0.00002),
    "Q3_K": (108, 0.0005), "Q2_K": (80, 0.002),
}  # fmt: skip
MINIMUM = {
    "Q4_1": (2, -7.5),
    "Q5_1": (2, -15.5),
    "Q4_K": (2, 7.5),
    "Q5_K": (2, 15.5),
    "Q2_K": (82, 1.5),
}


def served(path: Path, **settings: Any) -> LLM:
    """`path` served in fp32 with a small KV cache, `settings` over those."""
    base = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256}
    return LLM(str(path), **(base | settings))


def dense(path: Path) -> dict[str, torch.Tensor]:
    """The file's parameters as the loader reads them without the kernel (dequantized)."""
    cpu = torch.device("cpu")
    return loader.load_model(str(path), dtype=torch.float32, device=cpu).model.state_dict()


def random_blocks(ggml_type: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """`[rows, bytes per row]` of random blocks of `ggml_type` (or F32/F16 values)."""
    if ggml_type in ("F32", "F16"):
        dtype = np.float32 if ggml_type == "F32" else np.float16
        return (rng.standard_normal((rows, columns)) * 0.05).astype(dtype)
    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    blocks = rng.integers(0, 256, (rows, columns // per_block, block_bytes), dtype=np.uint8)
    offset, size = SCALE[ggml_type]
    d = (size * (0.5 + rng.random((rows, columns // per_block)))).astype(np.float16)
    blocks[..., offset : offset + 2] = d[..., None].view(np.uint8)
    if ggml_type in MINIMUM:
        at, factor = MINIMUM[ggml_type]
        minimum = (d.astype(np.float32) * factor).astype(np.float16)
        blocks[..., at : at + 2] = minimum[..., None].view(np.uint8)
    if ggml_type in ("Q4_K", "Q5_K"):  # each sub-block's 6-bit minimum = its scale
        blocks[..., 8:12] = blocks[..., 4:8]
        low = blocks[..., 12:16] & 0x0F
        blocks[..., 12:16] = low | (low << 4)
    if ggml_type == "Q2_K":  # each sub-block's 4-bit minimum = its scale
        low = blocks[..., :16] & 0x0F
        blocks[..., :16] = low | (low << 4)
    return blocks.reshape(rows, -1)


def write_gguf(
    path: Path,
    ggml_type: str = "Q4_K",
    *,
    architecture: str = "llama",
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = False,
    types: dict[str, str] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    pooling: PoolingType | None = None,
    seed: int = 0,
) -> Path:
    """A tiny `architecture` model ('llama', 'qwen2' or 'qwen3') whose linears and token
    embedding are `ggml_type` (`types` overrides it by GGUF tensor name, e.g.
    {"output.weight": "Q6_K"}); no `output.weight` where `tied`; `pooling` written as an
    embedder's file names it."""
    rng = np.random.default_rng(seed)
    tokenizer = build_tokenizer(path.parent / f"{path.stem}-tokenizer")
    vocab = len(tokenizer)
    head_dim = hidden // heads
    writer = GGUFWriter(path, architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    if architecture == "llama":
        writer.add_rope_dimension_count(head_dim)
    if architecture == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    _add_tokenizer(writer, tokenizer)
    if pooling is not None:  # as the converter writes an embedder's (Qwen3-Embedding's LAST)
        writer.add_pooling_type(pooling)
    shapes = _tensor_shapes(
        architecture, hidden, intermediate, layers, head_dim, heads, kv_heads, vocab, tied
    )
    for name, shape in shapes.items():
        if len(shape) == 1:
            values = (
                np.ones(shape, np.float32)
                if "norm" in name
                else rng.standard_normal(shape).astype(np.float32) * 0.02
            )
            writer.add_tensor(name, values)
            continue
        chosen = (types or {}).get(name, ggml_type)
        data = random_blocks(chosen, *shape, rng)
        raw = None if chosen in ("F32", "F16") else GGMLQuantizationType[chosen]
        writer.add_tensor(name, data, raw_dtype=raw)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    return _close(writer, path)


def _tensor_shapes(
    architecture: str, hidden: int, intermediate: int, layers: int, head_dim: int, heads: int,
    kv_heads: int, vocab: int, tied: bool,
) -> dict[str, tuple[int, ...]]:  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        block = f"blk.{i}"
        shapes[f"{block}.attn_norm.weight"] = (hidden,)
        shapes[f"{block}.attn_q.weight"] = (heads * head_dim, hidden)
        shapes[f"{block}.attn_k.weight"] = (kv_heads * head_dim, hidden)
        shapes[f"{block}.attn_v.weight"] = (kv_heads * head_dim, hidden)
        shapes[f"{block}.attn_output.weight"] = (hidden, heads * head_dim)
        if architecture == "qwen2":
            shapes[f"{block}.attn_q.bias"] = (heads * head_dim,)
            shapes[f"{block}.attn_k.bias"] = (kv_heads * head_dim,)
            shapes[f"{block}.attn_v.bias"] = (kv_heads * head_dim,)
        if architecture == "qwen3":
            shapes[f"{block}.attn_q_norm.weight"] = (head_dim,)
            shapes[f"{block}.attn_k_norm.weight"] = (head_dim,)
        shapes[f"{block}.ffn_norm.weight"] = (hidden,)
        shapes[f"{block}.ffn_gate.weight"] = (intermediate, hidden)
        shapes[f"{block}.ffn_up.weight"] = (intermediate, hidden)
        shapes[f"{block}.ffn_down.weight"] = (hidden, intermediate)
    shapes["output_norm.weight"] = (hidden,)
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    return shapes


def _add_tokenizer(writer: GGUFWriter, tokenizer, pre: str = "default") -> None:
    """The tokenizer as llama.cpp's converter writes a byte-level BPE ("gpt2"), its
    pre-tokenizer named `pre`."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda item: item[1])
    tokens = [token for token, _ in by_id]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL if token in SPECIAL_TOKENS else TokenType.NORMAL for token in tokens]
    )
    writer.add_token_merges(
        [" ".join(pair) if isinstance(pair, list) else pair for pair in model["merges"]]
    )
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_bert_gguf(
    folder: Path, path: Path, ggml_type: str = "F32", pooling: PoolingType = PoolingType.MEAN
) -> Path:
    """The BERT model of `folder` (a sentence-transformers folder) as llama.cpp's converter
    writes it: `bert.*` metadata, the WordPiece vocabulary with a phantom space ("▁word",
    continuations without their "##"), norms and biases in F32, the matrices in
    `ggml_type` (F32, F16 or a block type, quantized by gguf's own code) but for the
    position and token-type embeddings, in F32 as there."""
    config = BertConfig.from_pretrained(folder)
    writer = _encoder_writer(config, AutoTokenizer.from_pretrained(folder), path, "bert", pooling)
    names = get_tensor_name_map(MODEL_ARCH.BERT, config.num_hidden_layers)
    for hf_name, value in BertModel.from_pretrained(folder).state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None:  # the pooler, which llama.cpp's converter drops
            continue
        kind = "F32" if name in ("position_embd", "token_types") else ggml_type
        _add_tensor(writer, f"{name}.{suffix}", value.numpy(), kind)
    return _close(writer, path)


# NomicBertModel's modules -> llama.cpp's nomic-bert tensors (beside the fused attn_qkv),
# as its converter names nomic-embed-text's (mlp.fc11: up, mlp.fc12: the SiLU gate).
NOMIC_BERT_TENSORS = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "attn_output_norm",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_proj": "ffn_gate",
    "mlp.down_proj": "ffn_down",
    "post_mlp_layernorm": "layer_output_norm",
}


def write_nomic_bert_gguf(
    model: NomicBertModel, tokenizer_folder: Path, path: Path, ggml_type: str = "F32"
) -> Path:
    """`model` as llama.cpp's converter writes nomic-embed-text (`nomic-bert`: mean
    pooling, q, k and v fused into `attn_qkv`), with the WordPiece tokenizer of
    `tokenizer_folder`."""
    config = model.config
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    writer = _encoder_writer(config, tokenizer, path, "nomic-bert", PoolingType.MEAN)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    weights = {name: value.numpy() for name, value in model.state_dict().items()}
    for i in range(config.num_hidden_layers):
        fused = [weights.pop(f"layers.{i}.self_attn.{x}_proj.weight") for x in "qkv"]
        _add_tensor(writer, f"blk.{i}.attn_qkv.weight", np.concatenate(fused), ggml_type)
    for hf_name, value in weights.items():
        base, _, suffix = hf_name.rpartition(".")
        if base.startswith("layers."):
            _, layer, module = base.split(".", 2)
            name = f"blk.{layer}.{NOMIC_BERT_TENSORS[module]}"
        else:
            name = NOMIC_BERT_TENSORS[base]
        kind = "F32" if name == "token_types" else ggml_type
        _add_tensor(writer, f"{name}.{suffix}", value, kind)
    return _close(writer, path)


def build_xlm_roberta_folder(folder: Path, reranker: bool = False) -> Path:
    """A random XLMRobertaModel (mean pooling), or a reranker (XLMRobertaForSequenceClassification
    of one label, as bge-reranker-v2-m3), with a SentencePiece Unigram tokenizer trained on
    a few languages, as XLM-R's is (`sentencepiece.bpe.model`, its NFKC charsmap), read by
    transformers' own conversion."""
    folder.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(XLM_R_CORPUS * 20), model_writer=model, model_type="unigram",
        vocab_size=300, hard_vocab_limit=False, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    (folder / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "XLMRobertaTokenizer"}')
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = XLMRobertaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
        num_labels=1,
    )  # fmt: skip
    if reranker:
        XLMRobertaForSequenceClassification(config).save_pretrained(folder)
    else:
        XLMRobertaModel(config).save_pretrained(folder)
        write_pooling_modules(folder, "mean")
    return folder


XLM_R_CORPUS = [
    "A river bank at night.", "Whales migrate across oceans; unbelievably, they sing.",
    "Der schnelle braune Fuchs springt über den faulen Hund.", "Héllo WORLD, naïve café!",
    "Le renard brun rapide saute par-dessus le chien paresseux.", "東京の夜は明るい。",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
]  # fmt: skip


def write_xlm_roberta_gguf(
    folder: Path, path: Path, ggml_type: str = "F32", rank_named: bool = False
) -> Path:
    """The XLM-RoBERTa model of `folder` as llama.cpp's converter writes BGE-M3: a `bert`
    file whose positions start at 0 (the table's rows from pad + 1 on), its tokenizer a
    "t5" (Unigram) vocabulary in the model's ids from `sentencepiece.bpe.model`: "<s>",
    "<pad>", "</s>", "<unk>", then the pieces from the third on, a filler at the end (where
    transformers puts "<mask>"), with the scores, types and charsmap of the pieces. A
    reranker's file names no pooling, as the converter writes it, or RANK where
    `rank_named`; its labels' names."""
    config = XLMRobertaConfig.from_pretrained(folder)
    reranker = config.architectures == ["XLMRobertaForSequenceClassification"]
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((folder / "sentencepiece.bpe.model").read_bytes())
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    pieces += [
        (f"[PAD{i}]", -10000.0, TokenType.UNUSED) for i in range(len(pieces), config.vocab_size)
    ]
    control, unknown = TokenType.CONTROL, TokenType.UNKNOWN
    head = [
        ("<s>", 0.0, control),
        ("<pad>", 0.0, control),
        ("</s>", 0.0, control),
        ("<unk>", 0.0, unknown),
    ]
    tokens, scores, types = zip(*(head + pieces[3:-1]), strict=True)
    offset = config.pad_token_id + 1
    pooling = PoolingType.MEAN if not reranker else PoolingType.RANK if rank_named else None
    writer = _encoder_metadata(config, path, "bert", pooling, offset)
    if reranker:
        writer.add_classifier_output_labels([config.id2label[0]])
    writer.add_tokenizer_model("t5")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    writer.add_remove_extra_whitespaces(proto.normalizer_spec.remove_extra_whitespaces)
    writer.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
    writer.add_token_type_count(config.type_vocab_size)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(1)
    writer.add_mask_token_id(config.vocab_size - 1)  # transformers' "<mask>", a filler here
    names = get_tensor_name_map(MODEL_ARCH.BERT, config.num_hidden_layers)
    model = (XLMRobertaForSequenceClassification if reranker else XLMRobertaModel).from_pretrained(
        folder
    )
    for hf_name, value in model.state_dict().items():
        # A reranker's head: classifier.dense is `cls`, classifier.out_proj `cls.output`.
        base, _, suffix = hf_name.removeprefix("roberta.").rpartition(".")
        name = names.get_name(base)
        if name is None:  # the pooler, which llama.cpp's converter drops
            continue
        data = value.numpy()[offset:] if name == "position_embd" else value.numpy()
        kind = "F32" if name in ("position_embd", "token_types") else ggml_type
        _add_tensor(writer, f"{name}.{suffix}", data, kind)
    return _close(writer, path)


def _encoder_writer(config, tokenizer, path: Path, arch: str, pooling: PoolingType) -> GGUFWriter:
    """A writer holding an encoder's metadata and WordPiece vocabulary, as the converter's."""
    writer = _encoder_metadata(config, path, arch, pooling)
    special = set(tokenizer.all_special_tokens)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    writer.add_tokenizer_model("bert")
    writer.add_token_list([
        t if t in special else t[2:] if t.startswith("##") else f"\u2581{t}" for t, _ in by_id
    ])  # fmt: skip
    writer.add_token_types(
        [TokenType.CONTROL if t in special else TokenType.NORMAL for t, _ in by_id]
    )
    writer.add_token_type_count(config.type_vocab_size)
    writer.add_bos_token_id(tokenizer.cls_token_id)
    writer.add_eos_token_id(tokenizer.sep_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_sep_token_id(tokenizer.sep_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_mask_token_id(tokenizer.mask_token_id)
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", tokenizer.do_lower_case)
    return writer


def _encoder_metadata(
    config, path: Path, arch: str, pooling: PoolingType | None, position_offset: int = 0
) -> GGUFWriter:
    """A writer holding an encoder's shape and pooling (None: not named); its window the
    position table's rows from `position_offset` on."""
    writer = GGUFWriter(path, arch)
    writer.add_name(path.stem)
    writer.add_context_length(config.max_position_embeddings - position_offset)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_causal_attention(False)
    if pooling is not None:
        writer.add_pooling_type(pooling)
    return writer


def _add_tensor(writer: GGUFWriter, name: str, data: np.ndarray, ggml_type: str) -> None:
    """A vector in F32; a matrix in `ggml_type`."""
    if data.ndim == 1 or ggml_type == "F32":
        writer.add_tensor(name, data.astype(np.float32))
    elif ggml_type == "F16":
        writer.add_tensor(name, data.astype(np.float16))
    else:
        kind = GGMLQuantizationType[ggml_type]
        writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)


def _close(writer: GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

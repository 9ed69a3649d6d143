"""An encoder's GGUF (llama.cpp's `bert` architecture: all-MiniLM, BGE, mxbai, Snowflake
Arctic, and the XLM-RoBERTa models written as `bert`: BGE-M3, multilingual-e5;
`nomic-bert`: nomic-embed-text; as Ollama ships them) read as a sentence-transformers
folder: its config, tokenizer and pooling from the metadata, for the pooling engine
(`engine/pooling`).

transformers reads no encoder's GGUF, so the folder is written here from llama.cpp's keys:
`<arch>.*` for the shape (a `BertModel`, or a `NomicBertModel`: rotary positions, SwiGLU,
no biases), `<arch>.pooling_type` for the pooling (mean or CLS, normalized, as
llama-server's `/v1/embeddings` returns them) and the vocabulary, which llama.cpp's
converter stores with a "phantom space": a word-initial piece as "▁piece", a continuation
as "piece" (WordPiece's "##piece"), control tokens as they are. Undoing that gives the
WordPiece vocabulary back token for token. An XLM-RoBERTa's vocabulary is SentencePiece
Unigram pieces with their scores (`tokenizer.ggml.model` "t5"), in the model's ids; its
position table the converter trims to start at 0, so it too is a `BertModel`. A `bert`
file with a head of two layers (`cls`, tanh, `cls.output`: bge-reranker-v2-m3's) that
names RANK or no pooling is a reranker, a `BertForSequenceClassification` whose pooler is
the head's first layer (`head_names`). A file that pools otherwise is refused by name.

`parameter_names` names a nomic-bert file's tensors by `NomicBertModel`'s parameters (a
BERT's are gguf's own name map's): its fused `attn_qkv` rows hold q's, k's and v's in turn.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from gguf import GGUFReader, PoolingType, TokenType
from transformers import (
    BertConfig,
    BertTokenizer,
    NomicBertConfig,
    PretrainedConfig,
    PreTrainedModel,
    XLMRobertaTokenizer,
)

from engine.errors import ModelLoadError, UnsupportedModelError

# The GGUF architectures written as encoders here.
ENCODER_ARCHITECTURES = ("bert", "nomic-bert")
# A nomic-bert file's tensors (in block {bid}) -> NomicBertModel's parameters; a tuple
# takes the stored rows in equal parts, in order.
NOMIC_BERT_NAMES: dict[str, str | tuple[str, ...]] = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
    "blk.{bid}.attn_qkv": tuple(f"layers.{{bid}}.self_attn.{x}_proj" for x in "qkv"),
    "blk.{bid}.attn_output": "layers.{bid}.self_attn.o_proj",
    "blk.{bid}.attn_output_norm": "layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_up": "layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_gate": "layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_down": "layers.{bid}.mlp.down_proj",
    "blk.{bid}.layer_output_norm": "layers.{bid}.post_mlp_layernorm",
}
# `<arch>.pooling_type` -> sentence-transformers' pooling mode, for an encoder and a decoder.
POOLING = {PoolingType.MEAN: "mean", PoolingType.CLS: "cls"}
DECODER_POOLING = {PoolingType.MEAN: "mean", PoolingType.LAST: "lasttoken"}
PHANTOM_SPACE = "\u2581"
ST_MODULES = "sentence_transformers.models"
# BertTokenizer's special tokens, by the GGUF key of each one's id (llama.cpp's spelling).
SPECIAL_TOKENS = {
    "unk": "unknown", "sep": "seperator", "pad": "padding", "cls": "bos", "mask": "mask",
}  # fmt: skip
# XLMRobertaTokenizer's, and the id of its unknown piece.
XLM_R_SPECIAL_TOKENS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
XLM_R_UNKNOWN_ID = 3


def write_encoder_folder(reader: GGUFReader, path: Path, staging: Path, architecture: str) -> None:
    """Write the encoder GGUF's config, tokenizer, window and, for an embedder,
    `modules.json` (Transformer, Pooling, Normalize) into `staging`."""
    field = partial(metadata_field, reader, path)
    # A reranker's file names RANK, or no pooling (llama.cpp's converter writes none for a
    # sequence classifier; llama-server ranks where started with --reranking).
    named = int(field(f"{architecture}.pooling_type", -1))
    labels = _reranker_labels(reader, architecture) if named in (-1, PoolingType.RANK) else 0
    pooling = PoolingType.CLS if named == -1 else PoolingType(named)
    if pooling not in POOLING and not labels:
        raise UnsupportedModelError(
            f"{path.name}: pooling {pooling.name} is not served for an encoder's GGUF (MEAN or "
            "CLS, or RANK with a head of two layers: 'cls' and 'cls.output')"
        )
    tokens = field("tokenizer.ggml.tokens")
    model = field("tokenizer.ggml.model")
    if model not in TOKENIZERS or len(tokens) != len(field("tokenizer.ggml.token_type")):
        raise UnsupportedModelError(
            f"{path.name}: its tokenizer is neither BERT's WordPiece nor XLM-RoBERTa's "
            "SentencePiece Unigram"
        )
    window = int(field(f"{architecture}.context_length"))
    config = _config(reader, path, field, architecture, window)
    if labels:  # a cross-encoder: BERT's pooler is the head's first layer
        config.architectures, config.num_labels = ["BertForSequenceClassification"], labels
    config.save_pretrained(staging)
    TOKENIZERS[model](path, field, tokens, window).save_pretrained(staging)
    _write_json(staging / "sentence_bert_config.json", {"max_seq_length": window})
    if not labels:
        write_pooling_modules(staging, POOLING[pooling])


def _reranker_labels(reader: GGUFReader, architecture: str) -> int:
    """A `bert` reranker's labels: the rows of its head's output layer, where the head is
    two layers (`cls`, then tanh, then `cls.output`: XLM-RoBERTa's and RoBERTa's, as
    bge-reranker-v2-m3's); 0 where it is not."""
    if architecture != "bert":
        return 0
    shapes = {t.name: t.shape for t in reader.tensors}
    if "cls.weight" not in shapes or "cls.output.weight" not in shapes:
        return 0
    return int(shapes["cls.output.weight"][-1])


def _wordpiece_tokenizer(path: Path, field, tokens: list[str], window: int) -> BertTokenizer:
    """BERT's WordPiece tokenizer, each token's phantom space undone."""
    types = field("tokenizer.ggml.token_type")
    vocab = [_wordpiece(token, kind) for token, kind in zip(tokens, types, strict=True)]
    if len(set(vocab)) != len(vocab):
        raise UnsupportedModelError(f"{path.name}: its vocabulary repeats a WordPiece token")
    special = {
        f"{role}_token": vocab[int(field(f"tokenizer.ggml.{key}_token_id"))]
        for role, key in SPECIAL_TOKENS.items()
    }
    return BertTokenizer(
        vocab={token: index for index, token in enumerate(vocab)},
        do_lower_case=bool(field("tokenizer.ggml.normalizer.lowercase", True)),
        model_max_length=window,
        **special,
    )


def _unigram_tokenizer(path: Path, field, tokens: list[str], window: int) -> XLMRobertaTokenizer:
    """XLM-RoBERTa's SentencePiece Unigram (llama.cpp's "t5" model in a `bert` file: BGE-M3,
    multilingual-e5): the pieces and their scores in the model's ids, normalized by the
    file's precompiled charsmap, runs of whitespace collapsed, a space put before the text
    where the file says. XLMRobertaTokenizer takes its unknown piece at id 3, as the
    converter puts it; the special pieces are the file's."""
    if int(field("tokenizer.ggml.unknown_token_id")) != XLM_R_UNKNOWN_ID:
        raise UnsupportedModelError(f"{path.name}: its unknown piece is not at id 3, as XLM-R's")
    if not field("tokenizer.ggml.remove_extra_whitespaces", True):
        raise UnsupportedModelError(f"{path.name}: its tokenizer keeps runs of whitespace")
    special = {
        f"{role}_token": tokens[int(field(f"tokenizer.ggml.{key}_token_id"))]
        for role, key in XLM_R_SPECIAL_TOKENS.items()
    }
    # The converter writes no "<mask>" piece (the mask's id holds a filler): a mask only
    # where the file's is a control piece.
    mask = int(field("tokenizer.ggml.mask_token_id", -1))
    control = mask >= 0 and field("tokenizer.ggml.token_type")[mask] == TokenType.CONTROL
    charsmap = bytes(field("tokenizer.ggml.precompiled_charsmap", []))
    # tokenizers' Precompiled normalizer takes the charsmap's bytes (transformers' annotation
    # says str); no mask_token keeps "<mask>" from being added past the vocabulary.
    return XLMRobertaTokenizer(
        vocab=list(zip(tokens, map(float, field("tokenizer.ggml.scores")), strict=True)),
        add_prefix_space=bool(field("tokenizer.ggml.add_space_prefix", True)),
        _spm_precompiled_charsmap=charsmap or None,  # type: ignore[arg-type]
        mask_token=tokens[mask] if control else None,  # type: ignore[arg-type]
        model_max_length=window,
        **special,
    )


def write_decoder_pooling(reader: GGUFReader, path: Path, architecture: str, staging: Path) -> None:
    """Where a decoder's file names its pooling (`<arch>.pooling_type`, which llama.cpp's
    converter writes from a sentence-transformers folder: Qwen3-Embedding's LAST), write
    its modules, so that it embeds as that folder did; a file that names none (a chat
    model's), or RANK (a reranker's), stays a model to generate with."""
    named = metadata_field(reader, path, f"{architecture}.pooling_type", PoolingType.NONE.value)
    mode = DECODER_POOLING.get(PoolingType(named))
    if mode is not None:
        write_pooling_modules(staging, mode)


def write_pooling_modules(staging: Path, mode: str) -> None:
    """A sentence-transformers `modules.json` (the folder's transformer, Pooling by `mode`,
    Normalize) and its Pooling config."""
    _write_json(staging / "1_Pooling" / "config.json", {"pooling_mode": mode})
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    _write_json(
        staging / "modules.json",
        [
            {"idx": i, "name": str(i), "path": where, "type": f"{ST_MODULES}.{kind}"}
            for i, (kind, where) in enumerate(modules)
        ],
    )


def _config(
    reader: GGUFReader, path: Path, field, architecture: str, window: int
) -> PretrainedConfig:
    """A `BertConfig` or `NomicBertConfig` of the file's shape, its vocabulary the token
    embedding's rows."""
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ModelLoadError(f"{path.name} lacks the tensor 'token_embd.weight'")
    shape = {
        "vocab_size": int(embedding.shape[-1]),
        "hidden_size": int(field(f"{architecture}.embedding_length")),
        "num_hidden_layers": int(field(f"{architecture}.block_count")),
        "num_attention_heads": int(field(f"{architecture}.attention.head_count")),
        "intermediate_size": int(field(f"{architecture}.feed_forward_length")),
        "max_position_embeddings": window,
        "type_vocab_size": int(field("tokenizer.ggml.token_type_count", 2)),
        "layer_norm_eps": float(field(f"{architecture}.attention.layer_norm_epsilon")),
        "pad_token_id": int(field("tokenizer.ggml.padding_token_id", 0)),
    }
    if architecture == "bert":
        return BertConfig(architectures=["BertModel"], **shape)
    rope = {"rope_type": "default", "rope_theta": float(field(f"{architecture}.rope.freq_base"))}
    return NomicBertConfig(architectures=["NomicBertModel"], rope_parameters=rope, **shape)


def parameter_names(
    architecture: str, model: PreTrainedModel
) -> dict[str, str | tuple[str, ...]] | None:
    """A nomic-bert file's tensor names -> NomicBertModel's parameter names (a tuple: the
    rows in equal parts); None for another model (gguf's own name map names it)."""
    if architecture != "nomic-bert":
        return None
    layers = model.config.num_hidden_layers
    names: dict[str, str | tuple[str, ...]] = {}
    for stored, target in NOMIC_BERT_NAMES.items():
        for bid in range(layers) if "{bid}" in stored else (0,):
            for suffix in ("weight", "bias"):
                parts = (target,) if isinstance(target, str) else target
                named = tuple(f"{part.format(bid=bid)}.{suffix}" for part in parts)
                fused = not isinstance(target, str)
                names[f"{stored.format(bid=bid)}.{suffix}"] = named if fused else named[0]
    return names


def head_names(architecture: str, model: PreTrainedModel) -> dict[str, str]:
    """A bert reranker's head -> BertForSequenceClassification's: its first layer (`cls`)
    as BERT's pooler, its output layer (`cls.output`) as the classifier, where gguf's name
    map would put `cls` in the classifier; none for another model."""
    if architecture != "bert" or model.config.architectures != ["BertForSequenceClassification"]:
        return {}
    pooler = f"{model.base_model_prefix}.pooler.dense"
    return {
        f"{stored}.{suffix}": f"{target}.{suffix}"
        for stored, target in (("cls", pooler), ("cls.output", "classifier"))
        for suffix in ("weight", "bias")
    }


# `tokenizer.ggml.model` -> the tokenizer written for it.
TOKENIZERS = {"bert": _wordpiece_tokenizer, "t5": _unigram_tokenizer}


def _wordpiece(token: str, kind: int) -> str:
    if kind == TokenType.CONTROL:
        return token
    return token[1:] if token.startswith(PHANTOM_SPACE) else f"##{token}"


def metadata_field(reader: GGUFReader, path: Path, key: str, default: Any = None) -> Any:
    """A metadata value (a string, a number, a list of them), or `default` where the file
    lacks it; ModelLoadError where it lacks one with no default."""
    entry = reader.fields.get(key)
    if entry is None:
        if default is None:
            raise ModelLoadError(f"{path.name} lacks the GGUF metadata '{key}'")
        return default
    return entry.contents()


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")

"""A BERT GGUF (llama.cpp's `bert` architecture: all-MiniLM, BGE, mxbai, Snowflake Arctic,
as Ollama ships them) read as a sentence-transformers folder: its config, WordPiece
tokenizer and pooling from the metadata, for the pooling engine (`engine/pooling`).

transformers reads no BERT GGUF, so the folder is written here from llama.cpp's keys:
`bert.*` for the shape, `bert.pooling_type` for the pooling (mean or CLS, normalized, as
llama-server's `/v1/embeddings` returns them) and the vocabulary, which llama.cpp's
converter stores with a "phantom space": a word-initial piece as "▁piece", a continuation
as "piece" (WordPiece's "##piece"), control tokens as they are. Undoing that gives the
WordPiece vocabulary back token for token. A file that pools otherwise (a reranker's RANK,
LAST, none) is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader, PoolingType, TokenType
from transformers import BertConfig, BertTokenizer

from engine.errors import ModelLoadError, UnsupportedModelError

# The GGUF architectures written as encoders here.
ENCODER_ARCHITECTURES = ("bert",)
# `bert.pooling_type` -> sentence-transformers' pooling mode.
POOLING = {PoolingType.MEAN: "mean", PoolingType.CLS: "cls"}
PHANTOM_SPACE = "\u2581"
ST_MODULES = "sentence_transformers.models"
# BertTokenizer's special tokens, by the GGUF key of each one's id (llama.cpp's spelling).
SPECIAL_TOKENS = {
    "unk": "unknown", "sep": "seperator", "pad": "padding", "cls": "bos", "mask": "mask",
}  # fmt: skip


def write_encoder_folder(reader: GGUFReader, path: Path, staging: Path) -> None:
    """Write the BERT GGUF's config, tokenizer, `modules.json` (Transformer, Pooling,
    Normalize) and window into `staging`."""
    field = _fields(reader, path)
    pooling = PoolingType(field("bert.pooling_type", PoolingType.CLS.value))
    if pooling not in POOLING:
        raise UnsupportedModelError(
            f"{path.name}: pooling {pooling.name} is not served for a BERT GGUF (MEAN or CLS)"
        )
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    if field("tokenizer.ggml.model") != "bert" or len(tokens) != len(types):
        raise UnsupportedModelError(f"{path.name}: its tokenizer is not BERT's WordPiece")
    window = int(field("bert.context_length"))
    BertConfig(
        architectures=["BertModel"],
        vocab_size=len(tokens),
        hidden_size=int(field("bert.embedding_length")),
        num_hidden_layers=int(field("bert.block_count")),
        num_attention_heads=int(field("bert.attention.head_count")),
        intermediate_size=int(field("bert.feed_forward_length")),
        max_position_embeddings=window,
        type_vocab_size=int(field("tokenizer.ggml.token_type_count", 2)),
        layer_norm_eps=float(field("bert.attention.layer_norm_epsilon")),
        pad_token_id=int(field("tokenizer.ggml.padding_token_id", 0)),
    ).save_pretrained(staging)
    vocab = [_wordpiece(token, kind) for token, kind in zip(tokens, types, strict=True)]
    if len(set(vocab)) != len(vocab):
        raise UnsupportedModelError(f"{path.name}: its vocabulary repeats a WordPiece token")
    special = {
        f"{role}_token": vocab[int(field(f"tokenizer.ggml.{key}_token_id"))]
        for role, key in SPECIAL_TOKENS.items()
    }
    BertTokenizer(
        vocab={token: index for index, token in enumerate(vocab)},
        do_lower_case=bool(field("tokenizer.ggml.normalizer.lowercase", True)),
        model_max_length=window,
        **special,
    ).save_pretrained(staging)
    _write_json(staging / "1_Pooling" / "config.json", {"pooling_mode": POOLING[pooling]})
    _write_json(staging / "sentence_bert_config.json", {"max_seq_length": window})
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    _write_json(
        staging / "modules.json",
        [
            {"idx": i, "name": str(i), "path": where, "type": f"{ST_MODULES}.{kind}"}
            for i, (kind, where) in enumerate(modules)
        ],
    )


def _wordpiece(token: str, kind: int) -> str:
    if kind == TokenType.CONTROL:
        return token
    return token[1:] if token.startswith(PHANTOM_SPACE) else f"##{token}"


def _fields(reader: GGUFReader, path: Path):
    """A reader of the metadata's values (strings, numbers, lists of them), raising
    ModelLoadError for a key missing without a default."""

    def field(key: str, default: Any = None) -> Any:
        entry = reader.fields.get(key)
        if entry is None:
            if default is None:
                raise ModelLoadError(f"{path.name} lacks the GGUF metadata '{key}'")
            return default
        return entry.contents()

    return field


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")

"""What a pooling model is and how it pools, read from its folder before any weight.

A sentence-transformers folder (`modules.json`, in the layout of sentence-transformers 2
to 6) names its modules: the transformer (this folder), a `Pooling` module
(`1_Pooling/config.json`: CLS, mean or last-token pooling), any `Dense` modules (a linear
and an activation over the pooled vector, as EmbeddingGemma's) and an optional
`Normalize`, last; `sentence_bert_config.json` gives its window (`max_seq_length`), or
the tokenizer's `model_max_length` where sentence-transformers 6 saved it.
A decoder (`DECODER_TYPES`) is an embedder only from a sentence-transformers folder, and a
reranker where `hf_overrides` make it a `*ForSequenceClassification` with
`classifier_from_token` (vLLM's way to serve Qwen3-Reranker).
`pooler_config` (vLLM's setting: `pooling_type` LAST, MEAN or CLS, and `normalize`) makes
any encoder or `DECODER_TYPES` folder an embedder pooling as it says, over what the folder
says: a chat model's folder too.
A plain transformers folder is a pooling model by its architecture: an encoder
(`BertModel`, `RobertaModel`, `XLMRobertaModel`, `ModernBertModel`, `NomicBertModel`) embeds
with CLS pooling, normalized, as vLLM's default pooler does; a `*ForSequenceClassification`
encoder scores text pairs with its classifier (a cross-encoder). Anything else the folder
asks for (another pooling mode or module, a Dense activation outside `DENSE_ACTIVATIONS`)
is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.config import ConfigError
from engine.errors import ModelLoadError

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "modernbert", "nomic_bert")
# Decoders served as embedders from a sentence-transformers folder (Qwen3-Embedding's
# layout: last-token pooling, normalized), causal (`model.PACKED_DECODERS` run packed).
DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
# Pooling modes served, by their sentence-transformers 6 names and their older keys.
POOLING_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
# The activations a Dense module may name (torch.nn's classes, by sentence-transformers'
# full names, as `torch.nn.modules.activation.Tanh`).
DENSE_ACTIVATIONS = ("GELU", "Identity", "ReLU", "SiLU", "Sigmoid", "Tanh")
# vLLM's pooler config: its pooling types served, and its keys read.
POOLING_TYPES = {"LAST": "last", "MEAN": "mean", "CLS": "cls"}
POOLER_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True)
class DenseSpec:
    """A Dense module: `activation(linear(x))` over the pooled vector, its weights in `path`."""

    path: Path
    activation: str = "Tanh"


@dataclass(frozen=True)
class PoolingSpec:
    """How the model's token states become one vector (`embed`) or scores (`classify`);
    `max_length`: its window in tokens (None: the config's positions); `is_matryoshka`:
    whether `dimensions` may cut its embeddings, to the sizes in `matryoshka` (empty: any),
    as vLLM reads `is_matryoshka` and `matryoshka_dimensions` from the config."""

    task: Literal["embed", "classify"]
    pooling: Literal["cls", "mean", "last"] = "cls"
    normalize: bool = True
    max_length: int | None = None
    matryoshka: tuple[int, ...] = ()
    causal: bool = False  # a decoder
    # A decoder reranker's two tokens (vLLM's `classifier_from_token`): its score is the
    # LM head's softmax over (first, second) at the last token, given to the second.
    classifier_tokens: tuple[str, str] | None = None
    dense: tuple[DenseSpec, ...] = ()  # applied in order to the pooled vector
    is_matryoshka: bool = False


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot be read as JSON ({exc})") from None


def pooling_spec(
    folder: Path, overrides: dict | None = None, pooler: dict | None = None
) -> PoolingSpec | None:
    """The folder's pooling spec, its config.json under `overrides` (`hf_overrides`) and
    pooling as `pooler` (`pooler_config`) says where given, or None where it holds no
    pooling model (a decoder to generate with). Raises ModelLoadError naming what the
    folder asks for that is not served, ConfigError what `pooler` asks for."""
    if not (folder / "config.json").is_file():
        return None
    config = _json(folder / "config.json") | (overrides or {})
    architectures = config.get("architectures") or []
    classify = any(name.endswith("ForSequenceClassification") for name in architectures)
    model_type = config.get("model_type")
    encoder = model_type in ENCODER_TYPES
    modules = folder / "modules.json"
    pooled, normalized = _pooler(pooler) if pooler is not None else (None, None)
    if pooler is not None and classify:
        raise ConfigError(f"pooler_config: applies to embedding models, and {folder} scores pairs")
    if not encoder and classify and "classifier_from_token" in config:
        return _decoder_reranker(config, folder)
    if not encoder:
        if not modules.is_file() and pooler is None:
            return None  # a model to generate with
        if model_type not in DECODER_TYPES:
            raise ModelLoadError(
                f"{folder}: an embedding model of type '{model_type}' is not "
                f"served (encoders: {', '.join(ENCODER_TYPES)}; decoders: "
                f"{', '.join(DECODER_TYPES)})"
            )
    if encoder and not (
        classify or any(name.endswith("Model") for name in architectures) or modules.is_file()
    ):
        return None  # a masked-LM head: not a pooling model (refused by the generation loader)
    matryoshka = tuple(config.get("matryoshka_dimensions") or ())
    is_matryoshka = bool(matryoshka or config.get("is_matryoshka"))
    if classify:
        return PoolingSpec("classify", max_length=_window(folder), matryoshka=())
    if not modules.is_file():
        mode = pooled or ("cls" if encoder else "last")
        if not encoder and mode == "cls":
            raise ConfigError("pooler_config: a decoder pools its last token or its mean, not CLS")
        return PoolingSpec(
            "embed", mode, normalized is not False, _window(folder), matryoshka,
            not encoder, is_matryoshka=is_matryoshka,
        )  # fmt: skip
    pooling: Literal["cls", "mean", "last"] = "cls"
    normalize = False
    dense: list[DenseSpec] = []
    for module in _json(modules):
        kind = _module_kind(str(module.get("type", "")))
        path = folder / module.get("path", "")
        if normalize:
            raise ModelLoadError(f"{modules}: the module '{kind}' follows Normalize")
        if kind == "Transformer":
            if path != folder:
                raise ModelLoadError(f"{modules}: the transformer must be the folder itself")
        elif kind == "Pooling":
            pooling = _pooling_mode(_json(path / "config.json"), path)
        elif kind == "Dense":
            dense.append(_dense(path))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(
                f"{modules}: the sentence-transformers module '{kind}' is not served"
            )
    pooling = pooled or pooling
    normalize = normalize if normalized is None else normalized
    if not encoder and pooling == "cls":
        raise ModelLoadError(f"{modules}: a decoder pools its last token or its mean, not CLS")
    return PoolingSpec(
        "embed", pooling, normalize, _window(folder), matryoshka, not encoder,
        dense=tuple(dense), is_matryoshka=is_matryoshka,
    )  # fmt: skip


def _pooler(pooler: dict) -> tuple[Literal["cls", "mean", "last"] | None, bool | None]:
    """`pooler_config`'s pooling and normalization (None where it leaves them as the folder
    says); raises ConfigError naming a key or value that is not served."""
    unknown = sorted(set(pooler) - set(POOLER_KEYS))
    if unknown:
        raise ConfigError(
            f"pooler_config: '{unknown[0]}' is not served (only {', '.join(POOLER_KEYS)})"
        )
    kind, normalize = pooler.get("pooling_type"), pooler.get("normalize")
    if kind is not None and (not isinstance(kind, str) or kind.upper() not in POOLING_TYPES):
        raise ConfigError(
            f"pooler_config: pooling_type {kind!r} is not served (one of "
            f"{', '.join(POOLING_TYPES)})"
        )
    if normalize is not None and not isinstance(normalize, bool):
        raise ConfigError(f"pooler_config: normalize must be true or false, not {normalize!r}")
    pooling = POOLING_TYPES[kind.upper()] if kind is not None else None
    return pooling, normalize  # type: ignore[return-value]


def _module_kind(name: str) -> str:
    """A module's class name from its type in modules.json (`sentence_transformers.models.
    Pooling`, or 6's `sentence_transformers.base.modules.dense.Dense`); another package's
    module by its full name."""
    return name.rsplit(".", 1)[-1] if name.startswith("sentence_transformers.") else name


def _dense(path: Path) -> DenseSpec:
    config = _json(path / "config.json")
    name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    activation = name.rsplit(".", 1)[-1]
    if not name.startswith("torch.nn.") or activation not in DENSE_ACTIVATIONS:
        raise ModelLoadError(
            f"{path}: the Dense activation '{name}' is not served "
            f"(torch.nn's {', '.join(DENSE_ACTIVATIONS)})"
        )
    if config.get("use_residual"):
        raise ModelLoadError(f"{path}: the Dense module's use_residual is not served")
    return DenseSpec(path, activation)


def _decoder_reranker(config: dict, folder: Path) -> PoolingSpec:
    tokens = config["classifier_from_token"]
    if config.get("model_type") not in DECODER_TYPES:
        raise ModelLoadError(
            f"{folder}: a reranker of type '{config.get('model_type')}' is not served"
        )
    if not (
        isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)
    ):
        raise ModelLoadError(
            'hf_overrides: classifier_from_token must name two tokens, as ["no", "yes"]'
        )
    return PoolingSpec(
        "classify", max_length=_window(folder), causal=True, classifier_tokens=tuple(tokens)
    )


def _pooling_mode(config: dict, path: Path) -> Literal["cls", "mean", "last"]:
    mode = config.get("pooling_mode")  # sentence-transformers 6: a name, or a list of names
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode is not None:
        if mode not in POOLING_MODES:
            raise ModelLoadError(
                f"{path}: pooling {mode} is not served (one of {', '.join(POOLING_MODES)})"
            )
        return POOLING_MODES[mode]  # type: ignore[return-value]
    modes = [name for name, on in config.items() if name.startswith("pooling_mode") and on]
    if len(modes) != 1 or modes[0] not in POOLING_KEYS:
        raise ModelLoadError(
            f"{path}: pooling {', '.join(modes) or 'none'} is not served "
            f"(one of {', '.join(POOLING_KEYS)})"
        )
    return POOLING_KEYS[modes[0]]  # type: ignore[return-value]


def _window(folder: Path) -> int | None:
    """`max_seq_length`, else a tokenizer's `model_max_length` below transformers' "no
    limit" (`sentence_bert_config.json` without it: sentence-transformers 6's layout)."""
    settings = folder / "sentence_bert_config.json"
    if not settings.is_file():
        return None
    length = _json(settings).get("max_seq_length")
    if length:
        return int(length)
    tokenizer = folder / "tokenizer_config.json"
    limit = _json(tokenizer).get("model_max_length") if tokenizer.is_file() else None
    return int(limit) if isinstance(limit, int) and limit < 1_000_000 else None

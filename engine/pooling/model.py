"""A pooling model's forward. An encoder of the BERT family (`PACKED_ENCODERS`), ModernBERT
and NomicBERT (`PACKED_FORWARD_ENCODERS`) and the decoders of the Llama and Gemma families
(`PACKED_DECODERS`: an embedder in Qwen3-Embedding's layout, a decoder reranker) run on
packed rows: the texts of a batch side by side, then padding rows up to the row count the
packed linears compute with, each text's attention over its own tokens only (`_layer` for
the BERT family; for the others, their own forward attending through `text_attention`).
Any other model runs each text alone through its own forward.

Invariant: a text's output has the same bits alone or in any batch. Every linear is
packed (oneDNN on the CPU: a row's bits do not depend on the row count) or quantized (the
group kernel, at every row count, with the same property), the embeddings,
norms, rotary embeddings and activations work row by row, and attention runs per text on
its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from engine import capabilities
from engine.errors import ModelLoadError
from engine.model.loader import Install, load_gguf
from engine.pooling.dense import load_dense
from engine.pooling.spec import PoolingSpec
from engine.pooling.text_attention import attend_text_by_text

# The encoders whose layers `_layer` runs on packed rows (a BertLayer's shape).
PACKED_ENCODERS = ("bert", "roberta", "xlm-roberta")
# The decoders and encoders whose own forward runs on packed rows, attending text by text
# (gemma2 caps its attention logits; gemma3's layers may attend both ways).
PACKED_DECODERS = ("gemma", "gemma2", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3")
PACKED_FORWARD_ENCODERS = ("modernbert", "nomic_bert")


@dataclass(frozen=True)
class Text:
    """One input: its token ids and, for a pair, each token's segment (0 or 1)."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


class PoolingModel:
    """The model of a pooling folder (or of the `gguf` file whose metadata folder it is) in
    `dtype` on the CPU, its linears quantized where `quantization` is given ("int8":
    pagedserve's own groups; "gguf": the file's own types): `embed` and `classify` texts.
    Quantized linears run the group kernel at every row count, so a row's bits depend on
    it alone, as packed ones' do."""

    def __init__(
        self,
        folder: Path,
        spec: PoolingSpec,
        dtype: torch.dtype,
        quantization: str | None = None,
        gguf: Path | None = None,
    ) -> None:
        if gguf is None:
            model = _load(folder, spec, dtype)
        else:
            own_types = quantization == "gguf"
            install = capabilities.gguf_install(dtype, every_row_count=True) if own_types else None
            model = _load_gguf(gguf, folder, spec, dtype, install)
        self.model = model.eval().requires_grad_(False)
        self.spec = spec
        self.dtype = dtype
        self.config = model.config
        self.base = model.base_model
        kind = self.config.model_type
        self.packed_encoder = not spec.causal and kind in PACKED_ENCODERS
        # A config with `is_causal: false` (a decoder made to attend both ways by its config
        # alone) is not packed: its own forward's masks decide how it attends.
        causal = getattr(self.config, "is_causal", True)
        packed = PACKED_DECODERS if spec.causal else PACKED_FORWARD_ENCODERS
        self.packed_forward = kind in packed and causal
        if self.packed_forward:
            attend_text_by_text(model)
        self.reranker = None if spec.classifier_tokens is None else self._reranker(folder)
        if quantization == "int8":
            capabilities.quantize(self.model, quantization, dtype, None, every_row_count=True)
        # The row count the linears compute n rows with: a batch's rows are padded to it
        # once, not by each linear.
        self.padded_rows = capabilities.pack(self.model, torch.device("cpu"), dtype)
        positions = self.config.max_position_embeddings
        # RoBERTa's positions start after its padding index.
        roberta = self.config.model_type in ("roberta", "xlm-roberta")
        self.position_offset = self.config.pad_token_id + 1 if roberta else 0
        window = positions - self.position_offset
        self.max_length = min(spec.max_length or window, window)
        self.dense = [load_dense(dense) for dense in spec.dense]
        # The width of an embedding: the last Dense module's, else the model's.
        self.embedding_size = self.config.hidden_size
        for dense, dense_spec in zip(self.dense, spec.dense, strict=True):
            if dense[0].in_features != self.embedding_size:
                raise ModelLoadError(
                    f"{dense_spec.path}: the Dense module takes {dense[0].in_features} values, "
                    f"the vector before it has {self.embedding_size}"
                )
            self.embedding_size = dense[0].out_features

    @torch.inference_mode()
    def hidden_states(self, texts: list[Text]) -> list[torch.Tensor]:
        """Each text's last hidden states `[len, hidden]`."""
        if not self.packed_encoder and not self.packed_forward:  # each text alone, its own forward
            return [
                self.base(input_ids=torch.tensor([text.token_ids])).last_hidden_state[0]
                for text in texts
            ]
        lengths = [len(text.token_ids) for text in texts]
        total = sum(lengths)
        padding = [0] * (self.padded_rows(total) - total)  # rows of token 0 at position 0
        ids = torch.tensor([t for text in texts for t in text.token_ids] + padding)[None]
        positions = torch.tensor([p for n in lengths for p in range(n)] + padding)[None]
        positions += self.position_offset
        if self.packed_forward:
            states = self.base(
                input_ids=ids, position_ids=positions, use_cache=False, text_lengths=lengths
            )
            return list(states.last_hidden_state[0, :total].split(lengths))
        types = torch.tensor(
            [s for text in texts for s in (text.token_type_ids or [0] * len(text.token_ids))]
            + padding
        )[None]
        x = self.base.embeddings(input_ids=ids, token_type_ids=types, position_ids=positions)[0]
        for layer in self.base.encoder.layer:
            x = _layer(layer, x, lengths)
        return list(x[:total].split(lengths))

    @torch.inference_mode()
    def embed(self, texts: list[Text]) -> list[torch.Tensor]:
        """Each text's pooled vector (fp32), through the Dense modules, normalized where
        the spec says."""
        pooled = []
        for states in self.hidden_states(texts):
            if self.spec.pooling == "mean":
                vector = states.float().mean(dim=0)
            elif self.spec.pooling == "last":
                vector = states[-1].float()
            else:
                vector = states[0].float()
            for dense in self.dense:
                vector = dense(vector[None])[0]
            pooled.append(F.normalize(vector, dim=0) if self.spec.normalize else vector)
        return pooled

    def _reranker(self, folder: Path) -> torch.Tensor:
        """A decoder reranker's one-label classifier: the LM head's row of its second token
        less that of its first, so that sigmoid(h . w) is their softmax's second share."""
        assert self.spec.classifier_tokens is not None
        vocabulary = AutoTokenizer.from_pretrained(folder).get_vocab()
        missing = [t for t in self.spec.classifier_tokens if t not in vocabulary]
        if missing:
            raise ModelLoadError(
                f"hf_overrides: classifier_from_token {missing[0]!r} is not one token"
            )
        ids = torch.tensor([vocabulary[t] for t in self.spec.classifier_tokens])
        head = self.model.get_output_embeddings()  # an nn.Linear, or a GGUF's blocks
        first, second = head.weight[ids] if isinstance(head, nn.Linear) else head.rows(ids)
        return (second - first).float()

    @torch.inference_mode()
    def classify(self, texts: list[Text]) -> list[torch.Tensor]:
        """Each text's classifier logits `[num_labels]` (fp32), from its first token's
        state as the model's own head takes it (a decoder reranker: its last token's, one
        logit)."""
        if self.reranker is not None:
            return [
                (states[-1].float() @ self.reranker)[None] for states in self.hidden_states(texts)
            ]
        if self.config.model_type == "modernbert" and self.packed_forward:
            return self._modernbert_logits(texts)
        if not self.packed_encoder:  # the model's own head, over each text alone
            return [
                self.model(input_ids=torch.tensor([text.token_ids]), **self._alone(text))
                .logits[0]
                .float()
                for text in texts
            ]
        firsts = torch.stack([states[:1] for states in self.hidden_states(texts)])
        return list(self.model.classifier(_head_input(self.model, firsts)).float())

    def _alone(self, text: Text) -> dict[str, Any]:
        """What a forward of one text takes beside its ids: a pair's segments, and its row
        count where the model attends text by text."""
        extra: dict[str, Any] = {}
        if text.token_type_ids is not None:
            extra["token_type_ids"] = torch.tensor([text.token_type_ids])
        if self.packed_forward:
            extra["text_lengths"] = [len(text.token_ids)]
        return extra

    def _modernbert_logits(self, texts: list[Text]) -> list[torch.Tensor]:
        """ModernBertForSequenceClassification's logits: each text's first state or mean
        (`classifier_pooling`, the mean as its masked sum over the count), its head."""
        cls = self.config.classifier_pooling == "cls"
        pooled = torch.stack(
            [s[0] if cls else s.sum(dim=0) / len(s) for s in self.hidden_states(texts)]
        )
        model = self.model
        return list(model.classifier(model.drop(model.head(pooled))).float())


def _load(folder: Path, spec: PoolingSpec, dtype: torch.dtype) -> PreTrainedModel:
    auto: Any = AutoModelForSequenceClassification if spec.task == "classify" else AutoModel
    if spec.classifier_tokens is not None:
        auto = AutoModelForCausalLM  # a decoder reranker scores with its LM head's rows
    try:
        if auto is AutoModel and spec.causal:
            auto = _base_without_head(AutoConfig.from_pretrained(folder)) or auto
        model, info = auto.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder}: {exc}") from None
    if info["missing_keys"]:
        missing = ", ".join(sorted(info["missing_keys"])[:4])
        raise ModelLoadError(f"{folder}: the checkpoint lacks weights its model needs: {missing}")
    return model


def _base_without_head(config: PretrainedConfig) -> type[PreTrainedModel] | None:
    """The base model class of `config`'s decoder, reading a causal LM's checkpoint without
    reporting its LM head as unexpected (an embedder has no use for it); None where
    transformers has no base model for the config."""
    base = MODEL_MAPPING.get(type(config), None)
    if not isinstance(base, type):  # none, or a choice among several
        return None
    ignored = [*(base._keys_to_ignore_on_load_unexpected or ()), r"^lm_head\."]
    return type(base.__name__, (base,), {"_keys_to_ignore_on_load_unexpected": ignored})


def _load_gguf(
    path: Path, folder: Path, spec: PoolingSpec, dtype: torch.dtype, install: Install | None
) -> PreTrainedModel:
    """A pooling model's GGUF, dequantized to `dtype` (or put in by `install`): a BERT
    embedder as its encoder without the pooler (which embeddings do not use, and llama.cpp's
    converter drops), a BERT reranker as a sequence classifier (its head's first layer the
    pooler), a decoder as its causal LM, whose base model embeds."""
    config = AutoConfig.from_pretrained(folder)
    if spec.causal:
        return load_gguf(path, folder, config, dtype, install=install)[0]
    if spec.task == "classify":
        auto = AutoModelForSequenceClassification
        return load_gguf(path, folder, config, dtype, install=install, auto=auto)[0]
    encoder = load_gguf(
        path, folder, config, dtype, install=install, auto=AutoModel, add_pooling_layer=False
    )  # fmt: skip
    return encoder[0]


def _head_input(model: nn.Module, firsts: torch.Tensor) -> torch.Tensor:
    """What the classification head takes: BERT's pooler output `[B, hidden]`; RoBERTa's
    head pools the first token itself, from `[B, 1, hidden]`."""
    pooler = getattr(model.base_model, "pooler", None)
    if pooler is not None:
        return pooler(firsts)
    return firsts


def _layer(layer: Any, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """One encoder layer (a BertLayer's shape) over packed rows `x [tokens, hidden]`: the
    texts' rows (`lengths`), then padding rows, which attend to nothing and which nothing
    attends to (every other operation is row by row)."""
    attention = layer.attention.self
    heads, size = attention.num_attention_heads, attention.attention_head_size
    q, k, v = attention.query(x), attention.key(x), attention.value(x)
    mixed = torch.empty_like(q)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        # [1, heads, n, size]: the 4-d shape CPU's fused (flash) attention takes
        per_head = [t[rows].view(1, n, heads, size).transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*per_head)
        mixed[rows] = out.transpose(1, 2).reshape(n, heads * size)
        start += n
    mixed[start:] = 0  # the padding rows, which no text attends to
    out = layer.attention.output
    x = out.LayerNorm(out.dense(mixed) + x)
    return layer.output.LayerNorm(layer.output.dense(layer.intermediate(x)) + x)

"""The packed encoder against transformers' own padded forward, on a random BERT and a
random RoBERTa (whose positions start after the padding index); packed decoders and
ModernBERT against their own forward, text by text."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    NomicBertConfig,
    NomicBertForSequenceClassification,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    RobertaConfig,
    RobertaModel,
)

from engine import capabilities
from engine.config import ConfigError, EngineConfig
from engine.errors import EngineError, ModelLoadError
from engine.model.kernels import bf16_linear
from engine.pooling.async_pooler import AsyncPooler
from engine.pooling.model import PACKED_DECODERS, PACKED_FORWARD_ENCODERS, PoolingModel, Text
from engine.pooling.spec import PoolingSpec, pooling_spec

SHAPE = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=128, max_position_embeddings=130,
)  # fmt: skip


@pytest.mark.parametrize(
    ("model_class", "config"),
    [
        (BertModel, BertConfig(**SHAPE, architectures=["BertModel"])),
        (RobertaModel, RobertaConfig(**SHAPE, pad_token_id=1, architectures=["RobertaModel"])),
    ],
    ids=["bert", "roberta"],
)
def test_packed_texts_embed_as_the_padded_forward_by_cls(
    tmp_path: Path, model_class: type, config: BertConfig
):
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    spec = pooling_spec(tmp_path)
    assert spec is not None and (spec.pooling, spec.normalize) == ("cls", True)
    encoder = PoolingModel(tmp_path, spec, torch.float32)
    assert encoder.max_length == 130 - encoder.position_offset
    lengths = [3, 17, 1, 40, encoder.max_length]
    texts = [torch.randint(2, 300, (n,)).tolist() for n in lengths]
    got = torch.stack(encoder.embed([Text(ids) for ids in texts]))
    reference = model_class.from_pretrained(tmp_path).eval()
    ids = torch.full((len(texts), max(lengths)), config.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(texts):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    with torch.no_grad():
        states = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.allclose(got, F.normalize(states[:, 0], dim=-1), atol=1e-5)


DECODER_SHAPE = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
)  # fmt: skip
DECODERS = {
    "llama": LlamaConfig(**DECODER_SHAPE),
    "mistral": MistralConfig(**DECODER_SHAPE, sliding_window=8),  # texts see past it
    "qwen2": Qwen2Config(**DECODER_SHAPE),
    "qwen3": Qwen3Config(**DECODER_SHAPE, head_dim=16),
    "gemma": GemmaConfig(**DECODER_SHAPE, head_dim=16),
    # Logits capped at 2 (weights drawn wide enough for the logits to pass it), local
    # layers of 8 rows.
    "gemma2": Gemma2Config(
        **DECODER_SHAPE,
        head_dim=16,
        attn_logit_softcapping=2.0,
        sliding_window=8,
        initializer_range=0.5,
    ),
    # EmbeddingGemma's layers: both ways, the local ones 8 rows either side.
    "gemma3_text": Gemma3TextConfig(
        **DECODER_SHAPE,
        head_dim=16,
        sliding_window=8,
        use_bidirectional_attention=True,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "phi3": Phi3Config(**DECODER_SHAPE, pad_token_id=0),
}


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_packed_decoder_texts_are_their_own_forwards_states_alone_and_batched(
    tmp_path: Path, kind: str
):
    """Last-token pooling of a batch of texts equals each text's own forward through the
    model's own attention (within 1e-5), and each text's vector has the same bits alone."""
    assert kind in PACKED_DECODERS
    torch.manual_seed(0)
    AutoModel.from_config(DECODERS[kind], attn_implementation="eager").save_pretrained(tmp_path)
    spec = PoolingSpec(task="embed", pooling="last", causal=True)
    decoder = PoolingModel(tmp_path, spec, torch.float32)
    assert decoder.packed_forward
    lengths = [3, 17, 1, 40, 9, 25]
    texts = [Text(torch.randint(2, 300, (n,)).tolist()) for n in lengths]
    got = decoder.embed(texts)
    reference = AutoModel.from_pretrained(tmp_path).eval()
    for text, vector in zip(texts, got, strict=True):
        with torch.no_grad():
            states = reference(input_ids=torch.tensor([text.token_ids])).last_hidden_state
        assert torch.allclose(vector, F.normalize(states[0, -1], dim=0), atol=1e-5)
        assert torch.equal(decoder.embed([text])[0], vector)


def test_a_causal_lm_embeds_as_its_base_model_without_reporting_its_head(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """A causal LM's checkpoint (its LM head untied, so saved) embeds as its base model's
    states, and its head, which an embedder does not use, is not reported as unexpected."""
    torch.manual_seed(0)
    config = LlamaConfig(**DECODER_SHAPE, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    caplog.clear()
    decoder = PoolingModel(
        tmp_path, PoolingSpec(task="embed", pooling="last", causal=True), torch.float32
    )
    assert "lm_head" not in caplog.text
    text = Text([5, 17, 42, 8])
    reference = AutoModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        states = reference(input_ids=torch.tensor([text.token_ids])).last_hidden_state
    assert torch.allclose(decoder.embed([text])[0], F.normalize(states[0, -1], dim=0), atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_packed_modernbert_embeds_and_classifies_as_its_own_forward(tmp_path: Path, pooling: str):
    """ModernBERT's texts packed (global layers, and local ones of 8 rows that most texts
    pass): each text's mean embedding and its classifier's logits equal its own forward's
    (within 1e-5), and have the same bits alone."""
    torch.manual_seed(0)
    config = ModernBertConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, global_attn_every_n_layers=3, local_attention=8, num_labels=2,
        classifier_pooling=pooling, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2,
    )  # fmt: skip
    ModernBertForSequenceClassification(config).save_pretrained(tmp_path)
    assert config.model_type in PACKED_FORWARD_ENCODERS
    lengths = [3, 17, 1, 40, 9, 25]
    texts = [Text(torch.randint(3, 300, (n,)).tolist()) for n in lengths]
    reference = ModernBertForSequenceClassification.from_pretrained(tmp_path).eval()
    embedder = PoolingModel(tmp_path, PoolingSpec(task="embed", pooling="mean"), torch.float32)
    classifier = PoolingModel(tmp_path, PoolingSpec(task="classify"), torch.float32)
    assert embedder.packed_forward and classifier.packed_forward
    vectors, logits = embedder.embed(texts), classifier.classify(texts)
    for text, vector, logit in zip(texts, vectors, logits, strict=True):
        ids = torch.tensor([text.token_ids])
        with torch.no_grad():
            states = reference.model(input_ids=ids).last_hidden_state[0]
            want = reference(input_ids=ids).logits[0]
        assert torch.allclose(vector, F.normalize(states.mean(dim=0), dim=0), atol=1e-5)
        assert torch.allclose(logit, want, atol=1e-5)
        assert torch.equal(embedder.embed([text])[0], vector)
        assert torch.equal(classifier.classify([text])[0], logit)


def test_packed_nomic_bert_embeds_and_scores_pairs_as_its_own_forward(tmp_path: Path):
    """NomicBERT (rotary positions, SwiGLU) packed: each text's mean embedding equals its
    own forward's, with the same bits alone; a cross-encoder's logits for text pairs (their
    segments given) equal transformers' own."""
    torch.manual_seed(0)
    config = NomicBertConfig(**SHAPE, num_labels=1)
    NomicBertForSequenceClassification(config).save_pretrained(tmp_path)
    assert config.model_type in PACKED_FORWARD_ENCODERS
    reference = NomicBertForSequenceClassification.from_pretrained(tmp_path).eval()
    embedder = PoolingModel(tmp_path, PoolingSpec(task="embed", pooling="mean"), torch.float32)
    classifier = PoolingModel(tmp_path, PoolingSpec(task="classify"), torch.float32)
    texts = [Text(torch.randint(3, 300, (n,)).tolist()) for n in (3, 17, 40, 9)]
    halves = [(len(t.token_ids) // 2, len(t.token_ids) - len(t.token_ids) // 2) for t in texts]
    pairs = [Text(t.token_ids, [0] * a + [1] * b) for t, (a, b) in zip(texts, halves, strict=True)]
    vectors, logits = embedder.embed(texts), classifier.classify(pairs)
    for text, pair, vector, logit in zip(texts, pairs, vectors, logits, strict=True):
        ids = torch.tensor([text.token_ids])
        with torch.no_grad():
            states = reference.nomic_bert(input_ids=ids).last_hidden_state[0]
            types = torch.tensor([pair.token_type_ids])
            want = reference(input_ids=ids, token_type_ids=types).logits[0]
        assert torch.allclose(vector, F.normalize(states.mean(dim=0), dim=0), atol=1e-5)
        assert torch.allclose(logit, want, atol=1e-5)
        assert torch.equal(embedder.embed([text])[0], vector)


def test_a_dense_module_that_does_not_fit_the_pooled_vector_is_refused_by_name(tmp_path: Path):
    BertModel(BertConfig(**SHAPE, architectures=["BertModel"])).save_pretrained(tmp_path)
    st = "sentence_transformers.models."
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")]
    (tmp_path / "modules.json").write_text(
        json.dumps([{"type": st + kind, "path": path} for kind, path in modules])
    )
    for path, config in (("1_Pooling", {"pooling_mode": "cls"}), ("2_Dense", {})):
        (tmp_path / path).mkdir()
        (tmp_path / path / "config.json").write_text(json.dumps(config))
    save_file({"linear.weight": torch.zeros(16, 32)}, tmp_path / "2_Dense" / "model.safetensors")
    with pytest.raises(ModelLoadError, match="takes 32 values, the vector before it has 64"):
        PoolingModel(tmp_path, pooling_spec(tmp_path), torch.float32)


def _small_bert(folder: Path) -> Path:
    """A random BERT and its vocabulary, saved in `folder`."""
    torch.manual_seed(0)
    BertModel(BertConfig(**SHAPE, architectures=["BertModel"])).save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(f"t{i}" for i in range(300)))
    return folder


def _small_bert_pooler(folder: Path) -> AsyncPooler:
    """A pooling engine of a random BERT saved in `folder`, 128 tokens a batch."""
    _small_bert(folder)
    return AsyncPooler(
        EngineConfig(model=str(folder), max_num_batched_tokens=128), pooling_spec(folder)
    )


def test_a_cancelled_runs_waiting_texts_are_never_computed(tmp_path: Path):
    pooler = _small_bert_pooler(tmp_path)
    first = [Text(list(range(2, 122))) for _ in range(40)]  # 40 batches of one text
    second = [Text(list(range(2, 12))) for _ in range(8)]

    async def scenario() -> None:
        running = asyncio.ensure_future(pooler.run(first))
        while pooler.stats().num_running == 0:
            await asyncio.sleep(0.001)
        cancelled = asyncio.ensure_future(pooler.run(second))
        await asyncio.sleep(0.01)  # its texts wait behind the first run's
        assert pooler.stats().num_waiting > len(second)
        cancelled.cancel()
        assert len(await running) == len(first)
        await asyncio.sleep(0.2)
        assert pooler.stats().prompt_tokens_total == 40 * 120
        assert pooler.stats().num_waiting == 0
        await pooler.shutdown()

    asyncio.run(scenario())


def test_a_shutdown_with_texts_waiting_fails_them_and_returns(tmp_path: Path):
    pooler = _small_bert_pooler(tmp_path)

    async def scenario() -> None:
        running = asyncio.ensure_future(pooler.run([Text(list(range(2, 122)))] * 200))
        while pooler.stats().num_running == 0:
            await asyncio.sleep(0.001)
        await asyncio.wait_for(pooler.shutdown(), 30)
        with pytest.raises(EngineError, match="shut down"):
            await running

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("mode", "refusal"),
    [("int4", "none, int8 or gguf"), ("gguf", "serves a GGUF file's own quantized types")],
)
def test_quantizations_a_pooling_model_cannot_take_are_refused(
    tmp_path: Path, mode: str, refusal: str
):
    """int4 loses too much (cosine 0.94-0.95); gguf is a GGUF file's own types, and a
    folder has none."""
    config = EngineConfig(model=str(_small_bert(tmp_path)), quantization=mode)
    with pytest.raises(ConfigError, match=refusal):
        AsyncPooler(config, pooling_spec(tmp_path))


def test_auto_computes_a_pooling_model_in_bf16_only_where_amx_computes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """bf16 outruns fp32 at many rows only on AMX tiles; a dtype asked for is kept."""
    folder = _small_bert(tmp_path)
    for amx, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(bf16_linear, "runs_on_amx", lambda amx=amx: amx)
        pooler = AsyncPooler(EngineConfig(model=str(folder)), pooling_spec(folder))
        try:
            assert pooler.dtype == want
            vector = asyncio.run(pooler.run([Text([1, 2, 3])]))[0]
            assert vector.dtype == torch.float32 and bool(torch.isfinite(vector).all())
        finally:
            asyncio.run(pooler.shutdown())
        assert capabilities.pooling_dtype("float32") == torch.float32

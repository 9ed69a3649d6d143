"""Embedders from GGUF files: all-MiniLM-L6-v2 written as llama.cpp's converter writes a BERT
(F32: the folder's embeddings bit for bit; Q8_0: near them, in its own types by default), a
random nomic-bert (as transformers' NomicBertModel computes it), a decoder's file made an
embedder by a pooler config or a reranker by `hf_overrides`, and the BERT files that pool
otherwise refused by name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import PoolingType
from transformers import (
    AutoModel,
    AutoTokenizer,
    NomicBertConfig,
    NomicBertModel,
    XLMRobertaForSequenceClassification,
)

from engine import capabilities
from engine.config import EngineConfig
from engine.errors import UnsupportedModelError
from engine.linears import quantized_linear
from engine.linears.quantized_embedding import QuantizedEmbedding
from engine.linears.quantized_linear import QuantizedLinear
from engine.model.loader import resolve_model_folder
from engine.pooling.async_pooler import AsyncPooler, pooling_model
from engine.pooling.model import PoolingModel, Text
from engine.pooling.spec import pooling_spec
from tests.support.gguf_files import (
    build_xlm_roberta_folder,
    write_bert_gguf,
    write_gguf,
    write_nomic_bert_gguf,
    write_xlm_roberta_gguf,
)

# Cased, accented, CJK and punctuated text: the GGUF's vocabulary and lowercasing must
# give the folder's tokenizer's ids.
TEXTS = [
    "A river bank at night.",
    "Héllo WORLD, naïve café: 東京 and ünïcödé!",
    "money " * 40,
    "Whales migrate across oceans; unbelievably, they sing.",
]


def _embeddings(config: EngineConfig) -> tuple[list[list[int]], np.ndarray]:
    """The texts' token ids and embeddings from a pooling engine of `config`."""
    pooler = AsyncPooler(config, pooling_model(config))  # type: ignore[arg-type]
    try:
        texts = pooler.encode(TEXTS, None)
        vectors = asyncio.run(pooler.run(texts))
    finally:
        asyncio.run(pooler.shutdown())
    return [text.token_ids for text in texts], torch.stack(vectors).numpy()


def _pooling_model(path: Path, quantization: str = "auto", **config: object) -> PoolingModel:
    """The pooling model of a GGUF in the mode `quantization` chooses (the file's own types
    by default), as the pooling engine loads it."""
    engine = EngineConfig(model=str(path), quantization=quantization, **config)  # type: ignore[arg-type]
    mode = capabilities.quantization_mode(engine, torch.device("cpu"), torch.float32, True)
    spec = pooling_model(engine)
    assert spec is not None
    folder = Path(resolve_model_folder(str(path))[0])
    return PoolingModel(folder, spec, torch.float32, None if mode == "none" else mode, path)


def _ids(path: Path, texts: list[str] = TEXTS) -> list[list[int]]:
    """The texts' token ids by the file's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_folder(str(path))[0])
    return [tokenizer(text)["input_ids"] for text in texts]


def test_a_bert_gguf_embeds_as_its_folder(minilm: Path, tmp_path: Path, cache: Path):
    """In F32 the file holds the folder's weights, so the embeddings are the folder's bit for
    bit (the same forward over the same ids); in Q8_0, within its rounding."""
    ids, want = _embeddings(EngineConfig(model=str(minilm), dtype="float32"))
    f32 = write_bert_gguf(minilm, tmp_path / "minilm-f32.gguf", "F32")
    got_ids, got = _embeddings(EngineConfig(model=str(f32), dtype="float32"))
    assert got_ids == ids
    assert np.array_equal(got, want)
    q8 = write_bert_gguf(minilm, tmp_path / "minilm-q8_0.gguf", "Q8_0")
    for quantization in ("auto", "none"):  # its own types (the default), dequantized to fp32
        _, got = _embeddings(
            EngineConfig(model=str(q8), quantization=quantization, dtype="float32")
        )
        cosine = (got * want).sum(1)  # both normalized
        assert 0.999 <= cosine.min() < 0.99999


def test_a_quantized_gguf_embeds_in_its_pooling_model(minilm: Path, tmp_path: Path, cache: Path):
    """By default a Q8_0 file's linears and token table stay its blocks, run by the group
    kernel (as a decoder's file is served): a text alone has its bits in a batch, within
    the file's rounding of the weights dequantized to fp32 (`quantization: none`)."""
    path = write_bert_gguf(minilm, tmp_path / "minilm-q8_0.gguf", "Q8_0")
    own, dense = _pooling_model(path), _pooling_model(path, "none")
    kinds = [type(module) for module in own.model.modules()]
    # Six layers of six linears, and the token table's (its QuantizedEmbedding's) blocks.
    assert kinds.count(QuantizedLinear) == 6 * 6 + 1 and QuantizedEmbedding in kinds
    assert not any(isinstance(m, QuantizedLinear) for m in dense.model.modules())
    texts = [Text(ids) for ids in _ids(path)]
    got, want = torch.stack(own.embed(texts)), torch.stack(dense.embed(texts))
    assert 0.999 <= (got * want).sum(1).min() < 0.99999
    assert torch.equal(own.embed(texts[1:2])[0], got[1])


def test_a_gguf_embedder_is_dequantized_where_the_kernel_is_its_scalar_twin(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
):
    """Without AVX2 or AVX512-VNNI the kernel runs few rows only (generation computes more
    dense); an embedder's kernel must run every row count, so `auto` dequantizes its file,
    and `gguf` still keeps the blocks where asked."""
    path = write_gguf(tmp_path / "embed.gguf", "Q8_0", pooling=PoolingType.LAST)
    cpu = torch.device("cpu")

    def mode(quantization: str, every_row_count: bool) -> str:
        config = EngineConfig(model=str(path), quantization=quantization)  # type: ignore[arg-type]
        return capabilities.quantization_mode(config, cpu, torch.float32, every_row_count)

    assert mode("auto", True) == "gguf"  # this CPU: the kernel is vectorized
    monkeypatch.setattr(quantized_linear, "max_kernel_rows", lambda dtype: 16)
    assert (mode("auto", True), mode("gguf", True), mode("auto", False)) == ("none", "gguf", "gguf")


def test_a_decoders_gguf_reranks_in_its_pooling_model(tmp_path: Path, cache: Path):
    """A decoder's Q8_0 file made a reranker by `hf_overrides` (vLLM's way to serve
    Qwen3-Reranker) scores with its head's two rows read from the file's blocks: as the
    same file dequantized to fp32 does, within the kernel's rounding of activations."""
    path = write_gguf(tmp_path / "reranker.gguf", "Q8_0")
    overrides = {
        "architectures": ["LlamaForSequenceClassification"],
        "classifier_from_token": ["a", "b"],
    }
    own = _pooling_model(path, hf_overrides=overrides)
    dense = _pooling_model(path, "none", hf_overrides=overrides)
    assert isinstance(own.model.get_output_embeddings(), QuantizedLinear)
    texts = [Text(ids) for ids in (_ids(path)[:2])]
    got, want = torch.cat(own.classify(texts)), torch.cat(dense.classify(texts))
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())
    assert not torch.equal(got, want)


# Beside TEXTS: whitespace to collapse, characters the charsmap maps (NFKC), and a filler
# piece's name. "<mask>" is left out: the converter writes no piece for it.
XLM_R_TEXTS = [
    *(text for text in TEXTS if len(text) < 100), "  leading,   inner\tand trailing  ",
    "① ﬁne Ｆｕｌｌ width, Ⅻ", "<s> literal </s> and [PAD119]", "money " * 10,
]  # fmt: skip


def test_an_xlm_roberta_gguf_embeds_as_its_folder(tmp_path: Path, cache: Path):
    """BGE-M3's layout (a `bert` file with a SentencePiece Unigram tokenizer, its positions
    from 0): the folder's token ids for every text, and in F32 its embeddings bit for bit."""
    folder = build_xlm_roberta_folder(tmp_path / "xlm-r")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    want = PoolingModel(folder, pooling_spec(folder), torch.float32)  # type: ignore[arg-type]
    path = write_xlm_roberta_gguf(folder, tmp_path / "xlm-r.gguf", "F32")
    got = _pooling_model(path, "none")
    assert got.config.model_type == "bert" and want.config.model_type == "xlm-roberta"
    ids = [tokenizer(text)["input_ids"] for text in XLM_R_TEXTS]
    assert _ids(path, XLM_R_TEXTS) == ids
    texts = [Text(text_ids) for text_ids in ids]
    assert torch.equal(torch.stack(got.embed(texts)), torch.stack(want.embed(texts)))


@pytest.mark.parametrize("rank_named", [False, True])
def test_an_xlm_roberta_reranker_gguf_scores_pairs_as_transformers(
    tmp_path: Path, cache: Path, rank_named: bool
):
    """bge-reranker-v2-m3's layout (the head's dense layer `cls` and output layer
    `cls.output`; no pooling named, as the converter writes it, or RANK): each (query,
    document) pair's logit equals XLMRobertaForSequenceClassification's on the folder's
    pair ids, to 1e-5."""
    folder = build_xlm_roberta_folder(tmp_path / "reranker", reranker=True)
    path = write_xlm_roberta_gguf(folder, tmp_path / "reranker.gguf", "F32", rank_named)
    pairs = [("Where do whales sing?", text) for text in XLM_R_TEXTS]
    config = EngineConfig(model=str(path), dtype="float32")
    pooler = AsyncPooler(config, pooling_model(config))  # type: ignore[arg-type]
    try:
        texts = pooler.encode(pairs, None)
        got = torch.stack(asyncio.run(pooler.run(texts)))
    finally:
        asyncio.run(pooler.shutdown())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert [t.token_ids for t in texts] == [tokenizer(*pair)["input_ids"] for pair in pairs]
    reference = XLMRobertaForSequenceClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        want = [reference(input_ids=torch.tensor([t.token_ids])).logits[0] for t in texts]
    assert got.shape == (len(pairs), 1)
    assert torch.allclose(got, torch.stack(want), atol=1e-5)


@pytest.mark.parametrize("pooling", [PoolingType.RANK, PoolingType.LAST, PoolingType.NONE])
def test_a_bert_gguf_that_pools_otherwise_is_refused_by_name(
    minilm: Path, tmp_path: Path, cache: Path, pooling: PoolingType
):
    path = write_bert_gguf(minilm, tmp_path / "other.gguf", "F16", pooling)
    with pytest.raises(UnsupportedModelError, match=f"pooling {pooling.name} is not served"):
        pooling_model(EngineConfig(model=str(path)))


@pytest.mark.parametrize("named", [False, True])
def test_a_decoders_gguf_embeds_as_its_pooler_config_or_its_file_says(
    tmp_path: Path, cache: Path, named: bool
):
    """A chat model's file (and a reranker's, RANK) is a model to generate with; a pooler
    config (LAST), or the pooling the file names (as the converter writes
    Qwen3-Embedding's), makes it an embedder of its last token's state, normalized, as
    transformers computes it from the same file."""
    for kept in (None, PoolingType.RANK):
        kept_path = write_gguf(tmp_path / f"chat-{kept}.gguf", "Q8_0", pooling=kept)
        assert pooling_model(EngineConfig(model=str(kept_path))) is None
    pooling = PoolingType.LAST if named else None
    path = write_gguf(tmp_path / "embed.gguf", "Q8_0", pooling=pooling)
    pooler_config = None if named else {"pooling_type": "LAST"}
    # Dequantized (`none`): what transformers computes from the file.
    config = EngineConfig(
        model=str(path), pooler_config=pooler_config, quantization="none", dtype="float32"
    )
    pooler = AsyncPooler(config, pooling_model(config))  # type: ignore[arg-type]
    try:
        texts = pooler.encode(["hello there", "a b c d e f"], None)
        got = asyncio.run(pooler.run(texts))
    finally:
        asyncio.run(pooler.shutdown())
    model = AutoModel.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        for text, vector in zip(texts, got, strict=True):
            state = model(input_ids=torch.tensor([text.token_ids])).last_hidden_state[0, -1]
            assert torch.allclose(vector, F.normalize(state, dim=0), atol=1e-5)


def test_a_nomic_bert_gguf_embeds_as_transformers_nomic_bert(
    minilm: Path, tmp_path: Path, cache: Path
):
    """nomic-embed-text's layout (rotary positions, SwiGLU, q, k and v fused in one tensor),
    random weights: the mean of NomicBertModel's states, normalized, to 1e-5; its texts
    packed, so a text's embedding has the same bits alone."""
    torch.manual_seed(0)
    config = NomicBertConfig(
        vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256,
    )  # fmt: skip
    model = NomicBertModel(config).eval()
    path = write_nomic_bert_gguf(model, minilm, tmp_path / "nomic.gguf", "F16")
    config_ = EngineConfig(model=str(path), dtype="float32")
    pooler = AsyncPooler(config_, pooling_model(config_))  # type: ignore[arg-type]
    try:
        texts = pooler.encode(TEXTS, None)
        got = torch.stack(asyncio.run(pooler.run(texts)))
        alone = asyncio.run(pooler.run(texts[1:2]))[0]
    finally:
        asyncio.run(pooler.shutdown())
    assert torch.equal(alone, got[1])
    f16 = NomicBertModel(config).eval()  # the weights as the file holds them
    f16.load_state_dict(
        {k: v.half().float() if v.dim() == 2 and "token_type" not in k else v
         for k, v in model.state_dict().items()}
    )  # fmt: skip
    with torch.inference_mode():
        want = [
            F.normalize(
                f16(input_ids=torch.tensor([t.token_ids])).last_hidden_state[0].mean(0), dim=0
            )
            for t in texts
        ]
    assert torch.allclose(got, torch.stack(want), atol=1e-5)

"""Embeddings, scores and rerank over real HTTP: all-MiniLM-L6-v2 from its PyPI package
against sentence-transformers, and a random-weight cross-encoder against transformers."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from langchain_openai import OpenAIEmbeddings
from prometheus_client.parser import text_string_to_metric_families
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.dense import Dense
from sentence_transformers.base.modules.normalize import Normalize
from sentence_transformers.base.modules.transformer import Transformer
from sentence_transformers.sentence_transformer.modules.pooling import Pooling
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    Gemma3TextConfig,
    Gemma3TextModel,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    ModernBertModel,
)

from engine.model.kernels import bf16_linear
from server.config import ServeConfig, ServedModelConfig
from tests.server.conftest import client, live_server, tiny_config
from tests.support.gguf_files import write_bert_gguf

pytestmark = pytest.mark.xdist_group("embeddings")

WORDS = ["the", "a", "river", "bank", "money", "loan", "water", "fish", "boat", "city", "night"]
PAIRS = [  # (text, paraphrase or unrelated text)
    ("A man is playing a guitar.", "Someone plays an acoustic guitar."),
    ("The cat sleeps on the sofa.", "A cat is napping on the couch."),
    ("How do I reset my password?", "Steps to change a forgotten password."),
    ("The stock market fell sharply today.", "Shares dropped steeply in trading."),
    ("She is cooking pasta for dinner.", "Spaghetti is being made for the evening meal."),
    ("The train to Paris is delayed.", "Our Paris train is running late."),
    ("Children are playing in the park.", "Kids play outside on the grass."),
    ("The weather is cold and rainy.", "It is a chilly, wet day."),
    ("He bought a new laptop.", "He purchased a brand new computer."),
    ("The museum opens at nine.", "Doors of the museum open at 9 am."),
    ("A man is playing a guitar.", "The recipe needs two eggs."),
    ("The cat sleeps on the sofa.", "Quarterly taxes are due in April."),
    ("How do I reset my password?", "Volcanoes erupt molten rock."),
    ("The stock market fell sharply today.", "A bird is building a nest."),
    ("She is cooking pasta for dinner.", "The satellite orbits the planet."),
    ("The train to Paris is delayed.", "He plays chess every Sunday."),
    ("Children are playing in the park.", "The invoice was paid by wire."),
    ("The weather is cold and rainy.", "My phone battery is dead."),
    ("He bought a new laptop.", "Whales migrate across oceans."),
    ("The museum opens at nine.", "Tomatoes grow best in summer."),
]


def _texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 60)))) for _ in range(count)]


@pytest.fixture(scope="module")
def reference(minilm: Path) -> SentenceTransformer:
    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="module")
def minilm_gguf(minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 in Q8_0, laid out as llama.cpp's converter and quantizer make it."""
    return write_bert_gguf(minilm, tmp_path_factory.mktemp("gguf") / "minilm-q8_0.gguf", "Q8_0")


@pytest.fixture(scope="module")
def cross_encoder(minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight BertForSequenceClassification of one label, MiniLM's tokenizer."""
    folder = tmp_path_factory.mktemp("cross-encoder")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=1, architectures=["BertForSequenceClassification"],
    )  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def decoder_embedder(
    tiny_model_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny random-weight Qwen3 in Qwen3-Embedding's sentence-transformers layout:
    last-token pooling, normalized."""
    folder = tmp_path_factory.mktemp("qwen3-embedding") / "model"
    shutil.copytree(tiny_model_paths["qwen3"], folder)
    _sentence_transformers_layout(folder, "pooling_mode_lasttoken")
    return folder


@pytest.fixture(scope="module")
def modernbert(minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight ModernBERT in sentence-transformers' layout (mean pooling,
    normalized) with MiniLM's tokenizer; its local layers see 8 tokens, fewer than most
    texts hold, so the sliding window counts."""
    folder = tmp_path_factory.mktemp("modernbert")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    config = ModernBertConfig(
        vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, global_attn_every_n_layers=3, local_attention=8,
        pad_token_id=tokenizer.pad_token_id, cls_token_id=tokenizer.cls_token_id,
        sep_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id, architectures=["ModernBertModel"],
    )  # fmt: skip
    ModernBertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _sentence_transformers_layout(folder, "pooling_mode_mean_tokens")
    return folder


@pytest.fixture(scope="module")
def modernbert_cross_encoder(modernbert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight ModernBertForSequenceClassification of one label, as `modernbert`."""
    folder = tmp_path_factory.mktemp("modernbert-cross")
    torch.manual_seed(1)
    config = ModernBertConfig.from_pretrained(modernbert)
    config.num_labels, config.architectures = 1, ["ModernBertForSequenceClassification"]
    ModernBertForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(modernbert).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def embeddinggemma(minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model of EmbeddingGemma's layout, saved by sentence-transformers 6
    itself: a gemma3 decoder attending both ways (local layers of 8 tokens), mean
    pooling, two Dense projections, Normalize; MiniLM's tokenizer."""
    model = tmp_path_factory.mktemp("gemma3-text")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    config = Gemma3TextConfig(
        vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
        use_bidirectional_attention=True, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        architectures=["Gemma3TextModel"],
    )  # fmt: skip
    Gemma3TextModel(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    identity = torch.nn.Identity()
    modules = [
        Transformer(str(model)), Pooling(64, "mean"),
        Dense(64, 256, bias=False, activation_function=identity),
        Dense(256, 64, bias=False, activation_function=identity), Normalize(),
    ]  # fmt: skip
    folder = tmp_path_factory.mktemp("embeddinggemma")
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def _sentence_transformers_layout(folder: Path, pooling: str) -> None:
    """Make the transformers folder a sentence-transformers one: the model, a Pooling
    module of `pooling`, Normalize."""
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    (folder / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(modules)
    ]))  # fmt: skip
    (folder / "1_Pooling").mkdir()
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, pooling: True})
    )
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))


@pytest.fixture(scope="module")
def server(
    minilm: Path,
    minilm_gguf: Path,
    cross_encoder: Path,
    decoder_embedder: Path,
    modernbert: Path,
    modernbert_cross_encoder: Path,
    embeddinggemma: Path,
    tiny_model_paths: dict[str, Path],
) -> Iterator[str]:
    """One server of twelve models: eight embedders (MiniLM four times: fp32, int8, a Q8_0
    GGUF and the default dtype; the chat model's folder by a pooler config), two
    cross-encoders, a reranker and a chat model. Each is held to its reference in fp32."""
    chat = tiny_config(tiny_model_paths["llama"])
    fp32 = {"dtype": "float32"}
    config = ServeConfig(
        models=[
            ServedModelConfig(name="minilm", model=str(minilm), **fp32),
            ServedModelConfig(name="minilm-int8", model=str(minilm), quantization="int8", **fp32),
            ServedModelConfig(name="minilm-gguf", model=str(minilm_gguf), **fp32),
            ServedModelConfig(name="minilm-auto", model=str(minilm)),
            ServedModelConfig(name="cross", model=str(cross_encoder), **fp32),
            ServedModelConfig(name="qwen3-embedding", model=str(decoder_embedder), **fp32),
            ServedModelConfig(name="modernbert", model=str(modernbert), **fp32),
            ServedModelConfig(name="modernbert-cross", model=str(modernbert_cross_encoder), **fp32),
            ServedModelConfig(name="embeddinggemma", model=str(embeddinggemma), **fp32),
            ServedModelConfig(
                name="qwen3-reranker", model=str(tiny_model_paths["qwen3"]), hf_overrides=RERANKER,
                **fp32,
            ),
            ServedModelConfig(
                name="chat-embed", model=chat.model, pooler_config={"pooling_type": "MEAN"}, **fp32
            ),
            ServedModelConfig(name="chat", model=chat.model, kv_cache_memory="64MiB",
                              max_model_len=512, enforce_eager=True, **fp32),
        ],
    )  # fmt: skip
    with live_server(config) as url:
        yield url


# vLLM's way to serve Qwen3-Reranker (there "no" and "yes"; tokens of the tiny vocabulary here)
RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["a", "b"],
}


def _embed(url: str, inputs: object, **fields: object) -> httpx.Response:
    body = {"model": "minilm", "input": inputs, **fields}
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=120)


def _vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = sorted(response.json()["data"], key=lambda item: item["index"])
    if isinstance(data[0]["embedding"], str):
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])
    return np.array([d["embedding"] for d in data], dtype=np.float32)


def test_embeddings_equal_sentence_transformers(server: str, reference: SentenceTransformer):
    texts = _texts(200)
    openai = client(server)
    got = np.array([
        item.embedding
        for start in range(0, 200, 50)
        for item in openai.embeddings.create(model="minilm", input=texts[start : start + 50]).data
    ])  # fmt: skip
    want = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.99999
    assert np.abs(got - want).max() <= 1e-5


def test_a_texts_embedding_has_the_same_bits_alone_and_in_a_batch_of_64(server: str):
    texts = _texts(64, seed=1)
    # Alone, these are calls of 3, 7 and 10 rows, where MKL's rows differ from a long call's.
    texts[0], texts[17], texts[63] = "river", "a river bank at night", "the city at night " * 2
    batched = _vectors(_embed(server, texts, encoding_format="base64"))
    for i in (0, 17, 63):
        alone = _vectors(_embed(server, texts[i], encoding_format="base64"))[0]
        assert np.array_equal(alone, batched[i]), i


def test_int8_embeddings_keep_a_cosine_of_0_999_and_their_bits_alone_and_batched(
    server: str, reference: SentenceTransformer
):
    texts = _texts(200)
    got = np.concatenate([
        _vectors(_embed(server, texts[start : start + 50], model="minilm-int8"))
        for start in range(0, 200, 50)
    ])  # fmt: skip
    want = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.999
    assert cosine.min() < 0.99999  # quantized: not the fp32 model's embeddings
    for i in (0, 17, 49):
        alone = _vectors(_embed(server, texts[i], model="minilm-int8"))[0]
        assert np.array_equal(alone, got[i]), i


def test_the_default_dtype_is_bf16_on_amx_at_a_cosine_of_0_9999_and_keeps_its_bits(
    server: str, reference: SentenceTransformer
):
    """`dtype: auto` computes a pooling model in bf16 where the bf16 kernel runs on AMX (2.5x
    fp32's speed), else in fp32: sentence-transformers' embeddings to a cosine of 0.9999
    (of 0.99999 in fp32), a text's bits alone as in a batch."""
    texts = _texts(100, seed=2)
    got = _vectors(_embed(server, texts, model="minilm-auto"))
    want = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    if bf16_linear.runs_on_amx():
        assert 0.9999 <= cosine.min() < 0.99999
    else:
        assert cosine.min() >= 0.99999
    for i in (0, 41, 99):
        alone = _vectors(_embed(server, texts[i], model="minilm-auto"))[0]
        assert np.array_equal(alone, got[i]), i


@pytest.mark.parametrize(
    ("name", "folder"),
    [
        ("qwen3-embedding", "decoder_embedder"),
        ("modernbert", "modernbert"),
        ("embeddinggemma", "embeddinggemma"),
    ],
)
def test_decoders_and_modernbert_embed_as_sentence_transformers(
    server: str, name: str, folder: str, request: pytest.FixtureRequest
):
    """A decoder (last-token pooling), ModernBERT (mean pooling, sliding windows) and
    EmbeddingGemma's layout (attention both ways, Dense modules), their texts packed: the
    reference's embeddings, and alone = batched."""
    texts = _texts(40, seed=2)
    got = _vectors(_embed(server, texts, model=name, encoding_format="base64"))
    reference = SentenceTransformer(str(request.getfixturevalue(folder)), device="cpu")
    assert np.abs(got - reference.encode(texts)).max() <= 1e-5
    alone = _vectors(_embed(server, texts[7], model=name, encoding_format="base64"))
    assert np.array_equal(alone[0], got[7])


def test_the_ranking_of_pairs_by_cosine_is_the_references(
    server: str, reference: SentenceTransformer
):
    firsts, seconds = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    got = httpx.post(
        f"{server}/score", json={"model": "minilm", "text_1": firsts, "text_2": seconds}
    )
    assert got.status_code == 200, got.text
    scores = [item["score"] for item in got.json()["data"]]
    want = [
        float(np.dot(a, b))
        for a, b in zip(reference.encode(firsts), reference.encode(seconds), strict=True)
    ]
    assert list(np.argsort(scores)) == list(np.argsort(want))
    assert np.allclose(scores, want, atol=1e-5)
    assert min(scores[:10]) > max(scores[10:])  # paraphrases above unrelated pairs


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_orders_documents_as_the_reference(
    server: str, reference: SentenceTransformer, path: str
):
    query = "How do I reset my password?"
    documents = [b for _, b in PAIRS]
    body = {"model": "minilm", "query": query, "documents": documents, "top_n": 3}
    response = httpx.post(f"{server}{path}", json=body)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    want = reference.encode(documents) @ reference.encode(query)
    assert [r["index"] for r in results] == list(np.argsort(-want)[:3])
    assert results[0]["document"]["text"] == documents[results[0]["index"]]
    assert response.json()["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(
    ("name", "folder", "architecture"),
    [
        ("cross", "cross_encoder", BertForSequenceClassification),
        ("modernbert-cross", "modernbert_cross_encoder", ModernBertForSequenceClassification),
    ],
)
def test_cross_encoder_scores_are_the_sigmoid_of_transformers_logits(
    server: str, name: str, folder: str, architecture: type, request: pytest.FixtureRequest
):
    """Documents as strings or as objects (Jina's and Cohere's clients); the logit itself
    with vLLM's `use_activation: false`."""
    cross_encoder = request.getfixturevalue(folder)
    query, documents = "a river bank", ["money in the bank", "the river flows", "a song at night"]
    objects = [{"text": d} for d in documents]
    response = httpx.post(
        f"{server}/rerank", json={"model": name, "query": query, "documents": objects}
    )
    assert response.status_code == 200, response.text
    got = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
    model = architecture.from_pretrained(cross_encoder).eval()
    tokens = AutoTokenizer.from_pretrained(cross_encoder)(
        [query] * 3, documents, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits = model(**tokens).logits[:, 0]
    want = torch.sigmoid(logits).tolist()
    assert np.allclose([got[i] for i in range(3)], want, atol=1e-5)
    order = [r["index"] for r in response.json()["results"]]
    assert order == sorted(range(3), key=lambda i: -want[i])
    assert [r["document"]["text"] for r in response.json()["results"]] == [
        documents[i] for i in order
    ]
    raw = httpx.post(
        f"{server}/score",
        json={"model": name, "text_1": query, "text_2": documents, "use_activation": False},
    )
    assert raw.status_code == 200, raw.text
    assert np.allclose([d["score"] for d in raw.json()["data"]], logits.tolist(), atol=1e-5)
    refused = _embed(server, "a text", model=name)
    assert refused.status_code == 400 and "cross-encoder" in refused.json()["error"]["message"]


def test_a_decoder_reranker_scores_as_its_lm_heads_two_tokens(
    server: str, tiny_model_paths: dict[str, Path]
):
    query, documents = "a river bank", ["money in the bank", "the river flows", "a song"]
    body = {"model": "qwen3-reranker", "query": query, "documents": documents}
    response = httpx.post(f"{server}/rerank", json=body)
    assert response.status_code == 200, response.text
    got = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
    folder = tiny_model_paths["qwen3"]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pair = [tokenizer.convert_tokens_to_ids(t) for t in RERANKER["classifier_from_token"]]
    want = []
    for document in documents:
        ids = torch.tensor([tokenizer(query, document)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1, pair]
        want.append(torch.softmax(logits, dim=0)[1].item())
    assert np.allclose([got[i] for i in range(3)], want, atol=1e-5)
    chat = httpx.post(
        f"{server}/v1/completions", json={"model": "qwen3-reranker", "prompt": "a", "max_tokens": 1}
    )
    assert chat.status_code == 400


def test_base64_token_ids_and_float_agree(server: str, minilm: Path):
    text = "the river bank at night"
    ids = AutoTokenizer.from_pretrained(minilm)(text)["input_ids"]
    floats = _vectors(_embed(server, [text]))
    assert np.array_equal(_vectors(_embed(server, [text], encoding_format="base64")), floats)
    assert np.array_equal(_vectors(_embed(server, ids)), floats)
    assert np.array_equal(_vectors(_embed(server, [ids, ids])), np.concatenate([floats, floats]))
    usage = _embed(server, ids).json()["usage"]
    assert usage == {"prompt_tokens": len(ids), "total_tokens": len(ids)}


def test_over_long_inputs_are_refused_or_truncated_on_request(
    server: str, reference: SentenceTransformer
):
    text = " ".join(["river"] * 400)
    refused = _embed(server, text)
    assert refused.status_code == 400
    assert "window of 256" in refused.json()["error"]["message"]
    truncated = _vectors(_embed(server, text, truncate_prompt_tokens=-1))
    assert np.abs(truncated[0] - reference.encode(text)).max() <= 1e-5  # ST cuts at 256
    assert _embed(server, text, truncate_prompt_tokens=300).status_code == 400
    assert _embed(server, text, truncate_prompt_tokens=32).status_code == 200


def test_dimensions_cut_a_matryoshka_model_and_are_refused_by_name_elsewhere(
    server: str, minilm: Path, tmp_path: Path
):
    refused = _embed(server, "text", dimensions=128)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
    assert _embed(server, "text", dimensions=384).status_code == 200
    folder = tmp_path / "matryoshka"
    shutil.copytree(minilm, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [128, 256]}))
    with live_server(ServeConfig(model=str(folder))) as url:
        full = _vectors(_embed(url, "a river", model=None))[0]
        cut = _vectors(_embed(url, "a river", model=None, dimensions=128))[0]
        assert _embed(url, "a river", model=None, dimensions=100).status_code == 400
    assert np.allclose(cut, full[:128] / np.linalg.norm(full[:128]), atol=1e-6)
    # vLLM's `is_matryoshka` (as `--hf-overrides` gives it): any size below the model's.
    with live_server(ServeConfig(model=str(minilm), hf_overrides={"is_matryoshka": True})) as url:
        cut = _vectors(_embed(url, "a river", model=None, dimensions=100))[0]
        wider = _embed(url, "a river", model=None, dimensions=385)
    assert np.allclose(cut, full[:100] / np.linalg.norm(full[:100]), atol=1e-6)
    assert wider.status_code == 400 and "any size below it" in wider.json()["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"encoding_format": "int8"}, "encoding_format"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"pooling": "max"}, "pooling"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_fields_are_refused_by_name(server: str, fields: dict, param: str):
    body = {"model": "minilm", "input": "a text"} | fields
    response = httpx.post(f"{server}/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert param in json.dumps(response.json()["error"])


def test_each_model_serves_only_its_own_endpoints(server: str):
    chat = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": "minilm", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400
    assert "'minilm' is a pooling model" in chat.json()["error"]["message"]
    embed = _embed(server, "a text", model="chat")
    assert embed.status_code == 400 and "'chat' generates text" in embed.json()["error"]["message"]
    completion = client(server).completions.create(model="chat", prompt="a", max_tokens=2)
    assert completion.choices[0].text is not None  # the chat model serves beside them
    asleep = httpx.post(f"{server}/sleep")
    assert asleep.status_code == 400 and "does not sleep" in asleep.json()["error"]["message"]


def test_a_chat_models_folder_embeds_as_its_pooler_config_says(
    server: str, tiny_model_paths: dict[str, Path]
):
    """vLLM's `pooler_config` (MEAN here) serves a chat model's folder as an embedder: its
    token states' mean, normalized, as transformers computes them; it generates nothing."""
    folder = tiny_model_paths["llama"]
    texts = ["a river bank at night", "money", "the city of water and light " * 5]
    got = _vectors(_embed(server, texts, model="chat-embed", encoding_format="base64"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [
            F.normalize(
                model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].mean(0), dim=0
            )
            for text in texts
        ]
    assert np.abs(got - torch.stack(want).numpy()).max() <= 1e-5
    assert np.array_equal(_vectors(_embed(server, texts[1], model="chat-embed"))[0], got[1])
    chat = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": "chat-embed", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400
    assert "'chat-embed' is a pooling model" in chat.json()["error"]["message"]


def test_pooling_work_shows_in_the_vllm_metrics(server: str):
    assert _embed(server, ["a river", "a bank"]).status_code == 200
    families = {
        (sample.name, sample.labels.get("model_name")): sample.value
        for family in text_string_to_metric_families(httpx.get(f"{server}/metrics").text)
        for sample in family.samples
    }
    assert families[("vllm:prompt_tokens_total", "minilm")] >= 8
    assert families[("vllm:num_requests_waiting", "minilm")] == 0


def test_langchain_openai_embeddings(server: str, reference: SentenceTransformer):
    embedder = OpenAIEmbeddings(
        model="minilm", base_url=f"{server}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    texts = ["the river bank", "music at night"]
    got = np.array(embedder.embed_documents(texts))
    assert np.abs(got - reference.encode(texts)).max() <= 1e-5
    assert np.abs(np.array(embedder.embed_query(texts[0])) - got[0]).max() == 0


def test_a_bert_gguf_serves_embeddings_near_its_folders(
    server: str, reference: SentenceTransformer
):
    """The Q8_0 file, as Ollama and llama.cpp users bring it: the openai client's embeddings
    within Q8_0's rounding of the reference's; every paraphrase scores above every unrelated
    pair."""
    texts = [text for pair in PAIRS for text in pair]
    got = np.array([
        item.embedding
        for item in client(server).embeddings.create(model="minilm-gguf", input=texts).data
    ])  # fmt: skip
    assert (got * reference.encode(texts)).sum(1).min() >= 0.999
    scores = (got[0::2] * got[1::2]).sum(1)
    assert scores[:10].min() > scores[10:].max()


def test_haystack_openai_embedders(
    server: str, reference: SentenceTransformer, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HAYSTACK_TELEMETRY_ENABLED", "False")
    from haystack import Document
    from haystack.components.embedders import OpenAIDocumentEmbedder, OpenAITextEmbedder
    from haystack.utils import Secret

    settings = {"api_key": Secret.from_token("unused"), "model": "minilm",
                "api_base_url": f"{server}/v1"}  # fmt: skip
    query = OpenAITextEmbedder(**settings).run(text="the river bank")["embedding"]
    assert np.abs(np.array(query) - reference.encode("the river bank")).max() <= 1e-5
    documents = [Document(content="music at night"), Document(content="a loan from the bank")]
    embedded = OpenAIDocumentEmbedder(**settings).run(documents=documents)["documents"]
    want = reference.encode([d.content for d in documents])
    assert np.abs(np.array([d.embedding for d in embedded]) - want).max() <= 1e-5

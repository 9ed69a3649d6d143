"""Which folders hold pooling models, how they pool, and what is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig
from engine.errors import ModelLoadError
from engine.pooling.async_pooler import pooling_model
from engine.pooling.spec import DenseSpec, PoolingSpec, pooling_spec


def _folder(tmp_path: Path, config: dict, modules: list[dict] | None = None, **files: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if modules is not None:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
    for name, content in files.items():
        path = tmp_path / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return tmp_path


BERT = {"model_type": "bert", "architectures": ["BertModel"]}
ST = "sentence_transformers.models."


def _modules(*kinds: str) -> list[dict]:
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize"}
    return [
        {"type": ST + kind, "path": paths.get(kind, f"{i}_{kind}")} for i, kind in enumerate(kinds)
    ]


def test_a_sentence_transformers_folder_pools_as_its_modules_say(tmp_path: Path):
    folder = _folder(
        tmp_path, BERT, _modules("Transformer", "Pooling", "Normalize"),
        **{"1_Pooling__config.json": {"pooling_mode_mean_tokens": True},
           "sentence_bert_config.json": {"max_seq_length": 128}},
    )  # fmt: skip
    assert pooling_spec(folder) == PoolingSpec("embed", "mean", True, 128)


def test_a_plain_encoder_embeds_by_cls_normalized_and_a_classifier_scores(tmp_path: Path):
    assert pooling_spec(_folder(tmp_path, BERT)) == PoolingSpec("embed", "cls", True, None)
    roberta = {"model_type": "roberta", "architectures": ["RobertaForSequenceClassification"]}
    assert pooling_spec(_folder(tmp_path, roberta)) == PoolingSpec("classify")


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
        {"model_type": "bert", "architectures": ["BertForMaskedLM"]},  # refused by the loader
    ],
)
def test_decoders_and_masked_lm_heads_are_not_pooling_models(tmp_path: Path, config: dict):
    assert pooling_spec(_folder(tmp_path, config)) is None


def test_a_sentence_transformers_6_folder_with_dense_modules_pools_as_its_modules_say(
    tmp_path: Path,
):
    """sentence-transformers 6's layout (module types by their new paths, `pooling_mode`
    by name, the window in the tokenizer's config) with EmbeddingGemma's two Dense
    modules."""
    gemma3 = {"model_type": "gemma3_text", "architectures": ["Gemma3TextModel"]}
    base = "sentence_transformers.base.modules."
    modules = [
        {"path": "", "type": base + "transformer.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.sentence_transformer.modules."
         "pooling.Pooling"},
        {"path": "2_Dense", "type": base + "dense.Dense"},
        {"path": "3_Dense", "type": "sentence_transformers.models.Dense"},
        {"path": "4_Normalize", "type": base + "normalize.Normalize"},
    ]  # fmt: skip
    identity = {"activation_function": "torch.nn.modules.linear.Identity"}
    folder = _folder(
        tmp_path, gemma3, modules,
        **{"1_Pooling__config.json": {"pooling_mode": "mean"}, "2_Dense__config.json": identity,
           "3_Dense__config.json": {}, "sentence_bert_config.json": {},
           "tokenizer_config.json": {"model_max_length": 2048}},
    )  # fmt: skip
    dense = (DenseSpec(folder / "2_Dense", "Identity"), DenseSpec(folder / "3_Dense", "Tanh"))
    assert pooling_spec(folder) == PoolingSpec(
        "embed", "mean", True, 2048, (), causal=True, dense=dense
    )


@pytest.mark.parametrize(
    ("modules", "files", "named"),
    [
        (_modules("Transformer", "Pooling", "LayerNorm"),
         {"1_Pooling__config.json": {"pooling_mode_cls_token": True}}, "'LayerNorm'"),
        (_modules("Transformer", "Pooling"),
         {"1_Pooling__config.json": {"pooling_mode_max_tokens": True}}, "pooling_mode_max_tokens"),
        (_modules("Transformer", "Pooling"),
         {"1_Pooling__config.json": {"pooling_mode": "weightedmean"}}, "weightedmean"),
        (_modules("Transformer", "Pooling", "Dense"),
         {"1_Pooling__config.json": {"pooling_mode": "cls"},
          "2_Dense__config.json": {"activation_function": "mine.Swish"}}, "'mine.Swish'"),
        (_modules("Transformer", "Pooling", "Dense"),
         {"1_Pooling__config.json": {"pooling_mode": "cls"},
          "2_Dense__config.json": {"use_residual": True}}, "use_residual"),
        (_modules("Transformer", "Pooling", "Normalize", "Dense"),
         {"1_Pooling__config.json": {"pooling_mode": "cls"}}, "'Dense' follows Normalize"),
    ],
)  # fmt: skip
def test_what_a_folder_asks_for_and_is_not_served_is_refused_by_name(
    tmp_path: Path, modules: list[dict], files: dict, named: str
):
    with pytest.raises(ModelLoadError, match=named):
        pooling_spec(_folder(tmp_path, BERT, modules, **files))


def test_a_sentence_transformers_decoder_embeds_by_its_last_token_and_others_are_refused(
    tmp_path: Path,
):
    qwen3 = {"model_type": "qwen3", "architectures": ["Qwen3Model"]}
    pooling = {"1_Pooling__config.json": {"pooling_mode_lasttoken": True}}
    folder = _folder(tmp_path, qwen3, _modules("Transformer", "Pooling", "Normalize"), **pooling)
    assert pooling_spec(folder) == PoolingSpec("embed", "last", True, None, (), causal=True)
    t5 = {"model_type": "t5", "architectures": ["T5EncoderModel"]}
    with pytest.raises(ModelLoadError, match="'t5' is not served"):
        pooling_spec(_folder(tmp_path, t5, _modules("Transformer", "Pooling"), **pooling))


def test_a_decoder_with_hf_overrides_is_a_reranker_and_bad_tokens_are_refused(tmp_path: Path):
    qwen3 = _folder(tmp_path, {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    assert pooling_spec(qwen3) is None  # a model to generate with
    overrides = {"architectures": ["Qwen3ForSequenceClassification"]}
    spec = pooling_spec(qwen3, overrides | {"classifier_from_token": ["no", "yes"]})
    assert spec == PoolingSpec("classify", causal=True, classifier_tokens=("no", "yes"))
    with pytest.raises(ModelLoadError, match="two tokens"):
        pooling_spec(qwen3, overrides | {"classifier_from_token": ["yes"]})


def test_a_generating_model_refuses_hf_overrides_by_name(tiny_model_paths: dict[str, Path]):
    config = EngineConfig(
        model=str(tiny_model_paths["llama"]), hf_overrides='{"max_position_embeddings": 64}'
    )
    assert config.hf_overrides == {"max_position_embeddings": 64}  # JSON text, as flags give it
    with pytest.raises(ConfigError, match="hf_overrides: read for pooling models only"):
        pooling_model(config)


def test_a_pooler_config_makes_a_chat_model_an_embedder_and_overrides_the_folders_pooling(
    tmp_path: Path,
):
    llama = _folder(
        tmp_path / "llama", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    )
    assert pooling_spec(llama) is None  # a model to generate with
    last = PoolingSpec("embed", "last", True, None, (), causal=True)
    assert pooling_spec(llama, pooler={}) == last  # vLLM's default for a decoder: LAST
    mean = pooling_spec(llama, pooler={"pooling_type": "mean", "normalize": False})
    assert mean == PoolingSpec("embed", "mean", False, None, (), causal=True)
    assert pooling_spec(_folder(tmp_path / "bert", BERT), pooler={"pooling_type": "MEAN"}) == (
        PoolingSpec("embed", "mean", True)
    )
    folder = _folder(
        tmp_path / "st", BERT, _modules("Transformer", "Pooling"),
        **{"1_Pooling__config.json": {"pooling_mode_cls_token": True}},
    )  # fmt: skip
    assert pooling_spec(folder) == PoolingSpec("embed", "cls", False)
    assert pooling_spec(folder, pooler={"pooling_type": "LAST", "normalize": True}) == (
        PoolingSpec("embed", "last", True)
    )


@pytest.mark.parametrize(
    ("pooler", "named"),
    [
        ({"pooling_type": "STEP"}, "pooling_type 'STEP' is not served"),
        ({"pooling_type": "CLS"}, "a decoder pools its last token or its mean"),
        ({"softmax": True}, "'softmax' is not served"),
        ({"normalize": "yes"}, "normalize must be true or false"),
    ],
)
def test_what_a_pooler_config_asks_for_and_is_not_served_is_refused_by_name(
    tmp_path: Path, pooler: dict, named: str
):
    llama = _folder(tmp_path, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match=named):
        pooling_spec(llama, pooler=pooler)


def test_a_pooler_config_is_refused_for_a_cross_encoder(tmp_path: Path):
    cross = _folder(
        tmp_path, {"model_type": "bert", "architectures": ["BertForSequenceClassification"]}
    )
    with pytest.raises(ConfigError, match="applies to embedding models"):
        pooling_spec(cross, pooler={"pooling_type": "MEAN"})

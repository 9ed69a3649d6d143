"""LoRA adapters (engine/lora/) on the default model in fp32: each adapter's greedy tokens
equal transformers + peft's `generate()` (the adapter not merged); a step that mixes
three adapters and the base model gives each row the bits it gets alone; an adapter's
blocks never serve another's prompt from the prefix cache; bad adapters are refused by
name when they load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from engine import LLM, SamplingParams
from engine.errors import AdapterError
from tests.support.adapters import save_adapter
from tests.support.greedy import random_prompts, reference_greedy
from tests.support.tiny_models import build_model

pytestmark = pytest.mark.slow

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERY = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
# name -> (rank, target modules, seed)
ADAPTERS = {
    "r8-attn": (8, ATTENTION, 1),
    "r16-all": (16, EVERY, 2),
    "r8-mlp": (8, ["up_proj", "down_proj"], 3),
}
SETTINGS = dict(
    dtype="float32", quantization="none", max_model_len=512, max_num_batched_tokens=64,
    kv_cache_memory="128MiB", max_loras=4, max_lora_rank=16,
)  # fmt: skip
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(default_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_adapter(default_model.model, root / name, rank, targets, seed, scale=0.5)
        for name, (rank, targets, seed) in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def llm(adapters: dict[str, Path]) -> LLM:
    return LLM(
        "default", lora_modules={name: str(path) for name, path in adapters.items()}, **SETTINGS
    )


def greedy(llm: LLM, prompts: list, loras: list, logprobs: int | None = None) -> list:
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
    )
    outputs = llm.generate(prompts, params, use_tqdm=False, lora=loras)
    return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in outputs]


def test_each_adapter_gives_peft_s_tokens(
    default_model, adapters: dict[str, Path], llm: LLM
) -> None:
    prompts = random_prompts(default_model.model.config.vocab_size, lengths=(5, 40))
    base = reference_greedy(default_model.model, prompts, MAX_TOKENS)
    for name, folder in adapters.items():
        peft_model = PeftModel.from_pretrained(default_model.model, folder).eval()
        try:
            # peft put its LoRA layers into the model's own modules: its generate() runs
            # them (and honours the neutral generation config `reference_greedy` sets).
            expected = reference_greedy(default_model.model, prompts, MAX_TOKENS)
        finally:
            peft_model.unload()
        assert expected != base, name  # the adapter changes the output
        tokens = [ids for ids, _ in greedy(llm, prompts, [name] * len(prompts))]
        assert tokens == expected, name
    assert [ids for ids, _ in greedy(llm, prompts, [None] * len(prompts))] == base


def test_a_step_of_three_adapters_and_the_base_gives_each_row_its_bits_alone(
    default_model, llm: LLM
) -> None:
    prompts = random_prompts(default_model.model.config.vocab_size, lengths=(9, 23, 17, 30), seed=5)
    loras = ["r8-attn", "r16-all", None, "r8-mlp"]
    alone = [
        greedy(llm, [prompt], [lora], logprobs=3)[0]
        for prompt, lora in zip(prompts, loras, strict=True)
    ]
    together = greedy(llm, prompts * 2, loras * 2, logprobs=3)
    assert together == alone * 2


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(default_model, llm: LLM) -> None:
    prompt = random_prompts(default_model.model.config.vocab_size, lengths=(64,), seed=9)
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(prompt, params, use_tqdm=False, lora=["r8-attn"])[0]
    assert first.num_cached_tokens == 0
    again = llm.generate(prompt, params, use_tqdm=False, lora=["r8-attn"])[0]
    assert again.num_cached_tokens >= 48  # its own blocks
    for other in ("r16-all", None):
        assert llm.generate(prompt, params, use_tqdm=False, lora=[other])[0].num_cached_tokens == 0


def test_bad_adapters_are_refused_by_name(
    default_model, adapters: dict[str, Path], tmp_path: Path
) -> None:
    tiny = build_model(tmp_path / "tiny", "llama")
    from transformers import AutoModelForCausalLM

    tiny_model = AutoModelForCausalLM.from_pretrained(tiny)
    foreign = save_adapter(tiny_model, tmp_path / "foreign", 8, ATTENTION, 4)
    dora = tmp_path / "dora"
    dora.mkdir()
    for file in adapters["r8-attn"].iterdir():
        (dora / file.name).write_bytes(file.read_bytes())
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    lm_head = save_adapter(default_model.model, tmp_path / "lm_head", 8, ["lm_head"], 5)
    cases = {
        str(tmp_path / "missing"): "adapter_config.json",
        str(adapters["r16-all"]): "above max_lora_rank",
        str(foreign): "does not fit this base model",
        str(dora): "use_dora",
        str(lm_head): "lm_head",
    }
    for path, named in cases.items():
        with pytest.raises(AdapterError, match=named):
            LLM("default", lora_modules={"bad": path}, **(SETTINGS | {"max_lora_rank": 8}))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_adapters_run_in_the_compiled_forward_over_any_linear(
    tiny_model_paths: dict[str, Path], tmp_path: Path, quantization: str
) -> None:
    """The tiny Llama's adapters, compiled against eager, over plain and int8 linears."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_paths["llama"], dtype=torch.float32)
    modules = {
        name: str(save_adapter(model, tmp_path / name, rank, EVERY, seed, scale=1.0))
        for name, rank, seed in (("a", 8, 1), ("b", 16, 2))
    }
    settings = dict(dtype="float32", kv_cache_memory="16MiB", quantization=quantization,
                    lora_modules=modules)  # fmt: skip
    prompts = random_prompts(model.config.vocab_size, lengths=(7, 30, 12), seed=3)
    loras = ["a", "b", None]
    eager = greedy(
        LLM(str(tiny_model_paths["llama"]), enforce_eager=True, **settings), prompts, loras
    )
    compiled_llm = LLM(str(tiny_model_paths["llama"]), enforce_eager=False, **settings)
    assert compiled_llm.engine.runner.executor.name == "compiled"
    compiled = greedy(compiled_llm, prompts, loras)
    assert [ids for ids, _ in compiled] == [ids for ids, _ in eager]
    assert len({tuple(ids) for ids, _ in compiled}) == 3

"""The offline API: prompts of every shape, chat, stops, samples, seeds and logprobs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import EngineError, UnsupportedModelError
from engine.model.attention_backend import unavailable_reason


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def llm(tiny_model_paths: dict[str, Path], request: pytest.FixtureRequest) -> LLM:
    """The engine as it runs on the CPU, and with async scheduling (CUDA's default: the
    next step launched before this one's text)."""
    return LLM(
        str(tiny_model_paths["llama"]), dtype="float32", kv_cache_memory="16MiB",
        async_scheduling=request.param,
    )  # fmt: skip


def test_prompt_shapes_give_one_output_each(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The quick brown fox")
    single = llm.generate("The quick brown fox", params, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt == "The quick brown fox"
    by_ids = llm.generate(ids, params, use_tqdm=False)
    assert by_ids[0].prompt is None and by_ids[0].prompt_token_ids == ids
    assert by_ids[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    several = llm.generate(["a", "bb", ids], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in several] == [5, 5, 5]
    assert several[2].outputs[0].text == tokenizer.decode(several[2].outputs[0].token_ids)
    assert all(o.outputs[0].finish_reason == "length" for o in several)


def test_stop_string_cuts_text_and_reports_reason(llm: LLM):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate("Paged attention", greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[5:8]
    assert stop and stop not in text[:5]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    output = llm.generate("Paged attention", params, use_tqdm=False)[0].outputs[0]
    assert output.text == text[: text.index(stop)]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)


def test_eos_and_stop_token_ids_end_generation(llm: LLM):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate("Héllo", greedy, use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tokens[3]])
    output = llm.generate("Héllo", params, use_tqdm=False)[0].outputs[0]
    first = tokens.index(tokens[3])
    assert output.token_ids == tokens[: first + 1]
    assert output.stop_reason == tokens[3]


def test_seeded_samples_are_reproducible_across_batch_mixes(llm: LLM):
    seeded = SamplingParams(temperature=1.0, max_tokens=10, seed=7, n=2, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    alone = llm.generate("Continuous batching", seeded, use_tqdm=False)[0]
    mixed = llm.generate(
        ["noise one", "Continuous batching", "noise two two"], [other, seeded, other],
        use_tqdm=False,
    )[1]  # fmt: skip
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in mixed.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids


def test_logprobs_are_reported_per_token(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    output = llm.generate("def main", params, use_tqdm=False)[0].outputs[0]
    assert output.logprobs is not None and len(output.logprobs) == 4
    for token, entry in zip(output.token_ids, output.logprobs, strict=True):
        assert entry.token_id == token
        assert len(entry.top) == 3 and entry.top[0][0] == token  # greedy picks the best
        assert entry.logprob <= 0
        # Token texts are decoded by the engine, each token alone.
        decode = llm.get_tokenizer().decode
        assert entry.token == decode([token])
        assert entry.top_tokens == [decode([top_id]) for top_id, _ in entry.top]


def test_the_engine_seed_makes_unseeded_sampling_repeatable(tiny_model_paths: dict[str, Path]):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=2)
    prompts = ["Continuous batching", "Paged attention"]

    def sampled(seed: int) -> list[list[int]]:
        llm = LLM(
            str(tiny_model_paths["llama"]), dtype="float32", kv_cache_memory="16MiB", seed=seed
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [c.token_ids for o in outputs for c in o.outputs]

    first = sampled(7)
    assert sampled(7) == first
    assert sampled(8) != first


def test_chat_uses_the_template(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    messages = [{"role": "user", "content": "hi"}]
    output = llm.chat(messages, params, use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert output.prompt_token_ids == list(expected)


def test_invalid_requests_are_refused(llm: LLM):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate("x", SamplingParams(max_tokens=10**6), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10**7]], SamplingParams(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_an_attention_argument_paged_attention_lacks_stops_the_load(
    tiny_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
):
    # As if a transformers upgrade passed a new argument: refused by name at load.
    from transformers.models.llama.modeling_llama import LlamaAttention

    forward = LlamaAttention.forward

    def with_new_argument(self, *args, **kwargs):
        return forward(self, *args, attention_temperature=0.5, **kwargs)

    monkeypatch.setattr(LlamaAttention, "forward", with_new_argument)
    with pytest.raises(UnsupportedModelError, match=r"\(llama\).*`attention_temperature`"):
        LLM(str(tiny_model_paths["llama"]), dtype="float32", kv_cache_memory="16MiB")


def test_a_failed_request_raises_instead_of_returning_empty(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
):
    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with monkeypatch.context() as patch:
        patch.setattr(llm.engine.runner, "execute", broken)
        with pytest.raises(EngineError, match="the device fell over"):
            llm.generate(["a", "bb"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate("a", params, use_tqdm=False)[0].outputs[0].token_ids) == 5


@pytest.mark.slow
def test_default_model_chat_answers_paris():
    # "What is the capital of France?" is a near tie at greedy between "The" and "L'Étoile"
    # once the linears quantize their inputs to int8 (llama-server answers "L'Étoile" on
    # the same GGUF); this one is not: llama-server and pagedserve, fp32 and bf16, say Paris.
    llm = LLM("default", max_model_len=512, kv_cache_memory="256MiB", dtype="float32")
    messages = [{"role": "user", "content": "Name the capital of France."}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"


def test_unchunked_prefill_needs_a_budget_for_the_longest_prompt(tiny_model_paths):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(
            str(tiny_model_paths["llama"]), dtype="float32", kv_cache_memory="16MiB",
            enable_chunked_prefill=False, max_model_len=512, max_num_batched_tokens=256,
        )  # fmt: skip


def test_auto_backend_runs_decode_through_the_cpp_kernel(llm: LLM):
    engine = llm.engine
    reason = unavailable_reason("cpp", engine.device, engine.dtype, 32, engine.block_size)
    if reason is not None:
        pytest.skip(f"C++ kernel unavailable: {reason}")
    assert engine.attention.backend.name == "cpp" and not engine.attention.passed_over
    assert engine.model.config._attn_implementation == "pagedserve_cpp_cpu"


def test_engine_outputs_carry_only_what_each_step_added(llm: LLM):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    engine.add_request("deltas", engine.processor.from_prompt("Paged attention", params))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    sample_outputs = [output.outputs[0] for output in outputs]
    assert all(len(o.token_ids) <= 1 for o in sample_outputs)  # one token a step, never all
    assert all(len(o.logprobs or []) == len(o.token_ids) for o in sample_outputs)
    whole = llm.generate("Paged attention", params, use_tqdm=False)[0].outputs[0]
    assert [t for o in sample_outputs for t in o.token_ids] == whole.token_ids
    assert "".join(o.text for o in sample_outputs) == whole.text


def test_request_limits_are_the_engines_settings(tiny_model_paths: dict[str, Path], llm: LLM):
    """`LLM(max_stop_sequences=...)` bounds its own requests, as the server's setting bounds
    the server's: a lowered setting refuses what the default allows, a raised one accepts
    what the default refuses."""
    stops = [f"never{i}" for i in range(80)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, stop=stops)
    with pytest.raises(ValueError, match=r"^stop must hold at most 64 .*max_stop_sequences"):
        llm.generate("a", params, use_tqdm=False)
    model = str(tiny_model_paths["llama"])
    raised = LLM(model, dtype="float32", kv_cache_memory="16MiB", max_stop_sequences=100)
    [output] = raised.generate("a", params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3
    lowered = LLM(model, dtype="float32", kv_cache_memory="16MiB", max_stop_sequences=2)
    with pytest.raises(ValueError, match=r"^stop must hold at most 2 .*max_stop_sequences"):
        lowered.generate("a", dataclasses.replace(params, stop=stops[:3]), use_tqdm=False)
    assert not lowered.engine.has_unfinished_requests()
    lowered.generate("a", dataclasses.replace(params, stop=stops[:2]), use_tqdm=False)

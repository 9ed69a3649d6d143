"""Prompt logprobs equal transformers' fp32 log_softmax of the model's logits, whole
prompt at once, chunked, and after another request cached the prompt's prefix."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.support.greedy import random_prompts

TOP = 3
SETTINGS = {
    "one-chunk": dict(max_num_batched_tokens=2048),
    "chunked": dict(max_num_batched_tokens=7),
}


def reference(path, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every prompt position, fp32, one forward."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def free_blocks(llm: LLM) -> int:
    return llm.engine.scheduler.block_manager.num_free_blocks


def check(entries, prompt: list[int], expected: torch.Tensor, top: int = TOP) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        row = expected[i - 1]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        values, ids = row.topk(top)
        assert [token for token, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert entry.token and len(entry.top_tokens) == top


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_prompt_logprobs_match_transformers(tiny_model_paths, setting):
    path = tiny_model_paths["llama"]
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="4MiB", **SETTINGS[setting])
    free = free_blocks(llm)
    prompt, other = random_prompts(llm.engine.vocab_size, lengths=(30, 9), seed=3)
    expected = reference(path, prompt)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP, logprobs=1)
    # The first request caches the prompt's prefix; the second would hit it, and instead
    # computes every position: its prompt logprobs stay whole and exact.
    first = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt[:24] + other], first, use_tqdm=False)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    check(out.prompt_logprobs, prompt, expected)
    assert out.num_cached_tokens == 0
    assert len(out.outputs[0].token_ids) == 3  # sampling is unchanged
    # A request without them still takes the hit, and no block leaks.
    (again,) = llm.generate([prompt], first, use_tqdm=False)
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None
    assert free_blocks(llm) == free


def test_prompt_logprobs_with_n_and_a_one_token_prompt(tiny_model_paths):
    path = tiny_model_paths["qwen3"]
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="4MiB",
              max_num_batched_tokens=5)  # fmt: skip
    free = free_blocks(llm)
    (prompt,) = random_prompts(llm.engine.vocab_size, lengths=(13,), seed=4)
    params = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=2, prompt_logprobs=TOP)
    short, out = llm.generate([[prompt[0]], prompt], params, use_tqdm=False)
    assert short.prompt_logprobs == [None]
    check(out.prompt_logprobs, prompt, reference(path, prompt))
    assert all(len(sample.token_ids) == 2 for sample in out.outputs)
    assert free_blocks(llm) == free


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range(value):
    with pytest.raises(ValueError, match=r"^prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


@pytest.mark.slow
def test_prompt_logprobs_on_the_compiled_forward_beside_drafts(tiny_model_paths):
    """The compiled forward, with n-gram drafts: a repetitive prompt decodes with drafts
    while another request's chunked prefill computes its prompt logprobs in the same steps;
    both requests' tokens are those of an eager engine without prompt logprobs."""
    path = tiny_model_paths["llama"]
    settings = dict(dtype="float32", block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=9)
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    compiled = LLM(str(path), enforce_eager=False, speculative_config=speculative, **settings)
    assert compiled.engine.runner.executor.name == "compiled"
    free = free_blocks(compiled)
    vocab = compiled.engine.vocab_size
    repetitive = random_prompts(vocab, lengths=(4,), seed=5)[0] * 4
    (prompt,) = random_prompts(vocab, lengths=(40,), seed=6)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    got = compiled.generate([repetitive, prompt], [plain, with_logprobs], use_tqdm=False)
    check(got[1].prompt_logprobs, prompt, reference(path, prompt), top=2)
    eager = LLM(str(path), **settings).generate([repetitive, prompt], plain, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in eager]
    assert compiled.engine.speculator.stats.num_draft_tokens > 0
    assert free_blocks(compiled) == free

"""A hybrid model's recurrent state in the engine: prefix hits resume from checkpoints
with the bits of a cold run (also once a checkpoint is evicted), chat turns get
checkpoints where the next request parts, preemption and aborts leave every block and
state slot free, state slots bound how many sequences run, and what cannot carry the
state (speculative decoding, the disk tier) steps aside. A tiny Qwen3.5 (Gated DeltaNet
beside gated attention) served as `make serve` serves: compiled, its C++ kernels."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.request.intake import EngineRequest
from tests.support.architectures import HYBRID, build

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly. " * 24}
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
BUDGET = 32 * 2**20
SETTINGS = {"dtype": "float32", "kv_cache_memory": BUDGET, "max_model_len": 2048}
# One sequence's state: one Gated DeltaNet layer's convolution window (3 x 256 channels)
# and matrix (4 heads x 32 x 32), fp32.
STATE_BYTES = (3 * 256 + 4 * 32 * 32) * 4


def slots(count: int) -> float:
    """The `state_share` of `BUDGET` that holds `count` state slots."""
    return (count * STATE_BYTES + 1) / BUDGET


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("hybrid") / "qwen3_5", *HYBRID["qwen3_5"])


def _chat(llm: LLM, messages: list[dict]) -> tuple[list[int], list[float], int, int]:
    """Token ids, logprobs, cached and prompt tokens of one greedy chat."""
    output = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    sample = output.outputs[0]
    logprobs = [entry.logprob for entry in sample.logprobs]
    return sample.token_ids, logprobs, output.num_cached_tokens, len(output.prompt_token_ids)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_prefix_hits_resume_from_checkpoints_with_a_cold_runs_bits(qwen3_5: Path) -> None:
    warm = LLM(str(qwen3_5), **SETTINGS)
    first = _chat(warm, [SYSTEM, _user("What is the capital of France?")])
    assert first[2] == 0
    # Another question on the same system prompt: resumed at the block where the first
    # user message began, so at most one block and the new text are computed.
    second_messages = [SYSTEM, _user("Name a prime number.")]
    second = _chat(warm, second_messages)
    new_text = len(warm.get_tokenizer().encode("Name a prime number.<|im_end|>\n"))
    assert second[3] - second[2] <= new_text + 3 + 16  # + the assistant's opening, a block
    # The next turn of the first conversation resumes where its prompt ended.
    reply = warm.get_tokenizer().decode(first[0])
    answer = {"role": "assistant", "content": reply}
    third_messages = [SYSTEM, _user("What is the capital of France?"), answer, _user("And Spain?")]
    third = _chat(warm, third_messages)
    assert third[2] >= first[3] // 16 * 16 - 16
    for messages, hit in ((second_messages, second), (third_messages, third)):
        cold = _chat(LLM(str(qwen3_5), **SETTINGS), messages)
        assert cold[2] == 0 and (hit[0], hit[1]) == (cold[0], cold[1])


def test_a_hit_after_its_checkpoint_is_evicted_has_the_same_bits(qwen3_5: Path) -> None:
    # Two state slots: the running sequence's and one checkpoint.
    llm = LLM(str(qwen3_5), **SETTINGS, max_num_seqs=1, state_share=slots(2))
    assert llm.engine.recurrent.bytes_per_slot == STATE_BYTES
    assert llm.engine.num_state_slots == 2
    prompt = list(range(10, 90))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)

    def run(tokens: list[int]) -> tuple[list[int], list[float], int]:
        output = llm.generate([tokens], params, use_tqdm=False)[0]
        sample = output.outputs[0]
        return sample.token_ids, [e.logprob for e in sample.logprobs], output.num_cached_tokens

    cold = run(prompt)
    hit = run(prompt)
    assert hit[2] == 64 and hit[:2] == cold[:2]
    run(list(range(100, 180)))  # its checkpoint takes the only checkpoint slot
    evicted = run(prompt)
    assert evicted[2] == 0 and evicted[:2] == cold[:2]


def test_preemption_and_aborts_leave_every_block_and_slot_free(qwen3_5: Path) -> None:
    # 20 blocks of 16 tokens (one attention layer's K and V, 2 heads of 32) for four
    # sequences of 210 tokens, and 8 state slots.
    budget = 20 * 2 * 16 * 2 * 32 * 4 + 8 * STATE_BYTES
    llm = LLM(
        str(qwen3_5), dtype="float32", kv_cache_memory=budget, max_model_len=256,
        max_num_seqs=4, state_share=(8 * STATE_BYTES + 1) / budget, watermark=0,
    )  # fmt: skip
    engine = llm.engine
    assert engine.num_kv_blocks == 20 and engine.num_state_slots == 8
    manager = engine.scheduler.block_manager
    pool = manager.state_pool
    assert pool is not None and pool.num_slots == engine.num_state_slots
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [list(range(3 + i, 150 + i)) for i in range(6)]
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", engine.processor.from_prompt(prompt, params))
    for _ in range(30):
        engine.step()
    engine.abort_request("r1")
    engine.abort_request("r4")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert manager.stats().used_blocks == 0 and pool.num_live == 0
    assert pool.num_available == pool.num_slots


def test_state_slots_bound_the_running_sequences(qwen3_5: Path) -> None:
    llm = LLM(str(qwen3_5), **SETTINGS, max_num_seqs=4, state_share=slots(2))
    engine = llm.engine
    assert engine.num_state_slots == 2
    requests = [engine.processor.from_prompt(list(range(5 + i, 40 + i)), PARAMS) for i in range(6)]
    alone = [llm.generate([r.prompt_token_ids], PARAMS, use_tqdm=False)[0] for r in requests]
    together = llm.generate([r.prompt_token_ids for r in requests], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_speculative_decoding_and_the_disk_tier_step_aside(
    qwen3_5: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        llm = LLM(
            str(qwen3_5), **SETTINGS, kv_disk_size="64MiB", kv_disk_path=str(tmp_path),
            speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        )  # fmt: skip
    assert llm.engine.speculator is None and llm.engine.tier is None
    assert "speculative decoding off" in caplog.text and "KV tier off" in caplog.text


def test_turn_starts_are_where_a_changed_conversation_parts(qwen3_5: Path) -> None:
    llm = LLM(str(qwen3_5), **SETTINGS)
    messages = [SYSTEM, _user("first"), {"role": "assistant", "content": "ok"}, _user("last")]
    request: EngineRequest = llm.engine.processor.from_chat(messages, PARAMS)
    tokenizer = llm.get_tokenizer()
    prompt = request.prompt_token_ids
    first, last, opening = request.checkpoint_positions
    assert tokenizer.decode(prompt[first:]).startswith("first")
    assert tokenizer.decode(prompt[last:]).startswith("last")
    assert tokenizer.decode(prompt[opening:]) == "<|im_start|>assistant\n"


def test_sleep_gives_back_the_state_slots_and_the_next_request_is_unchanged(
    qwen3_5: Path,
) -> None:
    llm = LLM(str(qwen3_5), **SETTINGS)
    messages = [SYSTEM, _user("Hello")]
    before = _chat(llm, messages)
    states = llm.engine.runner.eager.states
    assert states is not None and torch.count_nonzero(states.ssm) > 0
    llm.engine.sleep(1)
    assert all(torch.count_nonzero(tensor) == 0 for tensor in states.tensors())
    llm.engine.wake_up()
    after = _chat(llm, messages)
    assert after[2] == 0 and after[:2] == before[:2]  # the checkpoints went with the pages


def test_the_next_turn_resumes_after_the_reply_with_a_cold_runs_bits(qwen3_5: Path) -> None:
    """A conversation's next prompt holds this turn's reply as generated: generating leaves
    a checkpoint at each block's end, the last one kept, so the next turn resumes there."""
    llm = LLM(str(qwen3_5), **SETTINGS)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    prompt = list(range(10, 60))
    reply = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    computed = len(prompt) + len(reply) - 1  # the last token was sampled, not computed
    pool = llm.engine.scheduler.block_manager.state_pool
    assert pool is not None and pool.num_checkpoints == 2  # before the last token, latest
    turn = [*prompt, *reply, 7, 8, 9, 10, 11]
    warm = llm.generate([turn], params, use_tqdm=False)[0]
    assert warm.num_cached_tokens == computed // 16 * 16
    cold = LLM(str(qwen3_5), **SETTINGS).generate([turn], params, use_tqdm=False)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert [e.logprob for e in warm.outputs[0].logprobs] == [
        e.logprob for e in cold.outputs[0].logprobs
    ]

"""The router's parts that need no Ray: its prediction of the replicas' caches, the
routing decision, the prompt hashes it routes by, and the merged /metrics."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from cache.block import extend_block_hashes
from cache.block_manager import BlockManager
from engine.request.intake import RequestProcessor
from engine.sampling.params import SamplingParams
from scale_out.metrics import merge_replica_metrics
from scale_out.policy import preferred_replicas
from scale_out.prefix_index import PrefixIndex
from scale_out.prompt_hashes import PromptHasher
from server.capabilities import tool_calling
from tests.server.conftest import QWEN3_TEMPLATE

BLOCK = 4


def chain(tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BLOCK)
    return hashes


def test_a_match_is_the_leading_blocks_the_replica_holds() -> None:
    index = PrefixIndex()
    shared = list(range(12))
    index.record("a", chain([*shared, 50, 51, 52, 53]), capacity=None)
    assert index.matched_blocks("a", chain([*shared, 60, 61, 62, 63])) == 3
    assert index.matched_blocks("a", chain([*shared, 50, 51, 52, 53, 9])) == 4
    assert index.matched_blocks("b", chain(shared)) == 0
    assert index.matched_blocks("a", chain([99, *shared])) == 0


def test_the_index_evicts_as_the_block_manager_does() -> None:
    """With the replica's capacity, the index keeps exactly the blocks the replica's own
    cache still holds after the same prompts ran one after another."""
    manager = BlockManager(num_blocks=6, block_size=BLOCK, watermark=0)
    index = PrefixIndex()
    prompts = [[p * 100 + i for i in range(4 * BLOCK)] for p in range(3)]
    for number, tokens in enumerate([*prompts, prompts[0]]):
        manager.allocate(f"s{number}", tokens)
        manager.cache_full_blocks(f"s{number}", tokens, len(tokens))
        manager.free(f"s{number}")
        index.record("r", chain(tokens), capacity=6)
    held = []
    for tokens in prompts:
        probe = copy.deepcopy(manager)  # a lookup that takes blocks would evict some
        held.append(probe.allocate("probe", [*tokens, -1]) // BLOCK)
    assert held == [4, 0, 2]  # prompt 0 ran last; prompt 2's tail went to make room for it
    assert [index.matched_blocks("r", chain(tokens)) for tokens in prompts] == held
    assert index.size("r") == 6
    index.retain(["other"])
    assert index.size("r") == 0


def test_balanced_load_goes_to_the_longest_match() -> None:
    choose = {"imbalance_threshold": 4, "min_match_ratio": 0.5}
    loads = {"a": 3, "b": 0}
    assert preferred_replicas(loads, {"a": 5, "b": 2}, {}, 8, **choose) == ["a"]
    assert preferred_replicas(loads, {"a": 5, "b": 5}, {}, 8, **choose) == ["a", "b"]


def test_unbalanced_load_goes_to_the_least_loaded() -> None:
    choose = {"imbalance_threshold": 4, "min_match_ratio": 0.5}
    loads = {"a": 9, "b": 2, "c": 2}
    assert preferred_replicas(loads, {"a": 5}, {}, 5, **choose) == ["b", "c"]


def test_a_new_prefix_goes_to_the_least_loaded_then_the_emptiest() -> None:
    choose = {"imbalance_threshold": 4, "min_match_ratio": 0.5}
    sizes = {"a": 10, "b": 3, "c": 0}
    # One block of eight in common (a chat template's preamble) is not a match worth it.
    assert preferred_replicas({"a": 1, "b": 1, "c": 2}, {"a": 1}, sizes, 8, **choose) == ["b"]
    assert preferred_replicas({"a": 0, "b": 0, "c": 0}, {}, sizes, 8, **choose) == ["c"]
    assert preferred_replicas({}, {}, {}, 8, **choose) == []


@pytest.fixture(scope="module")
def hasher(tiny_model_paths: dict[str, Path]) -> PromptHasher:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_paths["llama"])
    processor = RequestProcessor(tokenizer, len(tokenizer), 512)
    return PromptHasher(processor, lambda: tool_calling("auto", tokenizer.chat_template), BLOCK)


def hashes(hasher: PromptHasher, path: str, body: bytes) -> tuple[int, ...]:
    rendered = hasher.render(path, body)
    return () if rendered is None else rendered.block_hashes


def test_prompt_hashes_are_the_replicas_block_hashes(hasher: PromptHasher) -> None:
    processor, params = hasher.processor, SamplingParams(max_tokens=1)
    text = "The quick brown fox jumps over the lazy dog. " * 3
    completion = json.dumps({"model": "m", "prompt": [text, "other"]}).encode()
    expected = chain(processor.from_prompt(text, params).prompt_token_ids)
    assert list(hashes(hasher, "/v1/completions", completion)) == expected
    ids = json.dumps({"model": "m", "prompt": list(range(9))}).encode()
    assert list(hashes(hasher, "/v1/completions", ids)) == chain(list(range(9)))
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "Hi"}]
    chat = json.dumps({"model": "m", "messages": messages}).encode()
    rendered = processor.from_chat(messages, params).prompt_token_ids
    prompt = hasher.render("/v1/chat/completions", chat)
    assert prompt is not None and prompt.block_size == BLOCK
    assert list(prompt.token_ids) == rendered  # what the replica takes instead of rendering
    assert list(prompt.block_hashes) == chain(rendered)


def test_a_chat_with_tools_hashes_the_conversation_the_server_renders(
    hasher: PromptHasher,
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plain = {"model": "m", "messages": [{"role": "user", "content": "Hi there, how are you?"}]}
    with_tools = json.dumps({**plain, "tools": [tool]}).encode()
    # The tiny template ignores `tools`: the server describes them in a system message.
    assert (
        hashes(hasher, "/v1/chat/completions", with_tools)[:2]
        != hashes(hasher, "/v1/chat/completions", json.dumps(plain).encode())[:2]
    )


def test_a_chats_template_variables_render_at_the_ingress(
    tiny_model_paths: dict[str, Path],
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_paths["llama"])
    tokenizer.chat_template = QWEN3_TEMPLATE  # it reads `enable_thinking`
    processor = RequestProcessor(tokenizer, len(tokenizer), 512)
    hasher = PromptHasher(processor, lambda: tool_calling("auto", tokenizer.chat_template), BLOCK)
    messages = [{"role": "user", "content": "Hi"}]
    off = {"enable_thinking": False}
    body = {"model": "m", "messages": messages, "chat_template_kwargs": off}
    prompt = hasher.render("/v1/chat/completions", json.dumps(body).encode())
    assert prompt is not None
    assert list(prompt.token_ids) == processor.render_chat(messages, template_kwargs=off)
    assert list(prompt.token_ids) != processor.render_chat(messages)


def test_requests_the_server_refuses_or_does_not_run_have_no_prompt(hasher: PromptHasher) -> None:
    assert hasher.render("/v1/completions", b"{not json") is None
    assert hasher.render("/v1/completions", b'{"model": "m", "prompt": 5}') is None
    assert hasher.render("/tokenize", b'{"model": "m", "prompt": "Hello there"}') is None


def test_merged_metrics_label_each_replicas_samples() -> None:
    def exposition(value: float) -> str:
        registry = CollectorRegistry()
        Counter("pagedserve_prompt_tokens", "Prompt tokens.", registry=registry).inc(value)
        gauge = Gauge("vllm:num_requests_running", "Running.", ["model_name"], registry=registry)
        gauge.labels("tiny").set(value)
        return generate_latest(registry).decode()

    merged = merge_replica_metrics({"r1": exposition(3), "r2": exposition(5)}).decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(merged)
        for sample in family.samples
    }
    assert samples[("pagedserve_prompt_tokens_total", (("replica", "r1"),))] == 3
    assert samples[("pagedserve_prompt_tokens_total", (("replica", "r2"),))] == 5
    running = ("vllm:num_requests_running", (("model_name", "tiny"), ("replica", "r2")))
    assert samples[running] == 5
    assert merged.count("# TYPE pagedserve_prompt_tokens_total counter") == 1


def test_the_event_index_follows_a_replica_s_own_events() -> None:
    """What a replica publishes (its KV tensor's and its disk tier's blocks) is what the
    router predicts for it: a block evicted from RAM still matches while the disk holds it."""
    pytest.importorskip("zmq")
    from cache import AllBlocksCleared, BlockRemoved, BlockStored
    from engine.kv_events.zmq_publisher import ZmqEventPublisher
    from engine.kv_events_config import KVEventsConfig
    from scale_out.event_index import EventIndex
    from tests.support.kv_events import free_endpoint

    endpoint = free_endpoint()
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    index = EventIndex()
    index.follow("a", endpoint)
    tokens = list(range(4 * BLOCK))
    hashes = chain(tokens)

    def settle(expected: int, events: list) -> None:
        """Publish `events` until the index shows them (again and again at first: ZMQ's
        slow joiner drops what is sent before the subscription reaches the publisher)."""
        for _ in range(100):
            publisher.publish(events)
            time.sleep(0.05)
            if index.matched_blocks("a", hashes) == expected:
                return
        raise AssertionError(f"matched {index.matched_blocks('a', hashes)}, not {expected}")

    def stored(medium: str) -> BlockStored:
        return BlockStored(tuple(hashes), None, tuple(tokens), BLOCK, medium)

    settle(4, [stored("CPU")])
    settle(4, [stored("DISK"), BlockRemoved(tuple(hashes[1:]), "CPU")])  # on disk still
    settle(2, [BlockRemoved(tuple(hashes[2:]), "DISK")])
    assert index.size("a") == 2 and index.matched_blocks("b", hashes) == 0
    settle(0, [AllBlocksCleared("CPU")])
    index.retain(["b"])
    assert not index.follows("a")
    index.close()
    publisher.close()


def test_a_router_that_follows_late_replays_what_it_missed() -> None:
    pytest.importorskip("zmq")
    from cache import BlockStored
    from engine.kv_events.zmq_publisher import ZmqEventPublisher
    from engine.kv_events_config import KVEventsConfig
    from scale_out.event_index import EventIndex
    from tests.support.kv_events import free_endpoint

    endpoint, replay = free_endpoint(), free_endpoint()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay)
    publisher = ZmqEventPublisher(config)
    tokens = list(range(3 * BLOCK))
    hashes = chain(tokens)
    publisher.publish([BlockStored(tuple(hashes), None, tuple(tokens), BLOCK, "DISK")])
    time.sleep(0.2)  # sent and buffered before anyone subscribed
    index = EventIndex()
    index.follow("a", endpoint, replay)
    for _ in range(100):
        if index.matched_blocks("a", hashes) == 3:
            break
        time.sleep(0.05)
    assert index.matched_blocks("a", hashes) == 3
    index.close()
    publisher.close()

"""KV events from a serving server, read by a real ZMQ subscriber (pyzmq, msgpack) as a
router reads vLLM's: BlockStored carries the prompt's tokens block by block under hashes a
router computes from token ids alone, parents chain, the disk tier's copies come as their
own medium, evictions follow as BlockRemoved, sequence numbers count up, and a replay
returns what a late subscriber missed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from cache import hash_block
from tests.server.conftest import live_server, tiny_config
from tests.support.kv_events import free_endpoint, receive

BLOCK = 16
END = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture(scope="module")
def events_server(
    tiny_model_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, str]]:
    endpoint, replay = free_endpoint(), free_endpoint()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay, "topic": "kv"}  # fmt: skip
    config = tiny_config(
        tiny_model_paths["llama"], kv_cache_memory="256KiB", max_model_len=128,
        kv_disk_size="16MiB", kv_disk_path=str(tmp_path_factory.mktemp("kv")),
        kv_events_config=events,
    )  # fmt: skip
    with live_server(config) as url:
        yield url, endpoint, replay


def complete(url: str, tokens: list[int]) -> None:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": tokens, "max_tokens": 2, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_subscriber_sees_the_blocks_of_each_tier(events_server: tuple[str, str, str]) -> None:
    url, endpoint, replay_endpoint = events_server
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.5)  # ZMQ's slow joiner: the subscription reaches the publisher
    prompt = [(7 * i) % 200 + 10 for i in range(70)]  # 4 full blocks and 6 tokens
    complete(url, prompt)
    batches = receive(sub)
    numbers = [seq for seq, _ in batches]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    events = [event for _, batch in batches for event in batch]
    by_medium: dict[str, list[list[Any]]] = {}
    for event in events:
        if event[0] == "BlockStored":
            assert len(event) == 8 and event[4] == BLOCK and event[5] is None
            by_medium.setdefault(event[6], []).append(event)
    for medium in ("CPU", "DISK"):
        stored = by_medium[medium]
        hashes = [h for event in stored for h in event[1]]
        tokens = [t for event in stored for t in event[3]]
        assert tokens == prompt[: len(tokens)] and len(tokens) >= 4 * BLOCK
        # A router computes the hashes from token ids: chained xxh3 over each block.
        parent = None
        for index, block_hash in enumerate(hashes):
            assert block_hash == hash_block(parent, prompt[index * BLOCK : (index + 1) * BLOCK])
            parent = block_hash
        assert stored[0][2] is None  # the prompt's first block has no parent

    # Other prompts push the first out of the 16-block KV tensor: BlockRemoved follows.
    for start in range(3):
        complete(url, [(11 * i + start) % 300 + 5 for i in range(100)])
    later = receive(sub)
    removed = [h for _, batch in later for event in batch if event[0] == "BlockRemoved"
               and event[2] == "CPU" for h in event[1]]  # fmt: skip
    first_hashes = [h for event in by_medium["CPU"] for h in event[1]]
    assert set(first_hashes) <= set(removed)
    assert later[0][0] == batches[-1][0] + 1

    # A subscriber that missed everything asks for a replay from the first batch on.
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", numbers[0].to_bytes(8, "big")])
    replayed = []
    while dealer.poll(5000):
        _, seq, payload = dealer.recv_multipart()
        if seq == END:
            break
        replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
    assert replayed == batches + later
    for client in (sub, dealer):
        client.close(linger=0)

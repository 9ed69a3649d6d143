"""The torch thread: every engine of a process computes on one thread, so the process
keeps one pool of OpenMP workers however many models it serves."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine import torch_thread

REPOSITORY = Path(__file__).resolve().parents[2]


def test_calls_from_any_thread_run_on_one_thread():
    ran: list[tuple[int, int]] = []

    def record(index: int) -> int:
        ran.append((index, threading.get_ident()))
        return index * 2

    results: list[int] = []
    callers = [
        threading.Thread(target=lambda i=i: results.append(torch_thread.call(record, i)))
        for i in range(8)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert sorted(results) == [i * 2 for i in range(8)]
    assert len({ident for _, ident in ran}) == 1
    assert ran[0][1] != threading.get_ident()


def test_a_call_raises_on_its_caller_and_the_thread_goes_on():
    def fail() -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        torch_thread.call(fail)
    assert torch_thread.call(lambda: 3) == 3


def test_a_call_made_on_the_torch_thread_runs_at_once():
    outer = torch_thread.call(
        lambda: (threading.get_ident(), torch_thread.call(threading.get_ident))
    )
    assert outer[0] == outer[1]


def test_apart_runs_on_a_thread_that_has_ended():
    threads: list[threading.Thread] = []
    assert torch_thread.apart(lambda: threads.append(threading.current_thread()) or 5) == 5
    assert threads[0] is not threading.current_thread()
    assert not threads[0].is_alive()
    with pytest.raises(KeyError):
        torch_thread.apart(dict().__getitem__, "missing")


def _turns_of(seconds: float, count: int, log: list[str], name: str) -> threading.Thread:
    """A caller whose `count` turns each hold the torch thread for `seconds`."""
    left = [count]

    def turn() -> bool:
        time.sleep(seconds)
        log.append(name)
        left[0] -= 1
        return left[0] > 0

    caller = threading.Thread(target=torch_thread.turns, args=(turn,))
    caller.start()
    return caller


def test_two_busy_callers_share_the_time_not_the_turns():
    """Steps of 2 ms beside batches of 20 ms: about ten steps run per batch, as a decode
    stream keeps its pace beside a pooling model's long batches."""
    log: list[str] = []
    batches = _turns_of(0.02, 10, log, "batch")
    steps = _turns_of(0.002, 1000, log, "step")
    batches.join()
    during = log[: max(i for i, name in enumerate(log) if name == "batch")]
    assert during.count("step") >= 4 * during.count("batch")
    steps.join()


def test_a_caller_back_from_idle_gets_no_credit_for_its_idle_time():
    """A caller that used nothing while another ran for 0.3 s does not then hold the
    thread for 0.3 s: the two alternate."""
    log: list[str] = []
    busy = _turns_of(0.005, 200, log, "busy")
    time.sleep(0.3)
    late = _turns_of(0.005, 20, log, "late")
    late.join()
    first_late = log.index("late")
    assert log[first_late : first_late + 40].count("busy") >= 10
    busy.join()


# Builds a generating engine and a pooling engine in one fresh process, steps both, and
# prints how many OS threads that Python did not start (OpenMP's workers among them) the
# engines added.
TWO_ENGINES = """
import asyncio, os, sys, threading, time
from pathlib import Path
import torch
from transformers import BertConfig, BertModel
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.pooling.async_pooler import AsyncPooler
from engine.pooling.model import Text
from engine.pooling.spec import pooling_spec
from engine.sampling.params import SamplingParams
from tests.support.tiny_models import build_model

root = Path(sys.argv[1])
chat = build_model(root / "qwen3", "qwen3")
bert = root / "bert"
BertModel(BertConfig(vocab_size=300, hidden_size=256, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=1024,
                     max_position_embeddings=512, architectures=["BertModel"])
          ).save_pretrained(bert)
(bert / "vocab.txt").write_text("\\n".join(f"t{i}" for i in range(300)))


def foreign() -> int:
    python = {thread.native_id for thread in threading.enumerate()}
    return len([t for t in os.listdir("/proc/self/task") if int(t) not in python])


async def main() -> None:
    before = foreign()
    llm = AsyncLLM(EngineConfig(model=str(chat), dtype="float32", kv_cache_memory="16MiB",
                                enforce_eager=True))
    pooler = AsyncPooler(EngineConfig(model=str(bert)), pooling_spec(bert))
    texts = [Text(list(range(2, 290)))] * 4
    for round_ in range(2):
        await pooler.run(texts)
        request = await llm.process("hello " * 200, SamplingParams(max_tokens=4))
        async for _ in llm.generate(request, f"r{round_}"):
            pass
    workers = torch.get_num_threads() - 1
    for _ in range(50):  # a load's workers end with its thread, soon after it
        if foreign() - before <= workers:
            break
        time.sleep(0.1)
    print(foreign() - before, workers)
    await llm.shutdown()
    await pooler.shutdown()

asyncio.run(main())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_two_engines_in_one_process_keep_one_pool_of_workers(tmp_path: Path):
    """Each thread that computes keeps OpenMP workers of its own; more workers than cores
    slow every step (`torch_thread`). With a chat model and an embedding model stepped,
    the engines add the workers of one pool, not one pool each."""
    done = subprocess.run(
        [sys.executable, "-c", TWO_ENGINES, str(tmp_path)],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "2"},  # the suite's workers compute on one
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    added, workers = map(int, done.stdout.split()[-2:])
    assert added <= workers, f"the engines added {added} threads; one pool holds {workers}"

"""What a huge prompt does to running streams while the server's intake processes it.

`python -m bench.intake` starts an `AsyncLLM`, runs `--streams` greedy streams, and once
they decode sends one chat prompt of `--prompt-chars` characters through the intake
(rendered, tokenized, validated: far beyond `max_model_len`, so it is refused after all
of that work). It reports, for the steps that overlapped the intake's work, the longest
against the steady median before it, and the event loop's worst lag, over
`--repeats` rounds. `--intake-nice 0` runs the intake thread at normal priority instead
of pagedserve's `INTAKE_NICE` (raising a thread's priority needs CAP_SYS_NICE: as root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import threading
import time

from bench.tables import format_table
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.sampling.params import SamplingParams


async def one_round(llm: AsyncLLM, args: argparse.Namespace, steps: list[tuple[float, float]]):
    lags: list[tuple[float, float]] = []

    async def ticker() -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((start, time.perf_counter() - start - 0.001))

    async def stream(index: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        request = await llm.process(f"stream number {index}", params)
        async for _ in llm.generate(request, f"stream-{index}-{time.monotonic_ns()}"):
            pass

    tick = asyncio.create_task(ticker())
    streams = [asyncio.create_task(stream(i)) for i in range(args.streams)]
    await asyncio.sleep(args.warmup)
    huge = " ".join(f"word{i % 997}" for i in range(args.prompt_chars // 7))[: args.prompt_chars]
    start = time.perf_counter()
    with contextlib.suppress(ValueError):  # refused as too long, after the whole intake
        await llm.process_chat([{"role": "user", "content": huge}], SamplingParams())
    end = time.perf_counter()
    await asyncio.sleep(0.5)  # the step in flight at `end` reports when it is done
    for task in [tick, *streams]:
        task.cancel()
    await asyncio.gather(tick, *streams, return_exceptions=True)
    steady = [took for at, took in steps if at < start]
    during = [took for at, took in steps if at <= end and at + took >= start]
    steps.clear()
    return {
        "intake ms": 1000 * (end - start),
        "step median ms": 1000 * statistics.median(steady),
        "step max during ms": 1000 * max(during),
        "steps overlapping": len(during),
        "loop lag max ms": 1000 * max((lag for at, lag in lags if start <= at <= end), default=0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="pagedserve's model setting")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-chars", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of decoding first")
    parser.add_argument("--intake-nice", type=int, help="set the intake thread's nice value")
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model, dtype=args.dtype, device="cpu", max_model_len=1024,
        kv_cache_memory="256MiB",
    )  # fmt: skip
    llm = AsyncLLM(config)
    if args.intake_nice is not None:
        nice = args.intake_nice
        llm._intake.submit(
            lambda: os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        ).result()
    steps: list[tuple[float, float]] = []
    step = llm.engine.step

    def timed_step():  # the engine thread is the only caller
        start = time.perf_counter()
        outputs = step()
        steps.append((start, time.perf_counter() - start))
        return outputs

    llm.engine.step = timed_step  # type: ignore[method-assign]
    rows = [asyncio.run(one_round(llm, args, steps)) for _ in range(args.repeats)]
    asyncio.run(llm.shutdown())
    columns = list(rows[0])
    print(format_table(columns, [[f"{row[c]:.1f}" for c in columns] for row in rows]))


if __name__ == "__main__":
    main()

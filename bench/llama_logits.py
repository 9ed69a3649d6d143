"""Next-token log-probabilities of pagedserve and llama.cpp's llama-server on one GGUF.

`python -m bench.llama_logits --model FILE.gguf` serves the file with each server in turn
and asks both, over their OpenAI-compatible `/v1/completions`, for one greedy token and
the `--top` most likely next tokens' log-probabilities after each of `--prompts` prompts,
given as token ids (the same ids for both: their tokenizers may split a text differently).
It prints, per prompt, whether the two picked the same token, and the largest difference
between the log-probabilities both report for the same tokens, and the summary over all.

Both servers quantize the activations to int8 as llama.cpp's CPU backend does (per 32
inputs for the 32-weight block types, per 256 for the K types), so their logits differ
by summation order and rounding, not by arithmetic: the differences measure that. The
prompts are random runs of the text `bench.perplexity` scores.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

from bench.gguf_models import llama_server_binary
from bench.perplexity import text
from bench.run_all import stop_server, wait_healthy
from bench.tables import free_port
from engine.model.loader import resolve_model_folder


def start(server: str, gguf: Path, port: int, log: Path):
    if server == "llama-server":
        command = [
            str(llama_server_binary()), "-m", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "-c", "4096", "--no-webui",
        ]  # fmt: skip
    else:
        command = [
            sys.executable, "-m", "pagedserve", "serve", "--model", str(gguf),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
        ]  # fmt: skip
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=sink)
    return wait_healthy(process, port, log)


def top_logprobs(url: str, ids: list[int], top: int) -> dict[str, float]:
    """The next token's most likely tokens (by their text) and log-probabilities."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": top,
        "top_p": 1, "repetition_penalty": 1,  # not the default model's sampling defaults
    }  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    [choice] = reply.json()["choices"]
    logprobs = choice["logprobs"]
    if "content" in logprobs:  # llama-server answers in the chat API's shape
        return {e["token"]: e["logprob"] for e in logprobs["content"][0]["top_logprobs"]}
    return logprobs["top_logprobs"][0]


def prompts(model: str, count: int, length: int, seed: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_folder(model)[0])
    ids = tokenizer(text()[:200_000], add_special_tokens=False).input_ids
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - length) for _ in range(count)]
    return [ids[start : start + length] for start in starts]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.llama_logits", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=200, help="prompt tokens")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    asked = prompts(str(args.model), args.prompts, args.length, seed=0)
    answers: dict[str, list[dict[str, float]]] = {}
    for server in ("pagedserve", "llama-server"):
        port = free_port()
        process = start(server, args.model, port, args.logs / f"logits-{server}.log")
        try:
            answers[server] = [
                top_logprobs(f"http://127.0.0.1:{port}", ids, args.top) for ids in asked
            ]
        finally:
            stop_server(process)
    same, gaps = 0, []
    for i, (ours, theirs) in enumerate(
        zip(answers["pagedserve"], answers["llama-server"], strict=True)
    ):
        shared = set(ours) & set(theirs)
        gap = max((abs(ours[t] - theirs[t]) for t in shared), default=float("nan"))
        first = max(ours, key=ours.get) == max(theirs, key=theirs.get)
        same += first
        gaps.append(gap)
        print(f"prompt {i}: same greedy token {first}, {len(shared)} shared of top {args.top}, "
              f"max |d logprob| {gap:.4f}")  # fmt: skip
    print(f"{args.model.name}: same greedy token {same}/{len(gaps)}, max |d logprob| "
          f"median {statistics.median(gaps):.4f}, max {max(gaps):.4f}")  # fmt: skip


if __name__ == "__main__":
    main()

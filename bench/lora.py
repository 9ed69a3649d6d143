"""What serving LoRA adapters costs: c=8 output tokens/s with requests spread over four
adapters against the same load on the base model alone, on `make serve`'s model and
settings (configs/default.yaml: the int4 GGUF, the compiled forward).

`python -m bench.lora` makes four random-weight PEFT adapters of the default model (rank
8 and 16, on the attention and MLP projections, with `peft`), then starts two servers in
turn: `pagedserve serve --config configs/default.yaml` (no adapters) and the same with
`--lora-modules` naming the four. Each level sends `--requests` completions of
`--max-tokens` tokens (ignore_eos) with `--concurrency` in flight, random-word prompts of
`--prompt-words`: on the plain server to the base model, on the adapters' server to the
base model and then spread over the four adapters. Extra flags for both servers after
`--`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.kv_tier import start_pagedserve
from bench.run_all import stop_server
from bench.serve import WORDS
from bench.tables import format_table

# name -> (rank, target modules)
ADAPTERS = {
    "r8-attn": (8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r16-attn": (16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r8-all": (8, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
    "r16-mlp": (16, ["gate_proj", "up_proj", "down_proj"]),
}


def make_adapters(folder: Path) -> dict[str, Path]:
    """The four adapters of ADAPTERS on the default model, random weights (B scaled down)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from engine.model.loader import load_model

    model = load_model("default", dtype=torch.float32, device=torch.device("cpu")).model
    paths = {}
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                            init_lora_weights=False)  # fmt: skip
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for key, parameter in peft_model.named_parameters():
                if "lora_B" in key:
                    parameter.mul_(0.05)
        peft_model.save_pretrained(folder / name)
        model = peft_model.unload()
        paths[name] = folder / name
    return paths


async def load(url: str, models: list[str], args: argparse.Namespace) -> float:
    """Output tokens/s of `args.requests` completions, `args.concurrency` in flight, the
    i-th to `models[i % len(models)]`."""
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
               for _ in range(args.requests)]  # fmt: skip
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(args.requests):
        queue.put_nowait(index)
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            index = queue.get_nowait()
            body = {"model": models[index % len(models)], "prompt": prompts[index],
                    "max_tokens": args.max_tokens, "ignore_eos": True}  # fmt: skip
            response = await client.post(f"{url}/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient() as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        return tokens / (time.perf_counter() - started)


def serve(args: argparse.Namespace, extra: list[str], loads: dict[str, list[str]]) -> dict:
    server, url = start_pagedserve(args.config, [*extra, *args.server_args], "bench-lora")
    try:
        base = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(load(url, [base], argparse.Namespace(**{**vars(args), "requests": 8})))
        return {label: asyncio.run(load(url, [base if m == "base" else m for m in models], args))
                for label, models in loads.items()}  # fmt: skip
    finally:
        stop_server(server)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("server_args", nargs="*", help="after --: more `pagedserve serve` flags")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    paths = make_adapters(Path(tempfile.mkdtemp(prefix="bench-lora-adapters-")))
    flags = [flag for name, path in paths.items() for flag in ("--lora-modules", f"{name}={path}")]
    plain = serve(args, [], {"base model, no adapters loaded": ["base"]})
    adapted = serve(args, flags, {"base model, 4 adapters loaded": ["base"],
                                  "4 adapters mixed": list(paths)})  # fmt: skip
    reference = plain["base model, no adapters loaded"]
    rows = [[label, f"{value:.1f}", f"{value / reference:.2f}"]
            for label, value in {**plain, **adapted}.items()]  # fmt: skip
    print(format_table([f"c={args.concurrency}", "output tok/s", "vs base"], rows))


if __name__ == "__main__":
    main()

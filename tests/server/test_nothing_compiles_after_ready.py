"""Nothing compiles on a request's path: once /health answers, no request of any kind
starts Dynamo, Inductor, Triton or a C++ compiler, draft rows of speculative decoding
(on, as configs/default.yaml serves it) included.

A compile on the engine thread freezes every running stream for its whole length (10.5 s
for llguidance's `torch.compile`d mask on an empty Inductor cache, at the first structured
request) and fails where there is no compiler. The server runs in a process of its own
under `tests.server.compile_watch`, which logs every compile start to a file; whatever
compiled before /health answered (the compiled forward) is allowed, nothing after.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.compile_watch import LOG_VARIABLE
from tests.server.serve_process import serve_process

START_TIMEOUT = 300  # the compiled variant compiles the tiny forward first, on 2 busy cores
STREAMS = 4
DRAFTS = "vllm:spec_decode_num_drafts_total"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'
ASK = [{"role": "user", "content": "The quick brown fox"}]
COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8}
CHAT = {"model": "tiny", "messages": ASK, "max_tokens": 8}
# One request of every kind the API serves: (path, body).
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", COMPLETION | {"temperature": 0}),
    ("/v1/completions", COMPLETION | {"temperature": 0.8, "seed": 1, "n": 2, "logprobs": 3}),
    ("/v1/completions", COMPLETION | {"echo": True, "temperature": 0}),
    (
        "/v1/completions",
        COMPLETION
        | {"top_k": 5, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5}
        | {"frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"7": 5}}
        | {"min_tokens": 4, "stop": ["dog"], "stop_token_ids": [9]},
    ),
    ("/v1/completions", COMPLETION | {"stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", COMPLETION | {"guided_regex": r"[a-f]{3}-\d{2}", "max_tokens": 12}),
    ("/v1/completions", COMPLETION | {"guided_json": PERSON, "max_tokens": 60, "stream": True}),
    ("/v1/chat/completions", CHAT | {"temperature": 0}),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 3, "n": 2}),
    ("/v1/chat/completions", CHAT | {"stream": True, "stream_options": {"include_usage": True}}),
    (
        "/v1/chat/completions",
        CHAT
        | {"max_tokens": 60, "temperature": 0}
        | {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
    ),
    (
        "/v1/chat/completions",
        CHAT
        | {"max_tokens": 60, "temperature": 0.8, "n": 3, "seed": 2, "stream": True}
        # a batch of three constrained samples among unconstrained streams
        | {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
    ),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", CHAT | {"guided_choice": ["yes", "no"], "logprobs": True}),
    (
        "/v1/chat/completions",
        CHAT | {"guided_grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'},
    ),
    ("/v1/chat/completions", CHAT | {"structured_outputs": {"regex": r"\d{3}"}}),
    (
        "/v1/chat/completions",
        CHAT | {"max_tokens": 60, "tools": [WEATHER], "tool_choice": "required"},
    ),
    (
        "/v1/chat/completions",
        CHAT
        | {"max_tokens": 60, "tools": [WEATHER], "stream": True}
        | {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ),
    ("/v1/chat/completions", CHAT | {"tools": [WEATHER], "tool_choice": "auto"}),
    ("/tokenize", {"model": "tiny", "prompt": "The quick brown fox"}),
    ("/tokenize", {"model": "tiny", "messages": ASK, "add_generation_prompt": True}),
    ("/detokenize", {"model": "tiny", "tokens": [5, 6, 7]}),
]
GETS = ["/v1/models", "/metrics", "/version", "/dashboard/state"]
# Speculation as configs/default.yaml serves it, so draft rows go through the forward too.
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3}'


@contextmanager
def watched_server(model: Path, log: Path, env: dict[str, str], *args: str) -> Iterator[str]:
    """The tiny Llama served in a process of its own under `compile_watch`; its URL."""
    arguments = [
        *("--model", str(model), "--dtype", "float32", "--device", "cpu"),
        *("--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--served-model-name", "tiny"),
        *("--speculative-config", SPECULATIVE),
        *args,
    ]
    output = log.with_suffix(".out")
    with serve_process(
        arguments, output, module="tests.server.compile_watch", env=env, timeout=START_TIMEOUT
    ) as url:
        yield url


async def _send(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str:
    """The reply's body (a stream's to its end); a failure names the request."""
    async with http.stream("POST", path, json=body) as response:
        text = (await response.aread()).decode()
    assert response.status_code == 200, (path, body, text)
    if body.get("stream"):
        assert text.rstrip().endswith("data: [DONE]"), (path, body, text[-500:])
    return text


async def _every_kind_of_request(url: str) -> None:
    """Every request of REQUESTS while STREAMS long streams run, all at once; then each
    alone (a batch of one constrained row masks all of its logits in place); some steps
    verify drafts."""
    stream = COMPLETION | {"max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=180) as http:
        async with asyncio.TaskGroup() as group:  # a failure cancels the rest
            for _ in range(STREAMS):
                group.create_task(_send(http, "/v1/completions", stream))
            for path, body in REQUESTS:
                group.create_task(_send(http, path, body))
        for path, body in REQUESTS:
            await _send(http, path, body)
        for path in GETS:
            assert (await http.get(path)).status_code == 200, path
        metrics = (await http.get("/metrics")).text
    drafts = [line for line in metrics.splitlines() if line.startswith(DRAFTS)]
    assert drafts and float(drafts[0].split()[-1]) > 0, "no step verified a draft"


@pytest.mark.parametrize(
    "forward",
    ["eager", pytest.param("compiled", marks=pytest.mark.slow)],
)
def test_no_request_compiles_anything(
    tiny_model_paths: dict[str, Path], tmp_path: Path, forward: str
) -> None:
    """Eager, on an empty Inductor cache; and with the compiled forward (`slow`: its first
    start compiles it, once per machine), whose graph must serve every batch unchanged."""
    log = tmp_path / "compiles.log"
    env = os.environ | {LOG_VARIABLE: str(log)}
    if forward == "eager":
        # An empty Inductor cache, as on a fresh machine: any compile would be a real one.
        env |= {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
        args: tuple[str, ...] = ("--enforce-eager",)
    else:
        from engine.model.kernels.paged_attention import load_attention_kernel

        if load_attention_kernel() is None:
            pytest.skip("the C++ attention kernel cannot build here")
        env.pop("PAGEDSERVE_ENFORCE_EAGER", None)
        args = ("--no-enforce-eager",)
    with watched_server(tiny_model_paths["llama"], log, env, *args) as url:
        before = log.read_text().splitlines()
        asyncio.run(_every_kind_of_request(url))
        after = log.read_text().splitlines()
    assert before[0].startswith("watching"), before  # the hooks were in
    if forward == "compiled":
        assert "compiled forward ready" in log.with_suffix(".out").read_text()
    started = after[len(before) :]
    if started:
        pytest.fail("compiled after /health answered:\n" + "\n".join(started), pytrace=False)

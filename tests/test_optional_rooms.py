"""The optional rooms are optional: a copy of the core with the rooms' folders removed
imports, serves greedy tokens equal to the full tree's, and its app answers a chat; asking
for what a missing room gives fails with one line naming the setting or field.

The rooms here: the compiled step paths (`engine/compiled/`), the linears
(`engine/linears/`), the grammar (`engine/grammar/`), the dashboard (`server/dashboard/`)
and tool calling (`server/tools/`), which the core reaches only through
`engine.capabilities` and `server.capabilities`. The attention kernels, reached through the
backend registry, have their own such test (`tests/engine/test_attention_backend.py`).
And with every room in place, requests that do not use tools do not import the tools room.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

ROOT = Path(__file__).parents[1]
ROOMS = (
    "engine/compiled",
    "engine/linears",
    "engine/grammar",
    "server/dashboard",
    "server/tools",
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
PROMPT = "Paged attention"

WITHOUT_ROOMS = r"""
import json, sys

import pytest
from fastapi.testclient import TestClient

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.sampling.params import StructuredOutputs
from server.app import build_app
from server.config import ServeConfig

model = sys.argv[1]
settings = dict(dtype="float32", kv_cache_memory="4MiB", max_model_len=128)
llm = LLM(model, enforce_eager=True, quantization="none", **settings)
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
tokens = llm.generate([sys.argv[2]], greedy, use_tqdm=False)[0].outputs[0].token_ids
refusals = {}
for setting, value in (("enforce_eager", False), ("quantization", "int8")):
    with pytest.raises(ConfigError) as caught:
        LLM(model, **{"enforce_eager": True, "quantization": "none", setting: value}, **settings)
    refusals[setting] = str(caught.value)
structured = SamplingParams(structured_outputs=StructuredOutputs(choice=["yes", "no"]))
with pytest.raises(ValueError) as caught:
    llm.engine.processor.from_prompt("Yes or no?", structured)
refusals["structured_outputs"] = str(caught.value)
del llm
config = ServeConfig(model=model, device="cpu", enforce_eager=True, **settings)
with TestClient(build_app(config)) as http:
    while http.get("/health").status_code != 200:
        pass
    name = http.get("/v1/models").json()["data"][0]["id"]
    ask = {"model": name, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    chat = http.post("/v1/chat/completions", json=ask)
    tooled = http.post("/v1/chat/completions", json={**ask, "tools": [json.loads(sys.argv[3])]})
    dashboard = http.get("/dashboard").status_code
print(json.dumps({
    "tokens": tokens, "refusals": refusals, "chat": chat.status_code, "dashboard": dashboard,
    "finish": chat.json()["choices"][0]["finish_reason"],
    "tools": [tooled.status_code, tooled.json()["error"]],
}))
"""

WITHOUT_TOOLS = r"""
import json, sys

from fastapi.testclient import TestClient

from server.app import build_app
from server.config import ServeConfig

config = ServeConfig(
    model=sys.argv[1], device="cpu", enforce_eager=True, dtype="float32",
    kv_cache_memory="4MiB", max_model_len=512,  # the tools' instructions take ~400 tokens
)
imported = {}
with TestClient(build_app(config)) as http:
    while http.get("/health").status_code != 200:
        pass
    name = http.get("/v1/models").json()["data"][0]["id"]
    hi = [{"role": "user", "content": "Hi"}]
    ask = {"model": name, "max_tokens": 3, "messages": hi}
    statuses = [
        http.post("/v1/chat/completions", json=ask).status_code,
        http.post("/v1/chat/completions", json={**ask, "stream": True}).status_code,
        http.post("/v1/messages", json=ask).status_code,
        http.post("/v1/responses", json={"model": name, "input": "Hi"}).status_code,
        http.post("/tokenize", json={"model": name, "messages": hi}).status_code,
    ]
    imported["plain"] = sorted(m for m in sys.modules if m.startswith("server.tools"))
    tooled = {**ask, "tools": [json.loads(sys.argv[2])]}
    statuses.append(http.post("/v1/chat/completions", json=tooled).status_code)
    imported["tools"] = sorted(m for m in sys.modules if m.startswith("server.tools"))
print(json.dumps({"statuses": statuses, "imported": imported}))
"""


# An editable install of the project (`pip install -e .`, as `make setup` does) finds a
# top-level package's direct children in the checkout when the copy lacks them, so the
# scripts drop its finder first: a removed room must stay removed.
NO_EDITABLE_FINDER = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "_Editable" not in getattr(f, "__name__", "")]
"""


def run_script(script: str, cwd: Path, *args: str) -> dict:
    """The JSON that `script` prints last, run by this Python in `cwd` with `args`, with
    only `cwd`'s copy of the project importable."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", NO_EDITABLE_FINDER + script, *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
def test_requests_without_tools_leave_the_tools_room_unimported(tiny_model_paths) -> None:
    got = run_script(WITHOUT_TOOLS, ROOT, str(tiny_model_paths["llama"]), json.dumps(TOOL))
    assert got["statuses"] == [200] * 6
    assert got["imported"]["plain"] == []
    assert "server.tools.chat_tools" in got["imported"]["tools"]


@pytest.mark.slow
def test_the_core_serves_with_every_optional_room_removed(tiny_model_paths, tmp_path) -> None:
    for package in ("engine", "scheduler", "cache", "server"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    for room in ROOMS:
        path = tmp_path / room
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    model = str(tiny_model_paths["llama"])
    got = run_script(WITHOUT_ROOMS, tmp_path, model, PROMPT, json.dumps(TOOL))
    refusals = got["refusals"]
    assert refusals["enforce_eager"].startswith("enforce_eager false on the CPU compiles")
    assert "engine.compiled cannot be imported here" in refusals["enforce_eager"]
    assert refusals["quantization"].startswith("quantization 'int8' cannot run in this engine")
    assert "engine.linears cannot be imported here" in refusals["quantization"]
    assert refusals["structured_outputs"].startswith("structured_outputs: this engine has no")
    assert "\n" not in "".join(refusals.values())
    assert (got["chat"], got["finish"], got["dashboard"]) == (200, "length", 404)
    status, error = got["tools"]
    assert (status, error["param"], error["type"]) == (400, "tools", "invalid_request_error")
    assert "server.tools cannot be imported here" in error["message"]
    full = LLM(
        model, dtype="float32", kv_cache_memory="4MiB", max_model_len=128, enforce_eager=True
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = full.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert got["tokens"] == expected.token_ids

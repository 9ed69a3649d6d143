"""The optional components are optional: a copy of the core with the components' folders removed
imports, serves greedy tokens equal to the full tree's, and its app answers a chat; asking
for what a missing component gives fails with one line naming the setting or field.

The components here: the compiled step paths (`engine/compiled/`), the linears
(`engine/linears/`), the grammar (`engine/grammar/`), the KV tiers (`engine/kv_tiers/`)
and KV events (`engine/kv_events/`), the dashboard (`server/dashboard/`) and tool calling
(`server/tools/`), which the core reaches only through
`engine.capabilities` and `server.capabilities`. The attention kernels, reached through the
backend registry, have their own such test (`tests/engine/model/test_attention_backend.py`).
And with every component in place, requests that do not use tools do not import the tools component.
"""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from tests.support.core_copy import ROOT, copy_core, run_script

COMPONENTS = (
    "engine/compiled",
    "engine/linears",
    "engine/grammar",
    "engine/kv_tiers",
    "engine/kv_events",
    "server/dashboard",
    "server/tools",
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
PROMPT = "Paged attention"

WITHOUT_COMPONENTS = r"""
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
events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*"}
for setting, value in (
    ("enforce_eager", False), ("quantization", "int8"), ("kv_disk_size", "1GiB"),
    ("kv_events_config", events),
):
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
    hi = [{"role": "user", "content": "Hi"}]
    ask = {"model": name, "max_tokens": 3, "messages": hi, "ignore_eos": True}
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


@pytest.mark.slow
def test_requests_without_tools_leave_the_tools_room_unimported(tiny_model_paths) -> None:
    got = run_script(WITHOUT_TOOLS, ROOT, str(tiny_model_paths["llama"]), json.dumps(TOOL))
    assert got["statuses"] == [200] * 6
    assert got["imported"]["plain"] == []
    assert "server.tools.chat_tools" in got["imported"]["tools"]


@pytest.mark.slow
def test_the_core_serves_with_every_optional_room_removed(tiny_model_paths, tmp_path) -> None:
    copy_core(tmp_path, ("engine", "scheduler", "cache", "server"), COMPONENTS)
    model = str(tiny_model_paths["llama"])
    got = run_script(WITHOUT_COMPONENTS, tmp_path, model, PROMPT, json.dumps(TOOL))
    refusals = got["refusals"]
    assert refusals["enforce_eager"].startswith("enforce_eager false on the CPU compiles")
    assert "engine.compiled cannot be imported here" in refusals["enforce_eager"]
    assert refusals["quantization"].startswith("quantization 'int8' cannot run in this engine")
    assert "engine.linears cannot be imported here" in refusals["quantization"]
    assert refusals["kv_disk_size"].startswith("kv_disk_size: engine.kv_tiers cannot be")
    assert refusals["kv_events_config"].startswith("kv_events_config: engine.kv_events cannot")
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

"""The published contract: schemathesis (its CLI, as a user runs it) generates requests
from the server's own /openapi.json, valid and invalid, and checks every answer against
the document: no server error, only declared statuses and content types, bodies (errors
included) that match their schemas.

The default model's server takes every operation but /models/unload (each case would
unload the model and the next reload it, for minutes); an embedding model's server
(all-MiniLM-L6-v2) takes the pooling operations, which the chat model refuses. The hooks
(tests/server/schemathesis_hooks.py) make every body name the served model and ask for
few tokens. The seed is fixed, so a failure reproduces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.config import ServeConfig
from tests.server.conftest import live_server
from tests.support.default_model import DEFAULT_MODEL_SETTINGS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)
POOLING = r"^/(v1/|v2/)?(embeddings|score|rerank)$"


def schemathesis(url: str, model: str, folder: Path, *selection: str) -> str:
    """`st run` against the server's /openapi.json, on the operations `selection` picks
    (st's filter options): the coverage phase (each keyword's boundaries, each wrong type)
    and up to 5 fuzzed cases an operation. Fails the test on any finding; returns the
    run's summary."""
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st is not None, "schemathesis' CLI is missing: pip install -e '.[dev]'"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SCHEMATHESIS_HOOKS": "tests.server.schemathesis_hooks",
        "PAGEDSERVE_FUZZ_MODEL": model,
    }
    command = [
        st, "run", f"{url}/openapi.json", "--phases", "coverage,fuzzing",
        "--checks", ",".join(CHECKS), "--max-examples", "5", "--workers", "1", "--seed", "0",
        "--generation-database", "none", "--request-timeout", "60", "--no-color", *selection,
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    report = result.stdout + result.stderr
    if result.returncode != 0:
        pytest.fail(f"schemathesis found something:\n{report[-20000:]}")
    summary = report[report.find("SUMMARY") :]
    print(summary)  # the operations and cases, shown by pytest -rP
    return summary


def test_the_default_models_server_keeps_its_schema(tmp_path: Path):
    with live_server(ServeConfig(**DEFAULT_MODEL_SETTINGS)) as url:
        summary = schemathesis(
            url, "SmolLM2-135M-Instruct", tmp_path, "--exclude-path", "/models/unload"
        )
    assert "Tested: 26" in summary


def test_an_embedding_models_server_keeps_its_schema(minilm: Path, tmp_path: Path):
    config = ServeConfig(model=str(minilm), served_model_name="minilm", device="cpu")
    with live_server(config) as url:
        summary = schemathesis(url, "minilm", tmp_path, "--include-path-regex", POOLING)
    assert "Tested: 6" in summary

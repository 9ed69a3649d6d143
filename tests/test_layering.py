"""What the import rules (pyproject.toml's [tool.importlinter], checked by `lint-imports` in
`make test`) cannot say: which modules load torch when imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_server_error_module_and_engine_errors_load_without_torch() -> None:
    """Telling engine errors apart (and building error responses) needs no torch."""
    check = "import sys, server.errors, engine.errors; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)

"""A copy of the project's core packages with some components removed, and a script run against
only that copy: how the tests show that an optional component is optional."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).parents[2]

# An editable install of the project (`pip install -e .`, as `make setup` does) finds a
# top-level package's direct children in the checkout when the copy lacks them, so a
# script drops its finder first: a removed component must stay removed.
NO_EDITABLE_FINDER = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "_Editable" not in getattr(f, "__name__", "")]
"""


def copy_core(target: Path, packages: Iterable[str], removed: Iterable[str]) -> Path:
    """`target` holding a copy of `packages` without the `removed` paths (folders or
    files, relative to the project's root)."""
    for package in packages:
        shutil.copytree(ROOT / package, target / package, ignore=shutil.ignore_patterns("*.pyc"))
    for component in removed:
        path = target / component
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return target


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

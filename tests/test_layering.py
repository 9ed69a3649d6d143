"""Dependencies point one way: scale_out -> server -> engine -> scheduler -> cache, read
from the code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What each package may import of the others. The server talks to the engine only.
ALLOWED = {
    # The scale-out layer runs the server in replicas, and routes by the cache's block hash.
    "scale_out": {"server", "engine", "cache"},
    "server": {"engine"},
    "engine": {"scheduler", "cache"},
    "scheduler": {"cache"},
    "cache": set(),
}
# The command line starts every way of serving: `pagedserve ray-serve` imports the
# scale-out layer from there (lazily), and from nowhere else in the server.
UPWARD = {("server/cli.py", "scale_out")}


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("package", list(ALLOWED))
def test_packages_import_only_downward(package: str) -> None:
    others = set(ALLOWED) - {package}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for module in imported_modules(path):
            top = module.split(".")[0]
            if top in others and (name, top) not in UPWARD:
                assert top in ALLOWED[package], f"{name} imports {module}"


def test_the_scheduler_and_the_cache_know_no_torch() -> None:
    for package in ("scheduler", "cache"):
        for path in (ROOT / package).rglob("*.py"):
            assert not {m for m in imported_modules(path) if m.split(".")[0] == "torch"}, path


def test_kernels_do_not_reach_into_model_loading() -> None:
    for path in (ROOT / "engine" / "model" / "kernels").rglob("*.py"):
        assert "engine.model.loader" not in imported_modules(path), path


def test_the_server_error_module_and_engine_errors_load_without_torch() -> None:
    """Telling engine errors apart (and building error responses) needs no torch."""
    check = "import sys, server.errors, engine.errors; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)

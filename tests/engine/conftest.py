"""Fixtures shared by the engine's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import cache_root


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of its own, but the C++ kernels the suite has built (or builds) once: a
    first build takes a minute or more on a busy 2-core machine."""
    root = tmp_path / "cache"
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    root.mkdir()
    (root / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(root))
    return root

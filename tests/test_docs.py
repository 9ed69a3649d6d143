"""The README stays a front door over the docs site, and the site's generated settings
reference covers every setting. (`make test` builds the site itself with --strict.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "docs" / "hooks" / "settings.py"


def test_readme_is_short_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "../shared" not in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).is_file(), target


def test_settings_reference_has_a_row_per_setting() -> None:
    pytest.importorskip("mkdocs")
    from server.config import ServeConfig

    spec = importlib.util.spec_from_file_location("docs_settings_hook", HOOK)
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.render()
    for name in ServeConfig.model_fields:
        flag = "--model NAME=SOURCE" if name == "models" else "--" + name.replace("_", "-")
        assert f"| `{name}` | `PAGEDSERVE_{name.upper()}`<br>`{flag}" in page, name

"""Schemathesis' hooks for tests/server/test_openapi_contract.py (its CLI loads them by
the SCHEMATHESIS_HOOKS variable): every body names the served model, so the cases reach
the engine instead of stopping at a 404, and asks for few tokens and samples, so the run
stays short, with the model loaded throughout (no `keep_alive` that would unload it)."""

from __future__ import annotations

import os
from typing import Any

import schemathesis

MODEL = os.environ.get("PAGEDSERVE_FUZZ_MODEL", "default")
CAP = 8  # the most tokens a case generates
# The field that bounds the tokens of each generating operation: always set, at most CAP
# (left out, a reply may run to the end of the context).
LENGTH_FIELDS = {
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_completion_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
}
# Other counts, at most these.
CAPS = {"max_tokens": CAP, "min_tokens": CAP, "n": 2, "best_of": 2}


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = MODEL
    body.pop("keep_alive", None)
    for name, cap in CAPS.items():
        if _count(body.get(name)) and body[name] > cap:
            body[name] = cap
    field = LENGTH_FIELDS.get(case.operation.path)
    if field is not None:
        asked = body.get(field)
        body[field] = min(asked, CAP) if _count(asked) else CAP


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""The one entry point from the server's core to its optional components, each imported only when it
is used:

- the dashboard (`server.dashboard`), installed on the app at start-up;
- tool calling (`server.tools`), a `ToolCalling` (server/conversation.py) made the first
  time a request offers tools or holds earlier calls.

A component that cannot be imported (its folder removed, a dependency not installed) leaves
the core importable and serving: the app goes without the dashboard and says so; a
request that needs tool calling is refused with a 400 naming `tools` (server/conversation.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI

if TYPE_CHECKING:
    from engine.request.intake import SpecialTokens
    from server.conversation import ToolCalling

logger = logging.getLogger(__name__)


def install_dashboard(app: FastAPI) -> None:
    """Serve `/dashboard` and its data from `app`, or log why there is none."""
    try:
        from server.dashboard.routes import install
    except ImportError as exc:
        logger.warning("no /dashboard: server.dashboard cannot be imported here (%s)", exc)
        return
    install(app)


def tool_calling(
    setting: str, chat_template: str | None, special: SpecialTokens | None = None
) -> ToolCalling | None:
    """How the model writes tool calls under `tool_call_parser` `setting`, or None (with
    a warning) where the tools component cannot be imported. `special`: the model's special
    tokens (`AsyncLLM.special_tokens`), where known."""
    try:
        from server.tools.chat_tools import ToolSyntax
    except ImportError as exc:
        logger.warning("tool calling is off: server.tools cannot be imported here (%s)", exc)
        return None
    return ToolSyntax.of(setting, chat_template, special)

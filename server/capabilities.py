"""The one door from the server's core to its optional rooms, each imported only when it
is used: the dashboard (`server.dashboard`), installed on the app at start-up.

A room that cannot be imported (its folder removed, a dependency not installed) leaves
the core importable and serving; the app goes without it and says so.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

logger = logging.getLogger(__name__)


def install_dashboard(app: FastAPI) -> None:
    """Serve `/dashboard` and its data from `app`, or log why there is none."""
    try:
        from server.dashboard.routes import install
    except ImportError as exc:
        logger.warning("no /dashboard: server.dashboard cannot be imported here (%s)", exc)
        return
    install(app)

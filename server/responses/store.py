"""The stored responses of `/v1/responses` (`store: true`), in one SQLite file that
outlives the process.

Each row is one response as the API returned it, with the conversation that led to it
(its input items, those of the responses before it included), so a later request's
`previous_response_id` continues it with one read. A row belongs to the key that created
it (`owner`, see `server.auth.key_owner`): another key's id reads as unknown.

All SQLite work runs on one thread of the store's own, which owns the connection, so the
event loop never waits on the disk and the connection never crosses threads.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")

# The schema's version, in SQLite's `user_version`; a file of another version is refused.
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL
)
"""


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the store in `path` (made, with its schema, if new), in autocommit
    mode; ResponseStoreError naming the file and the setting if it cannot be opened or
    holds another schema version."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None)
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            db.close()
            raise ResponseStoreError(
                f"{path} holds stored responses of schema version {version}; this server "
                f"reads version {SCHEMA_VERSION} (set response_store elsewhere)"
            )
        if version == 0:  # a new file (servers starting together may both get here)
            db.execute(_SCHEMA)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except (OSError, sqlite3.Error) as exc:
        raise ResponseStoreError(
            f"cannot open the response store {path} (the response_store setting): {exc}"
        ) from exc
    return db


class ResponseStoreError(RuntimeError):
    """The store's file cannot be opened or is not a store of this version."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response object as returned, and the input items that led to it."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """Invariant: between `open` and `close` exactly one connection exists, used only on
    the store's thread; rows are written whole (one statement each)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None

    async def open(self) -> None:
        """Open the file, made with its schema if new; ResponseStoreError if it cannot be."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        await self._run(self._connect)

    async def close(self) -> None:
        if self._thread is None:
            return
        await self._run(self._disconnect)
        self._thread.shutdown()
        self._thread = None

    async def put(
        self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> None:
        """Keep `response` (its `id` and `created_at` are the row's) for `owner`."""
        row = (
            response["id"],
            owner,
            int(response["created_at"]),
            json.dumps(response, ensure_ascii=False),
            json.dumps(conversation, ensure_ascii=False),
        )
        await self._run(self._write, "INSERT INTO responses VALUES (?, ?, ?, ?, ?)", row)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """`owner`'s response of that id; None if there is none (or it is another's)."""
        row = await self._run(self._read, response_id, owner)
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    async def delete(self, owner: str, response_id: str) -> bool:
        """Forget `owner`'s response of that id; False if there was none."""
        deleted = await self._run(
            self._write, "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
        )
        return deleted > 0

    async def _run(self, work: Callable[..., T], *args: Any) -> T:
        assert self._thread is not None, "the store is not open"
        return await asyncio.get_running_loop().run_in_executor(self._thread, work, *args)

    def _connect(self) -> None:
        self._db = connect(self.path)

    def _disconnect(self) -> None:
        if self._db is not None:  # None when opening failed
            self._db.close()
            self._db = None

    def _write(self, statement: str, values: tuple[Any, ...]) -> int:
        assert self._db is not None
        return self._db.execute(statement, values).rowcount

    def _read(self, response_id: str, owner: str) -> tuple[str, str] | None:
        assert self._db is not None
        cursor = self._db.execute(
            "SELECT response, conversation FROM responses WHERE id = ? AND owner = ?",
            (response_id, owner),
        )
        return cursor.fetchone()


def response_store(request: Request) -> ResponseStore:
    """The app's store, made and opened with the app (server/app.py)."""
    store: ResponseStore = request.app.state.responses
    return store

"""The SQLite store of /v1/responses: rows by owner, kept across reopening, one schema."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from server.responses.store import ResponseStore, ResponseStoreError

RESPONSE = {"id": "resp_1", "created_at": 1, "output": [{"type": "message", "text": "é"}]}
CONVERSATION = [{"type": "message", "role": "user", "content": "hi"}]


async def _put_reopen_read(path: Path) -> None:
    store = ResponseStore(path)
    await store.open()
    await store.put("alice", RESPONSE, CONVERSATION)
    with pytest.raises(sqlite3.IntegrityError):  # an id is stored once
        await store.put("alice", RESPONSE, CONVERSATION)
    await store.close()

    reopened = ResponseStore(path)
    await reopened.open()
    stored = await reopened.get("alice", "resp_1")
    assert stored is not None
    assert (stored.response, stored.conversation) == (RESPONSE, CONVERSATION)
    # another owner sees nothing, and cannot delete it
    assert await reopened.get("bob", "resp_1") is None
    assert not await reopened.delete("bob", "resp_1")
    assert await reopened.delete("alice", "resp_1")
    assert await reopened.get("alice", "resp_1") is None
    assert not await reopened.delete("alice", "resp_1")
    await reopened.close()


def test_rows_belong_to_their_owner_and_outlive_the_store(tmp_path: Path) -> None:
    asyncio.run(_put_reopen_read(tmp_path / "made" / "here" / "store.sqlite3"))


def test_a_file_of_another_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")

    async def open_it() -> None:
        store = ResponseStore(path)
        try:
            await store.open()
        finally:
            await store.close()

    with pytest.raises(ResponseStoreError, match="schema version 99"):
        asyncio.run(open_it())


def test_an_unwritable_place_is_refused_by_name(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")

    async def open_it() -> None:
        store = ResponseStore(blocker / "store.sqlite3")
        try:
            await store.open()
        finally:
            await store.close()

    with pytest.raises(ResponseStoreError, match="response_store setting"):
        asyncio.run(open_it())

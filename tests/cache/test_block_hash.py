"""hash_block: deterministic, and sensitive to the tokens, their order and the parent."""

from __future__ import annotations

from cache import hash_block


def test_deterministic_and_type_independent() -> None:
    assert hash_block(None, [1, 2, 3]) == hash_block(None, (1, 2, 3))
    assert hash_block(7, [1, 2]) == hash_block(7, [1, 2])
    assert 0 <= hash_block(None, [1]) < 2**64


def test_depends_on_tokens_order_and_parent() -> None:
    root = hash_block(None, [1, 2])
    assert root != hash_block(None, [2, 1])
    assert root != hash_block(None, [1, 3])
    assert hash_block(root, [1, 2]) != hash_block(root + 1, [1, 2])
    # A chained block never encodes like a first block, even with the parent's bytes as tokens.
    assert hash_block(0, [5]) != hash_block(None, [0, 5])

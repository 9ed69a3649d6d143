"""Plain-text tables, free ports and comma lists, shared by the benchmarks (no torch)."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        parts = [first.ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)
        ]
        return "  ".join(parts)

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers such as "1,8,32"."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,32, got {text!r}")
    return values


def engine_setting(text: str) -> tuple[str, str]:
    """An argparse type: one engine setting as KEY=VALUE, such as "enforce_eager=false";
    the engine's config validates the key and converts the value."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()

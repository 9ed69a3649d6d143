"""Plain-text tables and free ports, shared by the benchmarks (no torch imported here)."""

from __future__ import annotations

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

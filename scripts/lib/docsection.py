"""One generated section of a doc: the text between a BEGIN and an END marker line, written
from its source of truth, or checked against it (``--check``: exit 1 when they differ)."""

from __future__ import annotations

import sys


def replaced(text: str, begin: str, end: str, body: str) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def write_or_check(path: str, begin: str, end: str, body: str, *, stale: str) -> int:
    """Write ``body`` between the markers of ``path``; with ``--check`` in argv, write
    nothing and return 1 (printing ``stale``) when the file differs from that."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = replaced(text, begin, end, body)
    if "--check" in sys.argv[1:]:
        if new != text:
            print(stale, file=sys.stderr)
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    return 0
